"""The run policy shared by ``train`` (all stages in one process) and every swarm peer.

One place decides: the device, the vocabulary check, the run folder's layout, fresh start versus
resume, checkpoint cadence, checkpoint metadata and pruning, the run manifest, the per-step JSONL
metrics and the validation cadence. The two drivers differ only in how a step becomes
*complete*: ``train`` sees every stage's file in its one folder; swarm peers agree by messages
(:mod:`mapl_swarm.peer.checkpoints`), because each stage's folder may be on another host.

Run folder (``run.out_dir``; each host of a swarm has its own, or they share one)::

    manifest.json                 the run manifest (train; swarm: stage 0)
    manifest_stage{S}.json        swarm stage S > 0: its own manifest (same fields + stage)
    metrics.jsonl                 train: one record per logged step
    metrics_stage{S}.jsonl        swarm stage S: one record per step, appended as it happens
    checkpoints/step_N/stage_S.pt, stage_S.manifest.json, checkpoints/complete_stage{S}.json
    checkpoints.previous/         an earlier run's checkpoints, moved there by a fresh run
    peer_stage{S}.json            swarm stage S: its result summary, written at the end

A fresh run (no ``--resume``) moves an earlier run's checkpoints of its stages to
``checkpoints.previous/`` and starts its metrics file anew, so the older, higher-numbered steps
can never outrank (and prune) its own. A resume appends to the metrics (records after the resume
step, left by the interrupted run, are dropped) and refuses checkpoints written by the other
driver or another config, and ones at or beyond ``run.steps``.
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable

from mapl_swarm.config import TrainConfig, config_to_dict
from mapl_swarm.errors import CheckpointError, ConfigError, MaplError
from mapl_swarm.files import atomic_write_text
from mapl_swarm.metrics import JsonlWriter, run_manifest
from mapl_swarm.pipeline import checkpoint

if TYPE_CHECKING:
    import torch

    from mapl_swarm.data import PreparedData

log = logging.getLogger(__name__)

__all__ = ["DRIVERS", "resolve_device", "bind_device", "check_vocab", "due", "checkpoint_due", "validation_due", "metrics_path",
           "manifest_path", "write_manifest", "start_fresh", "StageCheckpoints", "save_step", "choose_resume_step",
           "check_resume_step", "MetricsLog", "StepRecords", "steps_without_loss"]

DRIVERS = ("train", "swarm")
"""Who wrote a checkpoint: the in-process trainer or swarm peers."""


# ---------------------------------------------------------------- device, vocabulary, cadence
def resolve_device(name: str) -> "torch.device":
    """The torch device of ``runtime.device``: ``auto`` is CUDA when present (else the CPU), ``cuda``
    the first visible CUDA device, ``cuda:N`` visible device N. Asking for CUDA without one, or for
    an N beyond the visible count (``CUDA_VISIBLE_DEVICES`` narrows it: ``launch`` gives each peer
    one GPU), is a ConfigError that says so. The result is what :func:`bind_device` makes current in
    each thread that computes."""
    import torch

    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ConfigError(f"runtime.device is {name} but no CUDA device is available"
                          + _visible_note())
    device = torch.device(name)
    if device.type != "cuda":
        raise ConfigError(f"runtime.device must be auto, cpu, cuda or cuda:N, got {name!r}")
    count = torch.cuda.device_count()
    if device.index is not None and device.index >= count:
        raise ConfigError(f"runtime.device is cuda:{device.index} but only {count} CUDA device"
                          f"{'s are' if count != 1 else ' is'} visible (cuda:0..cuda:{count - 1})"
                          + _visible_note())
    return device


def _visible_note() -> str:
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    return "" if visible is None else f"; CUDA_VISIBLE_DEVICES={visible!r}"


def bind_device(device: "torch.device | str") -> None:
    """Make ``device`` the calling thread's current CUDA device (nothing for the CPU).

    The current CUDA device is per thread: ``torch.cuda.set_device`` in the main thread does not
    reach a worker thread, where kernels, streams, events, ``mem_get_info`` and compiled kernels
    without an explicit device would land on device 0. So every thread that does device work calls
    this first: the peer's main thread and its compute thread (an executor initializer, see
    :func:`mapl_swarm.peer.main.build_peer`), and the in-process trainer. ``cuda`` without an index
    binds device 0, the first visible one."""
    import torch

    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.set_device(0 if device.index is None else device.index)


def check_vocab(cfg: TrainConfig, data: "PreparedData") -> None:
    if data.tokenizer.vocab_size != cfg.model.vocab_size:
        raise ConfigError(f"model.vocab_size {cfg.model.vocab_size} != tokenizer vocabulary "
                          f"{data.tokenizer.vocab_size} (set model.vocab_size or data.vocab_size)")


def due(every: int, step: int, total_steps: int) -> bool:
    """The cadence of periodic work after optimizer step ``step``: every ``every`` steps and after
    the last one; never when ``every`` is 0."""
    return bool(every) and (step % every == 0 or step == total_steps)


def checkpoint_due(cfg: TrainConfig, step: int) -> bool:
    """Whether a checkpoint is saved after ``step`` (``checkpoint.interval_steps``, :func:`due`)."""
    return due(cfg.checkpoint.interval_steps, step, cfg.run.steps)


def validation_due(cfg: TrainConfig, step: int) -> bool:
    """Whether validation runs after ``step`` (``eval.interval_steps``, :func:`due`)."""
    return due(cfg.eval.interval_steps, step, cfg.run.steps)


# ---------------------------------------------------------------- layout, manifest, fresh start
def metrics_path(out_dir: str | Path, stage: int | None = None) -> Path:
    """``metrics.jsonl`` (train, ``stage=None``) or ``metrics_stage{S}.jsonl`` (swarm peer)."""
    return Path(out_dir) / ("metrics.jsonl" if stage is None else f"metrics_stage{stage}.jsonl")


def manifest_path(out_dir: str | Path, stage: int | None = None) -> Path:
    """``manifest.json`` (train; swarm stage 0) or ``manifest_stage{S}.json`` (swarm stage S > 0)."""
    return Path(out_dir) / ("manifest.json" if not stage else f"manifest_stage{stage}.json")


def write_manifest(cfg: TrainConfig, data: "PreparedData", *, driver: str, fingerprint: str,
                   resumed_from: int, stage: int | None = None) -> Path:
    """The run manifest: commit, versions, machine, config, corpus, who trains and from where."""
    extra: dict[str, Any] = {"driver": driver, "config_fingerprint": fingerprint}
    if stage is not None:
        extra["stage"] = stage
    manifest = run_manifest(config_to_dict(cfg), corpus_fingerprint=data.meta.get("corpus_fingerprint"),
                            tokenizer_hash=data.tokenizer.file_hash, seed=cfg.run.seed, resumed_from=resumed_from,
                            **extra)
    path = manifest_path(cfg.run.out_dir, stage)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        return atomic_write_text(path, json.dumps(manifest, indent=2))
    except OSError as exc:  # a full or read-only disk before the first step: one line, no traceback
        raise MaplError(f"cannot write the run manifest {path}: {exc.strerror or exc}") from None


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


# ---------------------------------------------------------------- checkpoints of one stage
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


# ---------------------------------------------------------------- metrics
class MetricsLog:
    """A JSONL metrics file, one record per line, flushed per record. Fresh (``resume_from=None``):
    started anew. Resume: records after ``resume_from`` (the interrupted run's) are dropped, then
    appended to."""

    def __init__(self, path: str | Path, *, resume_from: int | None) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if resume_from is None:
            self.path.write_text("")
        elif self.path.exists():
            kept = [line for line in self.path.read_text().splitlines() if _step_of(line) <= resume_from]
            atomic_write_text(self.path, "".join(line + "\n" for line in kept))
        self._writer = JsonlWriter(self.path)

    def write(self, record: dict[str, Any]) -> None:
        self._writer.write(record)

    def close(self) -> None:
        self._writer.close()

    def __enter__(self) -> "MetricsLog":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _step_of(line: str) -> float:
    try:
        return float(json.loads(line).get("step", 0))
    except (ValueError, AttributeError):
        return float("inf")  # an unreadable line of the interrupted run: dropped


class StepRecords:
    """A swarm stage's per-step records to ``metrics_stage{S}.jsonl``: the stage's own figures at its
    step flush (step time, lr multiplier, health, optimizer metrics); stage 0's record also waits
    for the swarm's train loss (REPORT) and, on validation steps, the val loss. Each record is
    written as soon as it is whole, every ``metrics.log_interval_steps``, on validation steps and
    on checkpoint steps (so a resume can tell whether a checkpoint step's loss is in the history:
    :func:`steps_without_loss`)."""

    def __init__(self, cfg: TrainConfig, stage: int, log_: MetricsLog, start_step: int) -> None:
        self.cfg, self.stage, self.log = cfg, stage, log_
        self._pending: dict[int, dict[str, Any]] = {}
        self._last_t = time.perf_counter()
        self._needs_loss = stage == 0 and cfg.pipeline.num_stages > 1
        self.start_step = start_step

    def _due(self, step: int) -> bool:
        return (step % self.cfg.metrics.log_interval_steps == 0 or validation_due(self.cfg, step)
                or checkpoint_due(self.cfg, step))

    def stage_step(self, step: int, metrics: dict[str, float]) -> None:
        """The stage finished ``step`` (after its optimizer step) with ``metrics``."""
        now = time.perf_counter()
        rec = self._pending.setdefault(step, {})
        rec.update({"step": step, "stage": self.stage, "step_s": round(now - self._last_t, 4),
                    **{k: float(v) for k, v in sorted(metrics.items()) if isinstance(v, (int, float))}})
        self._last_t = now
        self._maybe_write(step)

    def train_loss(self, step: int, loss: float, tokens: int) -> None:
        rec = self._pending.setdefault(step, {})
        rec.update({"loss": loss, "tokens": tokens})
        self._maybe_write(step)

    def val_loss(self, step: int, loss: float) -> None:
        self._pending.setdefault(step, {})["val_loss"] = loss
        self._maybe_write(step)

    def _maybe_write(self, step: int) -> None:
        rec = self._pending[step]
        if "stage" not in rec:
            return
        if self._needs_loss and not _has_losses(self.cfg, rec):
            return
        del self._pending[step]
        if self._due(step) or any(k.startswith("health/") for k in rec):
            self.log.write(rec)

    def close(self) -> None:
        """Write what is pending (a run that stopped early), then close the file."""
        for step in sorted(self._pending):
            if "stage" in self._pending[step]:
                self.log.write(self._pending[step])
        self._pending.clear()
        self.log.close()


def _has_losses(cfg: TrainConfig, rec: dict[str, Any]) -> bool:
    """Stage 0's record ``rec`` holds the swarm's train loss and, on a validation step, the val loss."""
    return "loss" in rec and ("val_loss" in rec or not validation_due(cfg, int(rec["step"])))


def steps_without_loss(cfg: TrainConfig, path: str | Path, steps: Iterable[int]) -> set[int]:
    """Of ``steps`` (checkpoint steps), those whose losses the swarm's stage-0 metrics file ``path``
    lacks: its record is missing or was written without them, because the last stage's REPORT of
    the step never reached stage 0 (a departure after stage 0 saved the step). All of them when
    the file cannot be read."""
    steps = set(steps)
    try:
        lines = Path(path).read_text().splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        log.warning("cannot read the metrics history %s: %s", path, getattr(exc, "strerror", None) or exc)
        return steps
    recorded = set()
    for line in lines:
        try:
            rec = json.loads(line)
        except ValueError:
            continue  # a line cut short by a crash
        if isinstance(rec, dict) and isinstance(rec.get("step"), int) and _has_losses(cfg, rec):
            recorded.add(rec["step"])
    return steps - recorded
