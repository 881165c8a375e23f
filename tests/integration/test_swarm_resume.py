"""A peer lost mid-run costs at most the steps since the last complete checkpoint."""

import json
import os
import signal

import pytest

from mapl_swarm.config import load_config
from mapl_swarm.pipeline import checkpoint
from mapl_swarm.pipeline.trainer import train

from swarm_helpers import Watched, cli, pids, train_losses, write_config

pytestmark = pytest.mark.timeout(600)


def _crash_host(pattern: str) -> None:
    """SIGKILL a peer the way a host crash does: the peer, its forked DHT child (same command line)
    and the DHT's p2pd daemon, so nothing of it outlives the test."""
    peer = pids("-f", pattern)
    assert peer, f"no process matches {pattern!r}"
    for pid in {*peer, *(c for p in peer for c in pids("-P", str(p)))}:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def test_killed_peer_then_resume_continues_exactly(tmp_path):
    # 10 steps over 0.25 Mbit/s links (~0.3 s a step), killed as soon as the first complete
    # checkpoint (step 2) appears: several steps are still to go, so the resume has steps to train
    path = write_config(tmp_path / "r.toml", stages=3, steps=10, cache=tmp_path / "cache", out=tmp_path / "run",
                        run_id="resume")
    text = path.read_text().replace("[net]", "[net]\nheartbeat_interval_s = 1.0\nbandwidth_mbps = 0.25")
    path.write_text(text.replace("[eval]\n", "[checkpoint]\ninterval_steps = 2\n\n[eval]\n"))
    swarm = Watched(cli("launch", "--config", str(path), "--quiet", "--max-restarts", "0"))
    step = int(swarm.wait_for(r"checkpoint step (\d+) saved by every stage", 300).group(1))
    _crash_host(f"peer --config {path} --stage 2")
    assert swarm.wait(120) == 2, swarm.output
    assert "stage 2 peer exited" in swarm.output
    done = checkpoint.latest_complete_step(tmp_path / "run", 3)
    assert done >= step

    # --log-level after the subcommand reaches every peer: the resumed swarm prints no INFO line
    resumed = Watched(cli("launch", "--config", str(path), "--resume", "--log-level", "WARNING", "--quiet"))
    assert resumed.wait(300) == 0, resumed.output
    assert " INFO " not in resumed.output and "LinkConfig(" not in resumed.output, resumed.output
    assert "payload" in resumed.output and "on the wire" in resumed.output
    losses = json.loads((tmp_path / "run" / "peer_stage0.json").read_text())["train_losses"]
    assert done < 10 and len(losses) == 10 - done

    ref = train(load_config(path, {"run": {"out_dir": str(tmp_path / "ref")}, "checkpoint": {"interval_steps": 0}}),
                progress=False)
    ref_losses = train_losses(tmp_path / "ref")
    assert len(ref_losses) == 10 and ref.steps == 10
    assert losses == pytest.approx(ref_losses[done:], rel=1e-3)
