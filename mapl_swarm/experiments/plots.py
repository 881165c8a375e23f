"""Sweep plots (matplotlib, Agg backend, PNG): the MAPL paper's Fig. 1, 3 and 4 for our runs.

- ``pareto.png`` — validation loss vs forward activation bytes/token (Fig. 1);
- ``loss_curves.png`` — training loss (smoothed) and validation loss per configuration;
- ``spectra.png`` — cumulative singular-value energy of the boundary residual (Fig. 3);
- ``projector_angles.png`` — pairwise mean principal angles between learned projectors (Fig. 4a);
- ``energy_captured.png`` — residual energy captured during training, learned vs fixed (Fig. 4b);
- ``cosine_pairs.png`` — token-pair cosine before vs after projection, with Pearson r (Fig. 4c);
- ``learned_minus_fixed.png`` — learned-minus-fixed projector val loss gap per validation step, per
  seed and mean (when a grid has both validated at several steps, see :func:`.tables.long_budget_pairs`).

Each function takes the run result dicts written by :mod:`.sweep` and returns the file it wrote,
or None when the results hold nothing to plot. Legend names, colours and which codecs a figure shows
come from the codec catalog (:mod:`mapl_swarm.config.catalog`).
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from pathlib import Path

import matplotlib
import numpy as np

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from mapl_swarm.config.catalog import codec_info, codecs_by_order, headline_codec, uncompressed_codec  # noqa: E402
from mapl_swarm.experiments.tables import aggregate, gap_by_step, long_budget_pairs  # noqa: E402

__all__ = ["make_all", "pareto", "loss_curves", "spectra", "projector_angles", "energy_captured", "cosine_pairs",
           "learned_minus_fixed", "data_limits"]

DPI = 90


def _name(r: dict) -> str:
    info = codec_info(r["codec"])
    s = info.short_name
    if r.get("variant"):
        s += f" [{r['variant']}]"
    if info.projected:
        s += f" r={r['rank']}"
    if info.anchored and r["anchor"] != "factorized":
        s += f", anchor {r['anchor']}"
    return s


def _default_anchor(codec: str, anchor: str) -> bool:
    """The run has the reference anchors: factorized, or any anchor for codecs that ignore it."""
    return not codec_info(codec).anchored or anchor == "factorized"


def _projector_codecs() -> list[str]:
    """The headline method, then every other codec with per-boundary projectors, in table order."""
    head = headline_codec()
    return [head] + [i.name for i in codecs_by_order() if i.anchored and i.name != head]


def _primary_stages(results: list[dict]) -> int:
    """The P with the most distinct codecs (the Table 1 setting)."""
    by_p: dict[int, set] = defaultdict(set)
    for r in results:
        by_p[r["stages"]].add((r["codec"], r["rank"]))
    return max(by_p, key=lambda p: (len(by_p[p]), -p))


def _pick(results: list[dict], codec: str, stages: int) -> dict | None:
    """Lowest-seed run of ``codec`` at P=stages with factorized anchors and no grid variant (middle
    rank if several)."""
    rs = [r for r in results if r["codec"] == codec and r["stages"] == stages and _default_anchor(codec, r["anchor"])
          and not r.get("variant")]
    if not rs:
        return None
    ranks = sorted({r["rank"] for r in rs})
    rank = ranks[len(ranks) // 2]
    return min((r for r in rs if r["rank"] == rank), key=lambda r: r["seed"])


def data_limits(values, margin: float = 0.05) -> tuple[float, float]:
    """Axis limits holding every finite value of ``values``, widened by ``margin`` of their span on
    each side (±0.5 around a single value); (0, 1) when there is none."""
    finite = [float(v) for v in values if np.isfinite(v)]
    if not finite:
        return 0.0, 1.0
    lo, hi = min(finite), max(finite)
    pad = margin * (hi - lo) if hi > lo else 0.5
    return lo - pad, hi + pad


def _save(fig, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    return path


def pareto(results: list[dict], path: Path) -> Path | None:
    p = _primary_stages(results)
    aggs = [a for a in aggregate(results) if a.stages == p and _default_anchor(a.codec, a.anchor)]
    if not aggs:
        return None
    fig, ax = plt.subplots(figsize=(7, 4.5))
    by_codec = defaultdict(list)
    for a in aggs:
        by_codec[a.codec, a.variant].append(a)
    for (codec, variant), items in by_codec.items():
        info = codec_info(codec)
        items.sort(key=lambda a: a.act_bytes)
        xs = [a.act_bytes for a in items]
        ys = [a.val[0] for a in items]
        es = [0.0 if a.val[1] != a.val[1] else a.val[1] for a in items]
        marker = "*" if info.uncompressed else "o"
        ax.errorbar(xs, ys, yerr=es, fmt=marker + "-", color=info.color, capsize=3,
                    markersize=12 if info.uncompressed else 6,
                    label=info.short_name + (f" [{variant}]" if variant else ""))
        for a in items:
            if info.projected:
                ax.annotate(f"r={a.rank}", (a.act_bytes, a.val[0]), textcoords="offset points", xytext=(4, 4),
                            fontsize=7, color=info.color)
    pts = sorted((a.act_bytes, a.val[0]) for a in aggs)
    front, best = [], float("inf")
    for x, y in pts:
        if y < best:
            front.append((x, y))
            best = y
    if len(front) > 1:
        ax.plot(*zip(*front), ":", color="purple", alpha=0.6, label="Pareto frontier")
    ax.set_xscale("log", base=2)
    ref = aggs[0].runs[0]["uncompressed_act_bytes"]
    xs = sorted({a.act_bytes for a in aggs})
    ax.set_xticks(xs, [f"{x:.0f}" for x in xs])
    ax.minorticks_off()
    ax.set_xlim(xs[0] / 1.4, xs[-1] * 1.4)
    sec = ax.secondary_xaxis("top", functions=(lambda b: ref / np.maximum(b, 1e-9), lambda c: ref / np.maximum(c, 1e-9)))
    sec.set_xticks([ref / x for x in xs], [f"{ref / x:.0f}×" for x in xs])
    sec.minorticks_off()
    sec.set_xlabel("compression ratio vs uncompressed bf16")
    ax.set_xlabel("forward activation bytes per token per boundary (log scale)")
    ax.set_ylabel("final validation loss (nats/token)")
    n = max(len(a.runs) for a in aggs)
    ax.set_title(f"Val loss vs communication, P={p} (mean ± std over {n} seed{'s' if n > 1 else ''}); lower-left is better",
                 fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return _save(fig, path)


def _ema(values: list[float], beta: float = 0.9) -> list[float]:
    out, m = [], None
    for v in values:
        m = v if m is None else beta * m + (1 - beta) * v
        out.append(m)
    return out


def loss_curves(results: list[dict], path: Path) -> Path | None:
    ps = sorted({r["stages"] for r in results})
    if not ps:
        return None
    fig, axes = plt.subplots(1, len(ps), figsize=(6.5 * len(ps), 4.5), squeeze=False)
    for ax, p in zip(axes[0], ps):
        by_label = defaultdict(list)
        for r in results:
            if r["stages"] == p:
                by_label[r["label"]].append(r)
        cmap = plt.get_cmap("tab10")
        plotted: list[float] = []
        for i, (label, rs) in enumerate(sorted(by_label.items())):
            r0 = min(rs, key=lambda r: r["seed"])
            info = codec_info(r0["codec"])
            color = info.color if info.uncompressed else cmap(i % 10)
            tok_per_step = r0["tokens"] / max(r0["steps"], 1)
            steps = [s for s, _ in r0["train_curve"]]
            train = _ema([v for _, v in r0["train_curve"]])
            ax.plot([s * tok_per_step / 1e6 for s in steps], train, color=color, alpha=0.45, lw=1)
            val = defaultdict(list)
            for r in rs:
                for s, v in r["val_history"]:
                    val[s].append(v)
            vs = sorted(val)
            val_mean = [statistics.fmean(val[s]) for s in vs]
            ax.plot([s * tok_per_step / 1e6 for s in vs], val_mean, "o-", color=color, ms=3, lw=1.5, label=_name(r0))
            plotted += train + val_mean
        ax.set_xlabel("training tokens (millions)")
        ax.set_ylabel("loss (nats/token)")
        ax.set_title(f"P={p}: validation (markers, seed mean) and train loss (thin, EMA, seed 0)", fontsize=9)
        ax.grid(alpha=0.3)
        ax.set_ylim(*data_limits(plotted))  # every curve inside the axes
        ax.legend(fontsize=7)
    return _save(fig, path)


def spectra(results: list[dict], path: Path) -> Path | None:
    p = _primary_stages(results)
    picks = [(c, _pick(results, c, p)) for c in (uncompressed_codec(), headline_codec())]
    picks = [(c, r) for c, r in picks if r is not None]
    if not picks:
        return None
    fig, axes = plt.subplots(1, len(picks), figsize=(6 * len(picks), 4.2), squeeze=False)
    for ax, (codec, r) in zip(axes[0], picks):
        for b in r["analysis"]["boundaries"]:
            cum = b["cumulative_energy"]
            ax.plot(range(1, len(cum) + 1), cum, label=f"boundary {b['boundary'] + 1}→{b['boundary'] + 2} "
                    f"(99% at rank {b['rank99']})")
        ax.axhline(0.99, color="gray", ls="--", lw=0.8)
        if codec_info(codec).projected:
            ax.axvline(r["rank"], color="green", ls=":", lw=1, label=f"projection rank r={r['rank']}")
        kind = r["analysis"]["boundaries"][-1]["residual"]
        ax.set_title(f"{codec_info(codec).short_name} model, P={p}: singular-value energy of {kind}\n"
                     f"({r['analysis']['boundaries'][0]['tokens']} held-out tokens per boundary)", fontsize=9)
        ax.set_xlabel(f"rank k (of d={r['hidden_size']})")
        ax.set_ylabel("cumulative energy Σσ²(≤k) / Σσ²")
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="lower right")
    return _save(fig, path)


def projector_angles(results: list[dict], path: Path) -> Path | None:
    method = codec_info(headline_codec())
    cands = [r for r in results if r["codec"] == method.name and len(r["analysis"]["projector_angles"]) > 1]
    if not cands:
        return None
    r = max(cands, key=lambda r: (r["stages"], r["anchor"] == "factorized", -r["seed"]))
    m = r["analysis"]["projector_angles"]
    n = len(m)
    fig, ax = plt.subplots(figsize=(max(6.0, 2.5 + 0.75 * n), max(4.8, 1.6 + 0.75 * n)))
    im = ax.imshow(m, vmin=0, vmax=90, cmap="viridis")
    for i in range(n):
        for j in range(n):
            ax.text(j, i, f"{m[i][j]:.0f}°", ha="center", va="center", fontsize=8,
                    color="white" if m[i][j] < 60 else "black")
    ticks = [f"A{i + 1}" for i in range(n)]
    ax.set_xticks(range(n), ticks)
    ax.set_yticks(range(n), ticks)
    ax.set_xlabel("boundary projector")
    ax.set_ylabel("boundary projector")
    fig.colorbar(im, ax=ax, label="mean principal angle (degrees)")
    rand = r["analysis"].get("random_pair_angle")
    if rand is None:  # results written before the reference was stored: compute it here
        from mapl_swarm.metrics.health import mean_principal_angle
        from mapl_swarm.compress.stiefel import random_stiefel
        from mapl_swarm.rng import generator

        d, k = r["hidden_size"], r["rank"]
        rand = mean_principal_angle(random_stiefel(d, k, generator(r["seed"], "analysis", 0)),
                                    random_stiefel(d, k, generator(r["seed"], "analysis", 1)))
    ref = f"; two random subspaces ≈ {rand:.0f}°" if rand is not None else ""
    ax.set_title(f"Learned {method.display_name} projectors, P={r['stages']}, r={r['rank']} of d={r['hidden_size']}:\n"
                 f"pairwise mean principal angles (0° same subspace, 90° orthogonal{ref})", fontsize=9)
    return _save(fig, path)


def energy_captured(results: list[dict], path: Path) -> Path | None:
    p = _primary_stages(results)
    picks = [(c, _pick(results, c, p)) for c in _projector_codecs()]
    picks = [(c, r) for c, r in picks if r is not None and r["health"]]
    if not picks:
        return None
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for codec, r in picks:
        steps = [h["step"] for h in r["health"]]
        keys = sorted(k for k in r["health"][0] if k.endswith("energy_captured"))
        mean = [statistics.fmean(h[k] for k in keys if k in h) for h in r["health"]]
        ax.plot(steps, mean, "-", color=codec_info(codec).color, lw=2,
                label=f"{_name(r)} (mean over {len(keys)} boundaries)")
        for k in keys:
            ax.plot(steps, [h.get(k, float('nan')) for h in r["health"]], "-", color=codec_info(codec).color, lw=0.6,
                    alpha=0.4)
    ax.set_xlabel("training step")
    ax.set_ylabel("energy captured ‖R A‖² / ‖R‖²")
    ax.set_ylim(0, 1.02)
    ax.set_title(f"Residual energy kept by the projector during training, P={p}\n(R = X − anchor on a training "
                 "micro-batch; thin lines: individual boundaries)", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return _save(fig, path)


def cosine_pairs(results: list[dict], path: Path) -> Path | None:
    p = _primary_stages(results)
    # the learned headline projector against the untrained one of the same shape
    fixed = [i.name for i in codecs_by_order() if i.anchored and not i.trainable_projector]
    picks = [(c, _pick(results, c, p)) for c in [headline_codec(), *fixed]]
    picks = [(c, r) for c, r in picks if r is not None]
    if not picks:
        return None
    nb = len(picks[0][1]["analysis"]["boundaries"])
    fig, axes = plt.subplots(1, nb, figsize=(4.2 * nb, 4.2), squeeze=False)
    for b, ax in enumerate(axes[0]):
        for codec, r in picks:
            info = r["analysis"]["boundaries"][b]
            if "cos_before" not in info:
                continue
            ax.scatter(info["cos_before"], info["cos_after"], s=4, alpha=0.35, color=codec_info(codec).color,
                       label=f"{_name(r)}: Pearson r={info['cos_pearson']:.3f}")
        ax.plot([-1, 1], [-1, 1], "k--", lw=0.8, label="identity")
        ax.set_xlim(-1, 1)
        ax.set_ylim(-1, 1)
        ax.set_aspect("equal")
        ax.set_xlabel("cos(rᵢ, rⱼ) full dimension")
        ax.set_ylabel("cos(rᵢA, rⱼA) after projection")
        ax.set_title(f"boundary {b + 1}→{b + 2} (P={p}), residual token pairs", fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="upper left", markerscale=3)
    return _save(fig, path)


def learned_minus_fixed(results: list[dict], path: Path) -> Path | None:
    pairs = long_budget_pairs(aggregate(results))
    if not pairs:
        return None
    fig, axes = plt.subplots(1, len(pairs), figsize=(6.5 * len(pairs), 4.2), squeeze=False)
    for ax, (fixed, learned) in zip(axes[0], pairs):
        rows = gap_by_step(fixed, learned)
        seeds = sorted({s for _, g in rows for s in g})
        for s in seeds:
            pts = [(step, g[s]) for step, g in rows if s in g]
            ax.plot(*zip(*pts), "o-", lw=0.8, ms=3, alpha=0.6, label=f"seed {s}")
        ax.plot([step for step, _ in rows], [statistics.fmean(g.values()) for _, g in rows], "-",
                color=codec_info(learned.codec).color, lw=2.2, label=f"mean over {len(seeds)} seeds")
        ax.axhline(0.0, color="black", lw=0.8)
        ax.set_xlabel("training step")
        ax.set_ylabel("val loss gap, (learned − fixed) / fixed (%)")
        ax.set_title(f"{learned.display_name} minus {fixed.display_name}, P={learned.stages}, r={learned.rank}\n"
                     "paired by seed; below 0: the learned projector is ahead", fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    return _save(fig, path)


def make_all(results: list[dict], folder: Path) -> list[Path]:
    """Every plot the results support; returns the files written."""
    folder = Path(folder)
    made = []
    for fn in (pareto, loss_curves, spectra, projector_angles, energy_captured, cosine_pairs, learned_minus_fixed):
        out = fn(results, folder / f"{fn.__name__}.png")
        if out is not None:
            made.append(out)
    return made
