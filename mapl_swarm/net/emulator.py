"""Application-level link emulator: token-bucket bandwidth plus a one-way latency delay line.

One :class:`LinkShaper` shapes one direction of one link (the sender shapes what it sends).
It models a link as a fluid token bucket followed by a pipe of fixed propagation delay:

- The bucket holds up to ``burst_bytes`` tokens and refills at ``bandwidth_mbps``. A message of
  ``n`` bytes starts transmitting once the previous message has left (FIFO); it uses the tokens
  available and then drains at the link rate, so its **departure** time (last byte leaves) is
  ``start + max(0, n - tokens) / rate``. Departure times are computed from the previous
  departure, not from when the event loop happened to wake up, so timer jitter never accumulates
  and a long stream runs at exactly the configured rate.
- The message is **delivered** (the downstream callable is awaited) at ``departure + latency``.
  Transmission of the next message starts right away, so any number of messages can be in
  flight and latency never caps throughput (a bandwidth-delay product's worth is in the pipe).

Message size is the ZMTP wire-size estimate of :func:`mapl_swarm.net.counters.zmtp_wire_bytes`
(payload + 2 or 9 bytes of framing per frame). ``send`` first waits for room in the emulated
socket send buffer — until at most ``queue_bytes`` accepted bytes are still untransmitted, and
at most ``queue_bytes`` are stuck because the downstream stopped accepting (a dead peer) — then
queues the message and returns. That is the backpressure a real socket gives; a caller that
times ``send`` out knows its message was not queued.

The shaper keeps references to the frames until delivery: do not mutate them after ``send``.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import math
from dataclasses import dataclass
from typing import Awaitable, Callable, Sequence

from mapl_swarm.aio import within
from mapl_swarm.errors import ConfigError
from mapl_swarm.net.counters import Frame, zmtp_wire_bytes
from mapl_swarm.net.errors import LinkClosedError, NetError, NetTimeoutError

__all__ = ["LinkConfig", "ShaperStats", "LinkShaper", "Deliver"]

logger = logging.getLogger(__name__)

Deliver = Callable[[list[Frame]], Awaitable[None]]
"""Downstream of a shaper: awaited once per message, in order, at its delivery time."""


@dataclass(frozen=True, kw_only=True)
class LinkConfig:
    """Emulated properties of one direction of a link."""

    bandwidth_mbps: float = 0.0
    """Token refill rate in Mbit/s (10**6 bits per second); 0 means unlimited."""
    latency_ms: float = 0.0
    """One-way propagation delay added to every message after it leaves the bucket."""
    burst_bytes: int = 64 * 1024
    """Token bucket depth: bytes that may leave back-to-back after the link was idle."""
    queue_bytes: int = 64 * 1024 * 1024
    """Send buffer: ``send`` waits while more than this many accepted bytes are not yet
    transmitted (or are due but refused downstream). 0: each ``send`` waits until the previous
    message's last byte has left."""

    def __post_init__(self) -> None:
        for name in ("bandwidth_mbps", "latency_ms"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
                raise ConfigError(f"link.{name} must be a finite number >= 0, got {value!r}")
        if not (isinstance(self.burst_bytes, int) and self.burst_bytes > 0):
            raise ConfigError(f"link.burst_bytes must be a positive integer, got {self.burst_bytes!r}")
        if not (isinstance(self.queue_bytes, int) and self.queue_bytes >= 0):
            raise ConfigError(f"link.queue_bytes must be an integer >= 0, got {self.queue_bytes!r}")

    def describe(self) -> str:
        """The shaping in words with units, for logs (``unshaped`` when there is none)."""
        if not self.bandwidth_mbps and not self.latency_ms:
            return "unshaped"
        rate = f"{self.bandwidth_mbps:g} Mbit/s" if self.bandwidth_mbps else "unlimited bandwidth"
        return (f"{rate}, {self.latency_ms:g} ms one-way, burst {self.burst_bytes / 1024:g} KiB, "
                f"queue {self.queue_bytes / (1 << 20):g} MiB")

    @property
    def rate_bytes_per_s(self) -> float:
        """Bandwidth in bytes per second (``inf`` when unlimited)."""
        return self.bandwidth_mbps * 1e6 / 8 if self.bandwidth_mbps > 0 else math.inf

    @property
    def latency_s(self) -> float:
        """One-way latency in seconds."""
        return self.latency_ms / 1e3


@dataclass(frozen=True)
class ShaperStats:
    """Snapshot of a shaper's counters (times are event-loop seconds)."""

    messages_sent: int
    """Messages accepted by ``send``."""
    bytes_sent: int
    """Shaped (wire) bytes accepted by ``send``."""
    messages_delivered: int
    """Messages handed to the downstream callable."""
    busy_s: float
    """Total time the bucket spent transmitting (draining at the link rate); utilisation over
    an interval is the increase of ``busy_s`` divided by the interval's length."""
    backlog_bytes: float
    """Accepted bytes not yet transmitted at snapshot time."""
    in_flight: int
    """Messages accepted but not yet delivered."""


class LinkShaper:
    """Shapes one direction of a link and feeds ``deliver`` in FIFO order (see module docstring).

    Create it inside the event loop that will run it; :meth:`aclose` stops its delivery task.
    If ``deliver`` raises, the link fails: the error is logged and re-raised (as
    :class:`NetError`) by the next :meth:`send` or :meth:`flush`.
    """

    def __init__(self, config: LinkConfig, deliver: Deliver, *, name: str = "link") -> None:
        self.config = config
        self.name = name
        self._deliver = deliver
        self._loop = asyncio.get_running_loop()
        self._rate = config.rate_bytes_per_s
        self._t_free = -math.inf  # departure time of the last accepted message
        self._tokens = float(config.burst_bytes)  # bucket level at _t_free
        self._line: collections.deque[tuple[float, int, list[Frame]]] = collections.deque()
        self._wakeup = asyncio.Event()
        self._progress = asyncio.Event()  # set after every delivery, failure or close
        self._delivering = 0  # bytes of the message being handed downstream
        self._drained = asyncio.Event()
        self._drained.set()
        self._error: BaseException | None = None
        self._closed = False
        self._sent = 0
        self._bytes = 0
        self._delivered = 0
        self._busy_s = 0.0
        self._task = self._loop.create_task(self._run(), name=f"shaper:{name}")

    async def send(self, frames: Sequence[Frame]) -> None:
        """Queue one multipart message, after waiting for room in the send buffer if it is full.
        If cancelled (e.g. by a timeout) while waiting, the message is not queued."""
        frames = list(frames)
        n = zmtp_wire_bytes(frames)
        await self._wait_for_room()
        now = self._loop.time()
        if math.isinf(self._rate):
            departure = now
        else:
            start = max(now, self._t_free)
            tokens = self._tokens if start == self._t_free else min(
                float(self.config.burst_bytes), self._tokens + (start - self._t_free) * self._rate)
            if tokens >= n:
                departure, tokens = start, tokens - n
            else:
                departure, tokens = start + (n - tokens) / self._rate, 0.0
            self._busy_s += departure - start
            self._t_free, self._tokens = departure, tokens
        self._line.append((departure + self.config.latency_s, n, frames))
        self._sent += 1
        self._bytes += n
        self._drained.clear()
        self._wakeup.set()

    async def _wait_for_room(self) -> None:
        limit = self.config.queue_bytes
        while True:
            self._check()
            now = self._loop.time()
            if not math.isinf(self._rate) and (self._t_free - now) * self._rate > limit:
                await asyncio.sleep(self._t_free - limit / self._rate - now)
            elif self._stuck_bytes(now) > limit:
                self._progress.clear()
                await self._progress.wait()
            else:
                return

    def _stuck_bytes(self, now: float) -> int:
        """Bytes due for delivery but not yet accepted downstream (normally ~0)."""
        stuck = self._delivering
        for due, n, _ in self._line:
            if due > now:
                break
            stuck += n
        return stuck

    async def flush(self, timeout_s: float) -> None:
        """Wait until every accepted message has been delivered downstream."""
        try:
            await within(self._drained.wait(), timeout_s)
        except asyncio.TimeoutError:
            raise NetTimeoutError(
                f"link {self.name!r}: {len(self._line)} message(s) still undelivered after "
                f"{timeout_s:g} s") from None
        self._check()

    def stats(self) -> ShaperStats:
        """Current counters."""
        now = self._loop.time()
        backlog = 0.0 if math.isinf(self._rate) else max(0.0, self._t_free - now) * self._rate
        return ShaperStats(self._sent, self._bytes, self._delivered, self._busy_s, backlog,
                           self._sent - self._delivered)

    @property
    def closed(self) -> bool:
        """True after :meth:`aclose` or a delivery failure."""
        return self._closed or self._error is not None

    async def aclose(self) -> None:
        """Stop delivering; messages still in the delay line are dropped (flush first to keep them)."""
        self._closed = True
        if self._line:
            logger.debug("link %r closed with %d undelivered message(s)", self.name, len(self._line))
        self._line.clear()
        self._task.cancel()
        try:
            await self._task
        except (asyncio.CancelledError, Exception):  # noqa: BLE001 - error already recorded
            pass
        self._drained.set()
        self._progress.set()

    def _check(self) -> None:
        if self._error is not None:
            raise NetError(f"link {self.name!r} failed: {self._error!r}") from self._error
        if self._closed:
            raise LinkClosedError(f"link {self.name!r} is closed")

    async def _run(self) -> None:
        """Delivery task: pop messages in order as their delivery time comes."""
        loop = self._loop
        try:
            while True:
                if not self._line:
                    self._drained.set()
                    self._wakeup.clear()
                    await self._wakeup.wait()
                    continue
                due, n, frames = self._line[0]
                delay = due - loop.time()
                if delay > 0:
                    await asyncio.sleep(delay)
                    continue
                self._line.popleft()
                self._delivering = n
                await self._deliver(frames)
                self._delivering = 0
                self._delivered += 1
                self._progress.set()
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - recorded and re-raised to the sender
            logger.error("link %r: delivery failed: %r", self.name, exc)
            self._error = exc
            self._line.clear()
            self._drained.set()
            self._progress.set()
