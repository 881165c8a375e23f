"""Sweep reports: variant rows, Δ% vs the offsets reference, the long-budget section (movement
budget, learned-minus-fixed gap), plot limits, and the quality bench's Δ% vs none_offsets."""

import argparse
import importlib.util
import math
from pathlib import Path
from types import SimpleNamespace

import pytest

from mapl_swarm.config import config_from_dict, config_to_dict
from mapl_swarm.experiments import plots
from mapl_swarm.experiments.tables import aggregate, gap_by_step, long_budget_pairs, movement_budget, summary_markdown

ROOT = Path(__file__).resolve().parents[2]
GRID = SimpleNamespace(name="t", description="", source="t.toml", tokens_per_run=256)
ANCHORED = ("fixed", "naive", "mapl", "mapl_vq")
PROJECTED = ANCHORED + ("ssn",)


def _config(steps: int = 300, offset_std: float = 0.02, **optim) -> dict:
    cfg = config_to_dict(config_from_dict({"run": {"steps": steps}, "optim": {"warmup_steps": 10, **optim}}))
    cfg["compression"]["ssn_offset_std"] = offset_std
    return cfg


def _run(codec: str, seed: int, val: float, *, variant: str = "", stages: int = 4, rank: int = 32,
         val_history: list | None = None, angles: tuple[float, ...] = (), offset_std: float = 0.02,
         steps: int = 300) -> dict:
    """A result dict with the fields the tables and plots read (as sweep._run_one writes them)."""
    label = codec + (f"-r{rank}" if codec in PROJECTED else "") + f"-P{stages}"
    label += ("-anchor-factorized" if codec in ANCHORED else "") + (f"-{variant}" if variant else "")
    boundaries = [{"boundary": i, "rank99": 10, "cumulative_energy": [0.6, 1.0], "residual": "X", "tokens": 64,
                   **({"angle_from_init": a} if codec in ANCHORED else {})}
                  for i, a in enumerate(angles or (0.0, 0.0))]
    return {"run_id": f"{label}-s{seed}", "label": label, "variant": variant, "codec": codec, "rank": rank,
            "stages": stages, "anchor": "factorized", "seed": seed, "val_loss": val, "steps": steps,
            "tokens": steps * 64, "device": "cpu", "hidden_size": 64,
            "act_bytes_per_token": 32.0 if codec in PROJECTED else 128.0,
            "uncompressed_act_bytes": 128, "bytes_per_token": [{"total": 300.0}], "health": [], "wall_s": 1.0,
            "val_history": val_history or [[0, 6.0], [steps, val]],
            "train_curve": [[s, 6.0 - s / steps] for s in range(1, steps + 1, 10)],
            "analysis": {"boundaries": boundaries, "projector_angles": []},
            "manifest": {"config": _config(steps, offset_std), "machine": "m", "versions": {"torch": "t"},
                         "commit": "abc"}}


def _md(results: list[dict]) -> str:
    return summary_markdown(GRID, results, skipped=[], plots=[])


def _row(md: str, start: str) -> list[str]:
    line = next(line for line in md.splitlines() if line.startswith(start))
    return [c.strip() for c in line.strip("|").split("|")]


def test_variant_rows_and_delta_vs_uncompressed_plus_offsets():
    results = [_run("none", 0, 4.0), _run("none", 1, 5.0),
               _run("none_offsets", 0, 4.2), _run("none_offsets", 1, 5.25),
               _run("ssn", 0, 4.62), _run("ssn", 1, 5.775),  # +10% vs none_offsets for both seeds
               _run("ssn", 0, 4.41, variant="adamw0.5"), _run("ssn", 1, 5.5125, variant="adamw0.5"),  # +5%
               _run("ssn", 0, 4.8, variant="offsets1", offset_std=1.0),  # no reference with these offsets
               _run("mapl", 0, 4.1), _run("mapl", 1, 5.1)]
    aggs = {a.label: a for a in aggregate(results)}
    plain, variant = aggs["ssn-r32-P4"], aggs["ssn-r32-P4-adamw0.5"]
    assert variant.variant == "adamw0.5" and variant.display_name == "SSN [adamw0.5]"
    assert plain.delta_offsets == (pytest.approx(10.0), pytest.approx(0.0))
    assert plain.delta == (pytest.approx(15.5), pytest.approx(0.0))  # vs plain uncompressed
    assert variant.delta_offsets == (pytest.approx(5.0), pytest.approx(0.0))
    assert aggs["ssn-r32-P4-offsets1"].delta_offsets is None
    for label in ("none_offsets-P4", "mapl-r32-P4-anchor-factorized", "none-P4"):
        assert aggs[label].delta_offsets is None

    md = _md(results)
    head = _row(md, "| method |")
    assert head[4:7] == ["P=4 val loss", "P=4 Δ%", "P=4 Δ% vs uncompressed + offsets"]
    ssn = _row(md, "| SSN | 32 |")
    assert ssn[6] == "+10.00 ± 0.00%" and ssn[7] == "+8.37%"  # the paper's figure (4x), plain row only
    ssn05 = _row(md, "| SSN [adamw0.5] | 32 |")
    assert ssn05[4] == "4.9612 ± 0.7796" and ssn05[6] == "+5.00 ± 0.00%" and ssn05[7] == "—"
    assert _row(md, "| SSN [offsets1] |")[6] == "n/a (no reference run with these offsets)"
    assert _row(md, "| MAPL | 32 |")[6] == "—" and _row(md, "| Uncompressed + SSN offsets |")[6] == "—"
    assert len(head) == len(ssn) == len(ssn05)
    # the all-configurations table keeps the variants apart too, with the same column
    all_head = _row(md, "| config |")
    col = all_head.index("Δ% vs uncompressed + offsets")
    assert _row(md, "| ssn-r32-P4-adamw0.5 |")[col] == "+5.00 ± 0.00%"
    assert _row(md, "| ssn-r32-P4 |")[col] == "+10.00 ± 0.00%"
    assert _row(md, "| none-P4 |")[col] == "—"


