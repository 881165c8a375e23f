"""Pipeline stages of a LLaMA-style decoder built from transformers' Llama components."""

from mapl_swarm.model.partition import partition_layers
from mapl_swarm.model.stage import StageModel, llama_config

__all__ = ["partition_layers", "StageModel", "llama_config"]
