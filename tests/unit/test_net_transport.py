"""ZeroMQ transport on loopback: exchange, zero-copy, shaping, counters, timeouts, addresses."""

from __future__ import annotations

import asyncio
import os
import socket
from dataclasses import replace
from typing import AsyncIterator, Sequence

import pytest
import pytest_asyncio

from mapl_swarm.errors import MaplError
from mapl_swarm.net.counters import Traffic, zmtp_wire_bytes
from mapl_swarm.net.emulator import LinkConfig
from mapl_swarm.net.errors import LinkClosedError, NetError, NetTimeoutError
from mapl_swarm.net.heartbeat import HeartbeatConfig, attach_heartbeat
from mapl_swarm.net.transport import Transport, TransportConfig, run, tcp_endpoint

LOOPBACK = TransportConfig(bind_host="127.0.0.1")


def kind_of(frames: Sequence) -> str:
    """Test classifier: the first frame is the kind label."""
    return bytes(frames[0]).decode()


@pytest_asyncio.fixture
async def pair() -> AsyncIterator[tuple[Transport, Transport]]:
    a = Transport("a", LOOPBACK, rx_kind=kind_of)
    b = Transport("b", LOOPBACK, rx_kind=kind_of)
    a.start()
    b.start()
    try:
        yield a, b
    finally:
        await a.aclose()
        await b.aclose()


@pytest.mark.asyncio
async def test_exchange_multipart_both_ways(pair: tuple[Transport, Transport]) -> None:
    a, b = pair
    a.connect("b", b.endpoint)
    b.connect("a", a.endpoint)
    msgs = [[b"ACT", b"", bytes(range(256)) * 3], [b"control", b"\x00" * 7], [b"GRAD", os.urandom(70_000)]]
    for m in msgs:
        await a.send("b", m, kind=m[0].decode())
    for m in msgs:
        peer, frames = await b.recv(timeout_s=5)
        assert peer == a.routing_id and Transport.name_of(peer) == "a"
        assert [bytes(f) for f in frames] == m
    await b.send("a", [b"REPORT", b"loss=3.1"], kind="REPORT")
    assert await a.recv(timeout_s=5) == (b.routing_id, [b"REPORT", b"loss=3.1"])


@pytest.mark.asyncio
async def test_large_frames_zero_copy(pair: tuple[Transport, Transport]) -> None:
    a, b = pair
    a.connect("b", b.endpoint)
    big = bytearray(os.urandom(16 * 1024 * 1024))
    await a.send("b", [b"ACT", memoryview(big)[: 8 * 1024 * 1024], memoryview(big)[8 * 1024 * 1024:]])
    await a.flush(timeout_s=5)
    _, frames = await b.recv(timeout_s=10)
    assert isinstance(frames[1], memoryview) and isinstance(frames[0], bytes)
    assert frames[1].nbytes + frames[2].nbytes == len(big)
    assert bytes(frames[1]) + bytes(frames[2]) == big


@pytest.mark.asyncio
async def test_shaped_link_throughput_over_zmq(pair: tuple[Transport, Transport]) -> None:
    a, b = pair
    link = LinkConfig(bandwidth_mbps=16.0, latency_ms=20.0)  # 2e6 B/s: 36 x 32 KiB ~ 0.6 s
    a.connect("b", b.endpoint, link)
    n, payload = 36, bytes(32 * 1024)

    async def sender() -> None:
        for _ in range(n):
            await a.send("b", [b"ACT", payload], kind="ACT")

    send_task = asyncio.create_task(sender())
    times = []
    for _ in range(n):
        await b.recv(timeout_s=5)
        times.append(asyncio.get_running_loop().time())
    await send_task
    warmup = 4  # the 64 KiB burst lets the first messages out back to back
    throughput = zmtp_wire_bytes([b"ACT", payload]) * (n - 1 - warmup) / (times[-1] - times[warmup])
    assert throughput == pytest.approx(link.rate_bytes_per_s, rel=0.05)


@pytest.mark.asyncio
async def test_counters_by_kind_exact(pair: tuple[Transport, Transport]) -> None:
    a, b = pair
    a.connect("b", b.endpoint)
    sent = {"ACT": [[b"ACT", bytes(1000)]] * 3, "GRAD": [[b"GRAD", bytes(200), bytes(300)]] * 2,
            "control": [[b"control"]]}
    for kind, messages in sent.items():
        for m in messages:
            await a.send("b", m, kind=kind)
    for _ in range(6):
        await b.recv(timeout_s=5)
    for kind, messages in sent.items():
        expected = Traffic(len(messages), sum(len(f) for m in messages for f in m),
                           sum(len(f) + (2 if len(f) <= 255 else 9) for m in messages for f in m))
        assert a.counters.get("b", "tx", kind) == expected
        assert b.counters.get("a", "rx", kind) == expected
    assert a.counters.get("b", "tx", "ACT") == Traffic(3, 3 * 1003, 3 * (5 + 1009))
    assert a.counters.total(direction="tx").messages == 6
    assert a.counters.total(direction="rx") == Traffic()
    assert {r["kind"] for r in b.counters.rows()} == {"ACT", "GRAD", "control"}


@pytest.mark.asyncio
async def test_recv_timeout_and_bad_links(pair: tuple[Transport, Transport]) -> None:
    a, _ = pair
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    with pytest.raises(NetTimeoutError, match=r"a: no message received .* within 0.2 s") as info:
        await a.recv(timeout_s=0.2)
    assert 0.19 <= loop.time() - t0 < 1.0
    assert isinstance(info.value, TimeoutError) and isinstance(info.value, MaplError)
    with pytest.raises(NetError, match="no outbound link 'nowhere'"):
        await a.send("nowhere", [b"x"])
    await a.aclose()
    with pytest.raises(LinkClosedError):
        await a.recv(timeout_s=0.1)


