"""mapl_swarm.wire must work in a process where torch cannot be imported."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

SCRIPT = r"""
import sys
sys.modules["torch"] = None  # any `import torch` now raises ImportError
import numpy as np
import mapl_swarm.wire as w
import mapl_swarm.wire.golden
m = w.Message(type=w.MessageType.ACT, run_id="r", src=0, dst=1, meta={"mode": "train"},
              tensors={"ids": np.arange(10, dtype=np.int64)})
assert w.decode(w.encode(m)) == m
assert sys.modules["torch"] is None
print("ok")
"""


def test_wire_imports_without_torch():
    r = subprocess.run(
        [sys.executable, "-c", SCRIPT], cwd=REPO, capture_output=True, text=True, timeout=60
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "ok"
