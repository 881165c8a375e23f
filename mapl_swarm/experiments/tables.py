"""Sweep results -> markdown tables shaped like the MAPL paper's Table 1, Table 5 and Table 6.

Runs that differ only by seed are aggregated: losses are reported as mean ± sample standard
deviation over seeds, and Δ% vs the uncompressed run of the same P as the mean ± standard deviation
of the seed-paired differences (same seed = same data order and shared initial weights). Codecs
with frozen token offsets (SSN) are also compared, seed-paired, with the uncompressed run that adds
the same offsets (the catalog's ``offsets_reference``), so the offsets' own effect is not counted as
the codec's. A grid variant (a named ``set`` over ``[base]``) is a configuration of its own: its
rows are shown separately, e.g. "SSN [adamw0.5]".

Bytes per token follow the paper: the forward activation payload per token per boundary (bf16
`none` at d=1024 is the paper's 2048 B); the full payload (activations, ids, gradients and
projector exchange, both directions) is reported alongside.

Which codecs make up each table, their row names and order, and the paper's reference figures per
codec come from the codec catalog (:mod:`mapl_swarm.config.catalog`).

The long-budget section (:func:`long_budget_pairs`) appears when a P and rank have both a fixed
projector and the headline (learned) one validated at two or more steps: it sets the SPEL movement
budget (:func:`movement_budget`) against the angle the projectors actually moved, and lists the
learned-minus-fixed gap per validation step, paired by seed (:func:`gap_by_step`).
"""

from __future__ import annotations

import math
import platform
import statistics
import time
from collections import defaultdict
from dataclasses import dataclass

from mapl_swarm.config.catalog import codec_info, codecs_by_order, headline_codec
from mapl_swarm.optim.schedule import lr_multiplier

__all__ = ["Aggregate", "aggregate", "summary_markdown", "movement_budget", "long_budget_pairs", "gap_by_step",
           "ANCHOR_NAMES", "PAPER_ANCHOR_DELTA_PCT"]

ANCHOR_NAMES = {"none": "No anchor", "static": "Static frozen (SSN style)", "full": "Full trainable anchor",
                "factorized": "Factorized anchor (MAPL)"}
PAPER_ANCHOR_DELTA_PCT = {"none": 2.39, "static": 2.48, "full": 0.47, "factorized": 1.11}
"""The paper's Table 6 Δ% vs uncompressed per anchor strategy (MAPL, 150M model, 4x, 3B DCLM tokens).
The per-codec figures of its Tables 1 and 5 are in the codec catalog."""


@dataclass
class Aggregate:
    """All seeds of one configuration."""

    label: str
    codec: str
    rank: int
    stages: int
    anchor: str
    runs: list[dict]
    variant: str = ""
    """The grid variant's name (empty: the grid's base settings)."""
    delta: tuple[float, float] | None = None
    """Δ% vs uncompressed at the same P: (mean, std over seed pairs; nan for one seed)."""
    delta_offsets: tuple[float, float] | None = None
    """Δ% vs the uncompressed run with the same frozen offsets at the same P (codecs with
    ``frozen_offsets`` other than the reference itself); None otherwise or without such a run."""

    @property
    def display_name(self) -> str:
        """The codec's report name, with the variant in brackets: "SSN [adamw0.5]"."""
        name = codec_info(self.codec).display_name
        return f"{name} [{self.variant}]" if self.variant else name

    @property
    def offset_std(self) -> float | None:
        """``compression.ssn_offset_std`` of the runs' config (None when the manifest has none)."""
        return self.runs[0]["manifest"]["config"].get("compression", {}).get("ssn_offset_std")

    @property
    def seeds(self) -> list[int]:
        return sorted(r["seed"] for r in self.runs)

    def stat(self, key: str) -> tuple[float, float]:
        vals = [float(r[key]) for r in self.runs]
        return statistics.fmean(vals), statistics.stdev(vals) if len(vals) > 1 else float("nan")

    @property
    def val(self) -> tuple[float, float]:
        return self.stat("val_loss")

    @property
    def act_bytes(self) -> float:
        return statistics.fmean(r["act_bytes_per_token"] for r in self.runs)

    @property
    def total_bytes(self) -> float:
        return statistics.fmean(statistics.fmean(b["total"] for b in r["bytes_per_token"]) if r["bytes_per_token"]
                                else 0.0 for r in self.runs)

    @property
    def compression(self) -> float:
        ref = self.runs[0]["uncompressed_act_bytes"]
        return ref / self.act_bytes if self.act_bytes else float("nan")

    def mean_analysis(self, key: str) -> float:
        vals = [b[key] for r in self.runs for b in r["analysis"]["boundaries"] if key in b]
        return statistics.fmean(vals) if vals else float("nan")


