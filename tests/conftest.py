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


def stdlib_run_config(cache, out, steps: int, **checkpoint) -> TrainConfig:
    """A 2-stage d=32 mapl run on a 200 kB stdlib corpus cached under ``cache``, writing to ``out``
    (checkpoint settings: every 20 steps unless ``checkpoint`` says otherwise): resume tests."""
    return config_from_dict({
        "model": {"vocab_size": 512, "hidden_size": 32, "num_layers": 2, "num_heads": 2,
                  "ffn_hidden_size": 64, "context_length": 16},
        "compression": {"codec": "mapl", "rank": 8, "anchor_rank": 8},
        "optim": {"warmup_steps": 2},
        "data": {"source": "stdlib", "vocab_size": 512, "max_corpus_bytes": 200_000, "val_fraction": 0.2,
                 "cache_dir": str(cache)},
        "run": {"steps": steps, "out_dir": str(out)},
        "pipeline": {"num_stages": 2, "micro_batch_size": 2, "num_micro_batches": 1},
        "eval": {"interval_steps": 0, "batches": 1},
        "checkpoint": {"interval_steps": 20, **checkpoint},
    }, "stdlib_run_config")


@pytest.fixture
def make_config():
    return micro_config


def capture_launch(monkeypatch, *keys: str, first=None) -> dict:
    """Replace ``mapl_swarm.launch.launch`` with a stand-in that records the ``keys`` of each call's
    keyword arguments (what the CLI handed it), runs ``first(kwargs)`` (launch()'s own first checks),
    then stops with a ConfigError; returns the record (cleared by the caller between calls)."""
    from mapl_swarm import launch as launch_mod
    from mapl_swarm.errors import ConfigError

    got: dict = {}

    def fake_launch(cfg, config_args, **kwargs):
        got.update({k: kwargs[k] for k in keys})
        if first is not None:
            first(kwargs)
        raise ConfigError("stop here")

    monkeypatch.setattr(launch_mod, "launch", fake_launch)
    return got
