"""The run policy shared by ``train`` (all stages in one process) and every swarm peer.

One policy, in one module per concern: the cadence of checkpoints and validation and the
vocabulary check (here), the device (:mod:`.device`), one stage's checkpoints — fresh start versus
resume, save, verification, pruning (:mod:`.checkpoint`) — and the run manifest and the
per-step JSONL metrics (:mod:`.run_records`). The two drivers differ only in how a step becomes
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
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from mapl_swarm.config import TrainConfig
from mapl_swarm.errors import ConfigError
from mapl_swarm.step.cadence import due

if TYPE_CHECKING:
    from mapl_swarm.data import PreparedData

__all__ = ["check_vocab", "due", "checkpoint_due", "validation_due"]


def check_vocab(cfg: TrainConfig, data: "PreparedData") -> None:
    if data.tokenizer.vocab_size != cfg.model.vocab_size:
        raise ConfigError(f"model.vocab_size {cfg.model.vocab_size} != tokenizer vocabulary "
                          f"{data.tokenizer.vocab_size} (set model.vocab_size or data.vocab_size)")


def checkpoint_due(cfg: TrainConfig, step: int) -> bool:
    """Whether a checkpoint is saved after ``step`` (``checkpoint.interval_steps``, :func:`due`)."""
    return due(cfg.checkpoint.interval_steps, step, cfg.run.steps)


def validation_due(cfg: TrainConfig, step: int) -> bool:
    """Whether validation runs after ``step`` (``eval.interval_steps``, :func:`due`)."""
    return due(cfg.eval.interval_steps, step, cfg.run.steps)
