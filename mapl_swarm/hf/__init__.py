"""The trained model outside the swarm: a transformers model class, export, evaluation, generation.

:mod:`.modeling` (``MaplConfig`` / ``MaplForCausalLM``, model type ``mapl_llama``) is registered with
transformers' ``AutoConfig`` and ``AutoModelForCausalLM`` as soon as both this package and
transformers are imported (:mod:`.registration`), so ``AutoModelForCausalLM.from_pretrained`` loads
an export after ``import mapl_swarm``.
"""

from mapl_swarm.lazy import lazy_exports

__all__ = ["MaplConfig", "MaplForCausalLM", "register"]

__getattr__, __dir__ = lazy_exports(__name__, {
    "MaplConfig": "mapl_swarm.hf.modeling",
    "MaplForCausalLM": "mapl_swarm.hf.modeling",
    "register": "mapl_swarm.hf.registration",
})
