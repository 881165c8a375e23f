"""The lm-evaluation-harness model ``mapl``: lm-eval's Hugging Face causal LM on an exported folder.

Importing this module registers it (``lm_eval --model mapl`` after ``import mapl_swarm.hf.lm_eval_model``;
``mapl-swarm eval --tasks`` does so itself). The folder's model loads through transformers' auto
classes, which know ``mapl_llama`` once mapl_swarm is imported; lm-eval's own batching, request
caching and metrics are used unchanged. The context is the model's trained length.
"""

from __future__ import annotations

from lm_eval.api.registry import register_model
from lm_eval.models.huggingface import HFLM

from mapl_swarm.hf.registration import register

__all__ = ["MaplLM"]


@register_model("mapl")
class MaplLM(HFLM):
    """``model_args``: ``pretrained=PATH`` (an exported folder) plus any of HFLM's (dtype, device, batch size)."""

    def __init__(self, pretrained: str, **kwargs) -> None:
        register()
        kwargs.setdefault("backend", "causal")
        super().__init__(pretrained=pretrained, **kwargs)
