"""Run a grid in-process, one run at a time, resumably; then write tables and plots.

Layout under the output folder::

    runs/<run_id>.json     one result per finished run (metrics, bytes, diagnostics, manifest)
    train/<run_id>/        the run's metrics.jsonl, manifest.json and (when the grid sets
                           ``[base.checkpoint] interval_steps``) its checkpoints
    summary.md             Table 1 / 5 / 6 shaped tables and the plot list
    plots/*.png            Pareto frontier, loss curves, spectra, principal angles, energy, cosines

A run whose JSON exists with the same config digest is skipped, so re-invoking the same command
after an interruption continues where it stopped: an unfinished run resumes from its newest
checkpoint when the grid checkpoints (long grids), and starts over otherwise. Every run trains the
grid's ``tokens_per_run``.
"""

from __future__ import annotations

import json
import logging
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

from mapl_swarm.compress import WIRE_TORCH_DTYPES
from mapl_swarm.config import config_to_dict
from mapl_swarm.files import atomic_write_text
from mapl_swarm.experiments.analysis import analyze_pipeline, link_bytes
from mapl_swarm.experiments.grid import Grid, RunSpec, config_hash
from mapl_swarm.metrics import run_manifest

log = logging.getLogger(__name__)

__all__ = ["SweepReport", "run_sweep", "load_results", "write_report"]


@dataclass
class SweepReport:
    """What one invocation did."""

    ran: list[str] = field(default_factory=list)
    skipped_done: list[str] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)
    """Runs that raised; their JSON is not written, so the next invocation retries them."""
    summary_path: Path | None = None
    plots: list[Path] = field(default_factory=list)


