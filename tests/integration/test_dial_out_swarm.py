"""Dial-out peers in a real multi-process swarm on 127.0.0.1 (no namespaces needed: a dial-out peer
announces no address, so nobody dials it whether it could be reached or not): a chain whose middle
stage dials out, and one whose stages 1 and 2 both dial out and link through `mapl-swarm relay`,
train to the losses of `mapl-swarm train`."""

import json
import re
import signal

import pytest

from mapl_swarm.config import load_config
from mapl_swarm.pipeline.trainer import train

from swarm_helpers import Watched, cli, identity_args, start_dht, train_losses, write_config

pytestmark = pytest.mark.timeout(420)


def _run_chain(path, maddr, dial_out: dict[int, list[str]]) -> None:
    procs = []
    try:
        for stage in range(3):
            procs.append(Watched(cli("peer", "--config", str(path), "--stage", str(stage), "--initial-peer", maddr,
                                     "--quiet", *dial_out.get(stage, []))))
        for p in procs:
            assert p.wait(300) == 0, p.output[-6000:]
            assert "Traceback" not in p.output
    finally:
        for p in procs:
            if p.proc.poll() is None:
                p.stop(signal.SIGKILL, timeout=10)


def _losses(out):
    """Stage 0's train losses."""
    return [json.loads(line)["loss"] for line in (out / "metrics_stage0.jsonl").read_text().splitlines()
            if '"loss"' in line]


def test_a_chain_whose_middle_stage_dials_out_trains_to_the_in_process_losses(tmp_path):
    path = write_config(tmp_path / "dialout.toml", stages=3, steps=3, cache=tmp_path / "cache", out=tmp_path / "run",
                        run_id="dialout-chain", timeout=90)
    dht, maddr = start_dht(path)
    try:
        _run_chain(path, maddr, {1: ["--set", 'net.reachable="no"']})
    finally:
        dht.stop(sig=2)
    train(load_config(path, {"run": {"out_dir": str(tmp_path / "ref")}}), progress=False)
    assert _losses(tmp_path / "run") == pytest.approx(train_losses(tmp_path / "ref"), abs=1e-3)


@pytest.mark.parametrize("found", ["configured", "announced"])
def test_two_dial_out_neighbours_train_through_a_relay(tmp_path, found):
    """``configured``: each dial-out peer is given the relay (``net.relay``); ``announced``: the relay
    runs with stage 0's peer key and certificate and announces itself in the run's DHT, where the
    dial-out peers, given no relay, find it."""
    run_id = f"dialout-relay-{found}"
    path = write_config(tmp_path / "relay.toml", stages=3, steps=3, cache=tmp_path / "cache", out=tmp_path / "run",
                        run_id=run_id, timeout=90)
    dht, maddr = start_dht(path)
    key, cert = identity_args(run_id, 3, 0)[1::2]
    announce = ["--relay-key", key, "--initial-peer", maddr, "--announce-host", "127.0.0.1"] \
        if found == "announced" else ["--relay-key", str(tmp_path / "relay.key")]
    relay = Watched(cli("relay", "--host", "127.0.0.1", *announce, "--cert", cert))
    try:
        address = relay.wait_for(r'net\.relay = "(127\.0\.0\.1:\d+#[0-9a-f]{64})"', 60).group(1)
        via = ["--set", 'net.reachable="no"', *(["--set", f'net.relay="{address}"'] if found == "configured" else [])]
        _run_chain(path, maddr, {1: via, 2: via})
    finally:
        relay.stop(sig=2)
        dht.stop(sig=2)
    assert re.search(r"relay: \S+ \((dial|serve)\) and \S+ \((dial|serve)\) paired", relay.output), relay.output
    train(load_config(path, {"run": {"out_dir": str(tmp_path / "ref")}}), progress=False)
    assert _losses(tmp_path / "run") == pytest.approx(train_losses(tmp_path / "ref"), abs=1e-3)


def test_two_dial_out_neighbours_without_a_relay_each_say_a_relay_is_needed(tmp_path):
    """Stages 1 and 2 both dial out and no relay is configured or announced: each exits (status 2)
    within the handshake timeout naming the other stage and that a relay is needed."""
    path = write_config(tmp_path / "norelay.toml", stages=3, steps=3, cache=tmp_path / "cache",
                        out=tmp_path / "run", run_id="dialout-norelay", timeout=60)
    dht, maddr = start_dht(path)
    procs = {}
    try:
        for stage in range(3):
            procs[stage] = Watched(cli("peer", "--config", str(path), "--stage", str(stage), "--initial-peer", maddr,
                                       "--quiet", *(["--set", 'net.reachable="no"'] if stage else [])))
        for mine, theirs in ((1, 2), (2, 1)):
            assert procs[mine].wait(120) == 2, procs[mine].output[-6000:]
            assert re.search(rf"stage{mine}: link 'stage{theirs}(@[0-9a-f]{{8}})?': the peer at dialout#[0-9a-f]{{64}} "
                             rf"accepts no connection, and neither does this one \(both dial out\): a relay between "
                             rf"them is needed", procs[mine].output), procs[mine].output[-6000:]
            assert "Traceback" not in procs[mine].output
    finally:
        for p in procs.values():
            if p.proc.poll() is None:
                p.stop(signal.SIGKILL, timeout=10)
        dht.stop(sig=2)
