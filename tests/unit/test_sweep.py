"""Experiment sweep: micro grid end to end (JSON, tables, plots, health), resume, strict grids."""

import json
import shutil
from pathlib import Path

import pytest

from mapl_swarm import cli
from mapl_swarm.errors import ConfigError
from mapl_swarm.experiments import grid_from_dict, load_grid

ROOT = Path(__file__).resolve().parents[2]
GRIDS = ROOT / "bench" / "grids"
PLOTS = ["pareto", "loss_curves", "spectra", "projector_angles", "energy_captured", "cosine_pairs"]


def _micro_grid_file(tmp_path: Path, extra: str = "") -> Path:
    text = (GRIDS / "micro.toml").read_text() + extra
    text = text.replace('source = "stdlib"', f'source = "stdlib"\ncache_dir = "{tmp_path / "cache"}"')
    text = text.replace('out_dir = "runs/sweep-micro"', f'out_dir = "{tmp_path / "out"}"')
    path = tmp_path / "micro.toml"
    path.write_text(text)
    return path


def test_micro_sweep_end_to_end_and_resume(tmp_path, capsys):
    grid_file = _micro_grid_file(tmp_path)
    assert cli.main(["--log-level", "WARNING", "sweep", "--grid", str(grid_file), "--quiet",
                     "--publish", str(tmp_path / "pub"), "--benchmarks", str(tmp_path / "BENCH.md")]) == 0
    assert "2 run, 0 already finished" in capsys.readouterr().out
    out = tmp_path / "out"
    results = {p.stem: json.loads(p.read_text()) for p in (out / "runs").glob("*.json")}
    assert set(results) == {"none-P3-s0", "mapl-r16-P3-anchor-factorized-s0"}
    mapl, none = results["mapl-r16-P3-anchor-factorized-s0"], results["none-P3-s0"]
    for r in (mapl, none):
        assert r["tokens"] == 1024 and r["steps"] == 8 and r["val_loss"] < r["initial_val_loss"]
        m = r["manifest"]
        assert m["commit"] and m["versions"]["torch"] and m["corpus_fingerprint"] and m["seed"] == 0
        assert m["config"]["compression"]["codec"] == r["codec"]
    assert mapl["act_bytes_per_token"] == 32.0 and none["act_bytes_per_token"] == 128.0  # bf16 r=16 / d=64
    assert len(mapl["analysis"]["projector_angles"]) == 2
    b0 = mapl["analysis"]["boundaries"][0]
    assert b0["cumulative_energy"][-1] == pytest.approx(1.0, abs=1e-4) and -1 <= b0["cos_pearson"] <= 1

    # health metrics in the run's metrics stream, every 2 steps, per boundary
    records = [json.loads(l) for l in (out / "train" / mapl["run_id"] / "metrics.jsonl").read_text().splitlines()]
    health = [r for r in records if "health/b0/energy_captured" in r]
    assert [r["step"] for r in health] == [2, 4, 6, 8]
    for key in ("health/b0/orth_error", "health/b0/grad_fidelity", "health/b1/energy_captured",
                "health/b1/grad_fidelity"):
        assert key in health[-1]
    assert mapl["health"] and len(mapl["health"]) == 4

    summary = (out / "summary.md").read_text()
    assert "Table 1" in summary and "| MAPL | 16 | 32 | 4× |" in summary and "none-P3" in summary
    for name in PLOTS:
        png = out / "plots" / f"{name}.png"
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name
        assert (tmp_path / "pub" / "plots" / f"{name}.png").exists()
    bench = (tmp_path / "BENCH.md").read_text()
    assert "<!-- sweep:micro:begin -->" in bench and "pub/plots/pareto.png" in bench

    # second invocation: everything is finished, nothing runs again
    before = {p: p.stat().st_mtime_ns for p in (out / "runs").glob("*.json")}
    assert cli.main(["--log-level", "WARNING", "sweep", "--grid", str(grid_file), "--quiet"]) == 0
    assert "0 run, 2 already finished" in capsys.readouterr().out
    assert before == {p: p.stat().st_mtime_ns for p in (out / "runs").glob("*.json")}


