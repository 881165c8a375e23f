"""Per-stage checkpoints at common step numbers.

Layout: ``<out_dir>/checkpoints/step_<08d>/stage_<s>.pt``. Each file is written to a temporary
name and renamed, so a crash never leaves a half file under the final name. A run resumes from the
newest step for which *every* stage has its file; older complete steps beyond ``keep`` are pruned.
Files are local (torch.save); nothing here crosses the network.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
from pathlib import Path
from typing import Any

import torch

from mapl_swarm.errors import CheckpointError

log = logging.getLogger(__name__)

__all__ = ["save_stage", "load_stage", "complete_steps", "latest_complete_step", "prune"]

_STEP_RE = re.compile(r"^step_(\d{8})$")


def _step_dir(root: Path, step: int) -> Path:
    return Path(root) / "checkpoints" / f"step_{step:08d}"


def save_stage(root: str | Path, step: int, stage: int, state: dict[str, Any]) -> Path:
    """Atomically write one stage's state for ``step``."""
    d = _step_dir(Path(root), step)
    d.mkdir(parents=True, exist_ok=True)
    final = d / f"stage_{stage}.pt"
    tmp = d / f".stage_{stage}.pt.tmp"
    torch.save(state, tmp)
    os.replace(tmp, final)
    return final


def load_stage(root: str | Path, step: int, stage: int) -> dict[str, Any]:
    path = _step_dir(Path(root), step) / f"stage_{stage}.pt"
    if not path.exists():
        raise CheckpointError(f"checkpoint missing: {path}")
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # corrupted file: name it, never crash with a traceback
        raise CheckpointError(f"cannot read checkpoint {path}: {exc}") from None


def complete_steps(root: str | Path, num_stages: int) -> list[int]:
    """Steps (ascending) for which all ``num_stages`` stage files exist."""
    base = Path(root) / "checkpoints"
    if not base.is_dir():
        return []
    steps = []
    for d in base.iterdir():
        m = _STEP_RE.match(d.name)
        if m and all((d / f"stage_{s}.pt").exists() for s in range(num_stages)):
            steps.append(int(m.group(1)))
    return sorted(steps)


def latest_complete_step(root: str | Path, num_stages: int) -> int | None:
    steps = complete_steps(root, num_stages)
    return steps[-1] if steps else None


def prune(root: str | Path, num_stages: int, keep: int) -> None:
    """Delete complete steps older than the newest ``keep`` (and incomplete ones older than those)."""
    steps = complete_steps(root, num_stages)
    if len(steps) <= keep:
        return
    cutoff = steps[-keep]
    base = Path(root) / "checkpoints"
    for d in base.iterdir():
        m = _STEP_RE.match(d.name)
        if m and int(m.group(1)) < cutoff:
            shutil.rmtree(d, ignore_errors=True)
            log.debug("pruned checkpoint %s", d)