def test_movement_budget_is_the_sum_of_the_projector_lrs():
    cfg = _config(12, muon_lr=0.03, projector_lr_ratio=0.2, warmup_steps=3, min_lr_ratio=0.1)
    peak, last, w = 0.03 * 0.2, 11, 3
    mult = [(t + 1) / w if t < w else 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (t - w) / (last - w)))
            for t in range(12)]  # linear warmup, then cosine down to min_lr_ratio at the last step
    assert movement_budget(cfg, 12) == pytest.approx(peak * sum(mult), rel=1e-12)
    assert movement_budget(cfg, 5) == pytest.approx(peak * sum(mult[:5]), rel=1e-12)
    cfg["optim"]["schedule"] = "constant"
    assert movement_budget(cfg, 12) == pytest.approx(peak * (1 / 3 + 2 / 3 + 1 + 9), rel=1e-12)


def _long_runs(steps=(100, 200, 300)) -> list[dict]:
    fixed = {0: [4.0, 3.5, 3.0], 1: [5.0, 4.0, 3.2]}
    mapl = {0: [3.96, 3.5, 2.97], 1: [5.05, 4.04, 3.2]}
    out = [_run("none", s, 2.9 + s / 10) for s in (0, 1)]
    for codec, vals, angles in (("fixed", fixed, (0.0, 0.0)), ("mapl", mapl, (9.0, 11.0))):
        for seed, v in vals.items():
            hist = [[0, 6.0]] + [[st, x] for st, x in zip(steps, v)]
            out.append(_run(codec, seed, v[-1], val_history=hist, angles=angles, steps=steps[-1]))
    return out


def test_long_budget_section_budget_angles_and_gap_per_checkpoint(tmp_path):
    results = _long_runs()
    aggs = aggregate(results)
    [(fixed, learned)] = long_budget_pairs(aggs)
    assert (fixed.codec, learned.codec) == ("fixed", "mapl")
    gaps = gap_by_step(fixed, learned)
    assert [s for s, _ in gaps] == [100, 200, 300]  # step 0 (shared init) left out
    assert gaps[0][1] == {0: pytest.approx(-1.0), 1: pytest.approx(1.0)}
    assert gaps[2][1] == {0: pytest.approx(-1.0), 1: pytest.approx(0.0)}

    md = _md(results)
    assert "### Long budget — learned vs fixed projector, P=4, rank 32" in md
    budget = movement_budget(results[-1]["manifest"]["config"], 300)
    mapl = _row(md, "| mapl-r32-P4-anchor-factorized | 0,1 | 300 |")
    assert mapl[3] == "19,200" and mapl[4] == f"{budget:.3f}"
    assert mapl[5] == f"{math.radians(10.0):.3f} rad (10.00°)"  # mean of 9° and 11° over boundaries
    assert mapl[6] == "3.0850 ± 0.1626"
    fixed_row = _row(md, "| fixed-r32-P4-anchor-factorized | 0,1 | 300 |")
    assert fixed_row[4] == "—" and fixed_row[5] == "0.000 rad (0.00°)"
    none_row = _row(md, "| none-P4 | 0,1 | 300 |")
    assert none_row[4] == "—" and none_row[5] == "—" and none_row[7] == "—"
    assert _row(md, "| step |") == ["step", "seed 0 gap %", "seed 1 gap %", "mean gap %"]
    assert _row(md, "| 100 |") == ["100", "-1.00", "+1.00", "+0.00"]
    assert _row(md, "| 200 |") == ["200", "+0.00", "+1.00", "+0.50"]
    assert _row(md, "| 300 |") == ["300", "-1.00", "+0.00", "-0.50"]
    assert "two seeds cannot resolve a gap under ~1%" in md

    png = plots.learned_minus_fixed(results, tmp_path / "learned_minus_fixed.png")
    assert png is not None and png.read_bytes()[:4] == b"\x89PNG"
    assert "learned_minus_fixed.png" in {p.name for p in plots.make_all(results, tmp_path / "all")}