def test_an_interrupted_run_resumes_from_its_checkpoint_and_matches_an_uninterrupted_one(tmp_path):
    """Checkpoints every 2 steps (keep 2): a run whose result is lost and whose newest checkpoint is
    gone resumes from the older one, keeps the validations of its first attempt and ends where an
    uninterrupted run ends."""
    from mapl_swarm.experiments import run_sweep
    from mapl_swarm.pipeline.checkpoint import CHECKPOINTS

    grid_file = _micro_grid_file(tmp_path)
    grid_file.write_text(grid_file.read_text().replace("[base.checkpoint]\ninterval_steps = 0",
                                                       "[base.checkpoint]\ninterval_steps = 2"))
    grid_file.write_text(grid_file.read_text().replace('codecs = ["none", "mapl"]', 'codecs = ["mapl"]'))
    grid = load_grid(grid_file)
    [spec] = grid.expand()
    a, b = tmp_path / "A", tmp_path / "B"
    assert run_sweep(grid, a, progress=False).ran == [spec.run_id]
    assert run_sweep(grid, b, progress=False).ran == [spec.run_id]
    ref = json.loads((a / "runs" / f"{spec.run_id}.json").read_text())
    assert ref["resumed_from"] == 0 and [s for s, _ in ref["val_history"]] == [0, 4, 8]

    (b / "runs" / f"{spec.run_id}.json").unlink()  # the run "did not finish" ...
    steps = sorted((b / "train" / spec.run_id / CHECKPOINTS).glob("step_*"))
    assert [p.name for p in steps] == ["step_00000006", "step_00000008"]
    for p in steps[1:]:  # ... and its newest checkpoint is gone
        shutil.rmtree(p)
    assert run_sweep(grid, b, progress=False).ran == [spec.run_id]
    res = json.loads((b / "runs" / f"{spec.run_id}.json").read_text())
    assert res["resumed_from"] == 6
    assert [s for s, _ in res["val_history"]] == [0, 4, 8]  # 0 and 4 from the first attempt
    for (s_ref, v_ref), (s, v) in zip(ref["val_history"], res["val_history"]):
        assert s == s_ref and v == pytest.approx(v_ref, abs=1e-6)
    assert res["val_loss"] == pytest.approx(ref["val_loss"], abs=1e-6)
    assert [s for s, _ in res["train_curve"]] == list(range(1, 9))


def test_a_failed_run_fails_the_sweep_loudly_and_publishes_nothing(tmp_path, capsys, monkeypatch):
    """A codec that crashes (e.g. under bf16 autocast) must not leave a table that looks complete."""
    from mapl_swarm.experiments import sweep

    real = sweep._run_one

    def broken(spec, *args, **kwargs):
        if spec.codec == "mapl":
            raise RuntimeError("expected m1 and m2 to have the same dtype")
        return real(spec, *args, **kwargs)

    monkeypatch.setattr(sweep, "_run_one", broken)
    grid_file = _micro_grid_file(tmp_path)
    assert cli.main(["--log-level", "ERROR", "sweep", "--grid", str(grid_file), "--quiet",
                     "--publish", str(tmp_path / "pub")]) == 1
    captured = capsys.readouterr()
    assert "1 run, 0 already finished, 1 failed" in captured.out
    assert "1 sweep run(s) failed" in captured.err and "nothing was published" in captured.err
    assert not (tmp_path / "pub").exists()
    summary = (tmp_path / "out" / "summary.md").read_text()
    assert "INCOMPLETE: 1 run(s) failed" in summary and "mapl-r16-P3-anchor-factorized-s0" in summary


def _raw(**extra):
    raw = {"name": "t", "tokens_per_run": 256,
           "base": {"model": {"vocab_size": 256, "hidden_size": 64, "num_layers": 4, "num_heads": 4,
                              "ffn_hidden_size": 128, "context_length": 16},
                    "compression": {"rank": 16, "anchor_rank": 16},
                    "pipeline": {"micro_batch_size": 2, "num_micro_batches": 2}},
           "group": [{"codecs": ["none", "mapl"], "seeds": [0, 1]}]}
    raw.update(extra)
    return raw


def test_grid_strict_loading_names_key_and_file(tmp_path):
    p = tmp_path / "bad.toml"
    p.write_text('name = "x"\ntokens_per_run = 64\nbogus = 1\n[base]\n[[group]]\ncodecs = ["none"]\n')
    with pytest.raises(ConfigError, match=r"bad\.toml.*unknown key 'bogus'"):
        load_grid(p)
    p.write_text('name = "x"\ntokens_per_run = 4096\n[base]\n[[group]]\ncodecs = ["none"]\nrank = [4]\n')
    with pytest.raises(ConfigError, match=r"bad\.toml \[\[group\]\] #1: unknown key 'rank'"):
        load_grid(p)
    p.write_text('name = "x"\ntokens_per_run = 4096\n[base.run]\nstepz = 3\n[[group]]\ncodecs = ["none"]\n')
    with pytest.raises(ConfigError, match=r"bad\.toml \[base\] \[run\]: unknown key 'stepz'"):
        load_grid(p)
    with pytest.raises(ConfigError, match="not one of"):
        grid_from_dict(_raw(group=[{"codecs": ["mpal"]}]), "g.toml")
    with pytest.raises(ConfigError, match="derived from tokens_per_run"):
        grid_from_dict(_raw(base={"run": {"steps": 3}}), "g.toml")
    with pytest.raises(ConfigError, match="not a multiple"):
        grid_from_dict(_raw(tokens_per_run=100), "g.toml")


