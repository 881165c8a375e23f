"""``mapl-swarm plot``: PNGs of one or more runs' metrics files, overlaid to compare them.

A run folder is a ``train`` run's (``metrics.jsonl``) or a swarm's (``metrics_stage{S}.jsonl`` of
each stage, and the same in ``replica{R}/`` for each further replica). Four figures:

- ``loss.png``: train loss per step (a swarm's from stage 0), validation loss as markers;
- ``throughput.png``: tokens per second per step;
- ``bandwidth.png``: bytes per second each process sent over time, per link (a swarm: each peer's
  payload per neighbour link from ``link_tx_bytes/*``, and its averaging rounds; ``train``: each
  boundary's payload, from ``bytes_per_token``), in MB/s;
- ``health.png``: compression health per boundary (energy captured, projector orthonormality
  error), where the run logged it (``metrics.health_interval_steps``).

A figure with nothing to draw is not written.
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mapl_swarm.errors import ConfigError

__all__ = ["RunMetrics", "load_run", "plot_runs"]

log = logging.getLogger(__name__)

_STAGE_FILE = re.compile(r"^metrics_stage(\d+)\.jsonl$")
_REPLICA_DIR = re.compile(r"^replica(\d+)$")


@dataclass
class RunMetrics:
    """The records of one run folder: ``train``'s, or every stage's and replica's of a swarm."""

    name: str
    train: list[dict[str, Any]] = field(default_factory=list)
    peers: dict[tuple[int, int], list[dict[str, Any]]] = field(default_factory=dict)
    """(stage, replica) -> that peer's records (a swarm)."""

    @property
    def main(self) -> list[dict[str, Any]]:
        """The records carrying the run's losses: ``train``'s, or stage 0's first replica's."""
        return self.train or self.peers.get((0, 0), [])


def _records(path: Path) -> list[dict[str, Any]]:
    out = []
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue  # a line cut short by a crash
        if isinstance(rec, dict) and isinstance(rec.get("step"), int):
            out.append(rec)
    return out


def load_run(folder: str | Path) -> RunMetrics:
    """The metrics files of run folder ``folder``; ConfigError when it holds none."""
    folder = Path(folder)
    if not folder.is_dir():
        raise ConfigError(f"plot: {folder} is not a folder (give a run folder: run.out_dir)")
    run = RunMetrics(folder.name or str(folder))
    if (folder / "metrics.jsonl").is_file():
        run.train = _records(folder / "metrics.jsonl")
    places = [(folder, 0)] + sorted(((d, int(m.group(1))) for d in folder.iterdir()
                                     if d.is_dir() and (m := _REPLICA_DIR.match(d.name))), key=lambda x: x[1])
    for where, replica in places:
        for path in sorted(where.glob("metrics_stage*.jsonl")):
            m = _STAGE_FILE.match(path.name)
            if m:
                run.peers[int(m.group(1)), replica] = _records(path)
    if not run.train and not any(run.peers.values()):
        raise ConfigError(f"plot: no metrics in {folder} (metrics.jsonl of `train`, metrics_stage<S>.jsonl of a "
                          "swarm peer)")
    return run


def _series(records: list[dict[str, Any]], key: str) -> tuple[list[float], list[float]]:
    pts = [(r["step"], float(r[key])) for r in records if isinstance(r.get(key), (int, float))]
    return [p[0] for p in pts], [p[1] for p in pts]


def _tokens_per_s(records: list[dict[str, Any]]) -> tuple[list[float], list[float]]:
    pts = [(r["step"], float(r["tokens_per_s"]) if "tokens_per_s" in r else r["tokens"] / r["step_s"])
           for r in records if "tokens_per_s" in r or (r.get("tokens") and r.get("step_s"))]
    return [p[0] for p in pts], [p[1] for p in pts]


def _rates(records: list[dict[str, Any]]) -> dict[str, tuple[list[float], list[float]]]:
    """Bytes per second sent over time (seconds since the first record), per link or boundary."""
    out: dict[str, tuple[list[float], list[float]]] = {}
    if not records:
        return out
    t0 = records[0]["time"] if "time" in records[0] else 0.0
    for prev, rec in zip(records, records[1:]):
        dt = rec.get("time", 0.0) - prev.get("time", 0.0)
        if dt <= 0:
            continue
        for key, value in rec.items():
            if key.startswith("link_tx_bytes/") and key in prev:
                xs, ys = out.setdefault(key.split("/", 1)[1], ([], []))
                xs.append(rec["time"] - t0)
                ys.append((value - prev[key]) / dt)
        if "averaging_sent_bytes" in rec and rec.get("step_s"):
            xs, ys = out.setdefault("averaging", ([], []))
            xs.append(rec["time"] - t0)
            ys.append(rec["averaging_sent_bytes"] / rec["step_s"])
    for rec in records:  # train: each boundary's payload
        per_token, rate = rec.get("bytes_per_token"), rec.get("tokens_per_s")
        if isinstance(per_token, list) and isinstance(rate, (int, float)):
            for b, n in enumerate(per_token):
                xs, ys = out.setdefault(f"boundary {b}", ([], []))
                xs.append(rec.get("time", 0.0) - t0)
                ys.append(n * rate)
    return out


