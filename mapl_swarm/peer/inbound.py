"""What a peer receives, on one path: receive -> admit -> held or queued -> handled.

Both receive loops (this peer's ROUTER, where every connection to it arrives, and its own
connections to its neighbours, where the answers to its HELLOs come back) pass each message to one
admission, one at a time in arrival order (:class:`~.admission.Admission`), then note the sign of
life; heartbeats are handled right there. Until this peer's training starts, a pipeline message
(from a neighbour that had the resume decision first) is *held*: once training starts
(:meth:`Inbound.start`) the held ones are admitted with the checks that remain, in arrival order,
before anything received later (SPEC §6.1 "Before training starts"). Every other admitted message
is queued for the dispatcher, which hands it to ``handle`` (the peer's
:class:`~.control.Control`: control messages by type, pipeline messages into the schedule's
mailbox). Receiving never waits on handling, so a handler that waits (a relay to a neighbour whose
send buffer is full) never makes another neighbour look silent. A refused HELLO is answered with
REJECT on its own connection, a version mismatch once per connection.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import asyncio

from mapl_swarm.net.errors import NetError
from mapl_swarm.peer.admission import Admission, Admitted, Arrival, RejectCounter
from mapl_swarm.peer.link import Links, PeerLink, Reply, stage_of
from mapl_swarm.peer.session import Early, HelloRefused
from mapl_swarm.wire import MessageType, VersionMismatch

if TYPE_CHECKING:
    from mapl_swarm.net.heartbeat import HeartbeatMonitor
    from mapl_swarm.peer.window import StepWindow

log = logging.getLogger(__name__)

__all__ = ["Inbound", "Handle"]

MT = MessageType

Then = Callable[[], Awaitable[None]]
"""What the dispatcher does with one received message, after its admission."""
Handle = Callable[[Admitted, Arrival, Any], Awaitable[None]]
"""``handle(admitted, arrival, transport)``: what an admitted message does (:class:`~.control.Control`)."""


class Inbound:
    """Peer ``name``'s receive path over ``links`` (see the module docstring); at most ``bound``
    messages wait for the dispatcher, and as many are held before training starts."""

    def __init__(self, name: str, links: Links, admission: Admission, monitor: HeartbeatMonitor,
                 rejects: RejectCounter, window: StepWindow, *, bound: int, handle: Handle) -> None:
        self.name, self.links, self.admission, self.monitor = name, links, admission, monitor
        self.rejects, self.window, self.bound, self.handle = rejects, window, bound, handle
        self.started = False
        """This peer's training started: pipeline messages are no longer held."""
        self._queue: asyncio.Queue[Then] = asyncio.Queue()
        self._held: list[Arrival] = []
        self._admitting = asyncio.Lock()
        """Held around each admission, so that messages are admitted in arrival order, the held
        ones before any later one."""
        self._refused_versions: set[str] = set()

    # ------------------------------------------------------------------ the loops
    async def receive_loop(self, transport: Any) -> None:
        """Messages on this peer's ROUTER, from every connection, admitted in order and queued."""
        while True:
            sender, frames = await transport.recv(timeout_s=3600.0)
            async with self._admitting:
                self._enqueue(await self._admit(Arrival(sender, frames), transport), sender)

    async def reply_loop(self, transport: Any) -> None:
        """Answers (WELCOME/REJECT) on this peer's own connections to its neighbours."""
        while True:
            link, frames = await transport.recv_reply(timeout_s=3600.0)
            self._enqueue(await self._admit(Arrival(link, frames, reply_link=link), transport), link)

    async def dispatch_loop(self) -> None:
        """Handles the admitted messages (and answers refused HELLOs) in arrival order."""
        while True:
            then = await self._queue.get()
            await then()

    async def receive(self, arrival: Arrival, transport: Any) -> None:
        """Admit one message and handle it at once (what the loops do, without their queue)."""
        then = await self._admit(arrival, transport)
        if then is not None:
            await then()

    async def start(self, transport: Any) -> None:
        """Training starts (the run epoch, step window and projector version are set): the held
        messages are admitted, in arrival order, before anything received later."""
        async with self._admitting:
            self.started = True
            held, self._held = self._held, []
            for arrival in held:
                self._enqueue(await self._admit(arrival, transport), arrival.sender)
        if held:
            log.debug("%s: %d message(s) that came before the start of training admitted now", self.name, len(held))

    # ------------------------------------------------------------------ one message
    def _enqueue(self, then: Then | None, sender: str) -> None:
        if then is None:
            return
        if self._queue.qsize() >= self.bound:
            self.rejects("queue_full", sender, f"{self.bound} received messages wait for the dispatcher already")
            return
        self._queue.put_nowait(then)

    async def _admit(self, arrival: Arrival, transport: Any) -> Then | None:
        """Admission, the sign of life, heartbeats and what later admissions depend on (a PROJ's
        version), on the receive loop; returns what remains to do (handle the message, answer a
        refused HELLO), or None."""
        try:
            got = await self.admission.admit(arrival)
        except Early as early:
            self._hold(arrival, early.link)
            return None
        except HelloRefused as exc:
            self.rejects(exc.code, arrival.sender, exc.text)
            link = self._link_of(arrival)
            if link is None:
                return None
            link.refused_hello = f"{exc.code}: {exc.text}"  # named if our own handshake then times out
            reply, code, text, nonce = self.reply(transport, arrival, link), exc.code, exc.text, exc.hello_nonce
            return lambda: self.answer(link.refuse(code, text, reply, hello_nonce=nonce, anchored=self.links.anchored))
        except VersionMismatch as exc:
            self.rejects(exc.code, arrival.sender, str(exc))
            link = self._link_of(arrival)
            if link is None or arrival.sender in self._refused_versions:  # once per connection
                return None
            if len(self._refused_versions) >= 1024:
                self._refused_versions.clear()  # bounded memory; a connection may get a second answer
            self._refused_versions.add(arrival.sender)
            reply, code, text = self.reply(transport, arrival, link), exc.code, str(exc)
            return lambda: self.answer(link.refuse(code, text, reply))
        if got is None:
            return None
        self.monitor.heard(got.link.name)
        if got.msg.type is MT.HEARTBEAT:
            self.monitor.on_heartbeat(got.link.name, got.msg.meta)  # its round-trip timestamps
            got.link.peer_anchored = got.link.peer_anchored or got.msg.meta.get("anchored") is True
            return None
        if got.msg.type is MT.PROJ:
            self.window.projector(got.link.stage, got.msg.pver)  # the link's version moves on (SPEC §9.6)
        return lambda: self.handle(got, arrival, transport)

    def _hold(self, arrival: Arrival, link: str) -> None:
        self.monitor.heard(link)  # authenticated and in sequence: a sign of life
        if len(self._held) >= self.bound:
            self.rejects("queue_full", arrival.sender, f"{self.bound} messages from before the start of training "
                                                       f"are held already")
            return
        self._held.append(replace(arrival, held=True))

    def _link_of(self, arrival: Arrival) -> PeerLink | None:
        if arrival.reply_link is not None:
            return None  # never answer an answer
        stage = stage_of(arrival.sender)
        return None if stage is None else self.links.by_stage(stage)

    def reply(self, transport: Any, arrival: Arrival, link: PeerLink) -> Reply:
        """Sends back on ``arrival``'s own connection (a transport without ``reply``: on the link)."""
        if self.admission.replies_on_link:
            return lambda frames, kind: transport.reply(arrival.sender, frames, kind=kind)
        return lambda frames, kind: transport.send(link.name, frames, kind=kind)

    async def answer(self, sending: Awaitable[None]) -> None:
        try:
            await sending
        except NetError as exc:  # the connection is gone, or does not read
            log.warning("%s: could not answer: %s", self.name, exc)