def _paired_delta(runs: list[dict], ref: list[dict]) -> tuple[float, float]:
    """Δ% of ``runs`` vs ``ref`` in val loss: mean ± std of the seed-paired differences, or of the
    means (std nan) when some seed has no partner."""
    by_seed = {r["seed"]: r["val_loss"] for r in ref}
    pairs = [100 * (r["val_loss"] - by_seed[r["seed"]]) / by_seed[r["seed"]] for r in runs if r["seed"] in by_seed]
    if len(pairs) == len(runs):
        return statistics.fmean(pairs), statistics.stdev(pairs) if len(pairs) > 1 else float("nan")
    mean, ref_mean = (statistics.fmean(r["val_loss"] for r in rs) for rs in (runs, ref))
    return 100 * (mean - ref_mean) / ref_mean, float("nan")


def _reference(a: Aggregate, candidates: list[Aggregate]) -> Aggregate | None:
    """The candidate at ``a``'s P with ``a``'s variant, else the plain one (never ``a`` itself)."""
    cands = [c for c in candidates if c.stages == a.stages and c is not a]
    return next((c for c in cands if c.variant == a.variant), None) or next((c for c in cands if not c.variant), None)


def aggregate(results: list[dict]) -> list[Aggregate]:
    """Group runs by configuration (seed aside) and attach Δ% vs the same-P uncompressed runs (and,
    for codecs with frozen offsets, vs the same-P uncompressed runs with the same offsets)."""
    groups: dict[str, list[dict]] = defaultdict(list)
    for r in results:
        groups[r["label"]].append(r)
    aggs = [Aggregate(label, rs[0]["codec"], rs[0]["rank"], rs[0]["stages"], rs[0]["anchor"], rs,
                      variant=rs[0].get("variant") or "") for label, rs in groups.items()]
    uncompressed = [a for a in aggs if codec_info(a.codec).uncompressed]
    offsets_refs = [a for a in aggs if codec_info(a.codec).offsets_reference]
    for a in aggs:
        info = codec_info(a.codec)
        ref = None if info.uncompressed else _reference(a, uncompressed)
        if ref is not None:
            a.delta = _paired_delta(a.runs, ref.runs)
        if info.frozen_offsets and not info.offsets_reference:  # same offsets, same P
            ref = _reference(a, [c for c in offsets_refs if c.offset_std == a.offset_std])
            if ref is not None:
                a.delta_offsets = _paired_delta(a.runs, ref.runs)
    return sorted(aggs, key=lambda a: (a.stages, codec_info(a.codec).order, a.rank, a.anchor, a.variant))


def _pm(mean: float, std: float, digits: int = 4) -> str:
    if mean != mean:
        return "—"
    return f"{mean:.{digits}f}" if std != std else f"{mean:.{digits}f} ± {std:.{digits}f}"


def _fmt_delta(d: tuple[float, float]) -> str:
    m, s = d
    return f"{m:+.2f}%" if s != s else f"{m:+.2f} ± {s:.2f}%"


