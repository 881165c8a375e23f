"""Golden losses: the first 5 training losses of every codec on the micro config, in-process, fp32.

Two recorded sets, one per boundary wire dtype:

- ``bf16`` (the default wire; recorded before the codec/run-policy refactor of issue 9);
- ``fp32:`` keys: the same runs with ``compression.wire_dtype = "fp32"``.

Another CPU or BLAS build runs the same arithmetic with other kernels (vector widths, summation
orders), so the numbers hold to a tolerance, not to the bit. What amplifies that rounding is
quantization: a value near a bf16 rounding boundary, or a VQ code near a tie, lands on the other side.
Measured on the recording machine with ``ATEN_CPU_CAPABILITY=default`` and ``MKL_CBWR=COMPATIBLE``
(other kernels, as another CPU): bf16 wire up to 6.4e-4 relative after 4 steps, fp32 wire up to
4.7e-7 (``mapl_vq`` up to 6.4e-4 either way); the first loss (the initial weights' forward) to 1e-7.
Hence the tolerances below. What they catch (measured on the fp32 set's scale): a 5% larger Muon lr
moves the losses by up to 5.7e-4, another warmup by 2.5e-3, a structural mistake by far more.
Bit-exactness is asserted where it is real: the same computation twice in one process.

Regenerate only for an intended numerical change: ``python tests/unit/test_golden_losses.py --write``.
The one intended change so far: SSN's offsets and AdamW ratio (issue 11); ``ssn_unscaled`` (offsets
N(0, 1), AdamW ratio 0.5) keeps SSN's numbers from before it, bit for bit.
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
CODECS: dict[str, dict] = {
    "none": {"codec": "none"}, "mapl": {"codec": "mapl"}, "fixed": {"codec": "fixed"},
    "naive": {"codec": "naive"}, "ssn": {"codec": "ssn"}, "mapl_vq": {"codec": "mapl_vq"},
    "none_offsets": {"codec": "none_offsets"},
    "ssn_unscaled": {"codec": "ssn", "ssn_offset_std": 1.0, "ssn_adamw_lr_ratio": 0.5},
}
"""Codec name -> ``[compression]`` settings."""
CASES: dict[str, dict] = {**CODECS, **{f"fp32:{name}": dict(c, wire_dtype="fp32") for name, c in CODECS.items()}}
"""Golden key -> ``[compression]`` settings: every codec on the bf16 and on the fp32 wire."""
STEPS = 5
FIRST_REL = 1e-5
"""Tolerance of the first loss (no optimizer step yet), relative."""
LOOSE_REL, TIGHT_REL = 2e-3, 1e-5
"""Tolerance of the later losses, relative: loose where quantization amplifies rounding (bf16 wire,
VQ codes), tight otherwise."""


def first_losses(case: str) -> list[float]:
    cfg = micro_config(compression=CASES[case], optim={"warmup_steps": 2})
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # one reduction order per machine
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
    tight = case.startswith("fp32:") and CASES[case]["codec"] != "mapl_vq"
    assert losses[0] == pytest.approx(expected[0], rel=FIRST_REL), case
    assert losses[1:] == pytest.approx(expected[1:], rel=TIGHT_REL if tight else LOOSE_REL), case


@pytest.mark.parametrize("case", CASES)
def test_golden_losses_unchanged(case):
    check_against_golden(case, first_losses(case))


def test_same_process_twice_is_bit_identical():
    """MAPL+VQ on the bf16 wire, the most rounding-sensitive case: deterministic to the bit."""
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