def test_grid_expansion_dedupes_and_skips_unknown_codecs():
    grid = grid_from_dict(_raw(group=[
        {"name": "t1", "codecs": ["none", "mapl", "ssn", "mapl_vq"], "seeds": [0, 1]},
        {"name": "t6", "codecs": ["none", "mapl"], "anchors": ["none", "factorized"], "seeds": [0]},
    ]), "g.toml")
    specs = grid.expand()
    ids = [s.run_id for s in specs]
    assert len(ids) == len(set(ids))
    assert ids[:5] == ["none-P4-s0", "mapl-r16-P4-anchor-factorized-s0", "ssn-r16-P4-s0",
                       "mapl_vq-r16-P4-anchor-factorized-s0", "mapl-r16-P4-anchor-none-s0"]
    assert all(s.seed == 1 for s in specs[5:]) and len(specs) == 9
    none0 = next(s for s in specs if s.run_id == "none-P4-s0")
    assert none0.groups == ("t1", "t6")
    assert all(s.raw["run"]["steps"] == 4 for s in specs)  # 256 tokens / (2 x 2 x 16)


def test_shipped_grids_load():
    files = sorted(GRIDS.glob("*.toml"))
    assert {f.stem for f in files} >= {"micro", "cpu", "gpu-small"}
    for f in files:
        assert load_grid(f).expand()


def _fake(codec, seed, val, stages=8, anchor="factorized", rank=32):
    from mapl_swarm.experiments.grid import ANCHORED_CODECS
    label = f"{codec}-P{stages}" if codec == "none" else (
        f"{codec}-r{rank}-P{stages}" + (f"-anchor-{anchor}" if codec in ANCHORED_CODECS else ""))
    cfg = {"model": {"vocab_size": 100, "hidden_size": 64, "num_layers": 8, "num_heads": 4,
                     "ffn_hidden_size": 128, "context_length": 16},
           "compression": {"anchor_rank": 8}, "pipeline": {"num_micro_batches": 2, "micro_batch_size": 2},
           "data": {"source": "stdlib"}}
    return {"run_id": f"{label}-s{seed}", "label": label, "codec": codec, "rank": rank, "stages": stages,
            "anchor": anchor, "seed": seed, "val_loss": val, "steps": 4, "device": "cpu",
            "act_bytes_per_token": 128.0 if codec == "none" else 2.0 * rank, "uncompressed_act_bytes": 128,
            "bytes_per_token": [{"total": 300.0}], "health": [], "wall_s": 1.0,
            "analysis": {"boundaries": [{"rank99": 10}], "projector_angles": []},
            "manifest": {"config": cfg, "machine": "m", "versions": {"torch": "t"}, "commit": "abc"}}


def test_tables_aggregate_seeds_with_paired_deltas():
    from types import SimpleNamespace

    from mapl_swarm.experiments.tables import aggregate, summary_markdown

    results = [_fake("none", 0, 4.0), _fake("none", 1, 5.0),
               _fake("mapl", 0, 4.4, anchor="full"), _fake("mapl", 1, 5.5, anchor="full"),
               _fake("mapl", 0, 4.2), _fake("mapl", 1, 5.25)]
    aggs = {a.label: a for a in aggregate(results)}
    full = aggs["mapl-r32-P8-anchor-full"]
    assert full.val[0] == pytest.approx(4.95) and full.val[1] == pytest.approx(0.7778, abs=1e-4)
    assert full.delta == (pytest.approx(10.0), pytest.approx(0.0))  # +10% for both seeds
    assert aggs["mapl-r32-P8-anchor-factorized"].delta[0] == pytest.approx(5.0)
    md = summary_markdown(SimpleNamespace(name="t", description="", source="t.toml", tokens_per_run=256), results,
                          skipped=["mapl_vq-r32-P8-anchor-factorized-s0 — FAILED"],
                          plots=[])
    assert "### Table 6" in md and "| Full trainable anchor | 4.9500 ± 0.7778 | +10.00 ± 0.00% | 6,400 |" in md
    assert "| Factorized anchor (MAPL) |" in md and "| 800 |" in md
    assert "Skipped: mapl_vq" in md
