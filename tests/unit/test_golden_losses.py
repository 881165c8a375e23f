"""Golden losses: the first 5 training losses of every codec on the micro config, in-process, fp32.

Recorded before the codec/run-policy refactor (issue 9). Another CPU or BLAS build computes the same
arithmetic with other kernels (other vector widths and summation orders), so the recorded numbers
hold to a tolerance, not to the bit: the first loss (the initial weights' forward) to 1e-5 relative,
later ones to 5e-4 (optimizer steps amplify rounding; a VQ code flipping at a tie moves the loss by
~2e-4). Measured on the recording machine with ``ATEN_CPU_CAPABILITY=default`` / ``avx2`` or
``MKL_CBWR=COMPATIBLE`` (other kernels, as another CPU): at most 2.3e-4 relative, step 1 at most 1e-7.
What it still catches (measured): another warmup moves them by 2.5e-3, a 5% larger Muon lr by 5.7e-4;
a structural mistake (a wrong anchor, a dropped gradient, another init) by far more.
Bit-exactness is asserted where it is real: the same computation twice in one process.
Regenerate only for an intended numerical change:
``python tests/unit/test_golden_losses.py --write``. The one intended change so far: SSN's offsets and
AdamW ratio (issue 11); ``ssn_unscaled`` (offsets N(0, 1), AdamW ratio 0.5) keeps SSN's numbers from
before it, bit for bit.
"""

from __future__ import annotations

import json
import os
import subprocess
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
FIRST_REL, LATER_REL = 1e-5, 5e-4


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


def check_against_golden(case: str, losses: list[float]) -> None:
    expected = json.loads(GOLDEN.read_text())[case]
    assert losses[0] == pytest.approx(expected[0], rel=FIRST_REL)
    assert losses[1:] == pytest.approx(expected[1:], rel=LATER_REL)


@pytest.mark.parametrize("case", CASES)
def test_golden_losses_unchanged(case):
    check_against_golden(case, first_losses(case))


def test_same_process_twice_is_bit_identical():
    """MAPL+VQ, the most rounding-sensitive codec (code assignments): deterministic to the bit."""
    assert first_losses("mapl_vq") == first_losses("mapl_vq")


def test_golden_losses_hold_with_other_cpu_kernels():
    """As on another CPU: torch's portable kernels instead of this CPU's vectorised ones, and MKL's
    conditional-numerical-reproducibility mode, in a fresh process."""
    env = dict(os.environ, ATEN_CPU_CAPABILITY="default", MKL_CBWR="COMPATIBLE")
    proc = subprocess.run([sys.executable, __file__, "--print"], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    got = json.loads(proc.stdout.splitlines()[-1])
    assert got.keys() == CASES.keys()
    for case, losses in got.items():
        check_against_golden(case, losses)


if __name__ == "__main__" and "--write" in sys.argv:
    GOLDEN.write_text(json.dumps({c: first_losses(c) for c in CASES}, indent=1) + "\n")
    print(f"wrote {GOLDEN}")
elif __name__ == "__main__" and "--print" in sys.argv:
    print(json.dumps({c: first_losses(c) for c in CASES}))
