"""The one-shot GPU check's smoke mode: `bench/gpu_check.sh --device cpu --smoke` runs every code path
of the check (VQ speed, boundary overhead per codec, a local swarm, a grid slice, the summary) on tiny
shapes, writes each part's JSON with status ok, and labels its figures as no measurement."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mapl_swarm.config.catalog import CODEC_NAMES

ROOT = Path(__file__).resolve().parents[2]
PARTS = {"vq_speed.json": "VQ encoder speed", "boundary_overhead.json": "Boundary overhead",
         "swarm.json": "Local swarm", "sweep.json": "Grid slice"}
DEADLINE_S = 180  # a hang guard: the run takes ~45 s on the shared 2-core machine

pytestmark = pytest.mark.timeout(DEADLINE_S + 60)


def test_gpu_check_cpu_smoke(tmp_path):
    out = tmp_path / "out"
    t0 = time.monotonic()
    proc = subprocess.run(["bash", str(ROOT / "bench" / "gpu_check.sh"), "--out", str(out), "--device", "cpu",
                           "--smoke", "--python", sys.executable, "--work", str(tmp_path / "work")],
                          cwd=tmp_path, capture_output=True, text=True, timeout=DEADLINE_S)
    wall = time.monotonic() - t0
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    files = sorted(p.name for p in out.iterdir())
    assert files == sorted([*PARTS, "gpu_check.json", "summary.md"]), files  # <= 8 plain files
    label = "smoke (CPU, not a measurement)"
    parts = {name: json.loads((out / name).read_text()) for name in PARTS}
    for name, d in parts.items():
        assert d["status"] == "ok", (name, d.get("reason"), d.get("log_tail"))
        assert d["label"] == label and d["commands"] and all(c["rc"] == 0 for c in d["commands"]), name
    assert {r["encoder"] for r in parts["vq_speed.json"]["results"]} == {"eager", "compiled"}
    assert parts["vq_speed.json"]["results"][0]["autocast"] == "bf16"
    overhead = parts["boundary_overhead.json"]
    assert {r["codec"] for r in overhead["results"]} == set(CODEC_NAMES)
    assert overhead["shape"]["autocast"] == "bf16"
    swarm = parts["swarm.json"]
    assert swarm["stages"] == 2 and swarm["train_steps"] == 2 and swarm["tokens_per_s"] > 0
    assert swarm["bytes_per_token"]["forward_wire"] > 0
    runs = parts["sweep.json"]["runs"]
    assert {r["codec"] for r in runs} == set(CODEC_NAMES) and all(r["val_loss"] > 0 for r in runs)
    overall = json.loads((out / "gpu_check.json").read_text())
    assert overall["smoke"] and overall["parts"] == {n.removesuffix(".json"): "ok" for n in PARTS}
    summary = (out / "summary.md").read_text()
    rows = [line for line in summary.splitlines() if line.startswith("| ") and line[2].isdigit()]
    assert len(rows) == len(PARTS), summary
    for (name, title), row in zip(PARTS.items(), rows):
        assert title in row and f"`{name}`" in row and "| ok |" in row and label in row, row
    assert "GPU figures: not measured" in summary
    print(f"gpu_check.sh --device cpu --smoke: {wall:.1f} s")


def test_a_timed_out_part_is_recorded_failed_and_keeps_its_partial_figures(tmp_path):
    """`finish` turns a part whose command ran out of its time box into status failed with the reason
    and the log's tail, keeping the figures written before; the summary marks the row and exits 1."""
    helper = [sys.executable, str(ROOT / "bench" / "gpu_check.py")]
    out = tmp_path / "out"
    out.mkdir()
    (out / "vq_speed.json").write_text(json.dumps({"results": [{
        "preset": "150M", "encoder": "eager", "encode_learn_us_per_token": 1.5, "vq_share_of_stage_compute": 0.04,
        "stage_fwd_bwd_s": 0.007, "tokens_per_micro_batch": 8192}]}))
    steps = tmp_path / "vq.steps"
    steps.write_text(json.dumps({"command": "python bench/vq_speed.py --presets 150M", "wall_s": 75.1, "rc": 124}) + "\n")
    log = tmp_path / "vq.log"
    log.write_text("compiling the fused search\n")
    subprocess.run([*helper, "finish", "--part", "vq_speed", "--json", str(out / "vq_speed.json"), "--rc", "124",
                    "--limit-s", "75", "--label", "measured on H200", "--steps-file", str(steps), "--log", str(log)],
                   check=True, capture_output=True, timeout=60)
    d = json.loads((out / "vq_speed.json").read_text())
    assert d["status"] == "failed" and "timed out" in d["reason"] and "75 s time box" in d["reason"]
    assert d["log_tail"] == "compiling the fused search" and d["results"][0]["encoder"] == "eager"
    proc = subprocess.run([*helper, "summary", "--dir", str(out), "--label", "measured on H200"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1 and "failed parts: vq_speed" in proc.stderr
    row = next(line for line in (out / "summary.md").read_text().splitlines() if line.startswith("| 1 |"))
    assert "| failed |" in row and "timed out" in row and "partial, measured on H200: 150M eager" in row, row