def _delta(a: Aggregate | None) -> str:
    if a is None:
        return "—"
    if codec_info(a.codec).uncompressed:
        return "—"
    if a.delta is None:
        return "n/a (no uncompressed run)"
    return _fmt_delta(a.delta)


def _delta_offsets(a: Aggregate | None) -> str:
    """Δ% vs the uncompressed run with the same frozen offsets; "—" for codecs without offsets."""
    if a is None:
        return "—"
    info = codec_info(a.codec)
    if not info.frozen_offsets or info.offsets_reference:
        return "—"
    if a.delta_offsets is None:
        return "n/a (no reference run with these offsets)"
    return _fmt_delta(a.delta_offsets)


def _paper(v: float | None) -> str:
    return "—" if v is None else f"+{v:.2f}%"


def _table1(aggs: list[Aggregate]) -> list[str]:
    rows = [a for a in aggs if codec_info(a.codec).in_table1 and
            (not codec_info(a.codec).anchored or a.anchor == "factorized")]
    if not rows:
        return []
    ps = sorted({a.stages for a in rows})
    keys = sorted({(a.codec, a.rank if codec_info(a.codec).projected else 0, a.variant) for a in rows},
                  key=lambda k: (codec_info(k[0]).order, -k[1], k[2]))
    head = "| method | rank | act B/token | comp. | " + " | ".join(
        f"P={p} val loss | P={p} Δ% | P={p} Δ% vs uncompressed + offsets" for p in ps)
    head += " | paper Δ% (150M, P=" + "/".join(str(p) for p in ps) + ") |"
    lines = ["### Table 1 — codecs at equal token budget (paper Table 1)", "", head,
             "|" + "---|" * (5 + 3 * len(ps))]
    for codec, rank, variant in keys:
        info = codec_info(codec)
        cells = {p: next((a for a in rows if a.codec == codec and a.stages == p and a.variant == variant and
                          (not info.projected or a.rank == rank)), None) for p in ps}
        any_a = next(a for a in cells.values() if a is not None)
        # the paper's figures are for the codec's own settings, not for a variant of them
        same = not variant and info.paper_ratio is not None and abs(any_a.compression - info.paper_ratio) < 0.5
        paper_pct = dict(info.paper_delta_pct)
        paper = "/".join(_paper(paper_pct.get(p) if same else None) for p in ps)
        line = (f"| {any_a.display_name} | {rank if info.projected else '—'} | {any_a.act_bytes:.0f} | "
                f"{'—' if info.uncompressed else f'{any_a.compression:.0f}×'} | ")
        line += " | ".join(f"{_pm(*cells[p].val) if cells[p] else '—'} | {_delta(cells[p])} | "
                           f"{_delta_offsets(cells[p])}" for p in ps)
        lines.append(line + f" | {paper} |")
    return lines + [""]


def _table5(aggs: list[Aggregate]) -> list[str]:
    projectors = [i for i in codecs_by_order() if i.projector_label]
    out: list[str] = []
    for p in sorted({a.stages for a in aggs}):
        rows = [a for a in aggs if a.stages == p and codec_info(a.codec).projector_label and
                a.anchor == "factorized" and not a.variant]
        for rank in sorted({a.rank for a in rows}):
            sel = {a.codec: a for a in rows if a.rank == rank}
            if len(sel) < 2:
                continue
            if not out:
                out += ["### Table 5 — projector updates (paper Table 5 / Appendix C)", ""]
            out += [f"P={p}, rank {rank} ({sel[next(iter(sel))].compression:.0f}×), factorized anchors:", "",
                    "| projector | val loss | Δ% vs uncompressed | ‖AᵀA − I‖_F (end) | energy captured (end) | paper Δ% |",
                    "|---|---|---|---|---|---|"]
            for info in projectors:
                a = sel.get(info.name)
                if a is None:
                    continue
                out.append(f"| {info.projector_label} | {_pm(*a.val)} | {_delta(a)} | "
                           f"{a.mean_analysis('orth_error'):.2e} | {a.mean_analysis('energy_captured'):.3f} | "
                           f"{_paper(info.paper_projector_delta_pct)} |")
            out.append("")
    return out


