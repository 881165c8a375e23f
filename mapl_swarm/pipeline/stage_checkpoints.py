"""One stage's checkpoints under the run folder: fresh start, save, verified steps, load, complete
steps and pruning, and the resume step of a run whose stages are all in one process.

A fresh run (no ``--resume``) moves an earlier run's checkpoints of its stages to
``checkpoints.previous/``, so the older, higher-numbered steps can never outrank (and prune) its
own. A resume refuses checkpoints written by the other driver or another config, and ones at or
beyond ``run.steps``. The files themselves (atomic writes, manifests, verification) are
:mod:`.checkpoint`'s.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Iterable

from mapl_swarm.errors import CheckpointError
from mapl_swarm.pipeline import checkpoint

log = logging.getLogger(__name__)

__all__ = ["DRIVERS", "start_fresh", "StageCheckpoints", "save_step", "choose_resume_step", "check_resume_step"]

DRIVERS = ("train", "swarm")
"""Who wrote a checkpoint: the in-process trainer or swarm peers."""


def start_fresh(out_dir: str | Path, stages: Iterable[int]) -> list[int]:
    """A run without ``--resume`` owns its folder: an earlier run's checkpoints of ``stages`` move to
    ``checkpoints.previous/`` (one log line says so); returns the steps moved."""
    stages = list(stages)
    moved = checkpoint.retire_stages(out_dir, stages)
    if moved:
        which = f"stage {stages[0]}" if len(stages) == 1 else f"stages {stages[0]}-{stages[-1]}"
        log.info("fresh run: moved an earlier run's checkpoints (%s, steps %s) to %s", which,
                 ", ".join(map(str, moved)), Path(out_dir) / checkpoint.PREVIOUS)
    return moved



class StageCheckpoints:
    """One stage's checkpoint files under ``out_dir``: save with a manifest, list the verified
    (usable) steps, load, record complete steps and prune (:func:`checkpoint.prune_plan`). Create it
    after :func:`start_fresh` (it reads the complete steps recorded so far, and removes the
    temporary files a killed save of this stage left)."""

    def __init__(self, out_dir: str | Path, stage: int, *, driver: str, fingerprint: str, keep: int) -> None:
        if driver not in DRIVERS:
            raise ValueError(f"driver must be one of {DRIVERS}, got {driver!r}")
        self.root, self.stage = Path(out_dir), stage
        self.driver, self.fingerprint, self.keep = driver, fingerprint, keep
        self.complete: list[int] = checkpoint.read_complete(self.root, stage)
        """Steps known to be complete across the swarm (every stage has them)."""
        for t in checkpoint.remove_temp_files(self.root, stage):
            log.info("stage %d: removed %s, left by an interrupted checkpoint save", stage, t)

    def save(self, step: int, state: dict[str, Any]) -> bool:
        """Save ``step``; False (after one warning naming the path and the bytes needed) when it
        could not be saved, e.g. on a full disk: nothing of the step is left, earlier steps are
        untouched and training goes on (the next checkpoint is tried again). Raises
        :class:`~checkpoint.CheckpointSaveError` when no checkpoint can ever be saved there."""
        try:
            checkpoint.save_stage(self.root, step, self.stage, state, meta={
                "driver": self.driver, "config_fingerprint": self.fingerprint, "step": step, "stage": self.stage})
        except checkpoint.CheckpointSaveError as exc:
            if exc.permanent:
                raise
            log.warning("%s; training goes on, the next checkpoint is tried again", exc)
            return False
        return True

    def discard(self, step: int) -> None:
        """Remove this stage's files of ``step`` (another stage could not save it)."""
        checkpoint.delete_stage_steps(self.root, self.stage, [step])

    def load(self, step: int) -> dict[str, Any]:
        """The state of ``step``, verified against its manifest before it is read."""
        return checkpoint.load_stage(self.root, step, self.stage)

    def local_steps(self) -> list[int]:
        return checkpoint.stage_steps(self.root, self.stage)

    def usable_steps(self) -> list[int]:
        """This stage's steps a resume may use: those whose files verify against their manifest
        (every file hashed, so call it at resume time). An incomplete or corrupt step is left out
        with one warning naming the file and why; a step of another driver or config raises
        :class:`CheckpointError` naming both. Steps written before manifests count (their load warns)."""
        usable = []
        for step in reversed(self.local_steps()):
            try:
                meta = checkpoint.verify_stage(self.root, step, self.stage)
            except checkpoint.UnusableCheckpoint as exc:
                log.warning("checkpoint step %d of stage %d is not usable, skipped: %s", step, self.stage, exc)
                continue
            where = f"checkpoint step {step} of stage {self.stage} under {self.root / checkpoint.CHECKPOINTS}"
            if meta.get("driver") != self.driver:
                raise CheckpointError(f"{where} was written by another driver: driver {meta.get('driver')} vs "
                                      f"{self.driver} (this run); run without --resume to start fresh")
            if meta.get("config_fingerprint") != self.fingerprint:
                raise CheckpointError(f"{where} was written with another config: fingerprint "
                                      f"{meta.get('config_fingerprint')} vs {self.fingerprint} (this run); model, "
                                      f"codec, seed, stages and tokenizer must match to resume")
            usable.append(step)
        return sorted(usable)

    def _record_complete(self) -> None:
        try:
            checkpoint.write_complete(self.root, self.stage, self.complete)
        except OSError as exc:  # a full disk: the record is only a hint for pruning after a restart
            log.warning("stage %d: cannot record the complete checkpoint steps under %s: %s", self.stage,
                        self.root / checkpoint.CHECKPOINTS, exc.strerror or exc)

    def mark_complete(self, step: int) -> list[int]:
        """Record ``step`` as complete and prune; returns the steps whose files were deleted."""
        local = self.local_steps()
        if step in self.complete or step not in local:
            return []
        self.complete = sorted({*(s for s in self.complete if s in local), step})
        self._record_complete()
        doomed = checkpoint.prune_plan(local, self.complete, self.keep)
        self.complete = [s for s in self.complete if s not in doomed]
        self._record_complete()
        checkpoint.delete_stage_steps(self.root, self.stage, doomed)
        return doomed

    def abandon(self, step: int) -> bool:
        """Delete this stage's files of ``step``, which will never be complete (stage 0 gave it up);
        a complete step is never deleted here. True when there were files."""
        if step in self.complete or step not in self.local_steps():
            return False
        self.discard(step)
        return True

    def resumed(self, step: int) -> None:
        """Resuming from ``step``: it is complete, and later files (of the interrupted run) are stale
        (step 0: a swarm re-forming without a common checkpoint starts again, every file is stale)."""
        stale = [s for s in self.local_steps() if s > step]
        checkpoint.delete_stage_steps(self.root, self.stage, stale)
        if stale:
            log.info("stage %d: removed checkpoint steps %s of the interrupted run (resuming from %d)",
                     self.stage, stale, step)
        self.complete = sorted({*(s for s in self.complete if s < step), *((step,) if step > 0 else ())})
        self._record_complete()


