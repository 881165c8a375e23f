"""Real multi-process swarms over ZeroMQ + DHT: equivalence, handshake refusal, garbage frames."""

import json
import os
import re
import signal

import pytest
import zmq

from mapl_swarm.compress import boundary_bytes
from mapl_swarm.config import load_config
from mapl_swarm.launch import launch
from mapl_swarm.pipeline.trainer import train
from mapl_swarm.wire.spec import PROTOCOL_VERSION

from swarm_helpers import Watched, cli, identity_args, start_dht, train_losses, write_config

pytestmark = pytest.mark.timeout(420)


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("cache")


@pytest.mark.parametrize("codec", ["none", "mapl"])
def test_four_peer_swarm_matches_single_process(tmp_path, cache, codec):
    path = write_config(tmp_path / "swarm.toml", codec=codec, cache=cache, out=tmp_path / "swarm",
                        run_id=f"eq-{codec}")
    cfg = load_config(path)
    summary = launch(cfg, ["--config", str(path)], progress=False, timeout_s=360)
    ref_cfg = load_config(path, {"run": {"out_dir": str(tmp_path / "ref")}})
    ref = train(ref_cfg, progress=False)
    ref_losses = train_losses(tmp_path / "ref")
    assert len(summary.train_losses) == 5
    assert summary.train_losses == pytest.approx(ref_losses, rel=1e-3)
    assert summary.val_history[-1][1] == pytest.approx(ref.final_val_loss, rel=1e-3)
    exp = boundary_bytes(codec, 64, 16, "bf16", 512, 32)
    proj = (64 * 16 * 4 / summary.tokens) if codec == "mapl" else 0.0  # one fp32 projector per message
    for link in summary.links:  # measured payload bytes/token equal the accounting exactly
        # PROJ: the initial one + one per step; PROJ_GRAD: one per step
        assert link["forward_payload"] == pytest.approx(exp.forward_bytes + 6 * proj, rel=1e-9)
        assert link["backward_payload"] == pytest.approx(exp.backward_bytes + 5 * proj, rel=1e-9)
        assert link["forward_wire"] > link["forward_payload"]  # headers counted on the wire


@pytest.mark.parametrize("codec", [
    "mapl", "mapl_vq",
    *(pytest.param(c, marks=pytest.mark.slow) for c in ("none", "fixed", "naive", "ssn")),
])
def test_four_peer_swarm_matches_single_process_under_cpu_bf16_autocast(tmp_path, cache, codec):
    """runtime.autocast = "bf16" on CPU: the swarm's losses equal the in-process run's within bf16
    distance (each peer process has its own threads, so bf16 reductions may round differently)."""
    path = write_config(tmp_path / "swarm.toml", codec=codec, cache=cache, out=tmp_path / "swarm",
                        run_id=f"bf16-{codec}")
    path.write_text(path.read_text() + '\n[runtime]\nautocast = "bf16"\n')
    cfg = load_config(path)
    summary = launch(cfg, ["--config", str(path)], progress=False, timeout_s=360)
    ref = train(load_config(path, {"run": {"out_dir": str(tmp_path / "ref")}}), progress=False)
    assert len(summary.train_losses) == 5
    assert summary.train_losses == pytest.approx(train_losses(tmp_path / "ref"), rel=1e-2)
    assert summary.val_history[-1][1] == pytest.approx(ref.final_val_loss, rel=1e-2)


def test_a_misconfigured_peer_is_refused_naming_the_setting_and_its_neighbour_serves_on(tmp_path, cache):
    a = write_config(tmp_path / "a.toml", stages=2, cache=cache, out=tmp_path / "a", run_id="fp", timeout=60)
    b = write_config(tmp_path / "b.toml", stages=2, rank=8, cache=cache, out=tmp_path / "b", run_id="fp",
                     timeout=60)
    dht, maddr = start_dht(a)
    procs = []
    try:
        p0 = Watched(cli("peer", "--config", str(a), "--stage", "0", "--initial-peer", maddr, "--quiet"))
        p1 = Watched(cli("peer", "--config", str(b), "--stage", "1", "--initial-peer", maddr, "--quiet"))
        procs += [p0, p1]
        assert p1.wait(120) == 2, p1.output
        err = [l for l in p1.lines if l.startswith("mapl-swarm: error:")]
        assert len(err) == 1 and "config differs: compression.rank (stage 1 has 8, stage 0 16)" in err[0], p1.output
        assert "stage 0 holds the run's configuration" in err[0] and "Traceback" not in p1.output
        assert p0.proc.poll() is None, p0.output  # the correct peer serves on
        p1 = Watched(cli("peer", "--config", str(a), "--stage", "1", "--initial-peer", maddr, "--quiet"))
        procs.append(p1)
        for p in (p0, p1):
            assert p.wait(120) == 0, p.output
        assert "Traceback" not in p0.output
    finally:
        for p in procs:
            if p.proc.poll() is None:
                p.stop(signal.SIGKILL, timeout=10)
        dht.stop(sig=2)


