"""Sweep results -> markdown tables shaped like the MAPL paper's Table 1, Table 5 and Table 6.

Runs that differ only by seed are aggregated: losses are reported as mean ± sample standard
deviation over seeds, and Δ% vs the uncompressed run of the same P as the mean ± standard deviation
of the seed-paired differences (same seed = same data order and shared initial weights). Bytes per
token follow the paper: the forward activation payload per token per boundary (bf16 `none` at
d=1024 is the paper's 2048 B); the full payload (activations, ids, gradients and projector
exchange, both directions) is reported alongside.

Which codecs make up each table, their row names and order, and the paper's reference figures per
codec come from the codec catalog (:mod:`mapl_swarm.compress.catalog`).
"""

from __future__ import annotations

import platform
import statistics
import time
from collections import defaultdict
from dataclasses import dataclass

from mapl_swarm.compress.catalog import codec_info, codecs_by_order, headline_codec

__all__ = ["Aggregate", "aggregate", "summary_markdown", "ANCHOR_NAMES", "PAPER_ANCHOR_DELTA_PCT"]

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
    delta: tuple[float, float] | None = None
    """Δ% vs uncompressed at the same P: (mean, std over seed pairs; nan for one seed)."""

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


def aggregate(results: list[dict]) -> list[Aggregate]:
    """Group runs by configuration (seed aside) and attach Δ% vs the same-P uncompressed runs."""
    groups: dict[str, list[dict]] = defaultdict(list)
    for r in results:
        groups[r["label"]].append(r)
    aggs = [Aggregate(label, rs[0]["codec"], rs[0]["rank"], rs[0]["stages"], rs[0]["anchor"], rs)
            for label, rs in groups.items()]
    base = {a.stages: a for a in aggs if codec_info(a.codec).uncompressed}
    for a in aggs:
        ref = base.get(a.stages)
        if ref is None or a is ref:
            continue
        by_seed = {r["seed"]: r["val_loss"] for r in ref.runs}
        pairs = [100 * (r["val_loss"] - by_seed[r["seed"]]) / by_seed[r["seed"]] for r in a.runs if r["seed"] in by_seed]
        if len(pairs) == len(a.runs):
            a.delta = (statistics.fmean(pairs), statistics.stdev(pairs) if len(pairs) > 1 else float("nan"))
        else:  # unpaired seeds: compare means
            a.delta = (100 * (a.val[0] - ref.val[0]) / ref.val[0], float("nan"))
    return sorted(aggs, key=lambda a: (a.stages, codec_info(a.codec).order, a.rank, a.anchor))


def _pm(mean: float, std: float, digits: int = 4) -> str:
    if mean != mean:
        return "—"
    return f"{mean:.{digits}f}" if std != std else f"{mean:.{digits}f} ± {std:.{digits}f}"


def _delta(a: Aggregate | None) -> str:
    if a is None:
        return "—"
    if codec_info(a.codec).uncompressed:
        return "—"
    if a.delta is None:
        return "n/a (no uncompressed run)"
    m, s = a.delta
    return f"{m:+.2f}%" if s != s else f"{m:+.2f} ± {s:.2f}%"


def _paper(v: float | None) -> str:
    return "—" if v is None else f"+{v:.2f}%"


def _table1(aggs: list[Aggregate]) -> list[str]:
    rows = [a for a in aggs if codec_info(a.codec).in_table1 and
            (not codec_info(a.codec).anchored or a.anchor == "factorized")]
    if not rows:
        return []
    ps = sorted({a.stages for a in rows})
    keys = sorted({(a.codec, a.rank if codec_info(a.codec).projected else 0) for a in rows},
                  key=lambda k: (codec_info(k[0]).order, -k[1]))
    head = "| method | rank | act B/token | comp. | " + " | ".join(f"P={p} val loss | P={p} Δ%" for p in ps)
    head += " | paper Δ% (150M, P=" + "/".join(str(p) for p in ps) + ") |"
    lines = ["### Table 1 — codecs at equal token budget (paper Table 1)", "", head,
             "|" + "---|" * (5 + 2 * len(ps)) ]
    for codec, rank in keys:
        info = codec_info(codec)
        cells = {p: next((a for a in rows if a.codec == codec and a.stages == p and
                          (not info.projected or a.rank == rank)), None) for p in ps}
        any_a = next(a for a in cells.values() if a is not None)
        same = info.paper_ratio is not None and abs(any_a.compression - info.paper_ratio) < 0.5
        paper_pct = dict(info.paper_delta_pct)
        paper = "/".join(_paper(paper_pct.get(p) if same else None) for p in ps)
        line = (f"| {info.display_name} | {rank if info.projected else '—'} | {any_a.act_bytes:.0f} | "
                f"{'—' if info.uncompressed else f'{any_a.compression:.0f}×'} | ")
        line += " | ".join(f"{_pm(*cells[p].val) if cells[p] else '—'} | {_delta(cells[p])}" for p in ps)
        lines.append(line + f" | {paper} |")
    return lines + [""]


def _table5(aggs: list[Aggregate]) -> list[str]:
    projectors = [i for i in codecs_by_order() if i.projector_label]
    out: list[str] = []
    for p in sorted({a.stages for a in aggs}):
        rows = [a for a in aggs if a.stages == p and codec_info(a.codec).projector_label and
                a.anchor == "factorized"]
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
        rows = [a for a in aggs if a.stages == p and a.codec == method.name]
        for rank in sorted({a.rank for a in rows}):
            sel = {a.anchor: a for a in rows if a.rank == rank}
            if len(sel) < 2:
                continue
            if not out:
                out += ["### Table 6 — anchor strategies (paper Table 6 / Appendix G)", ""]
            none = next((a for a in aggs if a.stages == p and codec_info(a.codec).uncompressed), None)
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


def _all_runs(aggs: list[Aggregate]) -> list[str]:
    lines = ["### All configurations", "",
             "| config | seeds | val loss | Δ% | act B/token | all payload B/token (fwd+bwd) | comp. | "
             "energy captured | grad fidelity (last) | rank99 of residual | wall s / run |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for a in aggs:
        fid = []
        for r in a.runs:
            if r["health"]:
                last = r["health"][-1]
                fid += [v for k, v in last.items() if k.endswith("grad_fidelity")]
        fid_s = f"{statistics.fmean(fid):.3f}" if fid else "—"
        en = a.mean_analysis("energy_captured")
        lines.append(
            f"| {a.label} | {','.join(map(str, a.seeds))} | {_pm(*a.val)} | {_delta(a)} | {a.act_bytes:.1f} | "
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
            "uncompressed run of the same P. act B/token: forward activation payload per token per boundary "
            "(the paper's bytes/token); comp. = uncompressed bf16 / that.",
            "",
        ]
    else:
        lines += ["(no finished runs)", ""]
    lines += _table1(aggs) + _table5(aggs) + _table6(aggs) + (_all_runs(aggs) if aggs else [])
    if skipped:
        lines += ["Skipped: " + "; ".join(skipped), ""]
    if plots:
        lines += ["Plots: " + ", ".join(f"[{p.stem}]({p.as_posix()})" for p in plots), ""]
    return "\n".join(lines)
