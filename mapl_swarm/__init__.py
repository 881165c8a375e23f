"""mapl_swarm: pipeline-parallel LLM training over slow links with MAPL compression."""

__version__ = "0.1.0"

from mapl_swarm.hf.registration import register_when_imported as _register_with_transformers  # noqa: E402

_register_with_transformers()  # AutoModelForCausalLM loads exported models (model type mapl_llama)