def test_a_peer_of_another_major_version_is_refused_naming_both_versions(tmp_path, cache):
    path = write_config(tmp_path / "c.toml", stages=2, cache=cache, out=tmp_path / "c", run_id="ver", timeout=40)
    dht, maddr = start_dht(path)
    _, key, _, cert = identity_args("ver", 2, 1)
    other = f"{PROTOCOL_VERSION[0] + 1}.0"
    script = (  # a certified stage-1 peer whose every header claims the next major version
        "import sys, msgpack\n"
        "import mapl_swarm.peer.link as rtm\n"
        "_encode = rtm.encode\n"
        "def encode_other(msg, **kw):\n"
        "    frames = _encode(msg, **kw)\n"
        "    header = msgpack.unpackb(bytes(frames[0]))\n"
        f"    header['v'] = [{PROTOCOL_VERSION[0] + 1}, 0]\n"
        "    return [msgpack.packb(header)] + list(frames[1:])\n"
        "rtm.encode = encode_other\n"
        "import sys\n"
        "from mapl_swarm.config import load_config\n"
        "from mapl_swarm.errors import MaplError\n"
        "from mapl_swarm.net.identity import load_identity\n"
        "from mapl_swarm.peer.main import run_peer\n"
        "try:\n"
        f"    identity = load_identity({key!r}, {cert!r}, run_id='ver', stage=1)\n"
        f"    run_peer(load_config({str(path)!r}), 1, membership=identity,\n"
        f"             initial_peers=[{maddr!r}], progress=False)\n"
        "except MaplError as e:\n"
        "    print('mapl-swarm: error:', e, file=sys.stderr); sys.exit(2)\n"
    )
    procs = []
    try:
        p0 = Watched(cli("peer", "--config", str(path), "--stage", "0", "--initial-peer", maddr, "--quiet"))
        p1 = Watched([os.sys.executable, "-c", script])
        procs += [p0, p1]
        assert p1.wait(180) == 2, p1.output
        mine = re.escape(f"{PROTOCOL_VERSION[0]}.")
        assert re.search(rf"refused stage 1: peer speaks {re.escape(other)}, this peer speaks {mine}\d+", p1.output), \
            p1.output
        assert p0.proc.poll() is None  # the refusing peer keeps serving
        p0.wait_for(rf"dropped a message from .stage1\.[0-9a-f]{{8}}.: peer speaks {re.escape(other)}", 10)
    finally:
        for p in procs:
            p.stop()
        dht.stop(sig=2)


def test_garbage_frames_dropped_while_training_continues(tmp_path, cache):
    """An insecure run (in a certified run a stranger's frames are never delivered at all: the
    decoder sees only what members send)."""
    path = write_config(tmp_path / "g.toml", stages=2, steps=6, cache=cache, out=tmp_path / "g", run_id="junk")
    dht, maddr = start_dht(None)
    ctx = zmq.Context()
    try:
        p1 = Watched(cli("peer", "--config", str(path), "--stage", "1", "--initial-peer", maddr, "--quiet",
                         "--insecure"))
        endpoint = p1.wait_for(r"stage1: bound (tcp://\S+),", 120).group(1)
        p0 = Watched(cli("peer", "--config", str(path), "--stage", "0", "--initial-peer", maddr, "--quiet",
                         "--insecure"))
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.IDENTITY, b"intruder")
        sock.connect(endpoint)
        from mapl_swarm.wire import Message, MessageType, encode
        valid = encode(Message(type=MessageType.HEARTBEAT, run_id="junk", src=0, dst=1))
        sock.send_multipart([b"\x00garbage\xff" * 3])
        sock.send_multipart([bytes(valid[0])[:7]])  # truncated header
        sock.send_multipart([bytes(valid[0]), b"unexpected tensor frame"])
        sock.send_multipart([os.urandom(64), os.urandom(1000)])
        for p in (p0, p1):
            assert p.wait(300) == 0, p.output
        res1 = json.loads((tmp_path / "g" / "peer_stage1.json").read_text())
        res0 = json.loads((tmp_path / "g" / "peer_stage0.json").read_text())
        assert res1["bad_frames"] >= 4
        assert len(res0["train_losses"]) == 6
        assert "dropped a message" in p1.output
    finally:
        ctx.destroy(linger=0)
        dht.stop(sig=2)
