"""Heartbeats and silent-peer detection, agnostic of the wire format.

A :class:`HeartbeatMonitor` calls an async ``send(peer)`` callback for every watched peer every
``interval_s`` (the caller builds the HEARTBEAT message and sends it), and declares a peer
*silent* when nothing was heard from it for ``timeout_s``: it then calls ``on_silent(peer,
silence_s)`` once and wakes :meth:`HeartbeatMonitor.wait_silent`. Hearing from the peer again
(any message, via :meth:`HeartbeatMonitor.heard`) clears the state. Watching a peer starts its
silence clock, so a neighbour that never comes up is also reported after ``timeout_s``.

:func:`attach_heartbeat` wires a monitor to a :class:`~mapl_swarm.net.transport.Transport`:
heartbeats go out on the transport's links and every received message counts as heard from its
sender's transport *name* (the routing id without its per-instance suffix,
:meth:`Transport.name_of <mapl_swarm.net.transport.Transport.name_of>`), so a neighbour that
restarts with a new routing id is still the same watched peer.
"""

from __future__ import annotations

import asyncio
import logging
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Awaitable, Callable, Iterable, Sequence

from mapl_swarm.errors import ConfigError
from mapl_swarm.net.counters import Frame
from mapl_swarm.net.errors import NetError, NetTimeoutError

if TYPE_CHECKING:
    from mapl_swarm.net.transport import Transport

__all__ = ["HeartbeatConfig", "HeartbeatMonitor", "attach_heartbeat"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class HeartbeatConfig:
    """How often to send heartbeats and when to give up on a silent neighbour."""

    interval_s: float = 5.0
    """Seconds between two heartbeats sent to the same peer."""
    timeout_s: float = 30.0
    """A peer heard nothing from for this long is declared silent; must exceed ``interval_s``."""

    def __post_init__(self) -> None:
        if not (math.isfinite(self.interval_s) and self.interval_s > 0):
            raise ConfigError(f"heartbeat.interval_s must be > 0, got {self.interval_s}")
        if not (math.isfinite(self.timeout_s) and self.timeout_s > self.interval_s):
            raise ConfigError(f"heartbeat.timeout_s ({self.timeout_s}) must be finite and greater "
                              f"than interval_s ({self.interval_s})")


class HeartbeatMonitor:
    """Sends heartbeats to watched peers and detects silent ones (see module docstring)."""

    def __init__(self, config: HeartbeatConfig, *, send: Callable[[str], Awaitable[None]],
                 on_silent: Callable[[str, float], None] | None = None) -> None:
        self.config = config
        self._send = send
        self._on_silent = on_silent
        self._loop = asyncio.get_running_loop()
        self._heard: dict[str, float] = {}
        self._sent: dict[str, float] = {}
        self._silent: set[str] = set()
        self._silent_event = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    def watch(self, peer: str) -> None:
        """Start sending heartbeats to ``peer`` and start its silence clock."""
        now = self._loop.time()
        self._heard.setdefault(peer, now)
        self._sent.setdefault(peer, -math.inf)

    def heard(self, peer: str) -> None:
        """Record that something arrived from ``peer`` (unwatched peers are ignored)."""
        if peer in self._heard:
            self._heard[peer] = self._loop.time()
            self._silent.discard(peer)

    def silent(self) -> set[str]:
        """Peers currently declared silent."""
        return set(self._silent)

    def start(self) -> "HeartbeatMonitor":
        """Start the background task (idempotent); returns self."""
        if self._task is None:
            self._task = self._loop.create_task(self._run(), name="heartbeat")
        return self

    async def aclose(self) -> None:
        """Stop the background task."""
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None

    async def wait_silent(self, timeout_s: float) -> str:
        """Wait until some watched peer is silent and return its name."""
        try:
            await asyncio.wait_for(self._silent_event.wait(), timeout_s)
        except asyncio.TimeoutError:
            raise NetTimeoutError(f"no peer went silent within {timeout_s:g} s") from None
        self._silent_event.clear()
        return sorted(self._silent)[0] if self._silent else ""

    async def _run(self) -> None:
        tick = min(self.config.interval_s, self.config.timeout_s / 4)
        while True:
            now = self._loop.time()
            for peer in list(self._heard):
                if now - self._sent.get(peer, -math.inf) >= self.config.interval_s:
                    self._sent[peer] = now
                    try:
                        await asyncio.wait_for(self._send(peer), self.config.interval_s)
                    except (NetError, asyncio.TimeoutError) as exc:
                        logger.warning("heartbeat to %r failed: %s", peer, exc or "timeout")
                silence = self._loop.time() - self._heard.get(peer, math.inf)
                if silence >= self.config.timeout_s and peer in self._heard and peer not in self._silent:
                    self._silent.add(peer)
                    logger.warning("peer %r silent for %.1f s", peer, silence)
                    if self._on_silent is not None:
                        self._on_silent(peer, silence)
                    self._silent_event.set()
            await asyncio.sleep(tick)


def attach_heartbeat(transport: "Transport", config: HeartbeatConfig,
                     make_heartbeat: Callable[[str], Sequence[Frame]], *,
                     peers: Iterable[str] | None = None, kind: str = "HEARTBEAT",
                     on_silent: Callable[[str, float], None] | None = None) -> HeartbeatMonitor:
    """Start a monitor that sends ``make_heartbeat(peer)`` on each link (counted under ``kind``)
    and treats every message received from a peer as a sign of life.

    ``peers`` defaults to the transport's outbound links; name links after the neighbours'
    transport names so received messages (whose routing ids are ``<name>.<hex>``) match them."""

    async def send(peer: str) -> None:
        await transport.send(peer, make_heartbeat(peer), kind=kind, timeout_s=config.interval_s)

    monitor = HeartbeatMonitor(config, send=send, on_silent=on_silent)
    for peer in (transport.links() if peers is None else peers):
        monitor.watch(peer)
    name_of = type(transport).name_of
    transport.add_receive_listener(lambda routing_id: monitor.heard(name_of(routing_id)))
    return monitor.start()