def _table6(aggs: list[Aggregate]) -> list[str]:
    method = codec_info(headline_codec())
    out: list[str] = []
    for p in sorted({a.stages for a in aggs}):
        rows = [a for a in aggs if a.stages == p and a.codec == method.name and not a.variant]
        for rank in sorted({a.rank for a in rows}):
            sel = {a.anchor: a for a in rows if a.rank == rank}
            if len(sel) < 2:
                continue
            if not out:
                out += ["### Table 6 — anchor strategies (paper Table 6 / Appendix G)", ""]
            none = next((a for a in aggs if a.stages == p and codec_info(a.codec).uncompressed and not a.variant),
                        None)
            out += [f"{method.display_name}, P={p}, rank {rank} ({sel[next(iter(sel))].compression:.0f}×):", "",
                    "| anchor | val loss | Δ% vs uncompressed | trainable anchor params / stage | paper Δ% |",
                    "|---|---|---|---|---|"]
            if none is not None:
                out.append(f"| Uncompressed baseline (P={p}) | {_pm(*none.val)} | — | — | — |")
            for anchor in ("none", "static", "full", "factorized"):
                a = sel.get(anchor)
                if a is None:
                    continue
                cfg = a.runs[0]["manifest"]["config"]
                v, d, ra = cfg["model"]["vocab_size"], cfg["model"]["hidden_size"], cfg["compression"]["anchor_rank"]
                params = {"none": 0, "static": 0, "full": v * d, "factorized": v * ra}[anchor]
                out.append(f"| {ANCHOR_NAMES[anchor]} | {_pm(*a.val)} | {_delta(a)} | {params:,} | "
                           f"{_paper(PAPER_ANCHOR_DELTA_PCT[anchor])} |")
            out.append("")
    return out


def movement_budget(config: dict, steps: int) -> float:
    """SPEL movement budget of a run's first ``steps`` optimizer steps: ``Σ_t lr_t`` in radians, with
    ``lr_t = optim.muon_lr × optim.projector_lr_ratio × lr_multiplier(t)`` (the run's own schedule).

    A SPEL step ``A ← retract(A − lr_t D)`` with ``‖D‖₂ = 1`` turns the projector's subspace by at
    most about ``lr_t``, so the sum bounds how far a projector can move from its initialisation.
    ``config`` is the run's config dict (``result["manifest"]["config"]``)."""
    o, total = config["optim"], config["run"]["steps"]
    peak = o["muon_lr"] * o["projector_lr_ratio"]
    return sum(peak * lr_multiplier(t, total_steps=total, warmup_steps=o["warmup_steps"], schedule=o["schedule"],
                                    min_lr_ratio=o["min_lr_ratio"], wsd_decay_fraction=o["wsd_decay_fraction"])
               for t in range(steps))


def _plain_projector_row(a: Aggregate) -> bool:
    return codec_info(a.codec).anchored and a.anchor == "factorized" and not a.variant


def gap_by_step(fixed: Aggregate, learned: Aggregate) -> list[tuple[int, dict[int, float]]]:
    """Learned-minus-fixed val loss gap in % of the fixed run, ``(learned − fixed) / fixed × 100``, at
    every validation step after step 0 that both runs of a seed have: ``[(step, {seed: gap %})]``."""
    fixed_by_seed = {r["seed"]: dict(r["val_history"]) for r in fixed.runs}
    rows: dict[int, dict[int, float]] = defaultdict(dict)
    for r in learned.runs:
        ref = fixed_by_seed.get(r["seed"])
        if ref is None:
            continue
        for step, v in r["val_history"]:
            if step > 0 and step in ref:
                rows[step][r["seed"]] = 100 * (v - ref[step]) / ref[step]
    return sorted(rows.items())


