"""What a peer receives, as one step: an arrival in, its one destination out (:meth:`Ingress.take`).

Both receive loops (this peer's ROUTER, where every connection to it arrives, and its own
connections to its neighbours, where the answers to its HELLOs come back) hand each message to
:meth:`Ingress.take`, one at a time in arrival order. It runs the rules of
:class:`~.admission.Admission` (header, session, window, content: each once) and sends what passes
to exactly one place:

- a refused HELLO, or a version mismatch (once per connection): the answer, on a task of its own;
- a pipeline message from before this peer's training started: *held* here. Once training starts
  (:meth:`Ingress.start`) the held ones are taken again, with the checks that remain, in arrival
  order, before anything received later (SPEC §6.1 "Before training starts");
- a HEARTBEAT: the liveness monitor (every admitted message is a sign of life);
- a pipeline message: the step core hears of it (``arrived``), then it waits for the schedule in
  the peer's one inbound queue (:class:`~.mailbox.Mailbox`);
- a control message: the same queue, for the dispatcher, which hands it to the handler its type
  names in ``handle``'s table (the peer's :class:`~.control.Control`).

A dial-out neighbour's (or, on a dial-out peer, every neighbour's) messages and answers share one
connection (SPEC §1.2): an answer (WELCOME, REJECT) that comes from a dial-out neighbour's
connection is taken as an answer on this peer's link to it, and a message other than an answer that
comes on a dial-out peer's own connection as its neighbour's message, under the name
``Transport.request_sender`` gives that connection.

Receiving never waits on handling, so a handler that waits (a relay to a neighbour whose send
buffer is full) never makes another neighbour look silent. A connection without a session (a
stranger's, or a neighbour's before its HELLO is welcomed) has a budget (:class:`StrangerBudget`):
what it sends beyond is dropped before it is decoded, and the ROUTER loop yields now and then, so a
flood cannot make this peer look silent to its neighbours.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import asyncio

from mapl_swarm.aio import until
from mapl_swarm.net.errors import NetError
from mapl_swarm.peer.admission import Admission, Admitted, Arrival, RejectCounter
from mapl_swarm.peer.link import Links, PeerLink, Reply, stage_of
from mapl_swarm.peer.session import Early, HelloRefused, Rejected
from mapl_swarm.peer.dialback import DialBacks, Refused as DialBackRefused
from mapl_swarm.wire import Message, MessageType, VersionMismatch, WireError, decode, decode_header
from mapl_swarm.wire.spec import FINISHED_REASON, REJOIN_REASON

if TYPE_CHECKING:
    from mapl_swarm.net.heartbeat import HeartbeatMonitor
    from mapl_swarm.peer.mailbox import Mailbox

log = logging.getLogger(__name__)

__all__ = ["Ingress", "Handle", "StrangerBudget"]

MT = MessageType

SCHEDULE_TYPES = frozenset({MT.ACT, MT.GRAD, MT.PROJ, MT.PROJ_GRAD, MT.CODEBOOK_SLICE, MT.ROUTE})
"""Pipeline messages: the schedule takes them from the queue (and so the BYE that ends the run)."""

Answer = Callable[[], Awaitable[None]]
"""The answer to a refused HELLO or a version mismatch, sent on a task of its own."""
MAX_ANSWERS = 64
"""Answers on their way at once at most; a flood of refused HELLOs beyond is dropped as ``queue_full``."""
STRANGER_BURST = 64
"""Messages a connection without a session (no neighbour's bound session) may send at once..."""
STRANGER_RATE_PER_S = 16.0
"""...and then per second: far more than a neighbour's HELLOs before its session (one per
``net.hello_retry_s``), far fewer than a flood that would keep this peer from serving; beyond it a
message is dropped before it is decoded (``queue_full``)."""
STRANGERS_REMEMBERED = 4096
"""Connections without a session whose budget is remembered (the oldest is forgotten first)."""
YIELD_EVERY = 64
"""The receive loop lets the peer's other tasks (heartbeats, the schedule) run after this many
messages in a row, so a flood of well-formed messages cannot make this peer look silent."""


class StrangerBudget:
    """A token bucket per connection without a session (:data:`STRANGER_BURST`, then
    :data:`STRANGER_RATE_PER_S`), keyed by routing id; ``clock`` is monotonic seconds."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self.clock = clock
        self._buckets: OrderedDict[str, tuple[float, float]] = OrderedDict()

    def allow(self, sender: str) -> bool:
        now = self.clock()
        tokens, at = self._buckets.pop(sender, (float(STRANGER_BURST), now))
        tokens = min(float(STRANGER_BURST), tokens + (now - at) * STRANGER_RATE_PER_S)
        allowed = tokens >= 1.0
        self._buckets[sender] = (tokens - 1.0 if allowed else tokens, now)
        if len(self._buckets) > STRANGERS_REMEMBERED:
            self._buckets.popitem(last=False)
        return allowed


Handle = Callable[[Admitted, Arrival, Any], Awaitable[None]]
"""``handle(admitted, arrival, transport)``: what an admitted message does (:class:`~.control.Control`)."""


class Ingress:
    """Peer ``name``'s way in over ``links`` into ``mailbox`` (see the module docstring);
    ``spawn(coroutine)`` runs the answers to refused HELLOs; at most ``held_bound`` messages are
    held before training starts (beyond: ``queue_full``)."""

    def __init__(self, name: str, links: Links, admission: Admission, monitor: HeartbeatMonitor,
                 rejects: RejectCounter, arrived: Callable[[Message, PeerLink], None], mailbox: Mailbox, *,
                 handle: Handle, spawn: Callable[[Awaitable[None]], Any], held_bound: int, run_steps: int,
                 dialbacks: DialBacks | None = None) -> None:
        self.name, self.links, self.admission, self.monitor = name, links, admission, monitor
        self.rejects, self.arrived, self.mailbox, self.handle, self.spawn = rejects, arrived, mailbox, handle, spawn
        """``arrived(msg, link)``: the step core hears of every admitted pipeline message as it comes
        (a PROJ moves its link's projector version, a ``reopen`` names replicas that left), before
        the message waits its turn in the queue."""
        self.started = False
        """This peer's training started: pipeline messages are no longer held."""
        self.held: list[Arrival] = []
        """Pipeline messages that came before training started, in arrival order (their ``seq``
        accepted then), taken again by :meth:`start`."""
        self.held_bound = held_bound
        self.run_steps = run_steps
        """The run's last step (``run.steps``): a BYE ``"training finished"`` of another step ends nothing."""
        self._dispatching = False
        """The dispatcher handles a control message now."""
        self._answering = 0
        """Answers on their way (:data:`MAX_ANSWERS` at most)."""
        self._admitting = asyncio.Lock()
        """Held around each admission, so that messages are admitted in arrival order, the held
        ones before any later one."""
        self._refused_versions: set[str] = set()
        self.strangers = StrangerBudget(admission.clock)
        """What connections without a session may send (a flood is dropped before decoding)."""
        self.dialbacks = dialbacks
        """Serves members' dial-back requests (:mod:`.dialback`); None: none served."""

    # ------------------------------------------------------------------ the loops
    async def receive_loop(self, transport: Any) -> None:
        """Messages on this peer's ROUTER, from every connection, admitted in order and queued."""
        received = 0
        while True:
            sender, frames = await transport.recv(timeout_s=3600.0)
            received += 1
            if received % YIELD_EVERY == 0:
                await asyncio.sleep(0)
            if not self._in_session(sender) and not self.strangers.allow(sender):
                self.rejects("queue_full", sender, f"a connection without a session sent more than {STRANGER_BURST} "
                                                   f"messages, then {STRANGER_RATE_PER_S:g} a second")
                continue
            key = transport.peer_key(sender) if self.admission.s.identity is not None else None
            reverse = transport.reverse_link(sender)
            arrival = (Arrival(reverse, frames, reply_link=reverse) if reverse is not None and self._is_answer(frames)
                       else Arrival(sender, frames, peer_key=key))
            async with self._admitting:
                self._answer(await self.take(arrival, transport), sender)

    def _in_session(self, sender: str) -> bool:
        """``sender`` is the routing id of a neighbour's bound inbound session."""
        return any(link.rx is not None and link.rx.routing_id == sender for link in self.links)

    async def reply_loop(self, transport: Any) -> None:
        """Answers (WELCOME/REJECT) on this peer's own connections to its neighbours."""
        while True:
            link, frames = await transport.recv_reply(timeout_s=3600.0)
            sender = transport.request_sender(link)
            if sender is None or self._is_answer(frames):
                arrival = Arrival(link, frames, reply_link=link)
            else:  # a dial-out peer: its neighbour speaks on this connection too
                arrival = Arrival(sender, frames, peer_key=transport.peer_key(sender))
            async with self._admitting:
                self._answer(await self.take(arrival, transport), arrival.sender)

    def _is_answer(self, frames: Any) -> bool:
        """``frames`` are a WELCOME or REJECT (what a malformed header is, the admission says)."""
        try:
            header, _ = decode_header(frames, self.admission.limits)
        except WireError:
            return False
        return header.type in (MT.WELCOME, MT.REJECT)

    async def dispatch_loop(self, transport: Any) -> None:
        """Handles the admitted control messages in arrival order."""
        while True:
            got, arrival = await self.mailbox.next_control()
            self._dispatching = True
            try:
                await self.handle(got, arrival, transport)
            finally:
                self._dispatching = False
                self.mailbox.poke()

    async def settled(self, timeout_s: float) -> None:
        """Until the control messages queued now are handled: the end of a session reads what they
        say (a drain's checkpoint, complete), though the BYE that ended its schedule came after them."""
        await until(lambda: not self._dispatching and not self.mailbox.has_control(), self.mailbox.changed,
                    timeout_s)

    async def receive(self, arrival: Arrival, transport: Any) -> None:
        """Admit one message and handle it at once (what the loops and the dispatcher do, without
        waiting their turn)."""
        answer = await self.take(arrival, transport, dispatch=False)
        if answer is not None:
            await answer()

    async def start(self, transport: Any) -> None:
        """Training starts (the run epoch, step window and projector version are set): the held
        messages are admitted, in arrival order, before anything received later."""
        async with self._admitting:
            self.started = True
            held, self.held = self.held, []
            for arrival in held:
                self._answer(await self.take(replace(arrival, held=True), transport), arrival.sender)
        if held:
            log.debug("%s: %d message(s) that came before the start of training admitted now", self.name, len(held))

    # ------------------------------------------------------------------ one message
    def _answer(self, answer: Answer | None, sender: str) -> None:
        if answer is None:
            return
        if self._answering >= MAX_ANSWERS:
            self.rejects("queue_full", sender, f"{MAX_ANSWERS} answers to refused HELLOs are on their way already")
            return
        self._answering += 1

        async def send() -> None:
            try:
                await answer()
            finally:
                self._answering -= 1

        self.spawn(send())

    def for_schedule(self, msg: Message, link: PeerLink) -> bool:
        """A pipeline message, or the BYE from upstream that ends the run (before training any BYE is
        the dispatcher's, SPEC §9.5; BYE ``"rejoin"`` is a re-form): the schedule's to take. A ROUTE
        ``end`` or ``reopen`` is the schedule's too (taken in its link's order, after the link's
        ACTs); another is the dispatcher's: a ``ready`` for a step this replica ended is answered at
        once; ``commit``, ``gone`` and ``redo`` change what the schedule waits for, whatever it
        waits for now (:meth:`~.driver.Schedule.on_control`)."""
        if msg.type is MT.ROUTE:
            return msg.meta.get("phase") in ("end", "reopen")
        if msg.type in SCHEDULE_TYPES:
            return True
        return msg.type is MT.BYE and link.is_upstream and self.started and msg.meta.get("reason") != REJOIN_REASON \
            and not self.premature_finish(msg)

    def premature_finish(self, msg: Message) -> bool:
        """A BYE ``"training finished"`` of a step other than the run's last: not the run's end (the
        dispatcher takes it as its sender's departure)."""
        return msg.type is MT.BYE and msg.meta.get("reason") == FINISHED_REASON and msg.step != self.run_steps

    async def take(self, arrival: Arrival, transport: Any, *, dispatch: bool = True) -> Answer | None:
        """The one step of the module docstring, on the receive loop (``dispatch`` False: a control
        message is handled at once); returns the answer to a refused HELLO (or the dial a dial-back
        request asks for), or None."""
        if self.dialbacks is not None and arrival.reply_link is None and stage_of(arrival.sender) is None:
            msg = self._dialback_request(arrival)  # no neighbour's connection: only a dial-back request is served
            if msg is not None:
                try:
                    return self.dialbacks.request(msg, arrival.sender, arrival.peer_key, transport)
                except DialBackRefused as exc:
                    self.rejects(exc.code, arrival.sender, exc.text)
                    return None
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
        if self._unsigned_work(got.msg, got.link):
            return None
        try:
            if self.for_schedule(got.msg, got.link):
                self.arrived(got.msg, got.link)
                self.mailbox.put(got.msg, got.link)
            elif dispatch:
                self.mailbox.put_control(got, arrival)
            else:
                await self.handle(got, arrival, transport)
        except Rejected as exc:  # queue_full
            self.rejects(exc.code, arrival.sender, exc.text)
        return None

    def _dialback_request(self, arrival: Arrival) -> Message | None:
        """A stranger's message decoded, when it is a well-formed DIALBACK request (SPEC §9.11);
        None for anything else, which the admission then drops as a stranger's."""
        try:
            msg = decode(arrival.frames, self.admission.limits)
        except WireError:
            return None
        return msg if msg.type is MT.DIALBACK else None

    def _unsigned_work(self, msg: Message, link: PeerLink) -> bool:
        """A train ACT or GRAD that its sender did not sign, in a run whose replicas check each other's
        work (SPEC §9.10 item 15): dropped (``not_allowed``), since this peer could not show a checker
        what it was given. True when dropped."""
        if not (link.settings.sign_work and link.settings.identity is not None
                and (msg.type is MT.GRAD or (msg.type is MT.ACT and msg.meta.get("mode") == "train"))):
            return False
        if link.signed_work(msg):
            return False
        self.rejects("not_allowed", link.name, f"{msg.type.name} of step {msg.step} micro-batch {msg.micro} without "
                                               f"its sender's signature (SPEC §9.10 item 15)")
        return True

    def _hold(self, arrival: Arrival, link: str) -> None:
        self.monitor.heard(link)  # authenticated and in sequence: a sign of life
        if len(self.held) >= self.held_bound:
            self.rejects("queue_full", arrival.sender, f"{self.held_bound} messages from before the start of "
                                                       f"training wait already")
            return
        self.held.append(arrival)

    def _link_of(self, arrival: Arrival) -> PeerLink | None:
        if arrival.reply_link is not None:
            return None  # never answer an answer
        stage = stage_of(arrival.sender)
        return None if stage is None else self.links.route(stage)

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
