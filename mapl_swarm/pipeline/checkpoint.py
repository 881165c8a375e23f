"""Per-stage checkpoint files at common step numbers, and the pruning rule.

Layout under ``<out_dir>``::

    checkpoints/step_<08d>/stage_<s>.pt          one stage's state (torch.save)
    checkpoints/step_<08d>/stage_<s>.meta.json   who wrote it: driver, config fingerprint, step, stage
    checkpoints/complete_stage<s>.json           the steps stage s knows every stage has (agreed)
    checkpoints.previous/...                     an earlier run's checkpoints, moved by a fresh run

Every file is written to a temporary name and renamed, so a crash never leaves a half file under
the final name. Each stage only ever touches its own files, so stages sharing one folder (one
host) and stages on separate hosts behave the same. Files are local; nothing here crosses the
network (which steps are complete swarm-wide is agreed by the peers, :mod:`mapl_swarm.peer.checkpoints`).
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
from pathlib import Path
from typing import Any, Iterable

import torch

from mapl_swarm.errors import CheckpointError
from mapl_swarm.files import atomic_write_text

log = logging.getLogger(__name__)

__all__ = ["save_stage", "load_stage", "read_meta", "stage_steps", "complete_steps", "latest_complete_step",
           "read_complete", "write_complete", "prune_plan", "delete_stage_steps", "prune", "retire_stages",
           "CHECKPOINTS", "PREVIOUS"]

CHECKPOINTS = "checkpoints"
PREVIOUS = "checkpoints.previous"
_STEP_RE = re.compile(r"^step_(\d{8})$")


def _step_dir(root: Path, step: int, folder: str = CHECKPOINTS) -> Path:
    return Path(root) / folder / f"step_{step:08d}"


def _stage_files(d: Path, stage: int) -> list[Path]:
    return [d / f"stage_{stage}.pt", d / f"stage_{stage}.meta.json"]


def save_stage(root: str | Path, step: int, stage: int, state: dict[str, Any],
               meta: dict[str, Any] | None = None) -> Path:
    """Atomically write one stage's state for ``step``, then its ``meta`` (``stage_<s>.meta.json``)."""
    d = _step_dir(Path(root), step)
    d.mkdir(parents=True, exist_ok=True)
    final = d / f"stage_{stage}.pt"
    tmp = d / f".stage_{stage}.pt.tmp"
    torch.save(state, tmp)
    os.replace(tmp, final)
    if meta is not None:
        atomic_write_text(d / f"stage_{stage}.meta.json", json.dumps(meta, sort_keys=True))
    return final


def load_stage(root: str | Path, step: int, stage: int) -> dict[str, Any]:
    path = _step_dir(Path(root), step) / f"stage_{stage}.pt"
    if not path.exists():
        raise CheckpointError(f"checkpoint missing: {path}")
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # corrupted file: name it, never crash with a traceback
        raise CheckpointError(f"cannot read checkpoint {path}: {exc}") from None


def read_meta(root: str | Path, step: int, stage: int) -> dict[str, Any] | None:
    """The metadata of a stage file, or None when it has none (written before metadata existed)."""
    path = _step_dir(Path(root), step) / f"stage_{stage}.meta.json"
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"cannot read checkpoint metadata {path}: {exc}") from None


def _steps(base: Path) -> list[tuple[int, Path]]:
    if not base.is_dir():
        return []
    return sorted((int(m.group(1)), d) for d in base.iterdir() if (m := _STEP_RE.match(d.name)))


def stage_steps(root: str | Path, stage: int) -> list[int]:
    """Steps (ascending) for which stage ``stage`` has its file under ``root``."""
    return [s for s, d in _steps(Path(root) / CHECKPOINTS) if (d / f"stage_{stage}.pt").exists()]


def complete_steps(root: str | Path, num_stages: int) -> list[int]:
    """Steps (ascending) for which all ``num_stages`` stage files exist under this one ``root``."""
    return [s for s, d in _steps(Path(root) / CHECKPOINTS)
            if all((d / f"stage_{k}.pt").exists() for k in range(num_stages))]


def latest_complete_step(root: str | Path, num_stages: int) -> int | None:
    steps = complete_steps(root, num_stages)
    return steps[-1] if steps else None


def read_complete(root: str | Path, stage: int) -> list[int]:
    """Steps stage ``stage`` recorded as complete across the swarm (``complete_stage<s>.json``)."""
    path = Path(root) / CHECKPOINTS / f"complete_stage{stage}.json"
    try:
        return sorted(int(s) for s in json.loads(path.read_text())["steps"])
    except FileNotFoundError:
        return []
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(f"cannot read {path}: {exc}") from None


def write_complete(root: str | Path, stage: int, steps: Iterable[int]) -> None:
    base = Path(root) / CHECKPOINTS
    base.mkdir(parents=True, exist_ok=True)
    atomic_write_text(base / f"complete_stage{stage}.json", json.dumps({"steps": sorted(set(steps))}))


def prune_plan(local: Iterable[int], complete: Iterable[int], keep: int) -> list[int]:
    """Which of a stage's ``local`` steps to delete: all but the newest ``keep`` complete steps,
    never the newest complete step, never a step newer than it; nothing while none is complete."""
    complete = sorted(set(complete))
    if not complete:
        return []
    kept = set(complete[-max(keep, 1):])
    newest = complete[-1]
    return sorted(s for s in set(local) if s < newest and s not in kept)


def delete_stage_steps(root: str | Path, stage: int, steps: Iterable[int]) -> None:
    """Remove stage ``stage``'s files of ``steps`` (and a step folder left empty)."""
    for step in steps:
        d = _step_dir(Path(root), step)
        for f in _stage_files(d, stage):
            f.unlink(missing_ok=True)
        try:
            d.rmdir()
        except OSError:
            pass  # other stages' files remain (or it is gone already)
        log.debug("pruned stage %d of checkpoint step %d", stage, step)


def prune(root: str | Path, num_stages: int, keep: int) -> None:
    """Single-folder pruning: complete = every stage's file is here (:func:`prune_plan`)."""
    complete = complete_steps(root, num_stages)
    for s in range(num_stages):
        delete_stage_steps(root, s, prune_plan(stage_steps(root, s), complete, keep))


def retire_stages(root: str | Path, stages: Iterable[int]) -> list[int]:
    """Move ``stages``' checkpoint files of an earlier run to ``checkpoints.previous/`` (replacing
    what an older run left there for those stages); returns the steps moved."""
    root = Path(root)
    stages = list(stages)
    for step, d in _steps(root / PREVIOUS):
        _drop_stages_in(d, stages)
    for s in stages:
        (root / PREVIOUS / f"complete_stage{s}.json").unlink(missing_ok=True)
    moved = set()
    for step, d in _steps(root / CHECKPOINTS):
        for s in stages:
            for f in _stage_files(d, s):
                if f.exists():
                    dest = _step_dir(root, step, PREVIOUS)
                    dest.mkdir(parents=True, exist_ok=True)
                    os.replace(f, dest / f.name)
                    moved.add(step)
        try:
            d.rmdir()
        except OSError:
            pass
    for s in stages:
        done = root / CHECKPOINTS / f"complete_stage{s}.json"
        if done.exists():
            (root / PREVIOUS).mkdir(parents=True, exist_ok=True)
            os.replace(done, root / PREVIOUS / done.name)
    return sorted(moved)


def _drop_stages_in(d: Path, stages: Iterable[int]) -> None:
    for s in stages:
        for f in _stage_files(d, s):
            f.unlink(missing_ok=True)
    if d.is_dir() and not any(d.iterdir()):
        shutil.rmtree(d, ignore_errors=True)
