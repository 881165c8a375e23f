"""Single-process training loop: data, steps, progress bar, metrics, validation, checkpoints."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm

from mapl_swarm.compress import config_boundary_bytes
from mapl_swarm.config import TrainConfig, config_to_dict
from mapl_swarm.data import BatchSampler, PreparedData, prepare_data, validation_batches
from mapl_swarm.errors import ConfigError
from mapl_swarm.metrics import JsonlWriter, run_manifest
from mapl_swarm.pipeline import checkpoint
from mapl_swarm.pipeline.inprocess import InProcessPipeline
from mapl_swarm.pipeline.payload import BACKWARD_KINDS, FORWARD_KINDS, kind_bytes

log = logging.getLogger(__name__)

__all__ = ["TrainSummary", "train", "resolve_device", "check_vocab"]


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


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError("runtime.device is cuda but no CUDA device is available")
    return torch.device(name)


def check_vocab(cfg: TrainConfig, data: PreparedData) -> None:
    if data.tokenizer.vocab_size != cfg.model.vocab_size:
        raise ConfigError(f"model.vocab_size {cfg.model.vocab_size} != tokenizer vocabulary "
                          f"{data.tokenizer.vocab_size} (set model.vocab_size or data.vocab_size)")


def _save_checkpoint(pipe: InProcessPipeline, cfg: TrainConfig, sampler: BatchSampler, step: int) -> None:
    for s, state in enumerate(pipe.state_dicts()):
        if s == 0:
            state["data"] = sampler.state_dict()
        checkpoint.save_stage(cfg.run.out_dir, step, s, state)
    checkpoint.prune(cfg.run.out_dir, cfg.pipeline.num_stages, cfg.checkpoint.keep)
    log.info("checkpoint saved at step %d", step)


def _resume(pipe: InProcessPipeline, cfg: TrainConfig, sampler: BatchSampler) -> int:
    step = checkpoint.latest_complete_step(cfg.run.out_dir, cfg.pipeline.num_stages)
    if step is None:
        log.warning("--resume: no complete checkpoint under %s, starting from step 0", cfg.run.out_dir)
        return 0
    for s, stage in enumerate(pipe.stages):
        state = checkpoint.load_stage(cfg.run.out_dir, step, s)
        stage.load_state_dict(state)
        if s == 0:
            sampler.load_state_dict(state["data"])
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
    data = data or prepare_data(cfg.data, progress=progress)
    check_vocab(cfg, data)
    run, T = cfg.run, cfg.model.context_length
    out = Path(run.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    pipe = InProcessPipeline(cfg, device)
    sampler = BatchSampler(data.train, cfg.pipeline.micro_batch_size, T, run.seed)
    val = validation_batches(data.val, cfg.pipeline.micro_batch_size, T, cfg.eval.batches)
    start = _resume(pipe, cfg, sampler) if resume else 0
    manifest = run_manifest(config_to_dict(cfg), corpus_fingerprint=data.meta.get("corpus_fingerprint"),
                            tokenizer_hash=data.tokenizer.file_hash, seed=run.seed, resumed_from=start)
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2))
    expected = config_boundary_bytes(cfg)
    log.info("codec %s: expected payload per boundary %.1f B/token forward, %.1f B/token backward "
             "(+ %.2f B/token codebook slices each way)", cfg.compression.codec, expected.forward_bytes,
             expected.backward_bytes, expected.codebook_bytes)

    initial_val = pipe.evaluate(val) if start == 0 else None
    val_history: list[tuple[int, float]] = [] if initial_val is None else [(0, initial_val)]
    tokens_total, wall, loss = 0, 0.0, float("nan")
    val_loss = initial_val if initial_val is not None else float("nan")
    with JsonlWriter(out / "metrics.jsonl") as metrics:
        if initial_val is not None:
            metrics.write({"step": 0, "val_loss": initial_val})
        bar = tqdm(total=run.steps, initial=start, disable=not progress, desc=f"train {cfg.compression.codec}",
                   unit="step", dynamic_ncols=True)
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
            if cfg.eval.interval_steps and (done % cfg.eval.interval_steps == 0 or done == run.steps):
                val_loss = pipe.evaluate(val)
                val_history.append((done, val_loss))
                record["val_loss"] = val_loss
            if done % cfg.metrics.log_interval_steps == 0 or "val_loss" in record or health:
                metrics.write(record)
            if cfg.checkpoint.interval_steps and (done % cfg.checkpoint.interval_steps == 0 or done == run.steps):
                _save_checkpoint(pipe, cfg, sampler, done)
            bar.set_postfix({"loss": f"{loss:.3f}", "val": f"{val_loss:.3f}", "tok_s": f"{res.tokens / dt:.0f}",
                             "payload_B/tok": f"{(sum(per_link) / len(per_link)) if per_link else 0:.0f}"})
            bar.update(1)
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