def long_budget_pairs(aggs: list[Aggregate]) -> list[tuple[Aggregate, Aggregate]]:
    """(fixed, learned) pairs: at the same P and rank, a fixed projector codec (anchored, not
    trainable) and the headline codec, both with the reference anchors and no variant, whose
    seed-paired validations meet at two or more steps after step 0."""
    head = headline_codec()
    return [(fixed, learned) for learned in aggs if learned.codec == head and _plain_projector_row(learned)
            for fixed in aggs if _plain_projector_row(fixed) and not codec_info(fixed.codec).trainable_projector
            and (fixed.stages, fixed.rank) == (learned.stages, learned.rank) and len(gap_by_step(fixed, learned)) >= 2]


def _signed(pct: float) -> str:
    return f"{round(pct, 2) + 0.0:+.2f}"  # + 0.0: a gap rounding to zero prints +0.00, not -0.00


def _long_budget(aggs: list[Aggregate]) -> list[str]:
    out: list[str] = []
    uncompressed = [a for a in aggs if codec_info(a.codec).uncompressed]
    for fixed, learned in long_budget_pairs(aggs):
        p, rank = learned.stages, learned.rank
        ref = _reference(learned, uncompressed)
        configs = ([ref] if ref is not None else []) + [
            a for a in aggs if _plain_projector_row(a) and (a.stages, a.rank) == (p, rank)]
        out += [f"### Long budget — learned vs fixed projector, P={p}, rank {rank} ({learned.compression:.0f}×)", "",
                "SPEL movement budget: Σ_t lr_t over the run, lr_t = optim.muon_lr × optim.projector_lr_ratio × "
                "the lr schedule at step t; a SPEL step turns a projector's subspace by at most about lr_t, so the "
                "sum bounds how far it can move (radians). Angle from init: mean principal angle between each "
                "boundary's final projector and its initialisation, mean over boundaries and seeds.", "",
                "| config | seeds | steps | tokens | SPEL movement budget Σ lr_t (rad) | angle from init | val loss | "
                "Δ% vs uncompressed |",
                "|---|---|---|---|---|---|---|---|"]
        for a in configs:
            budget = "—"
            if codec_info(a.codec).trainable_projector:
                budget = f"{statistics.fmean(movement_budget(r['manifest']['config'], r['steps']) for r in a.runs):.3f}"
            deg = a.mean_analysis("angle_from_init")  # degrees (metrics.health)
            angle = "—" if deg != deg else f"{math.radians(deg):.3f} rad ({deg:.2f}°)"
            out.append(f"| {a.label} | {','.join(map(str, a.seeds))} | {a.runs[0]['steps']:,} | "
                       f"{a.runs[0]['tokens']:,} | {budget} | {angle} | {_pm(*a.val)} | {_delta(a)} |")
        rows = gap_by_step(fixed, learned)
        seeds = sorted({s for _, g in rows for s in g})
        out += ["", f"{learned.display_name} minus {fixed.display_name}, val loss gap per validation step "
                "((learned − fixed) / fixed × 100, paired by seed; negative: the learned projector is ahead):", "",
                "| step | " + " | ".join(f"seed {s} gap %" for s in seeds) + " | mean gap % |",
                "|" + "---|" * (len(seeds) + 2)]
        for step, g in rows:
            cells = " | ".join(_signed(g[s]) if s in g else "—" for s in seeds)
            out.append(f"| {step:,} | {cells} | {_signed(statistics.fmean(g.values()))} |")
        last = rows[-1][1]
        spread = (f" (here the seeds' final gaps span {max(last.values()) - min(last.values()):.2f} points)"
                  if len(last) > 1 else "")
        out += ["", f"Note: {len(seeds)} seed{'s' if len(seeds) != 1 else ''}; two seeds cannot resolve a gap "
                f"under ~1%{spread}, so a smaller mean gap is no evidence either way.", ""]
    return out


