"""A short MAPL training run on the embedded corpus lowers the validation loss."""

import json

import pytest

from mapl_swarm.config import config_from_dict
from mapl_swarm.errors import CheckpointError
from mapl_swarm.pipeline.trainer import train


def test_short_mapl_training_lowers_val_loss(tmp_path):
    cfg = config_from_dict({
        "model": {"vocab_size": 512, "hidden_size": 64, "num_layers": 4, "num_heads": 4,
                  "ffn_hidden_size": 128, "context_length": 64},
        "compression": {"codec": "mapl", "rank": 16, "anchor_rank": 16},
        "optim": {"warmup_steps": 3},
        "data": {"source": "stdlib", "vocab_size": 512, "max_corpus_bytes": 400_000, "val_fraction": 0.2,
                 "cache_dir": str(tmp_path / "cache")},
        "run": {"steps": 30, "out_dir": str(tmp_path / "run")},
        "pipeline": {"num_stages": 4, "micro_batch_size": 4, "num_micro_batches": 2},
        "eval": {"interval_steps": 15, "batches": 2},
        "checkpoint": {"interval_steps": 15},
    })
    summary = train(cfg, progress=False)
    assert summary.initial_val_loss is not None
    assert summary.final_val_loss < summary.initial_val_loss - 0.5, summary.val_history
    records = [json.loads(l) for l in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert records[-1]["step"] == 30 and "val_loss" in records[-1]
    manifest = json.loads((tmp_path / "run" / "manifest.json").read_text())
    assert manifest["corpus_fingerprint"] and manifest["config"]["compression"]["codec"] == "mapl"
    # measured bytes/token: 16 ch bf16 forward + uint16 ids, 16 ch bf16 back, + amortised projectors
    proj_per_token = 64 * 16 * 4 / summary.tokens * 30
    for bpt in summary.bytes_per_token:
        assert abs(bpt["forward"] - (32 + 2 * 65 / 64 + proj_per_token)) < 1e-6
        assert abs(bpt["backward"] - (32 + proj_per_token)) < 1e-6

    # resume: the newest complete checkpoint is step 30 -> nothing left to do: a clear error (issue 9)
    with pytest.raises(CheckpointError, match=r"checkpoint at step 30 >= run.steps 30: nothing to train"):
        train(cfg, resume=True, progress=False)
