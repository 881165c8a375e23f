"""What a run writes besides checkpoints: its manifest and its per-step JSONL metrics.

A fresh run starts its metrics file anew; a resume appends to it (records after the resume step,
left by the interrupted run, are dropped).
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable, Sequence

from mapl_swarm.config import TrainConfig, config_to_dict
from mapl_swarm.errors import MaplError
from mapl_swarm.files import atomic_write_text
from mapl_swarm.metrics import JsonlWriter, run_manifest
from mapl_swarm.metrics.export import Exporter
from mapl_swarm.pipeline.run_policy import checkpoint_due, validation_due

if TYPE_CHECKING:
    from mapl_swarm.data import PreparedData

log = logging.getLogger(__name__)

__all__ = ["metrics_path", "manifest_path", "write_manifest", "MetricsLog", "StepRecords", "steps_without_loss"]


def metrics_path(out_dir: str | Path, stage: int | None = None) -> Path:
    """``metrics.jsonl`` (train, ``stage=None``) or ``metrics_stage{S}.jsonl`` (swarm peer)."""
    return Path(out_dir) / ("metrics.jsonl" if stage is None else f"metrics_stage{stage}.jsonl")


def manifest_path(out_dir: str | Path, stage: int | None = None) -> Path:
    """``manifest.json`` (train; swarm stage 0) or ``manifest_stage{S}.json`` (swarm stage S > 0)."""
    return Path(out_dir) / ("manifest.json" if not stage else f"manifest_stage{stage}.json")


def write_manifest(cfg: TrainConfig, data: "PreparedData", *, driver: str, fingerprint: str,
                   resumed_from: int, stage: int | None = None, exporters: Sequence[Exporter] = ()) -> Path:
    """The run manifest: commit, versions, machine, config, corpus, who trains and from where, and
    where the process serves its metrics (``metrics_endpoints``: the Prometheus URL)."""
    extra: dict[str, Any] = {"driver": driver, "config_fingerprint": fingerprint}
    endpoints = [e.url for e in exporters if hasattr(e, "url")]
    if endpoints:
        extra["metrics_endpoints"] = endpoints
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


class MetricsLog:
    """A JSONL metrics file, one record per line, flushed per record. Fresh (``resume_from=None``):
    started anew. Resume: records after ``resume_from`` (the interrupted run's) are dropped, then
    appended to. Every record also goes to ``exporters`` (:mod:`mapl_swarm.metrics.export`: the
    process's Prometheus endpoint, TensorBoard files), which live as long as the process and are
    closed by whoever made them."""

    def __init__(self, path: str | Path, *, resume_from: int | None, exporters: Sequence[Exporter] = ()) -> None:
        self.exporters = list(exporters)
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
        for exporter in self.exporters:
            try:
                exporter.record(record)
            except (OSError, ValueError) as exc:  # a full disk under the event files: the run goes on
                log.warning("metrics record not exported by %s: %s", type(exporter).__name__, exc)

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
        if rec.get("tokens") and rec.get("step_s"):  # the swarm's tokens over stage 0's step time, as train's
            rec["tokens_per_s"] = round(rec["tokens"] / rec["step_s"], 1)
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
