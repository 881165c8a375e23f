"""Link emulator: bandwidth accuracy, one-way latency, latency not capping throughput, backpressure."""

from __future__ import annotations

import asyncio

import pytest

from mapl_swarm.errors import ConfigError, MaplError
from mapl_swarm.net.counters import zmtp_wire_bytes
from mapl_swarm.net.emulator import LinkConfig, LinkShaper
from mapl_swarm.net.errors import LinkClosedError, NetError
from mapl_swarm.net.transport import run

MSG = 32 * 1024  # payload bytes per stream message
WARMUP = 4  # stream messages excluded from throughput measurement


class Sink:
    """Downstream that records (delivery time, frames)."""

    def __init__(self) -> None:
        self.got: list[tuple[float, list]] = []
        self.loop = asyncio.get_running_loop()

    async def __call__(self, frames: list) -> None:
        self.got.append((self.loop.time(), frames))


async def stream(config: LinkConfig, n_messages: int) -> tuple[float, float, Sink, LinkShaper]:
    """Send a back-to-back stream; returns (steady-state throughput in B/s, first send to last
    delivery in seconds, sink, shaper). Throughput is measured between the deliveries of message
    ``WARMUP`` and the last one, so the initial burst (64 KiB = 2 messages) does not count."""
    sink = Sink()
    shaper = LinkShaper(config, sink, name="test")
    payload = bytes(MSG)
    t0 = sink.loop.time()
    for _ in range(n_messages):
        await shaper.send([payload])
    await shaper.flush(timeout_s=30)
    times = [t for t, _ in sink.got]
    size = zmtp_wire_bytes([payload])
    throughput = size * (n_messages - 1 - WARMUP) / (times[-1] - times[WARMUP])
    await shaper.aclose()
    return throughput, times[-1] - t0, sink, shaper


@pytest.mark.asyncio
async def test_stream_throughput_matches_bandwidth() -> None:
    config = LinkConfig(bandwidth_mbps=8.0)  # 1e6 B/s: 32 x 32 KiB ~ 1.05 s
    throughput, _, sink, shaper = await stream(config, 32)
    assert len(sink.got) == 32
    assert throughput == pytest.approx(config.rate_bytes_per_s, rel=0.05)
    stats = shaper.stats()
    assert stats.messages_sent == stats.messages_delivered == 32
    assert stats.bytes_sent == 32 * zmtp_wire_bytes([bytes(MSG)])
    # The first 64 KiB ride the burst; the rest drain at the link rate.
    expected_busy = (stats.bytes_sent - config.burst_bytes) / config.rate_bytes_per_s
    assert stats.busy_s == pytest.approx(expected_busy, rel=0.01)


@pytest.mark.asyncio
@pytest.mark.parametrize("bandwidth_mbps", [0.0, 8.0])
async def test_unqueued_message_arrives_after_latency(bandwidth_mbps: float) -> None:
    config = LinkConfig(bandwidth_mbps=bandwidth_mbps, latency_ms=50.0)
    sink = Sink()
    shaper = LinkShaper(config, sink)
    t0 = sink.loop.time()
    await shaper.send([b"header", bytes(1000)])  # below the burst: no queueing delay
    await shaper.flush(timeout_s=5)
    delay = sink.got[0][0] - t0
    assert delay == pytest.approx(0.050, abs=max(0.005, 0.1 * 0.050))
    await shaper.aclose()


@pytest.mark.asyncio
async def test_latency_does_not_cap_throughput() -> None:
    base = LinkConfig(bandwidth_mbps=16.0)  # 2e6 B/s: 40 x 32 KiB ~ 0.65 s
    slow = LinkConfig(bandwidth_mbps=16.0, latency_ms=100.0)
    tp_base, total_base, _, _ = await stream(base, 40)
    tp_slow, total_slow, _, _ = await stream(slow, 40)
    assert tp_slow == pytest.approx(tp_base, rel=0.05)
    # Latency adds once, not once per message (which would add 4 s).
    assert total_slow - total_base == pytest.approx(0.100, abs=0.03)


