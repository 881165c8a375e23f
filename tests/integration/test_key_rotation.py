"""Key rotation at a step boundary (issue 12 item 1), the documented procedure: train to a checkpoint
with key A, stop, create key B (`mapl-swarm keys --out ... --force`), restart every peer with key B and
--resume. The resumed run continues exactly; a party still holding key A reaches no key-B peer.

Two real peers (ZeroMQ over 127.0.0.1 with CURVE, the real wire, each with its compute thread) run
in one event loop with an in-memory directory instead of the DHT."""

import asyncio

import pytest
import zmq
from zmq.utils.monitor import parse_monitor_message

from mapl_swarm.config import load_config
from mapl_swarm.net.errors import NetTimeoutError
from mapl_swarm.net.runkey import RunKey, create_run_key, load_run_key
from mapl_swarm.net.transport import Transport, TransportConfig
from mapl_swarm.peer.main import build_peer
from mapl_swarm.pipeline import checkpoint
from mapl_swarm.pipeline.trainer import train

from swarm_helpers import Directory, train_losses, write_config

pytestmark = pytest.mark.timeout(300)
N = 2


def run_swarm(cfg, run_key, *, resume: bool):
    directory = Directory()
    peers = [build_peer(cfg, s, resolve=directory.resolve, announce=directory.announcer(s), progress=False,
                        resume=resume, membership=run_key) for s in range(cfg.pipeline.num_stages)]

    async def swarm():
        return await asyncio.wait_for(asyncio.gather(*(p.run() for p in peers)), 240)

    return asyncio.run(swarm())


def test_rotate_the_run_key_at_a_checkpoint(tmp_path):
    path = write_config(tmp_path / "rot.toml", stages=2, steps=N, cache=tmp_path / "cache", out=tmp_path / "run",
                        run_id="rotate", timeout=60)
    path.write_text(path.read_text().replace("[eval]\n", f"[checkpoint]\ninterval_steps = {N}\n\n[eval]\n"))
    key_file = tmp_path / "run.key"
    key_a = create_run_key(key_file)
    first = run_swarm(load_config(path, {"runtime": {"threads": 1}}), key_a, resume=False)
    assert len(first[0].train_losses) == N and checkpoint.latest_complete_step(tmp_path / "run", 2) == N

    key_b = create_run_key(key_file, force=True)  # `mapl-swarm keys --out run.key --force`
    assert load_run_key(key_file).key_id == key_b.key_id != key_a.key_id
    cfg = load_config(path, {"run": {"steps": 2 * N}, "runtime": {"threads": 1}})
    second = run_swarm(cfg, load_run_key(key_file), resume=True)
    assert len(second[0].train_losses) == N and all(r.bad_frames == 0 for r in second)

    train(load_config(path, {"run": {"steps": 2 * N, "out_dir": str(tmp_path / "ref")},
                             "checkpoint": {"interval_steps": 0}, "runtime": {"threads": 1}}), progress=False)
    ref = train_losses(tmp_path / "ref")
    assert first[0].train_losses + second[0].train_losses == pytest.approx(ref, rel=1e-3)


HANDSHAKE_FAILED = (zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                    | zmq.EVENT_HANDSHAKE_FAILED_AUTH)


@pytest.mark.asyncio
async def test_old_key_reaches_no_new_key_peer():
    """Key A's holder dials a key-B member: its CURVE handshake fails (seen on the member's socket
    monitor), nothing is delivered, while a key-B holder gets through on the same endpoint."""
    key_a, key_b = RunKey.generate(), RunKey.generate()
    loopback = dict(bind_host="127.0.0.1", send_timeout_s=5)
    async with Transport("stage1", TransportConfig(curve=key_b.curve, **loopback)) as member, \
            Transport("stage0", TransportConfig(curve=key_a.curve, **loopback)) as old, \
            Transport("stage0", TransportConfig(curve=key_b.curve, **loopback)) as new:
        monitor = member._router.get_monitor_socket(HANDSHAKE_FAILED)
        try:
            old.connect("stage1", member.endpoint)
            await old.send("stage1", [b"HELLO from key A"])
            event = parse_monitor_message(await asyncio.wait_for(monitor.recv_multipart(), 5))
            assert event["event"] & HANDSHAKE_FAILED
        finally:
            member._router.disable_monitor()
            monitor.close(linger=0)
        with pytest.raises(NetTimeoutError):
            sender, frames = await member.recv(timeout_s=0.5)
            pytest.fail(f"delivered from {sender}: {frames}")
        new.connect("stage1", member.endpoint)
        await new.send("stage1", [b"HELLO from key B"])
        assert await member.recv(timeout_s=5) == (new.routing_id, [b"HELLO from key B"])
