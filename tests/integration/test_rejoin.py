"""Live rejoin (issue 13 item 3, SPEC "Rejoin"): peers started by hand, the middle one killed twice.

Each time, stage 1's neighbours notice within the liveness floor, pause and re-form; a replacement
started with ``--resume`` on the same checkpoint folder joins; every stage rolls back in place to the
newest step all of them saved, and training goes on. The surviving peers are never restarted (same
processes from start to end), and the losses of the whole run equal one uninterrupted in-process run
of the same seed. Every wait polls output or files against a deadline.
"""

from __future__ import annotations

import json
import os
import re
import signal

import pytest

from mapl_swarm.config import load_config
from mapl_swarm.pipeline.trainer import train

from swarm_helpers import Watched, cli, pids, start_dht, train_losses, wait_steps, write_config
from test_swarm_liveness import BAD_OUTPUT

pytestmark = pytest.mark.timeout(420)


def _peer(path, maddr: str, stage: int, *extra: str) -> Watched:
    return Watched(cli("peer", "--config", str(path), "--stage", str(stage), "--initial-peer", maddr, *extra))


def _outputs(*groups: list[Watched]) -> str:
    """Every peer's output, labelled by its command line, for a failure message."""
    return "\n\n".join(f"=== {' '.join(p.proc.args[-6:])} (exit {p.proc.poll()}) ===\n{p.output[-8000:]}"
                         for group in groups for p in group)


def _rejoin_config(tmp_path, name: str, steps: int):
    """A 3-stage config that checkpoints every 3 steps and retries HELLO every 2 s; (path, out)."""
    out = tmp_path / "swarm"
    path = write_config(tmp_path / f"{name}.toml", stages=3, steps=steps, cache=tmp_path / "cache", out=out,
                        run_id=name, timeout=60)
    path.write_text(path.read_text().replace("[net]\n", "[net]\nrejoin_timeout_s = 120\nhello_retry_s = 2\n")
                    + "\n[checkpoint]\ninterval_steps = 3\n")
    return path, out


