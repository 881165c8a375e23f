"""Swarm peers follow the run policy: pruning to checkpoint.keep across the swarm, a manifest,
per-step metrics streamed while the run goes, and multi-host resume from the newest step every
stage has (each stage with its own run.out_dir, agreement by CHECKPOINT messages, SPEC §5.2)."""

import json
from pathlib import Path

import pytest

from mapl_swarm.pipeline import checkpoint

from deadlines import wait_until
from swarm_helpers import Watched, cli, start_dht, write_config

pytestmark = pytest.mark.timeout(600)


def _records(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")]


def _configure(path: Path, **checkpoint) -> Path:
    extra = "".join(f"{k} = {v}\n" for k, v in checkpoint.items())
    text = path.read_text().replace("[net]\n", "[net]\nheartbeat_interval_s = 1.0\n")
    path.write_text(text.replace("[eval]\n", "[checkpoint]\n" + extra + "[eval]\n"))
    return path


def test_swarm_prunes_writes_manifest_and_streams_metrics(tmp_path):
    steps = 12
    path = write_config(tmp_path / "p.toml", stages=3, steps=steps, cache=tmp_path / "cache", out=tmp_path / "run",
                        run_id="policy")
    _configure(path, interval_steps=2, keep=2)
    path.write_text(path.read_text().replace("[net]\n", "[net]\nbandwidth_mbps = 0.5\n"))
    swarm = Watched(cli("launch", "--config", str(path), "--quiet"))
    try:
        metrics0 = tmp_path / "run" / "metrics_stage0.jsonl"
        def two_records() -> bool:  # streamed per step: readable while the swarm still runs
            assert swarm.proc.poll() is None, swarm.output
            return len(_records(metrics0)) >= 2

        wait_until(two_records, 300, "two metrics records while the swarm ran")
        assert swarm.proc.poll() is None, "the run ended before its records were read"
        assert swarm.wait(300) == 0, swarm.output
    finally:
        swarm.stop()
    run = tmp_path / "run"
    assert "metrics: " in swarm.output and "checkpoints: " in swarm.output
    step_dirs = sorted(p.name for p in (run / "checkpoints").glob("step_*"))
    assert step_dirs == [f"step_{steps - 2:08d}", f"step_{steps:08d}"]  # checkpoint.keep = 2
    for s in range(3):
        assert checkpoint.stage_steps(run, s) == [steps - 2, steps]
        assert checkpoint.read_complete(run, s) == [steps - 2, steps]
        meta = checkpoint.read_meta(run, steps, s)
        assert meta["driver"] == "swarm" and meta["step"] == steps and meta["stage"] == s
        records = _records(run / f"metrics_stage{s}.jsonl")
        assert [r["step"] for r in records] == list(range(1, steps + 1)), records  # one per step per stage
        assert all(r["stage"] == s and "lr_mult" in r and "step_s" in r for r in records)
    stage0 = _records(run / "metrics_stage0.jsonl")
    assert all("loss" in r and r["tokens"] > 0 for r in stage0)
    assert "val_loss" in stage0[-1]
    manifest = json.loads((run / "manifest.json").read_text())
    assert manifest["driver"] == "swarm" and manifest["resumed_from"] == 0
    assert json.loads((run / "manifest_stage2.json").read_text())["stage"] == 2


@pytest.mark.slow  # two 3-peer swarms: ~80 s on the 2-core machine
def test_multi_host_resume_from_newest_step_every_stage_has(tmp_path):
    path = write_config(tmp_path / "m.toml", stages=3, steps=6, cache=tmp_path / "cache", out=tmp_path / "unused",
                        run_id="multihost")
    _configure(path, interval_steps=2, keep=2)

    runs = iter(range(10))

    dhts: list[Watched] = []

    def swarm(*extra: str) -> list[Watched]:
        """The 3 peers, each with its own run.out_dir (host), under a new run id and its own DHT
        (a DHT would still hold the previous swarm's announcements)."""
        nonlocal maddr
        run_id = f"multihost{next(runs)}"
        if dhts:
            dhts[-1].stop(sig=2)
        dht, maddr = start_dht(path, run_id=run_id)
        dhts.append(dht)
        return [Watched(cli("peer", "--config", str(path), "--stage", str(s), "--initial-peer", maddr, "--quiet",
                            "--set", f"run.out_dir=\"{tmp_path / f'host{s}'}\"", "--set", f"run.run_id=\"{run_id}\"",
                            *extra)) for s in range(3)]

    maddr = ""
    peers: list[Watched] = []
    try:
        peers = swarm("--resume")  # nothing to resume: every peer says so and exits non-zero
        for p in peers:
            assert p.wait(300) == 2, p.output
            assert "mapl-swarm: error: --resume: no checkpoint to resume from" in p.output, p.output
            assert "stage 0 has none, stage 1 has none, stage 2 has none" in p.output, p.output
        peers = swarm()
        for p in peers:
            assert p.wait(300) == 0, p.output
        for s in range(3):  # each host pruned by agreement although it never sees the others' files
            assert checkpoint.stage_steps(tmp_path / f"host{s}", s) == [4, 6]
        checkpoint.delete_stage_steps(tmp_path / "host1", 1, [6])  # stage 1's host lost its newest

        peers = swarm("--resume", "--set", "run.steps=8")
        for p in peers:
            assert p.wait(300) == 0, p.output
        for s, p in enumerate(peers):
            assert f"stage {s} resumed from step 4" in p.output, p.output
        assert "stage 0 done: 4 steps" in peers[0].output  # steps 5..8
        for s in range(3):
            host = tmp_path / f"host{s}"
            assert checkpoint.stage_steps(host, s) == [6, 8]
            assert [r["step"] for r in _records(host / f"metrics_stage{s}.jsonl")] == list(range(1, 9))
            assert json.loads((host / ("manifest.json" if s == 0 else f"manifest_stage{s}.json")).read_text())[
                "resumed_from"] == 4
    finally:
        for p in peers:
            p.stop()
        for dht in dhts:
            dht.stop(sig=2)