def _read_metrics(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _train(cfg, train_dir: Path, **kwargs):
    """Train ``cfg`` into ``train_dir``, resuming an interrupted attempt from its newest checkpoint
    when the grid checkpoints; returns (summary, step resumed from)."""
    from mapl_swarm.errors import CheckpointError
    from mapl_swarm.pipeline.run_records import manifest_path
    from mapl_swarm.pipeline.trainer import train

    if train_dir.exists() and cfg.checkpoint.interval_steps > 0:
        try:
            summary = train(cfg, resume=True, **kwargs)
            manifest = json.loads(manifest_path(train_dir).read_text())
            return summary, int(manifest.get("resumed_from", 0))
        except CheckpointError as exc:
            log.warning("%s: cannot resume (%s); starting over", train_dir.name, exc)
    if train_dir.exists():
        shutil.rmtree(train_dir)  # an unfinished earlier attempt without checkpoints: start clean
    return train(cfg, **kwargs), 0


def _run_one(spec: RunSpec, grid: Grid, out: Path, data, progress: bool) -> dict:
    from mapl_swarm.pipeline.trainer import resolve_device

    train_dir = out / "train" / spec.run_id
    cfg = spec.config(train_dir)
    diag: dict = {}

    def on_finish(pipe, val_batches) -> None:
        t0 = time.perf_counter()
        diag["analysis"] = analyze_pipeline(pipe, val_batches, seed=spec.seed)
        diag["analysis_s"] = time.perf_counter() - t0
        diag["pipe"] = pipe

    t0 = time.perf_counter()
    summary, resumed_from = _train(cfg, train_dir, progress=progress, data=data, on_finish=on_finish)
    wall = time.perf_counter() - t0
    per_kind = link_bytes(diag.pop("pipe"), summary.tokens)
    records = _read_metrics(train_dir / "metrics.jsonl")
    train_curve = [[r["step"], round(r["loss"], 5)] for r in records if "loss" in r]
    # from the metrics file, which keeps the validations of every attempt of a resumed run
    val_history = [[r["step"], r["val_loss"]] for r in records if "val_loss" in r]
    if not val_history or val_history[-1][0] != summary.steps:
        val_history.append([summary.steps, summary.final_val_loss])
    health = [{k: v for k, v in r.items() if k == "step" or k.startswith("health/")}
              for r in records if any(k.startswith("health/") for k in r)]
    wire_item = WIRE_TORCH_DTYPES[cfg.compression.wire_dtype].itemsize
    return {
        "run_id": spec.run_id,
        "label": spec.label,
        "variant": spec.variant,
        "groups": list(spec.groups),
        "codec": spec.codec,
        "rank": spec.rank,
        "stages": spec.stages,
        "anchor": spec.anchor,
        "seed": spec.seed,
        "config_hash": config_hash(cfg),
        "hidden_size": cfg.model.hidden_size,
        "uncompressed_act_bytes": cfg.model.hidden_size * wire_item,
        "steps": summary.steps,
        # every step's tokens, the resumed attempt's and the earlier ones' (``summary.tokens``: this attempt's)
        "tokens": summary.steps * cfg.pipeline.num_micro_batches * cfg.pipeline.micro_batch_size
        * cfg.model.context_length,
        "tokens_this_attempt": summary.tokens,
        "val_loss": summary.final_val_loss,
        "initial_val_loss": val_history[0][1] if val_history and val_history[0][0] == 0 else None,
        "train_loss": summary.final_train_loss,
        "val_history": val_history,
        "resumed_from": resumed_from,
        "train_curve": train_curve,
        "health": health,
        "bytes_per_token": summary.bytes_per_token,
        "bytes_per_token_by_kind": per_kind,
        "act_bytes_per_token": (sum(b.get("act", 0.0) for b in per_kind) / len(per_kind)) if per_kind else 0.0,
        "wall_s": wall,
        "tokens_per_s": summary.tokens_per_s,
        "device": str(resolve_device(cfg.runtime.device)),
        "analysis": diag["analysis"],
        "analysis_s": diag["analysis_s"],
        "manifest": run_manifest(config_to_dict(cfg), corpus_fingerprint=data.meta.get("corpus_fingerprint"),
                                 tokenizer_hash=data.tokenizer.file_hash, seed=spec.seed,
                                 grid=grid.name, grid_source=grid.source, run_id=spec.run_id),
    }


def load_results(out: Path) -> list[dict]:
    """Every finished run's JSON under ``out/runs``."""
    folder = Path(out) / "runs"
    return [json.loads(p.read_text()) for p in sorted(folder.glob("*.json"))] if folder.exists() else []


def write_report(grid: Grid, out: Path, *, skipped: list[str] | None = None, command: str = "") -> tuple[Path, list[Path]]:
    """Tables (summary.md) and plots from the finished runs of ``grid`` under ``out``."""
    from mapl_swarm.experiments import plots, tables

    wanted = {s.run_id for s in grid.expand()}
    results = [r for r in load_results(out) if r["run_id"] in wanted]
    plot_dir = out / "plots"
    made = plots.make_all(results, plot_dir) if results else []
    md = tables.summary_markdown(grid, results, skipped=skipped or [], plots=[p.relative_to(out) for p in made],
                                 command=command)
    path = out / "summary.md"
    atomic_write_text(path, md)
    return path, made


def run_sweep(grid: Grid, out: str | Path | None = None, *, progress: bool = True, only: str | None = None,
              command: str = "", report_only: bool = False) -> SweepReport:
    """Run every unfinished run of ``grid`` (those whose id contains ``only``, if given), then report."""
    out = Path(out or grid.out_dir)
    (out / "runs").mkdir(parents=True, exist_ok=True)
    report = SweepReport()
    specs = [s for s in grid.expand() if only is None or only in s.run_id]
    data = None
    for i, spec in enumerate(specs):
        path = out / "runs" / f"{spec.run_id}.json"
        want = config_hash(spec.config(out / "train" / spec.run_id))
        if path.exists():
            try:
                done = json.loads(path.read_text()).get("config_hash") == want
            except json.JSONDecodeError:
                done = False
            if done:
                report.skipped_done.append(spec.run_id)
                log.info("[%d/%d] %s: already finished, skipped", i + 1, len(specs), spec.run_id)
                continue
            log.warning("%s: stored result has a different config; running it again", spec.run_id)
        if report_only:
            continue
        if data is None:
            from mapl_swarm.data import prepare_data

            data = prepare_data(grid.base_config.data, progress=progress)
        log.info("[%d/%d] %s: training %d tokens", i + 1, len(specs), spec.run_id, grid.tokens_per_run)
        try:
            result = _run_one(spec, grid, out, data, progress)
        except Exception as exc:  # one broken configuration must not end an hour-long sweep
            log.exception("[%d/%d] %s failed: %s", i + 1, len(specs), spec.run_id, exc)
            report.failed.append(f"{spec.run_id} ({type(exc).__name__}: {exc})")
            continue
        atomic_write_text(path, json.dumps(result, indent=1))
        report.ran.append(spec.run_id)
        log.info("[%d/%d] %s: val loss %.4f, %.1f act B/token, %.0f s", i + 1, len(specs), spec.run_id,
                 result["val_loss"], result["act_bytes_per_token"], result["wall_s"])
    skipped = [f"{r} — FAILED" for r in report.failed]
    report.summary_path, report.plots = write_report(grid, out, skipped=skipped, command=command)
    return report