def test_a_middle_peer_killed_twice_is_replaced_and_the_swarm_rolls_back_in_place(tmp_path):
    steps = 16
    path, out = _rejoin_config(tmp_path, "rejoin", steps)
    dht, maddr = start_dht(path)
    first = [_peer(path, maddr, s) for s in range(3)]
    survivors = [first[0], first[2]]
    pids = [p.proc.pid for p in survivors]
    middle = first[1]
    replacements: list[Watched] = []
    try:
        for round_, at in enumerate((5, 11), start=1):
            wait_steps(out, at, [*survivors, middle], 240)
            middle.proc.kill()
            middle.wait(10)
            middle = _peer(path, maddr, 1, "--resume")
            replacements.append(middle)
            for p in survivors:  # both neighbours pause and name the departed stage
                p.wait_for(rf"stage 1 at tcp://\S+ silent since .*pausing: the swarm re-forms \(run epoch {round_}\)",
                           60)
        for p in [*survivors, middle]:
            assert p.wait(240) == 0, _outputs(first, replacements)
        assert [p.proc.pid for p in survivors] == pids  # never restarted
        for p in [*survivors, *replacements]:
            assert not any(bad in p.output for bad in BAD_OUTPUT), p.output[-6000:]
    finally:
        for p in [*first, *replacements]:
            p.stop(signal.SIGKILL)
        dht.stop(sig=signal.SIGINT)
    result = json.loads((out / "peer_stage0.json").read_text())
    assert result["epoch"] == 2 and len(result["rejoins"]) == 2, result["rejoins"]
    records = [json.loads(line) for line in (out / "metrics_stage0.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in records if "loss" in r]
    assert [r["step"] for r in records if "loss" in r] == list(range(1, steps + 1))
    assert result["train_losses"] == pytest.approx(losses, abs=1e-6)  # the result keeps the rolled-back history
    # its training time covers every session (the paused ones too), so tokens/s is not inflated
    assert sum(r["step_s"] for r in records if "step_s" in r) <= result["wall_s"] + 1.0
    train(load_config(path, {"run": {"out_dir": str(tmp_path / "ref")}, "checkpoint": {"interval_steps": 0}}),
          progress=False)
    assert losses == pytest.approx(train_losses(tmp_path / "ref"), abs=1e-3)


@pytest.mark.slow  # ~70 s
def test_a_stalled_stage_rejoins_within_one_handshake_of_waking_up(tmp_path):
    """Stage 1 is stopped (SIGSTOP) for longer than ZeroMQ's heartbeat timeout, so every connection
    to and from it drops; its neighbours find it silent, pause and re-form. Once it goes on (SIGCONT)
    it hears their HELLO of the next run epoch, pauses too and re-forms on new connections: training
    goes on within one handshake, not after ZeroMQ's reconnect interval (5 x ``net.zmq_heartbeat_s``
    = 20 s here), and each stage logs the event once (no flood of drops)."""
    import time

    steps = 24
    path, out = _rejoin_config(tmp_path, "stall", steps)
    path.write_text(path.read_text().replace("[net]\n", "[net]\nzmq_heartbeat_s = 4\nheartbeat_interval_s = 0.5\n"
                                                           "liveness_floor_s = 3\n").replace("hello_retry_s = 2",
                                                                                              "hello_retry_s = 1"))
    dht, maddr = start_dht(path)
    peers = [_peer(path, maddr, s) for s in range(3)]
    try:
        wait_steps(out, 4, peers, 240)
        os.kill(peers[1].proc.pid, signal.SIGSTOP)
        for p in (peers[0], peers[2]):
            p.wait_for(r"stage 1 at tcp://\S+ silent since .*pausing: the swarm re-forms \(run epoch 1\)", 60)
        time.sleep(14)  # the stall itself: past ZeroMQ's heartbeat timeout (3 x 4 s), connections drop
        woke = time.monotonic()
        os.kill(peers[1].proc.pid, signal.SIGCONT)
        peers[0].wait_for(r"agreeing -> training: from step \d+ \(run epoch 1\)", 60)
        resumed_s = time.monotonic() - woke
        for p in peers:
            assert p.wait(240) == 0, _outputs(peers)
    finally:
        for p in peers:
            p.stop(signal.SIGKILL)
        dht.stop(sig=signal.SIGINT)
    assert resumed_s < 8.0, f"training went on {resumed_s:.1f} s after stage 1 woke up\n" + _outputs(peers)
    for p in peers:
        assert not any(bad in p.output for bad in BAD_OUTPUT), p.output[-6000:]
        assert len(re.findall(r"pausing: the swarm re-forms", p.output)) == 1, p.output[-6000:]
        assert "dropped a message" not in p.output, p.output[-6000:]
    records = [json.loads(line) for line in (out / "metrics_stage0.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "loss" in r] == list(range(1, steps + 1))


@pytest.mark.slow  # ~90 s; the restart itself is in the default run (test_launch_restart_processes.py)
def test_launch_restarts_a_killed_peer_and_the_swarm_finishes_with_unchanged_losses(tmp_path):
    """`launch` (default --max-restarts 3): SIGKILL of stage 1's peer mid-run; the launcher starts it
    again with --resume, its neighbours (never restarted) pause and roll back with it, and the run
    ends with exit 0 and the losses of one uninterrupted in-process run."""
    path, out = _rejoin_config(tmp_path, "relaunch", 12)
    swarm = Watched(cli("launch", "--config", str(path)))
    try:
        wait_steps(out, 5, [swarm], 240)
        pattern = f"peer --config {path} --stage"
        survivors = {s: pids("-f", f"{pattern} {s}") for s in (0, 2)}
        killed = pids("-f", f"{pattern} 1")
        assert killed and all(survivors.values()), (killed, survivors)
        for pid in killed:  # the peer and its forked DHT child, as a host crash
            os.kill(pid, signal.SIGKILL)
        swarm.wait_for(r"stage 1 \(pid \d+\) died \(SIGKILL\); restarting it with --resume \(restart 1 of 3\)", 30)
        assert swarm.wait(300) == 0, swarm.output[-6000:]
        assert "restarted peers: stage 1 x1" in swarm.output
        assert not any(bad in swarm.output for bad in BAD_OUTPUT), swarm.output[-6000:]
    finally:
        swarm.stop(signal.SIGKILL)
    for s in (0, 2):  # never restarted: the same processes wrote their results
        assert json.loads((out / f"peer_stage{s}.json").read_text())["rejoins"], s
    records = [json.loads(line) for line in (out / "metrics_stage0.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in records if "loss" in r]
    train(load_config(path, {"run": {"out_dir": str(tmp_path / "ref")}, "checkpoint": {"interval_steps": 0}}),
          progress=False)
    assert losses == pytest.approx(train_losses(tmp_path / "ref"), abs=1e-3)
