"""Pipeline stages of a LLaMA-style decoder (transformers' Llama blocks, in plain torch)."""

from mapl_swarm.model.partition import partition_layers
from mapl_swarm.model.stage import StageModel

__all__ = ["partition_layers", "StageModel"]