def save_step(stores: list[StageCheckpoints], step: int, states: list[dict[str, Any]]) -> bool:
    """Every stage's state of ``step``, all in one process (``train``): all saved, or none (the
    stages already saved are removed again when one fails, so the step is never half there)."""
    try:
        for store, state in zip(stores, states, strict=True):
            if not store.save(step, state):
                break
        else:
            return True
    except BaseException:
        for store in stores:
            store.discard(step)
        raise
    for store in stores:
        store.discard(step)
    return False


def choose_resume_step(have: dict[int, list[int]], run_steps: int, where: str) -> int:
    """The newest step every stage of ``have`` (stage -> usable steps) holds, or a
    :class:`CheckpointError` saying why there is none (or why it leaves nothing to train)."""
    common = set.intersection(*(set(v) for v in have.values())) if have else set()
    if not common:
        listing = ", ".join(f"stage {s} has {sorted(v) if v else 'none'}" for s, v in sorted(have.items()))
        if not any(have.values()):
            raise CheckpointError(f"--resume: no checkpoint to resume from under {where} ({listing}); "
                                  f"run without --resume to start fresh")
        raise CheckpointError(f"--resume: no checkpoint step that every stage has ({listing})")
    step = max(common)
    check_resume_step(step, run_steps)
    newer = sorted({s for v in have.values() for s in v if s > step})
    if newer:
        log.info("resuming from step %d, the newest step every stage holds intact (step %s: not on every stage)",
                 step, ", ".join(map(str, newer)))
    return step


def check_resume_step(step: int, run_steps: int) -> None:
    if step >= run_steps:
        raise CheckpointError(f"checkpoint at step {step} >= run.steps {run_steps}: nothing to train; "
                              f"raise run.steps")