def test_no_long_budget_section_without_two_validations_of_both():
    results = _long_runs(steps=(300,))
    assert long_budget_pairs(aggregate(results)) == []
    assert "Long budget" not in _md(results)
    assert plots.learned_minus_fixed(results, Path("unused.png")) is None
    mapl_only = [r for r in _long_runs() if r["codec"] != "fixed"]
    assert "Long budget" not in _md(mapl_only)


def test_plot_limits_hold_every_plotted_value(monkeypatch, tmp_path):
    assert plots.data_limits([3.0, 1.0, float("nan"), 2.0]) == (pytest.approx(0.9), pytest.approx(3.1))
    assert plots.data_limits([2.0]) == (1.5, 2.5) and plots.data_limits([]) == (0.0, 1.0)
    results = _long_runs()
    for r in results:  # a train curve from ln(vocab) down, far above the final losses
        r["train_curve"] = [[s, 8.3 - 5.0 * s / 300] for s in range(1, 301)]
    figures = []
    real_save = plots._save
    monkeypatch.setattr(plots, "_save", lambda fig, path: (figures.append(fig), real_save(fig, path))[1])
    assert plots.loss_curves(results, tmp_path / "loss_curves.png") is not None
    [ax] = figures[0].axes
    lo, hi = ax.get_ylim()
    ys = [y for line in ax.get_lines() for y in line.get_ydata()]
    assert len(ax.get_lines()) == 6 and len(ys) > 300
    assert lo < min(ys) and max(ys) < hi
    assert hi - lo < 1.2 * (max(ys) - min(ys))  # a small margin, not a wide window


def _quality():
    spec = importlib.util.spec_from_file_location("bench_quality", ROOT / "bench" / "quality.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _qrow(label: str, val: float, seed: int = 0, offset_std: float | None = 0.02) -> dict:
    return {"codec": label, "val_loss": val, "bytes_per_token": {"total": 100.0}, "tokens": 1024, "wall_s": 1.0,
            "command": "python bench/quality.py",
            "manifest": {"seed": seed, "commit": "abcdef0", "machine": "m", "versions": {"torch": "t"},
                         "corpus_fingerprint": "c" * 16, "tokenizer_hash": "h" * 12,
                         "config": {"compression": {"ssn_offset_std": offset_std}}}}


def test_quality_bench_delta_vs_none_offsets_pairs_seed_and_offsets():
    q = _quality()
    assert q._codec("ssn:adamw=0.5") == "ssn" and q._codec("ssn:offsets=1.0+seed=1") == "ssn"
    rows = [_qrow("none", 4.0), _qrow("none:seed=1", 5.0, seed=1),
            _qrow("none_offsets", 4.2), _qrow("ssn", 4.62), _qrow("ssn:adamw=0.5", 4.41),
            _qrow("ssn:offsets=1.0", 4.5, offset_std=1.0),  # no none_offsets row with std 1.0
            _qrow("none_offsets:offsets=1.0", 4.5, offset_std=1.0), _qrow("ssn:offsets=1.0+seed=1", 5.5, seed=1,
                                                                          offset_std=1.0),
            _qrow("mapl", 4.1)]
    args = argparse.Namespace(threads=1, stages=4, rank=64, steps=8, micro_batches=2, micro_batch_size=4, seed=0,
                              ssn_refresh=0)
    md = q.to_markdown(q.sort_rows(rows), args)
    head = _row(md, "| codec |")
    col = head.index("Δ% vs none_offsets")
    assert head[col - 1] == "Δ% vs none"
    cells = {label: _row(md, f"| {label} |")[col] for label in
             ("ssn", "ssn:adamw=0.5", "ssn:offsets=1.0", "ssn:offsets=1.0+seed=1", "none_offsets", "mapl", "none")}
    assert cells == {"ssn": "+10.00%", "ssn:adamw=0.5": "+5.00%", "ssn:offsets=1.0": "+0.00%",
                     "ssn:offsets=1.0+seed=1": "—", "none_offsets": "—", "mapl": "—", "none": "—"}
    assert _row(md, "| ssn:offsets=1.0+seed=1 |")[col - 1] == "+10.00%"  # vs none of seed 1