@pytest.mark.asyncio
async def test_many_messages_in_flight_with_pure_latency() -> None:
    sink = Sink()
    shaper = LinkShaper(LinkConfig(latency_ms=80.0), sink)
    t0 = sink.loop.time()
    for i in range(50):
        await shaper.send([i.to_bytes(2, "little")])
    assert shaper.stats().in_flight == 50
    await shaper.flush(timeout_s=5)
    assert [int.from_bytes(f[0], "little") for _, f in sink.got] == list(range(50))  # FIFO
    assert max(t for t, _ in sink.got) - t0 < 0.080 + 0.03
    assert min(t for t, _ in sink.got) - t0 >= 0.080 - 0.002
    await shaper.aclose()


@pytest.mark.asyncio
async def test_zero_queue_send_waits_for_previous_transmission() -> None:
    config = LinkConfig(bandwidth_mbps=8.0, burst_bytes=1024, queue_bytes=0)
    sink = Sink()
    shaper = LinkShaper(config, sink)
    payload = bytes(100_000)
    t0 = sink.loop.time()
    await shaper.send([payload])  # the link is idle: queued at once
    assert sink.loop.time() - t0 < 0.01
    await shaper.send([payload])  # waits for the first message's last byte to leave
    expected = (zmtp_wire_bytes([payload]) - 1024) / config.rate_bytes_per_s  # ~0.1 s
    assert sink.loop.time() - t0 == pytest.approx(expected, abs=0.01)
    await shaper.flush(timeout_s=5)
    await shaper.aclose()


@pytest.mark.asyncio
async def test_stalled_downstream_blocks_send_without_queueing() -> None:
    release = asyncio.Event()
    sink = Sink()

    async def stalled(frames: list) -> None:
        await release.wait()  # a peer that stopped reading
        await sink(frames)

    shaper = LinkShaper(LinkConfig(queue_bytes=10_000), stalled)
    for _ in range(3):  # 3 x 4 KiB due but refused downstream: 12 KiB stuck > 10 KB
        await shaper.send([bytes(4096)])
    with pytest.raises(asyncio.TimeoutError):
        await asyncio.wait_for(shaper.send([b"not queued"]), 0.1)
    assert shaper.stats().messages_sent == 3
    release.set()
    await shaper.flush(timeout_s=5)
    assert len(sink.got) == 3
    await shaper.send([b"room again"])
    await shaper.flush(timeout_s=5)
    assert bytes(sink.got[-1][1][0]) == b"room again"
    await shaper.aclose()


@pytest.mark.asyncio
async def test_delivery_failure_and_close_are_reported() -> None:
    async def broken(frames: list) -> None:
        raise RuntimeError("socket gone")

    shaper = LinkShaper(LinkConfig(), broken, name="bad")
    await shaper.send([b"x"])
    with pytest.raises(NetError, match="bad.*socket gone"):
        await shaper.flush(timeout_s=5)
    assert shaper.closed
    await shaper.aclose()

    ok = LinkShaper(LinkConfig(), Sink())
    await ok.aclose()
    with pytest.raises(LinkClosedError):
        await ok.send([b"x"])


def test_uvloop_stream_throughput() -> None:
    uvloop = pytest.importorskip("uvloop")

    async def main() -> tuple[float, bool]:
        tp, _, _, _ = await stream(LinkConfig(bandwidth_mbps=40.0, latency_ms=20.0), 64)
        return tp, isinstance(asyncio.get_running_loop(), uvloop.Loop)

    throughput, on_uvloop = run(main())
    assert on_uvloop
    assert throughput == pytest.approx(5e6, rel=0.05)


@pytest.mark.parametrize("kwargs", [
    dict(bandwidth_mbps=-1.0), dict(latency_ms=float("nan")), dict(burst_bytes=0),
    dict(queue_bytes=-1), dict(bandwidth_mbps=float("inf")),
])
def test_link_config_validation(kwargs: dict) -> None:
    with pytest.raises(ConfigError):
        LinkConfig(**kwargs)
    assert issubclass(ConfigError, MaplError)
