"""Heartbeats, round-trip times and silent-peer detection, agnostic of the wire format.

A :class:`HeartbeatMonitor` calls an async ``send(peer)`` callback for every watched peer every
``interval_s`` and declares a peer *silent* when nothing was heard from it for longer than that
peer's **deadline**: it then calls ``on_silent(Silence)`` once and wakes
:meth:`HeartbeatMonitor.wait_silent`. Hearing from the peer again (any message, via
:meth:`HeartbeatMonitor.heard`) clears the state. Watching a peer starts its silence clock, so a
neighbour that never comes up is also reported.

**Nothing blocks it.** The monitor runs on the event loop, which never computes (a peer's compute
runs on a worker thread), so a neighbour in a 30 s step still heartbeats. Each heartbeat is sent
by a task of its own: a send that waits (a full send buffer, a neighbour that stopped reading)
delays neither the silence checks nor the heartbeats to other peers, and at most one heartbeat per
peer is pending at a time. A heartbeat keeps its place in its link's order (a session's sequence
numbers are strict, SPEC §9.3), so on a busy link it waits behind the messages sent before it —
which then arrive, and count as signs of life, meanwhile. A monitor whose own loop did not run for
a while (the process was stopped, or the loop blocked) moves every silence clock on by that gap:
what it did not hear while it was not listening is not the neighbours' silence.

**Deadlines from round trips** (SPEC §9.5). Heartbeats carry timestamps (:meth:`heartbeat_meta`):
``sent_ns``, this side's monotonic clock; ``echo_ns``, the ``sent_ns`` of the newest heartbeat
heard from that peer; ``held_ns``, how long ago that was. The first heartbeat heard from a peer is
answered at once, so both sides have a sample right after the handshake. The peer receiving an echo
of its own ``sent_ns`` has one round-trip sample, ``now - echo_ns - held_ns``, measured on its own clock only
(the other side contributes a duration): it includes the time both heartbeats queued behind other
messages, so a busy or slow link gets a longer deadline by itself. :class:`RttEstimator` smooths the
samples as TCP does (RFC 6298: ``srtt``, ``rttvar``, estimate ``srtt + 4 rttvar``).

**Deadlines from gaps.** A round trip overstates how long a live neighbour can go unheard on a busy
link: a heartbeat queued behind this side's bulk payloads says nothing of the other direction, and
one queued behind the neighbour's payloads waits while those payloads arrive, each a sign of life.
What a live neighbour shows is the time between two messages heard from it: :class:`GapTracker`
keeps the longest such gap of the last ``gap_window_s``. Once a neighbour has been watched that
long, the deadline is the shorter of the two rules, so a link whose messages keep arriving keeps a
short deadline however long its heartbeats queue. :func:`liveness_deadline`::

    deadline = clamp(min(rtt_factor x estimate + 2 x interval_s, rtt_factor x longest gap), floor_s, timeout_s)

Before the first round trip (or from a peer that does not echo) the round-trip rule gives
``timeout_s``, the ceiling, and before a full window the gap rule gives nothing. The floor keeps a
fast link from declaring a neighbour dead over a short stall (a GC pause, a 3 s SIGSTOP); the
ceiling bounds how long a stopped neighbour is waited for.

**A connection that ends** (:meth:`HeartbeatMonitor.connection`, from the transport's connection
events): a neighbour whose process exits or is killed closes its TCP connections at once, while a
stopped one keeps them. A neighbour whose connection from this peer ended and did not come back
within two heartbeat intervals is lost, whatever still arrives from it meanwhile (a killed
process's kernel still sends what its sockets held). A live one would be lost anyway: ZeroMQ
reconnects only after several of its heartbeat intervals
(:class:`~mapl_swarm.net.transport.TransportConfig`), and until then this peer's messages, its
heartbeats included, do not reach it, so it finds this peer silent past its floor.

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
import time
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Awaitable, Callable, Iterable, Mapping, Sequence

from mapl_swarm.aio import within
from mapl_swarm.errors import ConfigError
from mapl_swarm.net.counters import Frame
from mapl_swarm.net.errors import NetError, NetTimeoutError
from mapl_swarm.when import iso_time

if TYPE_CHECKING:
    from mapl_swarm.net.transport import Transport

__all__ = ["GapTracker", "HeartbeatConfig", "HeartbeatMonitor", "RttEstimator", "Silence", "attach_heartbeat",
           "liveness_deadline", "rtt_sample_s", "RTT_FACTOR"]

logger = logging.getLogger(__name__)

RTT_FACTOR = 4.0
"""Default ``k`` of the deadline: a link may be this many round-trip estimates slower than measured."""

_STALL_S = 1.0
"""A check that runs this much later than planned means this process did not run (stopped or blocked)."""


@dataclass(frozen=True, kw_only=True)
class HeartbeatConfig:
    """How often to send heartbeats and when to give up on a silent neighbour."""

    interval_s: float = 5.0
    """Seconds between two heartbeats sent to the same peer."""
    timeout_s: float = 30.0
    """The ceiling: a peer heard nothing from for this long is silent whatever its round trip; also
    the deadline before a round trip is measured. Must exceed ``interval_s``."""
    floor_s: float | None = None
    """The shortest deadline a measured round trip can give; None: ``timeout_s`` (a fixed deadline,
    round trips are measured but not used). Above it, deadlines follow :func:`liveness_deadline`."""
    rtt_factor: float = RTT_FACTOR
    """``k``: the deadline allows this many round-trip estimates plus two heartbeat intervals, or this
    many times the longest gap between two messages heard."""
    gap_window_s: float = 60.0
    """How far back the longest gap is looked for; also how long a peer is watched before gaps count."""

    def __post_init__(self) -> None:
        if not (math.isfinite(self.interval_s) and self.interval_s > 0):
            raise ConfigError(f"heartbeat.interval_s must be > 0, got {self.interval_s}")
        if not (math.isfinite(self.timeout_s) and self.timeout_s > self.interval_s):
            raise ConfigError(f"heartbeat.timeout_s ({self.timeout_s}) must be finite and greater "
                              f"than interval_s ({self.interval_s})")
        if self.floor_s is not None and not (self.interval_s < self.floor_s <= self.timeout_s):
            raise ConfigError(f"heartbeat.floor_s ({self.floor_s}) must be above interval_s ({self.interval_s}) "
                              f"and at most timeout_s ({self.timeout_s})")
        if not (math.isfinite(self.rtt_factor) and self.rtt_factor >= 1):
            raise ConfigError(f"heartbeat.rtt_factor must be >= 1, got {self.rtt_factor}")
        if not (math.isfinite(self.gap_window_s) and self.gap_window_s > 2 * self.interval_s):
            raise ConfigError(f"heartbeat.gap_window_s ({self.gap_window_s}) must be finite and above two "
                              f"heartbeat intervals ({2 * self.interval_s})")

    @property
    def floor(self) -> float:
        return self.timeout_s if self.floor_s is None else self.floor_s


def liveness_deadline(estimate_s: float | None, config: HeartbeatConfig, longest_gap_s: float | None = None) -> float:
    """Seconds of silence after which a peer is declared silent, given its round-trip estimate
    (None: none measured yet) and the longest gap between two messages heard from it (None: not
    watched for a full window yet): ``clamp(min(k x estimate + 2 x interval, k x gap), floor, ceiling)``."""
    raw = config.timeout_s if estimate_s is None else config.rtt_factor * estimate_s + 2 * config.interval_s
    if longest_gap_s is not None:
        raw = min(raw, config.rtt_factor * longest_gap_s)
    return min(max(raw, config.floor), config.timeout_s)


def rtt_sample_s(now_ns: int, echo_ns: Any, held_ns: Any) -> float | None:
    """One round trip from an echoed heartbeat: ``now - echo_ns - held_ns`` in seconds, or None when
    the echo is not a plausible one (not integers, from the future)."""
    if type(echo_ns) is not int or type(held_ns) is not int or echo_ns < 0 or held_ns < 0:
        return None
    sample = now_ns - echo_ns - held_ns
    return sample / 1e9 if sample >= 0 else None


class RttEstimator:
    """Smoothed round-trip time and its variation (RFC 6298 with alpha 1/8, beta 1/4)."""

    ALPHA = 1 / 8
    BETA = 1 / 4

    def __init__(self) -> None:
        self.srtt: float | None = None
        """Smoothed round trip (s); None before the first sample."""
        self.rttvar = 0.0
        """Smoothed mean deviation (s)."""
        self.samples = 0
        self.last: float | None = None
        """The newest sample (s)."""

    def add(self, sample_s: float) -> None:
        if not (math.isfinite(sample_s) and sample_s >= 0):
            return
        self.samples += 1
        self.last = sample_s
        if self.srtt is None:
            self.srtt, self.rttvar = sample_s, sample_s / 2
            return
        self.rttvar = (1 - self.BETA) * self.rttvar + self.BETA * abs(self.srtt - sample_s)
        self.srtt = (1 - self.ALPHA) * self.srtt + self.ALPHA * sample_s

    @property
    def estimate(self) -> float | None:
        """``srtt + 4 rttvar`` (TCP's retransmission timeout without its 1 s minimum); None before a sample."""
        return None if self.srtt is None else self.srtt + 4 * self.rttvar


class GapTracker:
    """The longest time between two messages heard from a peer within the last ``window_s`` (a
    sliding maximum: the gaps kept fall in time and in length, so the first is the longest)."""

    def __init__(self, window_s: float, now: float) -> None:
        self.window_s = window_s
        self.since = now
        """When watching began: gaps count once a full window has passed."""
        self._last = now
        self._peaks: deque[tuple[float, float]] = deque()  # (when it ended, gap)

    def heard(self, now: float) -> None:
        gap, self._last = max(0.0, now - self._last), now
        while self._peaks and self._peaks[-1][1] <= gap:
            self._peaks.pop()
        self._peaks.append((now, gap))

    def skip(self, seconds: float, now: float) -> None:
        """This process did not run for ``seconds``: the gap running now does not include them."""
        self._last = min(now, self._last + seconds)

    def longest(self, now: float) -> float | None:
        """The longest gap that ended within the window; None before a full window was watched."""
        if now - self.since < self.window_s:
            return None
        while self._peaks and self._peaks[0][0] < now - self.window_s:
            self._peaks.popleft()
        return self._peaks[0][1] if self._peaks else 0.0


@dataclass(frozen=True)
class Silence:
    """A peer declared silent: what the monitor knew of it at that moment."""

    peer: str
    silence_s: float
    """Seconds since anything was heard from it."""
    last_seen: float
    """Wall-clock time (``time.time()``) it was last heard from (or watched, if never)."""
    deadline_s: float
    """Its deadline when declared."""
    rtt_s: float | None
    """Its smoothed round trip (None: never measured)."""
    gap_s: float | None = None
    """The longest gap between two of its messages in the window (None: not watched that long)."""
    cut_s: float | None = None
    """Seconds since its connection ended (None: connected); ``deadline_s`` then applies to it."""

    def describe(self) -> str:
        """``silent since 2026-12-05T12:03:04Z (10.4 s; deadline 10.0 s, round trip 0.4 ms, longest gap
        2.0 s)``, or ``... (1.2 s; connection ended 4.1 s ago, deadline 4.0 s, ...)``."""
        since = iso_time(self.last_seen)
        rtt = "no round trip measured" if self.rtt_s is None else f"round trip {self.rtt_s * 1e3:.1f} ms"
        gap = "" if self.gap_s is None else f", longest gap {self.gap_s:.1f} s"
        cut = "" if self.cut_s is None else f"connection ended {self.cut_s:.1f} s ago, "
        return f"silent since {since} ({self.silence_s:.1f} s; {cut}deadline {self.deadline_s:.1f} s, {rtt}{gap})"


class _Peer:
    """What the monitor tracks of one watched peer."""

    __slots__ = ("heard", "sent", "sending", "rtt", "gaps", "echo", "echoed", "answer", "silent", "cut_at")

    def __init__(self, now: float, gap_window_s: float) -> None:
        self.heard = now
        self.gaps = GapTracker(gap_window_s, now)
        self.sent = -math.inf
        self.sending: asyncio.Task[None] | None = None
        self.rtt = RttEstimator()
        self.echo: tuple[int, int] | None = None  # (its sent_ns, our monotonic_ns when heard)
        self.echoed = False  # a heartbeat with an echo went out
        self.answer = False  # one should, as soon as the heartbeat on its way is sent
        self.silent = False
        self.cut_at: float | None = None  # when the connection to it ended (None: connected)


class HeartbeatMonitor:
    """Sends heartbeats to watched peers, measures their round trips and detects silent ones (see
    the module docstring). ``clock`` (seconds) and ``clock_ns`` are monotonic clocks; tests may
    replace them and drive :meth:`check` themselves."""

    def __init__(self, config: HeartbeatConfig, *, send: Callable[[str], Awaitable[None]],
                 on_silent: Callable[[Silence], None] | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 clock_ns: Callable[[], int] = time.monotonic_ns) -> None:
        self.config = config
        self._send = send
        self._on_silent = on_silent
        self._clock = clock
        self._clock_ns = clock_ns
        self._peers: dict[str, _Peer] = {}
        self._early: dict[str, tuple[int, int]] = {}
        """Heartbeats heard from peers not watched yet (sent_ns, when): echoed once watched."""
        self._silent_event = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._last_check: float | None = None
        self.tick_s = min(config.interval_s, config.floor / 10, 1.0)
        """Seconds between two rounds of checks."""

    # ------------------------------------------------------------------ what the owner tells it
    def watch(self, peer: str) -> None:
        """Start sending heartbeats to ``peer`` (the first one now, when running) and start its
        silence clock."""
        if peer not in self._peers:
            state = self._peers[peer] = _Peer(self._clock(), self.config.gap_window_s)
            state.echo = self._early.pop(peer, None)  # its heartbeat came before it welcomed us
            state.answer = state.echo is not None
            if self._task is not None:
                self._start_heartbeat(peer, state)

    def forget(self, peer: str) -> None:
        """Stop watching ``peer`` (it left, or was declared silent and is no longer waited for)."""
        state = self._peers.pop(peer, None)
        if state is not None and state.sending is not None:
            state.sending.cancel()

    def heard(self, peer: str) -> None:
        """Record that something arrived from ``peer`` (unwatched peers are ignored)."""
        state = self._peers.get(peer)
        if state is not None:
            state.heard = self._clock()
            state.gaps.heard(state.heard)
            state.silent = state.silent and state.cut_at is not None  # a cut stays until it comes back

    def connection(self, peer: str, up: bool) -> None:
        """The TCP connection to ``peer`` ended (``up`` False: its process exited or was killed, or
        the network dropped it) or came back: lost when it stays down for :attr:`cut_grace_s`
        (unwatched peers are ignored)."""
        state = self._peers.get(peer)
        if state is None:
            return
        if up:
            state.cut_at = None
        elif state.cut_at is None:
            state.cut_at = self._clock()
            logger.info("peer %r: connection ended; lost unless it comes back within %.1f s", peer, self.cut_grace_s)

    def figures(self) -> dict[str, tuple[float | None, float]]:
        """Per watched peer: (its smoothed round trip in seconds, None before a sample; seconds since
        anything was heard from it). Safe from another thread: reads a copy."""
        now = self._clock()
        return {peer: (state.rtt.srtt, now - state.heard) for peer, state in dict(self._peers).items()}

    @property
    def cut_grace_s(self) -> float:
        """How long a neighbour's connection may stay down: two heartbeat intervals."""
        return 2 * self.config.interval_s

    def on_heartbeat(self, peer: str, meta: Mapping[str, Any]) -> None:
        """A heartbeat's timestamps (SPEC §9.5): remember its ``sent_ns`` to echo, and take a round
        trip sample from its ``echo_ns`` / ``held_ns``. Call :meth:`heard` too (any message is life)."""
        state = self._peers.get(peer)
        now_ns = self._clock_ns()
        sent = meta.get("sent_ns")
        if state is None:
            if type(sent) is int and sent >= 0 and (peer in self._early or len(self._early) < 64):
                self._early[peer] = (sent, now_ns)
            return
        if type(sent) is int and sent >= 0:
            state.echo = (sent, now_ns)
            if not state.echoed:  # answer at once: both sides know the round trip right after the handshake
                state.answer = True
                self._start_heartbeat(peer, state)
        if "echo_ns" in meta:
            sample = rtt_sample_s(now_ns, meta.get("echo_ns"), meta.get("held_ns", 0))
            if sample is not None and sample <= self.config.timeout_s:
                state.rtt.add(sample)
                if state.rtt.samples == 1:
                    logger.info("peer %r: round trip %.1f ms, liveness deadline %.1f s", peer, sample * 1e3,
                                self._deadline(state))

    def heartbeat_meta(self, peer: str) -> dict[str, int]:
        """The timestamps of the next heartbeat to ``peer``: ``sent_ns`` and, once it sent one,
        ``echo_ns`` / ``held_ns``."""
        now_ns = self._clock_ns()
        meta = {"sent_ns": now_ns}
        state = self._peers.get(peer)
        if state is not None and state.echo is not None:
            meta["echo_ns"], meta["held_ns"] = state.echo[0], max(0, now_ns - state.echo[1])
            state.echoed, state.answer = True, False
        return meta

    # ------------------------------------------------------------------ what it knows
    def silent(self) -> set[str]:
        """Peers currently declared silent."""
        return {p for p, s in self._peers.items() if s.silent}

    def rtt(self, peer: str) -> RttEstimator | None:
        state = self._peers.get(peer)
        return None if state is None else state.rtt

    def deadline_s(self, peer: str) -> float:
        """``peer``'s current deadline (:func:`liveness_deadline` of its round trip and gaps)."""
        state = self._peers.get(peer)
        return self.config.timeout_s if state is None else self._deadline(state)

    def session_deadline_s(self, peer: str) -> float:
        """How long ``peer``'s session stays live unheard before training (SPEC §9.2 step 5): its
        deadline, the floor until a round trip is measured (a live neighbour heartbeats every
        interval from its WELCOME on, so a dead one frees its stage soon)."""
        state = self._peers.get(peer)
        return self.config.floor if state is None or state.rtt.estimate is None else self._deadline(state)

    def _deadline(self, state: _Peer) -> float:
        return liveness_deadline(state.rtt.estimate, self.config, state.gaps.longest(self._clock()))

    def silence_s(self, peer: str) -> float:
        """Seconds since ``peer`` was last heard from."""
        return self._clock() - self._peers[peer].heard

    # ------------------------------------------------------------------ running
    def start(self) -> "HeartbeatMonitor":
        """Start the background task (idempotent); returns self."""
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(), name="heartbeat")
        return self

    async def aclose(self) -> None:
        """Stop the background task and any heartbeat still being sent."""
        tasks = [s.sending for s in self._peers.values() if s.sending is not None]
        if self._task is not None:
            tasks.append(self._task)
            self._task = None
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def wait_silent(self, timeout_s: float) -> str:
        """Wait until some watched peer is silent and return its name."""
        try:
            await within(self._silent_event.wait(), timeout_s)
        except asyncio.TimeoutError:
            raise NetTimeoutError(f"no peer went silent within {timeout_s:g} s") from None
        self._silent_event.clear()
        silent = self.silent()
        return sorted(silent)[0] if silent else ""

    def check(self) -> list[Silence]:
        """One round: start the heartbeats that are due, declare the peers past their deadline
        silent (``on_silent`` once each). Returns the new silences."""
        now = self._clock()
        if self._last_check is not None:
            late = now - self._last_check - self.tick_s
            if late > _STALL_S:  # this process was not running: nobody was heard meanwhile
                logger.info("heartbeat checks ran %.1f s late (this process was stopped or blocked); "
                            "silence clocks move on by as much", late)
                for state in self._peers.values():
                    state.heard = min(now, state.heard + late)
                    state.gaps.skip(late, now)
                    if state.cut_at is not None:
                        state.cut_at = min(now, state.cut_at + late)
        self._last_check = now
        found: list[Silence] = []
        for peer, state in list(self._peers.items()):
            if now - state.sent >= self.config.interval_s:
                self._start_heartbeat(peer, state)
            silence = now - state.heard
            cut = None if state.cut_at is None else now - state.cut_at
            deadline = self._deadline(state)
            if cut is not None and cut > self.cut_grace_s:
                deadline = self.cut_grace_s
            elif silence <= deadline:
                continue
            if not state.silent:
                state.silent = True
                found.append(Silence(peer, silence, time.time() - silence, deadline, state.rtt.srtt,
                                     state.gaps.longest(now), cut))
        for s in found:
            logger.warning("peer %r %s", s.peer, s.describe())
            if self._on_silent is not None:
                self._on_silent(s)
            self._silent_event.set()
        return found

    def _start_heartbeat(self, peer: str, state: _Peer) -> None:
        """Send a heartbeat to ``peer`` now, on a task of its own, unless one is still on its way."""
        if state.sending is not None and not state.sending.done():
            return
        state.sent = self._clock()
        state.sending = asyncio.get_running_loop().create_task(self._heartbeat(peer), name=f"heartbeat->{peer}")

    async def _heartbeat(self, peer: str) -> None:
        try:
            await within(self._send(peer), self.config.timeout_s)  # behind a full link: it waits its turn
        except (NetError, asyncio.TimeoutError) as exc:
            logger.warning("heartbeat to %r failed: %s", peer, exc or "timeout")
        state = self._peers.get(peer)
        if state is not None and state.answer:  # an echo arrived while this one was on its way
            state.answer = False
            asyncio.get_running_loop().call_soon(self._start_heartbeat, peer, state)

    async def _run(self) -> None:
        while True:
            try:
                self.check()
            except Exception:  # noqa: BLE001 - the monitor must outlive a failing callback
                logger.exception("heartbeat check failed")
            await asyncio.sleep(self.tick_s)


def attach_heartbeat(transport: "Transport", config: HeartbeatConfig,
                     make_heartbeat: Callable[[str], Sequence[Frame]], *,
                     peers: Iterable[str] | None = None, kind: str = "HEARTBEAT",
                     on_silent: Callable[[Silence], None] | None = None) -> HeartbeatMonitor:
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