@pytest.mark.asyncio
async def test_send_to_dead_peer_times_out() -> None:
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    config = TransportConfig(bind_host="127.0.0.1", send_hwm=2)
    async with Transport("lonely", config) as t:
        t.connect("ghost", tcp_endpoint("127.0.0.1", port), LinkConfig(queue_bytes=100_000))
        with pytest.raises(NetTimeoutError, match="link 'ghost' not accepted within 0.3 s"):
            for _ in range(100):
                await t.send("ghost", [bytes(50_000)], kind="ACT", timeout_s=0.3)
        assert 2 <= t.counters.get("ghost", "tx", "ACT").messages < 20


@pytest.mark.asyncio
async def test_advertised_address_differs_from_bind_address() -> None:
    async with Transport("wild", TransportConfig(advertise_host="127.0.0.1")) as t, \
            Transport("client", LOOPBACK) as c:
        assert t.port > 0
        assert t.bound_endpoint == f"tcp://0.0.0.0:{t.port}"
        assert t.endpoint == f"tcp://127.0.0.1:{t.port}"
        c.connect("wild", t.endpoint)
        await c.send("wild", [b"hello"])
        assert await t.recv(timeout_s=5) == (c.routing_id, [b"hello"])
    assert tcp_endpoint("::1", 5) == "tcp://[::1]:5"


@pytest.mark.asyncio
async def test_sender_may_start_before_receiver() -> None:
    with socket.socket() as s:  # find a free port, then let the receiver bind it later
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # ZeroMQ retries the connection every reconnect interval (0.1 s without ZeroMQ heartbeats; with
    # them 5x the heartbeat: a peer dials a neighbour only once it announced its bound endpoint)
    async with Transport("early", replace(LOOPBACK, zmq_heartbeat_s=0)) as early:
        early.connect("late", tcp_endpoint("127.0.0.1", port))
        await early.send("late", [b"queued", b"before bind"])
        async with Transport("late", TransportConfig(bind_host="127.0.0.1", bind_port=port)) as late:
            assert await late.recv(timeout_s=5) == (early.routing_id, [b"queued", b"before bind"])


@pytest.mark.asyncio
async def test_heartbeat_detects_silent_peer(pair: tuple[Transport, Transport]) -> None:
    a, b = pair
    a.connect("b", b.endpoint)
    b.connect("a", a.endpoint)
    cfg = HeartbeatConfig(interval_s=0.05, timeout_s=0.3)
    monitor_a = attach_heartbeat(a, cfg, lambda peer: [b"HEARTBEAT", peer.encode()])
    monitor_b = attach_heartbeat(b, cfg, lambda peer: [b"HEARTBEAT", peer.encode()])
    heard = asyncio.Event()

    async def serve(t: Transport) -> None:
        while True:
            try:
                await t.recv(timeout_s=0.1)
            except NetTimeoutError:
                continue
            if t is a and t.counters.get("b", "rx", "HEARTBEAT").messages >= 5:
                heard.set()

    servers = [asyncio.create_task(serve(a)), asyncio.create_task(serve(b))]
    await asyncio.wait_for(heard.wait(), 5)
    assert monitor_a.silent() == set() and monitor_b.silent() == set()
    assert a.counters.get("b", "tx", "HEARTBEAT").messages >= 1
    servers[1].cancel()
    await monitor_b.aclose()  # b stops sending: a must notice within timeout_s (+ one tick)
    t0 = asyncio.get_running_loop().time()
    assert await monitor_a.wait_silent(timeout_s=2) == "b"
    assert asyncio.get_running_loop().time() - t0 < cfg.timeout_s + 0.2
    await monitor_a.aclose()
    servers[0].cancel()
    await asyncio.gather(*servers, return_exceptions=True)


def test_exchange_on_uvloop() -> None:
    pytest.importorskip("uvloop")

    async def main() -> list[bytes]:
        async with Transport("x", LOOPBACK) as x, Transport("y", LOOPBACK) as y:
            x.connect("y", y.endpoint, LinkConfig(latency_ms=5))
            await x.send("y", [b"ACT", b"payload"], kind="ACT")
            _, frames = await y.recv(timeout_s=5)
            return [bytes(f) for f in frames]

    assert run(main()) == [b"ACT", b"payload"]


@pytest.mark.asyncio
async def test_a_links_connection_made_and_ended_is_told_to_the_connection_listeners() -> None:
    """The link's DEALER connects (up), then the neighbour's sockets close (its process ended): the
    listeners get the link's name with False; a removed listener hears nothing more."""
    a, b = Transport("a", LOOPBACK), Transport("b", LOOPBACK)
    a.start()
    b.start()
    events: asyncio.Queue[tuple[str, bool]] = asyncio.Queue()
    remove = a.add_connection_listener(lambda link, up: events.put_nowait((link, up)))
    try:
        a.connect("b", b.endpoint)
        assert await asyncio.wait_for(events.get(), 5) == ("b", True)
        await a.send("b", [b"ACT", b"x"], kind="ACT")
        await b.recv(timeout_s=5)
        assert events.empty()
        await b.aclose()
        assert await asyncio.wait_for(events.get(), 5) == ("b", False)
        remove()
        assert a._connection_listeners == []
    finally:
        await a.aclose()
        await b.aclose()
