"""Golden losses: the first 5 training losses of every codec on the micro config, in-process, fp32.

Recorded before the codec/run-policy refactor (issue 9) and compared exactly: a structural change
must not move a single bit of the numbers. Regenerate only for an intended numerical change:
``python tests/unit/test_golden_losses.py --write``. The one intended change so far: SSN's offsets and
AdamW ratio (issue 11); ``ssn_unscaled`` (offsets N(0, 1), AdamW ratio 0.5) keeps SSN's numbers from
before it, bit for bit.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

if __package__ in (None, ""):  # run as a script: make the tests' conftest importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from conftest import micro_config

from mapl_swarm.pipeline.inprocess import InProcessPipeline

GOLDEN = Path(__file__).with_name("golden_losses.json")
CASES: dict[str, dict] = {
    "none": {"codec": "none"}, "mapl": {"codec": "mapl"}, "fixed": {"codec": "fixed"},
    "naive": {"codec": "naive"}, "ssn": {"codec": "ssn"}, "mapl_vq": {"codec": "mapl_vq"},
    "none_offsets": {"codec": "none_offsets"},
    "ssn_unscaled": {"codec": "ssn", "ssn_offset_std": 1.0, "ssn_adamw_lr_ratio": 0.5},
}
"""Golden name -> ``[compression]`` settings."""
STEPS = 5


def first_losses(case: str) -> list[float]:
    cfg = micro_config(compression=CASES[case], optim={"warmup_steps": 2})
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the same reduction order on every machine
    try:
        torch.manual_seed(0)
        pipe = InProcessPipeline(cfg)
        gen = torch.Generator().manual_seed(1234)
        B, T, V = cfg.pipeline.micro_batch_size, cfg.model.context_length, cfg.model.vocab_size
        losses = []
        for _ in range(STEPS):
            batches = [torch.randint(0, V, (B, T + 1), generator=gen) for _ in range(cfg.pipeline.num_micro_batches)]
            losses.append(pipe.train_step(batches).loss)
        return losses
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("case", CASES)
def test_golden_losses_unchanged(case):
    expected = json.loads(GOLDEN.read_text())[case]
    assert first_losses(case) == expected


if __name__ == "__main__" and "--write" in sys.argv:
    GOLDEN.write_text(json.dumps({c: first_losses(c) for c in CASES}, indent=1) + "\n")
    print(f"wrote {GOLDEN}")