def _health(records: list[dict[str, Any]]) -> dict[str, tuple[list[float], list[float]]]:
    keys = sorted({k for r in records for k in r if re.match(r"^health/b\d+/(energy_captured|orth_error)$", k)})
    return {k.removeprefix("health/"): _series(records, k) for k in keys}


def _finish(ax: Any, size: int, ncol: int = 1) -> None:
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=size, ncol=ncol)


def _loss(runs: list[RunMetrics], ax: Any) -> bool:
    drawn = False
    for run in runs:
        xs, ys = _series(run.main, "loss")
        if xs:
            line, = ax.plot(xs, ys, label=f"{run.name} train", lw=1.2)
            drawn = True
            vx, vy = _series(run.main, "val_loss")
            if vx:
                ax.plot(vx, vy, "o--", color=line.get_color(), label=f"{run.name} val", ms=4, lw=0.8)
    ax.set(xlabel="step", ylabel="loss", title="Loss")
    _finish(ax, 8)
    return drawn


def _throughput(runs: list[RunMetrics], ax: Any) -> bool:
    drawn = False
    for run in runs:
        xs, ys = _tokens_per_s(run.main)
        if xs:
            ax.plot(xs, ys, label=run.name, lw=1.2)
            drawn = True
    ax.set(xlabel="step", ylabel="tokens / s", title="Throughput")
    _finish(ax, 8)
    return drawn


def _bandwidth(runs: list[RunMetrics], ax: Any) -> bool:
    drawn = False
    for run in runs:
        sources = [("", run.train)] if run.train else [
            (f"s{s}" + (f"r{r}" if r else ""), recs) for (s, r), recs in sorted(run.peers.items())]
        for who, recs in sources:
            for link, (xs, ys) in sorted(_rates(recs).items()):
                if any(ys):  # a stage of one replica records averaging rounds of 0 bytes: no line
                    ax.plot(xs, [y / 1e6 for y in ys], label=" ".join(x for x in (run.name, who, link) if x), lw=1)
                    drawn = True
    ax.set(xlabel="seconds", ylabel="MB / s sent", title="Bandwidth per link")
    _finish(ax, 6, ncol=2)
    return drawn


def _health_figure(runs: list[RunMetrics], axes: Any) -> bool:
    energy, orth = axes
    drawn = False
    for run in runs:
        records = run.train or [r for (_, replica), recs in sorted(run.peers.items()) if replica == 0 for r in recs]
        for key, (xs, ys) in _health(records).items():
            if xs:
                (energy if key.endswith("energy_captured") else orth).plot(xs, ys, ".-", label=f"{run.name} {key}",
                                                                           lw=1, ms=3)
                drawn = True
    energy.set(xlabel="step", ylabel="energy captured", title="Projector: energy captured")
    orth.set(xlabel="step", ylabel="‖AᵀA − I‖", title="Projector: orthonormality error")
    for ax in (energy, orth):
        _finish(ax, 6)
    return drawn


_FIGURES = (("loss.png", _loss, 1), ("throughput.png", _throughput, 1), ("bandwidth.png", _bandwidth, 1),
            ("health.png", _health_figure, 2))
"""(file, what draws it, panels side by side)."""


def plot_runs(folders: list[str | Path], out_dir: str | Path) -> list[Path]:
    """Write the figures of the runs in ``folders`` (overlaid) under ``out_dir``; the paths written
    (a figure with nothing to draw is not written)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [load_run(f) for f in folders]
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    for name, draw, panels in _FIGURES:
        fig, axes = plt.subplots(1, panels, figsize=(7 if panels == 1 else 10, 4.2))
        if draw(runs, axes):
            fig.tight_layout()
            fig.savefig(out / name, dpi=110)
            written.append(out / name)
        plt.close(fig)
    log.info("plot: %s", ", ".join(str(p) for p in written))
    return written
