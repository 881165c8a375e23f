"""Single-process training loop: data, steps, progress bar, metrics, validation, checkpoints."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from mapl_swarm.compress import config_boundary_bytes
from mapl_swarm.config import TrainConfig, model_fingerprint
from mapl_swarm.data import BatchSampler, PreparedData, prepare_data, validation_batches
from mapl_swarm.metrics.export import opened_exporters
from mapl_swarm.metrics.progress import StepProgress
from mapl_swarm.pipeline.device import bind_device, resolve_device
from mapl_swarm.pipeline.inprocess import InProcessPipeline
from mapl_swarm.pipeline.payload import BACKWARD_KINDS, FORWARD_KINDS, kind_bytes
from mapl_swarm.pipeline.run_policy import check_vocab, checkpoint_due, validation_due
from mapl_swarm.pipeline.run_records import MetricsLog, metrics_path, write_manifest
from mapl_swarm.pipeline.checkpoint import (StageCheckpoints, choose_resume_step, rolled_back_note, save_step,
                                           start_fresh)

log = logging.getLogger(__name__)

__all__ = ["TrainSummary", "train", "resolve_device", "check_vocab"]  # the last two: run_policy's


@dataclass
class TrainSummary:
    """Figures of a finished run."""

    steps: int
    final_train_loss: float
    final_val_loss: float
    initial_val_loss: float | None
    tokens: int
    wall_s: float
    tokens_per_s: float
    bytes_per_token: list[dict[str, float]] = field(default_factory=list)
    """Measured payload bytes per token per boundary: forward, backward, total."""
    val_history: list[tuple[int, float]] = field(default_factory=list)


def _save_checkpoint(pipe: InProcessPipeline, stores: list[StageCheckpoints], sampler: BatchSampler,
                     step: int) -> None:
    states = pipe.state_dicts()
    states[0]["data"] = sampler.state_dict()
    if not save_step(stores, step, states):  # e.g. a full disk: said once, nothing of the step left
        return
    for store in stores:  # every stage's file is in this one folder: the step is complete
        store.mark_complete(step)
    log.info("checkpoint saved at step %d", step)


def _resume(pipe: InProcessPipeline, cfg: TrainConfig, stores: list[StageCheckpoints], sampler: BatchSampler) -> int:
    step = choose_resume_step({st.stage: st.usable_steps() for st in stores}, cfg.run.steps, cfg.run.out_dir)
    later: set[int] = set()
    for store, stage in zip(stores, pipe.stages):
        state = store.load(step)
        stage.load_state_dict(state)
        if store.stage == 0:
            sampler.load_state_dict(state["data"])
        later.update(store.resumed(step))
    if later:
        log.warning("%s", rolled_back_note(cfg.run.out_dir, step, later, "the run"))
    for b in range(len(pipe.links)):  # receivers' projector copies are saved too; re-sync anyway
        proj = pipe.stages[b].outbound_projector()
        if proj is not None:
            pipe.stages[b + 1].load_inbound_projector(*proj)
    log.info("resumed from step %d", step)
    return step


def train(cfg: TrainConfig, *, resume: bool = False, progress: bool = True,
          data: PreparedData | None = None,
          on_finish: Callable[[InProcessPipeline, list[torch.Tensor]], None] | None = None) -> TrainSummary:
    """Train ``cfg`` with all stages in this process. ``on_finish(pipeline, val_batches)`` is called
    once after the final validation (end-of-run analysis)."""
    if cfg.runtime.threads:
        torch.set_num_threads(cfg.runtime.threads)
    device = resolve_device(cfg.runtime.device)
    bind_device(device)  # cuda:N: kernels, streams and compiled code without a device go to N too
    data = data or prepare_data(cfg.data, progress=progress)
    check_vocab(cfg, data)
    run, T = cfg.run, cfg.model.context_length
    out = Path(run.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    fingerprint = model_fingerprint(cfg, data.tokenizer.file_hash, data.tokenizer.vocab_size)
    if not resume:  # a fresh run owns its folder: an earlier run's checkpoints move aside
        start_fresh(out, range(cfg.pipeline.num_stages))
    stores = [StageCheckpoints(out, s, driver="train", fingerprint=fingerprint, keep=cfg.checkpoint.keep)
              for s in range(cfg.pipeline.num_stages)]
    pipe = InProcessPipeline(cfg, device)
    sampler = BatchSampler(data.train, cfg.pipeline.micro_batch_size, T, run.seed)
    val = validation_batches(data.val, cfg.pipeline.micro_batch_size, T, cfg.eval.batches)
    start = _resume(pipe, cfg, stores, sampler) if resume else 0

    expected = config_boundary_bytes(cfg)
    extra = [f"{n:.2f} B/token of {what}" for n, what in ((expected.codebook_bytes, "codebook slices"),
                                                          (expected.projector_bytes, "projector exchange")) if n]
    log.info("codec %s: expected payload per boundary %.1f B/token forward, %.1f B/token backward (activations, "
             "ids and gradients)%s", cfg.compression.codec, expected.forward_bytes, expected.backward_bytes,
             f", + {' and '.join(extra)} each way" if extra else "")

    initial_val = pipe.evaluate(val) if start == 0 else None
    val_history: list[tuple[int, float]] = [] if initial_val is None else [(0, initial_val)]
    tokens_total, wall, loss = 0, 0.0, float("nan")
    val_loss = initial_val if initial_val is not None else float("nan")
    with opened_exporters(cfg, stage=None) as exporters, \
            MetricsLog(metrics_path(out), resume_from=start if resume else None, exporters=exporters) as metrics:
        write_manifest(cfg, data, driver="train", fingerprint=fingerprint, resumed_from=start, exporters=exporters)
        if initial_val is not None:
            metrics.write({"step": 0, "val_loss": initial_val})
        bar = StepProgress(run.steps, initial=start, enabled=progress, desc=f"train {cfg.compression.codec}")
        for step in range(start, run.steps):
            batches = [next(sampler) for _ in range(cfg.pipeline.num_micro_batches)]
            before = [link.total() for link in pipe.links]
            t0 = time.perf_counter()
            res = pipe.train_step(batches)
            dt = time.perf_counter() - t0
            wall += dt
            tokens_total += res.tokens
            loss = res.loss
            done = step + 1
            per_link = [(link.total() - b) / res.tokens for link, b in zip(pipe.links, before)]
            record = {"step": done, "loss": loss, "tokens": res.tokens, "step_s": round(dt, 4),
                      "tokens_per_s": res.tokens / dt, "lr_mult": res.metrics.get("stage0/lr_mult"),
                      "bytes_per_token": per_link}
            health = {k.split("/", 1)[1]: v for k, v in res.metrics.items() if "/health/" in k}
            record.update(dict(sorted(health.items())))
            if validation_due(cfg, done):
                val_loss = pipe.evaluate(val)
                val_history.append((done, val_loss))
                record["val_loss"] = val_loss
            if done % cfg.metrics.log_interval_steps == 0 or "val_loss" in record or health:
                metrics.write(record)
            if checkpoint_due(cfg, done):
                _save_checkpoint(pipe, stores, sampler, done)
            bar.step(**{"loss": f"{loss:.3f}", "val": f"{val_loss:.3f}", "tok_s": f"{res.tokens / dt:.0f}",
                        "payload_B/tok": f"{(sum(per_link) / len(per_link)) if per_link else 0:.0f}"})
        bar.close()
    if not val_history or val_history[-1][0] != run.steps:
        val_loss = pipe.evaluate(val)
        val_history.append((run.steps, val_loss))
    if on_finish is not None:
        on_finish(pipe, val)
    total_tok = max(tokens_total, 1)
    per_boundary = []
    for link in pipe.links:
        fwd, bwd = kind_bytes(link.bytes, FORWARD_KINDS), kind_bytes(link.bytes, BACKWARD_KINDS)
        per_boundary.append({"forward": fwd / total_tok, "backward": bwd / total_tok,
                             "total": (fwd + bwd) / total_tok})
    return TrainSummary(steps=run.steps, final_train_loss=loss, final_val_loss=val_history[-1][1],
                        initial_val_loss=initial_val, tokens=tokens_total, wall_s=wall,
                        tokens_per_s=tokens_total / wall if wall else 0.0, bytes_per_token=per_boundary,
                        val_history=val_history)
