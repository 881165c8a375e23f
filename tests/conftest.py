"""Shared fixtures: tiny configs and a small prepared corpus."""

from __future__ import annotations

import pytest

from mapl_swarm.config import TrainConfig, config_from_dict


def micro_config(**sections) -> TrainConfig:
    """A very small model (d=64, 4 layers) for fast numerical tests."""
    raw = {
        "model": {"vocab_size": 256, "hidden_size": 64, "num_layers": 4, "num_heads": 4,
                  "ffn_hidden_size": 128, "context_length": 16},
        "compression": {"rank": 16, "anchor_rank": 16},
        "run": {"steps": 10},
        "pipeline": {"num_stages": 4, "micro_batch_size": 2, "num_micro_batches": 2},
        "runtime": {"threads": 0},
    }
    for name, values in sections.items():
        raw.setdefault(name, {}).update(values)
    return config_from_dict(raw, "micro_config")


@pytest.fixture
def make_config():
    return micro_config
