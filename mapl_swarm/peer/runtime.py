"""One stage peer: it builds its parts, finds its neighbours, shakes hands, dispatches and reports.

A peer is assembled from parts, each owning one concern:

- :class:`~.link.PeerLink` per neighbour (``links.upstream`` / ``links.downstream``): handshake
  state, sequence numbers, torch <-> wire payloads, byte counters, the send, and with mapl_vq the
  link's codebook stream (:class:`~.vq_link.CodebookLink`);
- :class:`~.admission.Admission`: what gets in (sender, header, who may say what, session and
  sequence, tensors decoded on the decode thread, content), every drop counted by code;
- :class:`~.mailbox.Mailbox`: admitted pipeline messages waiting to be taken, in arrival order,
  bounded per neighbour;
- :class:`~.compute.ComputeThread`: the stage's compute off the event loop, and the encode lock;
- :class:`~.schedule.PipelineSchedule`: the 1F1B schedule, given all of the above and a step-end hook;
- :class:`~.waiting.WaitingLog`: "waiting for stage K at ADDR (n s)" lines during long waits;
- :class:`~mapl_swarm.net.heartbeat.HeartbeatMonitor` (``monitor``): heartbeats to each neighbour,
  their round trips and liveness deadlines (SPEC §9.5);
- :class:`~.handshake.Handshake`: HELLO to each neighbour until it welcomed this peer, trying every
  DHT record of its stage;
- :class:`~.departures.Departures`: neighbours that went silent or left, as events, and the policy
  that decides what a departure does: during training this peer pauses and the session ends so
  that the swarm re-forms (:mod:`~.sessions`, SPEC §9.6), or, without live rejoin, it ends;
- :class:`~.drain.Drain`: the graceful drain on SIGINT/SIGTERM (every stage saves the same step).

The peer itself owns the lifecycle (transport, discovery, handshake, result), the receive loops
and the dispatcher. Receiving never waits on handling: the receive loops admit each message and
note the sign of life (heartbeats are handled right there), then queue it for the dispatcher, whose
:meth:`Peer._dispatch` routes it through one table; a handler that waits (a relay to a neighbour
whose send buffer is full) therefore never makes another neighbour look silent. Pipeline messages
that come before this peer's training started (a neighbour that had the resume decision first)
are held and admitted, in arrival order, once it starts (SPEC §6.1). The work (lookup,
handshake, resume agreement, the schedule) runs as one task that a departure or a second signal
cancels wherever it waits.

The peer drives the same :class:`~mapl_swarm.pipeline.stage.StageRuntime` as the single-process
pipeline. Messages that cannot be used (garbage, wrong version, run or sender, a type the sender may
not send, another session, a replay, bad content, a full queue) are dropped, counted by code in the
result (``rejects``) and logged; the peer keeps serving. A HELLO is answered on its own connection
(WELCOME, or REJECT with the code), so a forged HELLO never reaches the real neighbour. Heartbeats
go to a neighbour once it welcomed this peer. ERROR is informational (logged, counted in
``errors``) except ``retransmit_unavailable``; BYE ``"rejoin"`` pauses this peer (the swarm
re-forms); any other BYE from upstream ends the run, from downstream it is a departure. A NaN/Inf
in this peer's own compute (:class:`~mapl_swarm.errors.NonFiniteError`) ends the peer (exit
status 3) after a BYE naming it upstream; downstream it is a lost neighbour (SPEC §9.5).

Ends (``result.end``): ``finished`` (the last step), ``drained`` (a graceful drain, or a BYE
``"drain"`` from upstream), ``stopped`` (a signal before training started, or a neighbour's planned
departure without live rejoin) — all exit status 0, with ``result.end_note`` as the one line to
print; ``rejoin`` (the session ended so that the swarm re-forms: the process goes on with its next
session, :mod:`~.sessions`); without live rejoin an unplanned departure raises
:class:`~.departures.NeighbourLost`, a second signal :class:`~.drain.Interrupted`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import torch

from mapl_swarm.config import TrainConfig, config_summary
from mapl_swarm.errors import MaplError, NonFiniteError
from mapl_swarm.net.emulator import LinkConfig
from mapl_swarm.net.errors import NetError
from mapl_swarm.net.heartbeat import HeartbeatConfig, HeartbeatMonitor, Silence
from mapl_swarm.net.transport import Transport, TransportConfig
from mapl_swarm.peer.admission import Admission, Admitted, Arrival, RejectCounter, mailbox_bound, run_shapes
from mapl_swarm.peer.compute import BackgroundTasks, ComputeThread, WorkerThread
from mapl_swarm.peer.departures import Departure, Departures, NeighbourLost
from mapl_swarm.peer.drain import (DRAIN_CAPABILITY, DRAIN_PHASES, DRAIN_REASON, Drain, Interrupted, checkpoint_note,
                                   drained_at)
from mapl_swarm.peer.handshake import Handshake, candidates_of, connect
from mapl_swarm.peer.link import LinkSettings, Links, PeerLink, Reply, stage_name, stage_of
from mapl_swarm.peer.mailbox import Mailbox
from mapl_swarm.peer.result import PeerResult, write_result
from mapl_swarm.peer.schedule import NoRunHooks, PipelineSchedule, ScheduleSettings
from mapl_swarm.peer.session import Early, HelloRefused, Rejected
from mapl_swarm.peer.vq_link import codebook_summary
from mapl_swarm.peer.waiting import WAIT_LOG_INTERVAL_S, WaitingLog
from mapl_swarm.pipeline.stage import StageRuntime
from mapl_swarm.wire import Message, MessageType, VersionMismatch
from mapl_swarm.wire.codebook import INDEXED_SLICES_CAPABILITY, RETRANSMIT_CAPABILITY, VQ_CAPABILITY
from mapl_swarm.wire.spec import REJOIN_CAPABILITY, REJOIN_REASON

if TYPE_CHECKING:
    from mapl_swarm.net.runkey import RunKey
    from mapl_swarm.peer.checkpoints import PeerRunPolicy

log = logging.getLogger(__name__)

__all__ = ["Peer", "PeerResult", "PeerRejected", "NeighbourLost", "Interrupted", "stage_name", "write_result"]

MT = MessageType

_LAST_WORDS_S = 1.0
"""After a clean end, how long ZeroMQ may take to send what it still queues (a BYE)."""

Then = Callable[[], Awaitable[None]]
"""What the dispatcher does with one received message, after its admission."""


class PeerRejected(MaplError):
    """A neighbour refused the handshake (version or config fingerprint mismatch)."""


class _CleanStop(Exception):
    """A planned end before the last step (exit status 0): ``end`` and the line to print."""

    def __init__(self, end: str, note: str) -> None:
        super().__init__(note)
        self.end, self.note = end, note


class _Rejoin(_CleanStop):
    """This session ends so that the swarm re-forms at run epoch ``epoch`` (SPEC "Rejoin"): stage
    ``lost`` departed (None: told by ``told_by``, a neighbour that re-forms)."""

    def __init__(self, note: str, *, epoch: int, lost: int | None, told_by: int | None = None) -> None:
        super().__init__("rejoin", note)
        self.epoch, self.lost, self.told_by = epoch, lost, told_by


class Peer:
    """Stage ``stage`` of ``cfg``; ``resolve(stage, timeout_s) -> endpoint`` finds neighbours (the
    DHT), ``announce(endpoint)`` publishes this peer's. ``run_policy`` (:class:`~.checkpoints.PeerRunPolicy`)
    agrees the start step after the handshake (resume), records metrics and saves checkpoints after every
    optimizer step; ``compute`` is the thread it shares with it. Without one nothing is recorded.
    ``config``: the settings neighbours must share (``config.config_summary``; default: from ``cfg``
    without the tokenizer's)."""

    def __init__(self, cfg: TrainConfig, stage: int, runtime: StageRuntime, *, fingerprint: str,
                 config: Mapping[str, Any] | None = None,
                 resolve: Callable[[int, float], Awaitable[str]], announce: Callable[[str], Awaitable[Any]],
                 sampler=None, val_batches: list[torch.Tensor] | None = None, progress: bool = False,
                 start_step: int = 0, secret: bytes | None = None, compute: ComputeThread | None = None,
                 run_policy: PeerRunPolicy | None = None,
                 wait_log_interval_s: float = WAIT_LOG_INTERVAL_S, run_key: RunKey | None = None,
                 epoch: int = 0, rejoining: bool = False) -> None:
        self.cfg, self.stage, self.rt = cfg, stage, runtime
        self.epoch = epoch
        """This peer's run epoch (SPEC "Rejoin"): the swarm's once the start step is agreed."""
        self.rejoining = rejoining
        """This session re-forms the swarm after a departure: it waits up to ``net.rejoin_timeout_s``
        for a replacement and rolls back to the newest step every stage has."""
        P = cfg.pipeline.num_stages
        self.name = stage_name(stage)
        self.resolve, self.announce = resolve, announce
        self.secret = secret
        self.run_key = run_key  # members-only links (CURVE); None: insecure
        self.result = PeerResult(stage)
        self.rejects = RejectCounter(self.name, self.result.rejects)
        """Counts and logs every dropped message by code (into ``result.rejects``)."""
        self.mailbox = Mailbox(self.name, max_per_sender=mailbox_bound(cfg))
        self.compute = compute or ComputeThread(self.name)
        self.decoder = WorkerThread(f"{self.name}-decode")
        """Decodes and inflates received tensors and checks their content, off the event loop."""
        self.tasks = BackgroundTasks(on_error=self.mailbox.fail)
        self.waits = WaitingLog(self.name, wait_log_interval_s)
        vq = runtime.vq is not None
        settings = LinkSettings(
            run_id=cfg.run.run_id, stage=stage, num_stages=P, fingerprint=fingerprint,
            config=config if config is not None else config_summary(cfg),
            capabilities=("1f1b", *((REJOIN_CAPABILITY,) if self._rejoin_configured(cfg, run_policy) else ()),
                          *((VQ_CAPABILITY, RETRANSMIT_CAPABILITY, INDEXED_SLICES_CAPABILITY) if vq else ()),
                          *(run_policy.capabilities if run_policy is not None else ()), DRAIN_CAPABILITY),
            num_micro_batches=cfg.pipeline.num_micro_batches, micro_batch_size=cfg.pipeline.micro_batch_size,
            eval_batches=cfg.eval.batches, max_in_flight=cfg.net.max_in_flight or P, secret=secret,
            compress_ids=cfg.net.compress_ids,
            max_frame_bytes=cfg.net.max_frame_bytes)
        self.links = Links(
            upstream=PeerLink(settings, stage - 1, on_bad_frame=self.bad_frame) if stage > 0 else None,
            downstream=PeerLink(settings, stage + 1, on_bad_frame=self.bad_frame) if stage < P - 1 else None)
        self.links.set_epoch(epoch)
        if run_policy is not None and not run_policy.checkpoints_on and cfg.net.rejoin_timeout_s > 0:
            log.warning("%s: checkpoint.interval_steps = 0: live rejoin is impossible (a departed stage comes back "
                        "to a step every stage saved); a departure ends every peer", self.name)
        if vq:
            for link in self.links:
                link.use_codebooks(runtime, self.compute, spawn=self.tasks.spawn)
        self.drain = Drain(stage, P, send=self._send_checkpoint, can_send=self._takes_drain,
                           on_decided=run_policy.drain_at if run_policy is not None else None)
        """The graceful drain (:meth:`request_drain`: a signal)."""
        self.schedule = PipelineSchedule(
            runtime, self.links, self.mailbox, self.compute, name=self.name,
            settings=ScheduleSettings.from_config(cfg, start_step=start_step, progress=progress),
            result=self.result, waits=self.waits, hooks=run_policy or NoRunHooks(),
            sampler=sampler, val_batches=val_batches or [], reject=self.rejects, drain=self.drain)
        self.run_policy = run_policy
        self.admission = Admission(
            settings, self.links, shapes=run_shapes(cfg, stage), window=self.schedule.window, rejects=self.rejects,
            decoder=self.decoder, timeout_s=cfg.net.timeout_s, clock=time.monotonic, replies_on_link=False,
            started=lambda: self._training)
        net = cfg.net
        self.monitor = HeartbeatMonitor(
            HeartbeatConfig(interval_s=net.heartbeat_interval_s, timeout_s=net.liveness_ceiling,
                            floor_s=net.liveness_floor),
            send=self._heartbeat, on_silent=self._on_silent)
        """Heartbeats to, round trips and silence of, each neighbour once it welcomed this peer
        (running while :meth:`serve` does)."""
        self.departures = Departures(self._on_departure)
        """Neighbours that went silent or left (:mod:`~.departures`)."""
        self._inbox: asyncio.Queue[Then] = asyncio.Queue()
        self._inbox_bound = 4 * mailbox_bound(cfg) + 64
        self._held: list[Arrival] = []
        """Pipeline messages that came before this peer's training started, in arrival order: admitted
        when it starts (:meth:`_start_training`; at most ``_inbox_bound``)."""
        self._admitting = asyncio.Lock()
        """Held by the receive loop around each admission, so that messages are admitted in arrival
        order, the held ones before any later one."""
        self._stop_event = asyncio.Event()
        self._stop_reason: BaseException | None = None
        self._training = False
        self._schedule_ended = False
        """The schedule ran to its end (the last step, or a drain): a neighbour leaving now is no departure."""
        self._refused_versions: set[str] = set()
        self._welcome_event = asyncio.Event()
        self._handlers: dict[MessageType, Callable[[Message, PeerLink], Awaitable[None]]] = {
            MT.WELCOME: self._on_welcome,
            MT.REJECT: self._on_reject,
            MT.ERROR: self._on_error,
            MT.BYE: self._on_bye,
            MT.HEARTBEAT: self._on_heartbeat,
            MT.RESYNC: self._on_resync,
            MT.REPORT: self._on_report,
            MT.CHECKPOINT: self._on_checkpoint,
        }
        """Messages handled on arrival (HELLO: by :meth:`receive`); every other type goes to the mailbox
        for the schedule."""

    def bad_frame(self, sender: str, why: str) -> None:
        """Count, log and drop a message the links cannot use (``not_allowed``)."""
        self.rejects("not_allowed", sender, why)

    # ------------------------------------------------------------------ receiving
    async def _receive_loop(self, transport: Transport) -> None:
        """Messages on this peer's ROUTER, from every connection, one at a time (in order), admitted
        and queued for the dispatcher."""
        while True:
            sender, frames = await transport.recv(timeout_s=3600.0)
            async with self._admitting:
                self._queue(await self._admit(Arrival(sender, frames), transport), sender)

    async def _reply_loop(self, transport: Any) -> None:
        """Answers (WELCOME/REJECT) on this peer's own connections to its neighbours."""
        while True:
            link, frames = await transport.recv_reply(timeout_s=3600.0)
            self._queue(await self._admit(Arrival(link, frames, reply_link=link), transport), link)

    def _queue(self, then: Then | None, sender: str) -> None:
        if then is None:
            return
        if self._inbox.qsize() >= self._inbox_bound:
            self.rejects("queue_full", sender, f"{self._inbox_bound} received messages wait for the dispatcher "
                                               f"already")
            return
        self._inbox.put_nowait(then)

    async def _dispatch_loop(self) -> None:
        """Handles the admitted messages (and answers refused HELLOs) in arrival order: handlers may
        wait, receiving goes on."""
        while True:
            then = await self._inbox.get()
            await then()

    async def receive(self, arrival: Arrival, transport: Any) -> None:
        """Admit one received message (:class:`~.admission.Admission`) and handle it at once; answer a
        refused HELLO with REJECT on its own connection. (The receive loops admit and queue instead.)"""
        then = await self._admit(arrival, transport)
        if then is not None:
            await then()

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
            reply, code, text, nonce = self._reply(transport, arrival, link), exc.code, exc.text, exc.hello_nonce
            return lambda: self._answer(link.refuse(code, text, reply, hello_nonce=nonce,
                                                    anchored=self.links.anchored))
        except VersionMismatch as exc:
            self.rejects(exc.code, arrival.sender, str(exc))
            link = self._link_of(arrival)
            if link is None or arrival.sender in self._refused_versions:  # once per connection
                return None
            if len(self._refused_versions) >= 1024:
                self._refused_versions.clear()  # bounded memory; a connection may get a second answer
            self._refused_versions.add(arrival.sender)
            reply, code, text = self._reply(transport, arrival, link), exc.code, str(exc)
            return lambda: self._answer(link.refuse(code, text, reply))
        if got is None:
            return None
        self.monitor.heard(got.link.name)
        if got.msg.type is MT.HEARTBEAT:
            self.monitor.on_heartbeat(got.link.name, got.msg.meta)  # its round-trip timestamps
            got.link.peer_anchored = got.link.peer_anchored or got.msg.meta.get("anchored") is True
            return None
        if got.msg.type is MT.PROJ:
            self.schedule.window.projector(got.link.stage, got.msg.pver)  # the link's version moves on (SPEC §9.6)
        return lambda: self._handle(got, arrival, transport)

    def _hold(self, arrival: Arrival, link: str) -> None:
        self.monitor.heard(link)  # authenticated and in sequence: a sign of life
        if len(self._held) >= self._inbox_bound:
            self.rejects("queue_full", arrival.sender, f"{self._inbox_bound} messages from before the start of "
                                                       f"training are held already")
            return
        self._held.append(replace(arrival, held=True))

    async def _start_training(self, transport: Any) -> None:
        """Training starts (the run epoch, step window and projector version are set): the held
        messages are admitted, in arrival order, before anything received later (SPEC §6.1 "Before
        training starts": a neighbour that had the resume decision first may have sent step N's PROJ
        and ACTs while this peer still loaded its checkpoint)."""
        async with self._admitting:
            self._training = True
            held, self._held = self._held, []
            for arrival in held:
                self._queue(await self._admit(arrival, transport), arrival.sender)
        if held:
            log.debug("%s: %d message(s) that came before the start of training admitted now", self.name, len(held))

    async def _handle(self, got: Admitted, arrival: Arrival, transport: Any) -> None:
        if got.msg.type is MT.HELLO and self._training and got.msg.epoch > self.epoch:
            # a neighbour re-forms the swarm (it lost its other neighbour); not answered: it repeats
            # its HELLO to this peer's next session
            self._pause(f"stage {got.msg.src} re-forms the swarm (its HELLO of run epoch {got.msg.epoch})",
                        epoch=got.msg.epoch, lost=None, told_by=got.msg.src)
            return
        if got.msg.type is MT.HELLO and self._must_resume(got.msg):
            return
        if got.msg.type is MT.HELLO:
            reply = self._reply(transport, arrival, got.link)
            await self._answer(got.link.on_hello(got.msg, arrival.sender, reply, now=self.admission.clock(),
                                                 anchored=self.links.anchored))
            return
        try:
            await self._dispatch(got.msg, got.link)
        except Rejected as exc:  # queue_full
            self.rejects(exc.code, arrival.sender, exc.text)

    def _link_of(self, arrival: Arrival) -> PeerLink | None:
        if arrival.reply_link is not None:
            return None  # never answer an answer
        stage = stage_of(arrival.sender)
        return None if stage is None else self.links.by_stage(stage)

    def _reply(self, transport: Any, arrival: Arrival, link: PeerLink) -> Reply:
        """Sends back on ``arrival``'s own connection (a transport without ``reply``: on the link)."""
        if self.admission.replies_on_link:
            return lambda frames, kind: transport.reply(arrival.sender, frames, kind=kind)
        return lambda frames, kind: transport.send(link.name, frames, kind=kind)

    async def _answer(self, sending: Awaitable[None]) -> None:
        try:
            await sending
        except NetError as exc:  # the connection is gone, or does not read
            log.warning("%s: could not answer: %s", self.name, exc)

    async def _dispatch(self, msg: Message, link: PeerLink) -> None:
        handler = self._handlers.get(msg.type)
        if handler is None:
            self.mailbox.put(msg)  # ACT, GRAD, PROJ, PROJ_GRAD, CODEBOOK_SLICE, BYE from upstream: the schedule's
        else:
            await handler(msg, link)

    def _must_resume(self, msg: Message) -> bool:
        """A HELLO or WELCOME from a swarm that re-forms after a departure (run epoch > 0) while this
        peer starts fresh: it can only take the departed stage's place from that stage's checkpoints,
        so it stops at once saying how (rather than waiting for pipeline messages that never come)."""
        resuming = self.run_policy is not None and self.run_policy.resume
        if self._training or resuming or msg.epoch == 0:
            return False
        self.mailbox.fail(PeerRejected(
            f"stage {msg.src} belongs to a swarm that re-forms after a departure (run epoch {msg.epoch}): stage "
            f"{self.stage} must take the departed peer's place from its checkpoints, so start it again with --resume "
            f"on a host holding stage {self.stage}'s checkpoint folder ({self.cfg.run.out_dir}/checkpoints)"))
        self._welcome_event.set()
        return True

    async def _on_welcome(self, msg: Message, link: PeerLink) -> None:
        if self._must_resume(msg):
            return
        refused = link.settings.mismatch(msg.meta, msg.src)
        if refused is not None:  # the neighbour runs another configuration (SPEC §9.2 step 3)
            link.on_reject(msg)
            self.mailbox.fail(PeerRejected(f"stage {msg.src} welcomed stage {self.stage} with another "
                                           f"configuration: {refused[1]}"))
            self._welcome_event.set()
            return
        link.on_welcome(msg)
        self.monitor.watch(link.name)  # heartbeats to it from now on
        if self.links.all_welcomed:
            self._welcome_event.set()

    async def _on_reject(self, msg: Message, link: PeerLink) -> None:
        link.on_reject(msg)
        reason, retry_s = msg.meta.get("reason"), self.cfg.net.hello_retry_s
        if link.retry and msg.meta.get("code") == "stage_taken":  # its old session has not timed out yet
            log.info("%s: stage %d still holds a session of stage %d; HELLO again in %g s", self.name, msg.src,
                     self.stage, retry_s)
            return
        if link.retry:  # a configuration refusal by a peer that is not anchored: which one is wrong is open
            if link.refused_by != reason:
                link.refused_by = reason
                log.warning("%s: stage %d at %s refused this peer: %s; neither is known to hold stage 0's "
                            "configuration yet, so this peer waits for one that does (HELLO again every %g s)",
                            self.name, msg.src, link.endpoint, reason, retry_s)
            return
        anchored = (f"; stage {msg.src} holds the run's configuration (stage 0's), so fix this peer's"
                    if msg.meta.get("anchored") is True else "")
        self.mailbox.fail(PeerRejected(f"stage {msg.src} refused stage {self.stage}: {reason}{anchored}"))
        self._welcome_event.set()

    async def _on_error(self, msg: Message, link: PeerLink) -> None:
        """ERROR is informational (SPEC §9.5): logged and counted; ``retransmit_unavailable`` (a
        micro-batch this peer waits for is lost) stops the peer."""
        code = str(msg.meta.get("code"))
        self.result.errors[code] = self.result.errors.get(code, 0) + 1
        log.warning("%s: stage %d reports an error: %s: %s", self.name, msg.src, code, msg.meta.get("message"))
        if code == "retransmit_unavailable":
            self.mailbox.fail(MaplError(f"stage {msg.src} failed: {msg.meta.get('message')}"))

    async def _on_bye(self, msg: Message, link: PeerLink) -> None:
        """BYE from upstream ends the run (the schedule's; before training, a BYE ``"drain"`` is a
        planned departure); from downstream the neighbour leaves: a planned departure with ``reason``
        ``"drain"``, else it left before the end (SPEC §9.5)."""
        reason = str(msg.meta.get("reason", ""))
        if reason == REJOIN_REASON:
            lost = msg.meta.get("lost")
            departed = f" (stage {lost} departed)" if lost is not None else ""
            self._pause(f"stage {msg.src} re-forms the swarm{departed}", epoch=max(self.epoch + 1, msg.epoch),
                        lost=lost, told_by=msg.src)
            return
        if link.is_upstream and (self._training or reason != DRAIN_REASON):
            self.mailbox.put(msg)
            return
        self._depart(link, "drain" if reason == DRAIN_REASON else "left", reason)

    async def _on_heartbeat(self, msg: Message, link: PeerLink) -> None:
        self.monitor.on_heartbeat(link.name, msg.meta)  # (the receive loops handle heartbeats themselves)

    async def _on_resync(self, msg: Message, link: PeerLink) -> None:
        link.on_resync(msg)

    async def _on_report(self, msg: Message, link: PeerLink) -> None:
        await self.schedule.on_report(msg)

    async def _on_checkpoint(self, msg: Message, link: PeerLink) -> None:
        if msg.meta["phase"] in DRAIN_PHASES:
            await self.drain.on_message(msg)
            return
        if self.run_policy is None:
            self.bad_frame(link.name, "CHECKPOINT but this peer keeps no checkpoints")
            return
        await self.run_policy.on_message(msg)

    # ------------------------------------------------------------------ lifecycle
    async def run(self, transport: Transport | None = None) -> PeerResult:
        """:meth:`serve` on ``transport`` (a started one, kept open: the next session of this process
        uses it, :mod:`~.sessions`), or on a transport of its own, closed at the end."""
        if transport is not None:
            return await self.serve(transport)
        async with Transport(self.name, TransportConfig.for_run(self.cfg, self.run_key)) as own:
            result = await self.serve(own)
            # a clean end: what is still queued (the last BYE) gets up to a second to leave
            await own.aclose(linger_s=_LAST_WORDS_S)
            return result

    async def serve(self, transport: Any) -> PeerResult:
        """Announce, find the neighbours, shake hands, train until the end (or a drain), collect the
        counters. ``transport`` is a started :class:`~mapl_swarm.net.transport.Transport` (tests: a
        fake). A departure or a second signal stops the work wherever it waits (see the module
        docstring for the ends)."""
        self.admission.replies_on_link = hasattr(transport, "reply") and hasattr(transport, "recv_reply")
        endpoint = transport.start()
        self._background: list[asyncio.Task] = []
        work = asyncio.create_task(self._work(transport, endpoint), name=f"{self.name} work")
        stopping = asyncio.create_task(self._stop_event.wait())
        codebooks = None
        try:
            try:
                await asyncio.wait({work, stopping}, return_when=asyncio.FIRST_COMPLETED)
                finished = work.done() and not work.cancelled() and work.exception() is None
                if not finished and self._stop_reason is not None:
                    work.cancel()
                    await asyncio.gather(work, return_exceptions=True)
                    await self._stopped(transport)
                else:
                    codebooks = await work
            except NonFiniteError as exc:
                await self._tell_neighbours(transport, exc)
                raise
        finally:
            for task in (work, stopping):
                task.cancel()
            await asyncio.gather(work, stopping, return_exceptions=True)
            await self.tasks.aclose()
            await self.monitor.aclose()
            for task in self._background:
                task.cancel()
            await asyncio.gather(*self._background, return_exceptions=True)
            self.compute.close()
            self.decoder.close()
            self.schedule.close()
            if self.run_policy is not None:  # its metrics stream: pending records written, file closed
                self.run_policy.close()
        self._collect(transport, codebooks)
        return self.result

    async def _work(self, transport: Any, endpoint: str) -> dict[str, Any] | None:
        """Everything :meth:`serve` does until the end, as one cancellable task."""
        net = self.cfg.net
        shaping = LinkConfig(bandwidth_mbps=net.bandwidth_mbps, latency_ms=net.latency_ms)
        await self.announce(endpoint)
        for link in self.links:
            candidates = await self.waits.wait(candidates_of(self.resolve, link.stage, net.timeout_s),
                                               lambda link=link: [link])
            await connect(link, transport, candidates[0], shaping)
            log.info("%s: link to stage %d at %s", self.name, link.stage, candidates[0])
        self._background.append(asyncio.create_task(self._receive_loop(transport)))
        if self.admission.replies_on_link:
            self._background.append(asyncio.create_task(self._reply_loop(transport)))
        self._background.append(asyncio.create_task(self._dispatch_loop()))
        self.monitor.start()
        await self._handshake(transport, shaping)
        self.schedule.begin(await self._agree_start(transport), self.epoch)
        await self._start_training(transport)
        await self.schedule.run()
        self._schedule_ended = True
        self._ended()
        await transport.flush(net.timeout_s)
        return await self.compute.run(self._codebook_summary)  # digests read device memory

    # ------------------------------------------------------------------ liveness and departures
    async def _heartbeat(self, name: str) -> None:
        """One HEARTBEAT to neighbour ``name``, with its round-trip timestamps (SPEC §9.5)."""
        link = self.links.named(name)
        if link is not None:
            await link.send_heartbeat(lambda: {**self.monitor.heartbeat_meta(name),
                                               **({"anchored": True} if self.links.anchored else {})})

    def _on_silent(self, silence: Silence) -> None:
        link = self.links.named(silence.peer)
        if link is not None:
            self.departures.report(Departure(stage=link.stage, endpoint=link.endpoint, kind="silent",
                                             last_seen=silence.last_seen, detail=silence.describe()))

    def _depart(self, link: PeerLink, kind: str, detail: str) -> None:
        self.departures.report(Departure(stage=link.stage, endpoint=link.endpoint, kind=kind,  # type: ignore[arg-type]
                                         last_seen=time.time(), detail=detail))

    def _on_departure(self, departure: Departure) -> None:
        """A departure during training (or while the swarm re-forms) while this peer is not draining
        pauses it: the swarm re-forms and waits for a replacement of the stage (SPEC "Rejoin"; with
        ``net.rejoin_timeout_s`` and checkpoints on). Otherwise a planned departure ends this peer
        cleanly (its other neighbour is told with BYE ``"drain"``), any other one ends it with
        :class:`NeighbourLost`. After the schedule's end neighbours leave as they finish: logged only."""
        self.monitor.forget(stage_name(departure.stage))
        if self._schedule_ended:
            log.info("%s: %s after the end of the run", self.name, departure.describe())
            return
        if (self._training or self.rejoining) and self._can_rejoin and not self.drain.active:
            self._pause(departure.describe(), epoch=self.epoch + 1, lost=departure.stage)
            return
        if departure.planned:
            self._stop(_CleanStop("stopped", f"stage {self.stage} stopped: {departure.describe()}"))
            return
        error = NeighbourLost(self.name, departure)
        self.mailbox.fail(error)
        self._stop(error)

    @staticmethod
    def _rejoin_configured(cfg: TrainConfig, run_policy: PeerRunPolicy | None) -> bool:
        """This peer takes part in rejoin (advertises it): ``net.rejoin_timeout_s`` > 0 and checkpoints
        on, agreed with the other stages (SPEC "Rejoin": a departed stage comes back to a saved step)."""
        return cfg.net.rejoin_timeout_s > 0 and run_policy is not None and run_policy.checkpoints_on

    @property
    def _can_rejoin(self) -> bool:
        """A departure can be survived: this peer and every neighbour take part in rejoin."""
        return (self._rejoin_configured(self.cfg, self.run_policy)
                and all(REJOIN_CAPABILITY in link.capabilities for link in self.links))

    def _pause(self, why: str, *, epoch: int, lost: int | None, told_by: int | None = None) -> None:
        """End this session so that the swarm re-forms at run epoch ``epoch`` (SPEC "Rejoin")."""
        if self._stop_reason is None:
            log.warning("%s: %s; pausing: the swarm re-forms (run epoch %d) and rolls back to the newest step "
                        "every stage saved", self.name, why, epoch)
        self.mailbox.fail(MaplError(f"{self.name}: paused: {why}"))
        self._stop(_Rejoin(f"stage {self.stage} paused at step {self.schedule.step}: {why}", epoch=epoch, lost=lost,
                           told_by=told_by))

    def _stop(self, reason: BaseException) -> None:
        """End the work now with ``reason`` (raised, or a :class:`_CleanStop`); the first one counts."""
        if self._stop_reason is None:
            self._stop_reason = reason
        self._stop_event.set()

    async def _stopped(self, transport: Any) -> None:
        """The work was stopped: a clean stop tells the neighbours still here (BYE ``"drain"``) and
        becomes the result's end; anything else is raised."""
        reason = self._stop_reason
        if not isinstance(reason, _CleanStop):
            raise reason
        if isinstance(reason, _Rejoin):  # the other neighbours re-form too
            bye = {"reason": REJOIN_REASON, **({"lost": reason.lost} if reason.lost is not None else {})}
            self.result.epoch = reason.epoch
            self.result.rejoins.append(reason.note)
        else:
            bye = {"reason": DRAIN_REASON}
        told_by = getattr(reason, "told_by", None)  # a neighbour that re-forms already: not told again
        for link in self.links:
            if link.welcomed and self.departures.gone(link.stage) is None and link.stage != told_by:
                try:
                    await asyncio.wait_for(link.send_bye(bye, step=self.schedule.step), 5.0)
                except (NetError, asyncio.TimeoutError) as err:
                    log.warning("%s: could not tell stage %d: %s", self.name, link.stage, err)
        try:
            await transport.flush(5.0)
        except (NetError, asyncio.TimeoutError):
            pass
        self.result.end, self.result.end_note = reason.end, reason.note

    # ------------------------------------------------------------------ drain
    def request_drain(self, signal_name: str) -> None:
        """A first SIGINT/SIGTERM (:class:`~.drain.DrainSignals`): drain the swarm at the next step
        boundary; before training started, stop at once."""
        reason = f"{signal_name} at stage {self.stage}"
        if not self._training:
            self._stop(_CleanStop("stopped", f"stage {self.stage} stopped before training started ({signal_name})"))
            return
        log.info("%s: %s: draining (finishing the current step, then a checkpoint; again to stop at once)",
                 self.name, signal_name)

        async def ask() -> None:
            try:
                await self.drain.request(reason)
            except MaplError as exc:
                self._stop(Interrupted(f"{exc}; stopped at once"))

        self.tasks.spawn(ask())

    def abort(self, signal_name: str) -> None:
        """A second SIGINT/SIGTERM: stop at once (the step in flight is lost)."""
        self._stop(Interrupted(f"stage {self.stage} stopped at once by a second {signal_name}: the step in "
                               f"flight is lost; the newest complete checkpoint is kept"))

    def _send_checkpoint(self, dst: int, meta: dict) -> Awaitable[None]:
        return self.links.by_stage(dst).send(MT.CHECKPOINT, step=meta.get("step") or 0, meta=meta)

    def _takes_drain(self, stage: int) -> bool:
        link = self.links.by_stage(stage)
        return link is not None and link.welcomed and DRAIN_CAPABILITY in link.capabilities

    def _ended(self) -> None:
        """The schedule ended: after a drain (decided here, or a BYE ``"drain"``), say so; after the
        last step, say so only when its checkpoint will never be complete (a stage could not save it)."""
        step = drained_at(self.drain, self.schedule.bye)
        if step is None:
            last = self.cfg.run.steps
            if self.run_policy is not None and self.run_policy.unsaved_reason(last) is not None:
                self.result.checkpoint_note = checkpoint_note(self.run_policy, last, self.schedule.s.start_step)
                log.warning("%s: %s", self.name, self.result.checkpoint_note)
            return
        why = self.drain.reason or self.drain.requested or "asked by another stage"
        note = checkpoint_note(self.run_policy, step, self.schedule.s.start_step)
        self.result.end, self.result.drained_at, self.result.checkpoint_note = "drained", step, note
        self.result.end_note = f"stage {self.stage} drained at step {step} ({why}): {note}"

    async def _tell_neighbours(self, transport: Any, exc: NonFiniteError) -> None:
        """Best effort, before this peer exits: BYE with the reason upstream, where it stops the
        neighbour at once (SPEC §9.5: a downstream neighbour left before the end). Downstream, a BYE
        would end the run as finished; the neighbour there sees this peer lost instead."""
        up = self.links.upstream
        if up is not None and up.welcomed:
            try:
                await asyncio.wait_for(up.send_bye({"reason": str(exc)}), 5.0)
            except (NetError, asyncio.TimeoutError) as err:
                log.warning("%s: could not tell stage %d: %s", self.name, up.stage, err)
        try:
            await transport.flush(5.0)
        except (NetError, asyncio.TimeoutError):
            pass

    async def _handshake(self, transport: Any, shaping: LinkConfig) -> None:
        net = self.cfg.net
        await Handshake(self.name, self.links, resolve=self.resolve, retry_s=net.hello_retry_s, waits=self.waits,
                        welcomed=self._welcome_event, failed=lambda: self.mailbox.error).run(
            transport, shaping, timeout_s=net.rejoin_timeout_s if self.rejoining else net.timeout_s,
            rejoining=self.rejoining)

    async def _agree_start(self, transport: Transport) -> int | None:
        """The step to start from, agreed by every stage on resume (SPEC §5.2), its state loaded."""
        if self.run_policy is None:
            return None
        links = {link.stage: link for link in self.links}

        async def send(dst: int, meta: dict) -> None:
            await links[dst].send(MT.CHECKPOINT, step=meta.get("step") or 0, meta=meta)

        try:
            start = await self.run_policy.begin(send, {s: set(link.capabilities) for s, link in links.items()},
                                                lambda: self.mailbox.error, epoch=self.epoch, rejoin=self.rejoining)
        except MaplError:
            await transport.flush(self.cfg.net.timeout_s)  # a refusal reaches the other stages first
            raise
        self.epoch = self.run_policy.epoch
        self.links.set_epoch(self.epoch)
        self.result.start_step, self.result.epoch = start, self.epoch
        return start

    def _codebook_summary(self) -> dict[str, Any] | None:
        """mapl_vq: the links' codebook counters, versions and digests (on the compute thread)."""
        if self.rt.vq is None:
            return None
        return codebook_summary(self.rt.vq, [link.codebooks for link in self.links])

    def _collect(self, transport: Transport, codebooks: dict[str, Any] | None) -> None:
        """The links' and transport's counters (and the codebook summary) into the result."""
        self.result.bad_frames = self.rejects.total
        rows = transport.counters.rows()
        for link in self.links:
            self.result.payload_tx[link.name] = {str(k): v for k, v in link.counter.bytes.items()}
            self.result.wire_tx[link.name] = {r["kind"]: r["wire_bytes"] for r in rows
                                              if r["link"] == link.name and r["direction"] == "tx"}
            st = transport.shaper(link.name).stats()
            self.result.shaper[link.name] = {"bytes_sent": st.bytes_sent, "busy_s": st.busy_s,
                                             "messages": st.messages_sent}
        if codebooks is not None:
            self.result.codebooks = codebooks