def _all_runs(aggs: list[Aggregate]) -> list[str]:
    lines = ["### All configurations", "",
             "| config | seeds | val loss | Δ% | Δ% vs uncompressed + offsets | act B/token | "
             "all payload B/token (fwd+bwd) | comp. | energy captured | grad fidelity (last) | rank99 of residual | "
             "wall s / run |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for a in aggs:
        fid = []
        for r in a.runs:
            if r["health"]:
                last = r["health"][-1]
                fid += [v for k, v in last.items() if k.endswith("grad_fidelity")]
        fid_s = f"{statistics.fmean(fid):.3f}" if fid else "—"
        en = a.mean_analysis("energy_captured")
        lines.append(
            f"| {a.label} | {','.join(map(str, a.seeds))} | {_pm(*a.val)} | {_delta(a)} | {_delta_offsets(a)} | "
            f"{a.act_bytes:.1f} | "
            f"{a.total_bytes:.1f} | {'—' if codec_info(a.codec).uncompressed else f'{a.compression:.1f}×'} | "
            f"{'—' if en != en else f'{en:.3f}'} | {fid_s} | {a.mean_analysis('rank99'):.0f} | "
            f"{statistics.fmean(r['wall_s'] for r in a.runs):.0f} |")
    return lines + [""]


def summary_markdown(grid, results: list[dict], *, skipped: list[str], plots: list, command: str = "") -> str:
    """The whole report of a sweep as markdown."""
    aggs = aggregate(results)
    lines = [f"## Sweep `{grid.name}`", ""]
    failed = [x for x in skipped if x.endswith("FAILED")]
    if failed:
        lines += [f"**INCOMPLETE: {len(failed)} run(s) failed; their rows are missing from every table below:** "
                  + "; ".join(failed), ""]
    if grid.description:
        lines += [grid.description.strip(), ""]
    if results:
        r0 = results[0]
        m = r0["manifest"]
        cfg = m["config"]
        mdl, run = cfg["model"], cfg.get("pipeline") or cfg["run"]  # older manifests: [run]
        lines += [
            f"Command: `{command or f'mapl-swarm sweep --grid {grid.source}'}`  ",
            f"Machine: {platform.machine()}, {m['machine']}, device {r0['device']}, torch {m['versions']['torch']}; "
            f"date {time.strftime('%Y-%m-%d')}; commit {m['commit'][:12]}{' + uncommitted changes' if m.get('commit_dirty') else ''}  ",
            f"Model: d={mdl['hidden_size']}, {mdl['num_layers']} layers, {mdl['num_heads']} heads, ffn "
            f"{mdl['ffn_hidden_size']}, vocab {mdl['vocab_size']}, context {mdl['context_length']}; "
            f"{grid.tokens_per_run:,} tokens per run ({r0['steps']} steps × {run['num_micro_batches']} micro-batches × "
            f"{run['micro_batch_size']} × {mdl['context_length']}); corpus {str(m.get('corpus_fingerprint'))[:16]} "
            f"({cfg['data']['source']}); {len(results)} runs.",
            "",
            "Losses are final validation cross-entropy, mean ± std over seeds; Δ% is seed-paired against the "
            "uncompressed run of the same P, and for codecs with frozen token offsets (SSN) also against the "
            "uncompressed run with the same offsets (Δ% vs uncompressed + offsets). act B/token: forward "
            "activation payload per token per boundary (the paper's bytes/token); comp. = uncompressed bf16 / that.",
            "",
        ]
    else:
        lines += ["(no finished runs)", ""]
    lines += _table1(aggs) + _table5(aggs) + _table6(aggs) + _long_budget(aggs) + (_all_runs(aggs) if aggs else [])
    if skipped:
        lines += ["Skipped: " + "; ".join(skipped), ""]
    if plots:
        lines += ["Plots: " + ", ".join(f"[{p.stem}]({p.as_posix()})" for p in plots), ""]
    return "\n".join(lines)
