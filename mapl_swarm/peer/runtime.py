"""One stage peer: its lifecycle, as one state machine, and the parts it is assembled from.

The parts (one concern each) are listed in :mod:`mapl_swarm.peer`; :class:`Peer` builds and wires them.

The lifecycle of one session (SPEC §9.9) is :mod:`~.lifecycle`'s state machine, each transition
logged once.

Every part that fails ends the session through :meth:`Peer.stop` (the first reason wins): the
work (lookup, handshake, agreement, schedule) runs as one task that a stop cancels wherever it
waits, and the receive loops and other background tasks stop the peer when they fail
(:class:`~.compute.BackgroundTasks`). A NaN/Inf in this peer's own compute
(:class:`~mapl_swarm.errors.NonFiniteError`) ends the peer (exit status 3) after a BYE naming it
upstream; downstream it is a lost neighbour (SPEC §9.5).

Ends (``result.end``): ``finished`` (the last step), ``drained`` (a graceful drain, or a BYE
``"drain"`` from upstream), ``stopped`` (a signal before training started, or a neighbour's planned
departure without live rejoin) — all exit status 0, with ``result.end_note`` as the one line to
print; ``rejoin`` (the session ended so that the swarm re-forms: the process goes on with its next
session, :mod:`~.sessions`); without live rejoin an unplanned departure raises
:class:`~.departures.NeighbourLost`, a second signal :class:`~.signals.Interrupted`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import TYPE_CHECKING, Any

import torch

from mapl_swarm.aio import within
from mapl_swarm.config import TrainConfig, config_summary
from mapl_swarm.errors import MaplError, MissingCheckpoints, NonFiniteError
from mapl_swarm.net.emulator import LinkConfig
from mapl_swarm.net.errors import NetError
from mapl_swarm.net.heartbeat import HeartbeatConfig, HeartbeatMonitor, Silence
from mapl_swarm.net.identity import REVOCATION_POLL_S
from mapl_swarm.net.transport import Transport, peer_transport
from mapl_swarm.peer.admission import Admission, RejectCounter, mailbox_bound, run_shapes
from mapl_swarm.peer.checkpoints import CheckpointAgreement, checkpoint_note
from mapl_swarm.peer.compute import BackgroundTasks, ComputeThread, WorkerThread
from mapl_swarm.peer.control import Control, PeerRejected
from mapl_swarm.peer.departures import Departure, Departures, NeighbourLost, TakenForGone
from mapl_swarm.peer.dialback import DialBacks
from mapl_swarm.peer.ingress import Ingress
from mapl_swarm.peer.lifecycle import PeerState
from mapl_swarm.peer.link import LinkSettings, Links, PeerLink, stage_name
from mapl_swarm.peer.mailbox import Mailbox
from mapl_swarm.peer.result import PeerResult, collect, write_result
from mapl_swarm.peer.linker import Linker, Reform, candidates_of, starting_replicas
from mapl_swarm.peer.replica_resume import ReplicaResume
from mapl_swarm.peer.credits import Credits
from mapl_swarm.peer.strikes import Strikes
from mapl_swarm.peer.driver import NoRunHooks, Schedule
from mapl_swarm.peer.signals import Interrupted
from mapl_swarm.peer.vq_link import codebook_summary
from mapl_swarm.peer.waiting import WAIT_LOG_INTERVAL_S, WaitingLog
from mapl_swarm.pipeline.stage import StageRuntime
from mapl_swarm.wire import MessageType
from mapl_swarm.wire.codebook import INDEXED_SLICES_CAPABILITY, RETRANSMIT_CAPABILITY, VQ_CAPABILITY
from mapl_swarm.wire.spec import DRAIN_REASON, REJOIN_CAPABILITY, REJOIN_REASON, REPLICAS_CAPABILITY

if TYPE_CHECKING:
    from mapl_swarm.net.identity import PeerIdentity
    from mapl_swarm.net.transport import Membership
    from mapl_swarm.peer.checkpoints import PeerRunPolicy
    from mapl_swarm.replicas.gradients import ReplicaGradients

log = logging.getLogger(__name__)

__all__ = ["Peer", "PeerState", "PeerResult", "PeerRejected", "NeighbourLost", "Interrupted", "stage_name",
           "write_result"]

MT = MessageType

_LAST_WORDS_S = 1.0
"""After a clean end, how long ZeroMQ may take to send what it still queues (a BYE)."""


def _rejoin_configured(cfg: TrainConfig, run_policy: PeerRunPolicy | None) -> bool:
    """A peer takes part in rejoin: ``net.rejoin_timeout_s`` > 0 and checkpoints on, agreed with the
    other stages (SPEC "Rejoin": a departed stage comes back to a saved step). A chain's peer
    advertises it; a replica does not (its HELLO may carry a redo's run epoch, which the
    capability's admission would take for a re-form) and re-forms when a stage loses its last
    replica (SPEC §9.10 item 10)."""
    return cfg.net.rejoin_timeout_s > 0 and run_policy is not None and run_policy.checkpoints_on


_LAST_REPLICA_HINT = (
    "; it was its stage's last replica, so the run ends (without net.rejoin_timeout_s > 0 and checkpoints the swarm "
    "cannot wait for a replacement; SPEC §9.10 item 10). Start every replica of the run again with --resume: they go "
    "on from the newest checkpoint every current replica holds (a lost stage's replica from its checkpoint folder)")


def _checkpoint_on(link: PeerLink, meta: dict) -> Awaitable[None]:
    """A CHECKPOINT on ``link`` (header ``step``: the meta's, 0 when nil or absent; SPEC §5.2)."""
    return link.send(MT.CHECKPOINT, step=meta.get("step") or 0, meta=meta)


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
    without the tokenizer's). ``epoch`` and ``rejoining``: a session that re-forms the swarm after a
    departure (:mod:`~.sessions`): it waits up to ``net.rejoin_timeout_s`` for a replacement and
    rolls back to the newest step every stage has."""

    def __init__(self, cfg: TrainConfig, stage: int, runtime: StageRuntime, *, fingerprint: str,
                 config: Mapping[str, Any] | None = None,
                 resolve: Callable[[int, float], Awaitable[str]], announce: Callable[[str], Awaitable[Any]],
                 sampler=None, val_batches: list[torch.Tensor] | None = None, progress: bool = False,
                 start_step: int = 0, compute: ComputeThread | None = None,
                 run_policy: PeerRunPolicy | None = None,
                 wait_log_interval_s: float = WAIT_LOG_INTERVAL_S, membership: Membership | None = None,
                 epoch: int = 0, rejoining: bool = False, replicas: ReplicaGradients | None = None,
                 joining: bool = False, reform: Reform | None = None, credits: Credits | None = None) -> None:
        self.cfg, self.stage, self.rt, self.run_policy = cfg, stage, runtime, run_policy
        self.epoch = epoch
        """This peer's run epoch (SPEC "Rejoin"): the swarm's once the start step is agreed."""
        self.rejoining = rejoining
        self.joining = joining
        """With replicas: this replica joins a running swarm (SPEC §9.10 item 11)."""
        self.reform = reform
        """With replicas, a session that re-forms the swarm: what this peer knew at its pause."""
        self.next_reform: Reform | None = None
        """With replicas, once this session paused: what the next one re-forms with."""
        self.state = PeerState.STARTING
        P, net = cfg.pipeline.num_stages, cfg.net
        self.name = stage_name(stage)
        self.announce = announce
        self.membership = membership  # a certified identity (CURVE links to named peers); None: insecure
        self.result = PeerResult(stage)
        self.rejects = RejectCounter(self.name, self.result.rejects)
        """Counts and logs every dropped message by code (into ``result.rejects``)."""
        self.mailbox = Mailbox(self.name, max_per_sender=mailbox_bound(cfg), bound=4 * mailbox_bound(cfg) + 64)
        """The one inbound queue: admitted messages for the schedule and the dispatcher, and the
        pipeline messages held until training starts."""
        self.compute = compute or ComputeThread(self.name)
        self.decoder = WorkerThread(f"{self.name}-decode")
        """Decodes and inflates received tensors and checks their content, off the event loop."""
        self.tasks = BackgroundTasks(on_error=self.stop)
        """The receive loops, the dispatcher and other tasks beside the work: a failure stops the peer."""
        self.waits = WaitingLog(self.name, wait_log_interval_s)
        vq = runtime.vq is not None
        self.agreement = run_policy.agreement if run_policy is not None else CheckpointAgreement(None, stage, P)
        """Every CHECKPOINT phase: checkpoint agreement and the drain (:meth:`request_drain`: a signal)."""
        self.agreement.send, self.agreement.on_drain = self._send_checkpoint, self._drain_decided
        if membership is not None and stage == 0:
            self.agreement.prove = lambda step: membership.sign_drain(self.epoch, step)
        self.replicas_on = cfg.replicas.enabled
        """Several peers per stage (SPEC §9.10): a link per neighbour replica, ROUTE, rounds and commits;
        checkpoints agreed on resume only, no drain (a signal stops this replica); a neighbour
        replica that leaves is the schedule's while its stage keeps another, the last one re-forms
        the swarm (:attr:`_can_rejoin`)."""
        settings = LinkSettings(
            run_id=cfg.run.run_id, stage=stage, num_stages=P, fingerprint=fingerprint,
            config=config if config is not None else config_summary(cfg),
            capabilities=("1f1b", *((REJOIN_CAPABILITY,) if _rejoin_configured(cfg, run_policy)
                                    and not cfg.replicas.enabled else ()),
                          *((VQ_CAPABILITY, RETRANSMIT_CAPABILITY, INDEXED_SLICES_CAPABILITY) if vq else ()),
                          *((REPLICAS_CAPABILITY,) if self.replicas_on else self.agreement.capabilities)),
            num_micro_batches=cfg.pipeline.num_micro_batches, micro_batch_size=cfg.pipeline.micro_batch_size,
            eval_batches=cfg.eval.batches, max_in_flight=net.max_in_flight or P, identity=membership,
            sign_work=self.replicas_on and cfg.replicas.check_fraction > 0,
            compress_ids=net.compress_ids, max_frame_bytes=net.max_frame_bytes, replicas=self.replicas_on,
            stage_replicas=reform.replicas if reform is not None else 0, lost=reform.lost if reform else None)
        self.settings = settings
        self.links = Links(stage - 1 if stage > 0 else None, stage + 1 if stage < P - 1 else None)
        """A link per peer of each neighbour stage, each to its DHT record's contact (:attr:`linker`)."""
        if run_policy is not None and not run_policy.checkpoints_on and net.rejoin_timeout_s > 0:
            log.warning("%s: checkpoint.interval_steps = 0: live rejoin is impossible (a departed stage comes back "
                        "to a step every stage saved); a departure ends every peer", self.name)
        self.schedule = Schedule(
            runtime, self.links, self.mailbox, self.compute, name=self.name, cfg=cfg, start_step=start_step,
            progress=progress, result=self.result, waits=self.waits, hooks=run_policy or NoRunHooks(), replicas=replicas,
            sampler=sampler, val_batches=val_batches or [], reject=self.rejects, spawn=self.tasks.spawn,
            joining=joining, drain=None if self.replicas_on else self.agreement,
            may_drain=stage == 0 or membership is None or "drain" in membership.body.roles,
            stage_contacts=lambda: candidates_of(self.linker.resolve, stage, net.timeout_s),
            leave=lambda why: self.stop(TakenForGone(self.name, why)))
        if reform is not None:  # what a pause before the handshake ends carries on
            self.schedule.starting = reform.replicas
        if self.replicas_on and run_policy is not None:  # a resumed run's agreement (SPEC §9.10 item 13)
            run_policy.replica_resume = ReplicaResume(self.name, stage, self.links, _checkpoint_on,
                                                      self.schedule.resume_round)
        self.linker = Linker(
            self.name, self.links, settings, resolve=resolve, timeout_s=net.timeout_s,
            hello_retry_s=net.hello_retry_s, waits=self.waits, on_bad_frame=self.bad_frame,
            shaping=LinkConfig(bandwidth_mbps=net.bandwidth_mbps, latency_ms=net.latency_ms),
            gone=lambda: self.schedule.gone, epoch=lambda: self.schedule.epoch if self.replicas_on else self.epoch,
            one_per_stage=not self.replicas_on,
            prepare=lambda link: link.use_codebooks(runtime, self.compute, spawn=self.tasks.spawn,
                                                    strike=lambda *a: self.strikes.count(*a)) if vq else None)
        """The links to the neighbour stages' peers and the handshake (with replicas, new ones while training too)."""
        self.monitor = HeartbeatMonitor(
            HeartbeatConfig(interval_s=net.heartbeat_interval_s, timeout_s=net.liveness_ceiling,
                            floor_s=net.liveness_floor),
            send=self._heartbeat, on_silent=self._on_silent)
        """Heartbeats to, round trips and silence of, each neighbour once it welcomed this peer
        (running while :meth:`serve` does)."""
        self.strikes = Strikes(self._struck_out)
        """Neighbours in session whose messages keep failing the content checks (:mod:`~.strikes`)."""
        self.admission = Admission(
            settings, self.links, shapes=run_shapes(cfg, stage), window=self.schedule.window, rejects=self.rejects,
            decoder=self.decoder, deadline=self.monitor.session_deadline_s, clock=time.monotonic, replies_on_link=False,
            started=lambda: self.ingress.started, unknown_replica=self.linker.unknown, strike=self.strikes.count)
        self.departures = Departures(self._on_departure)
        """Neighbours that went silent or left (:mod:`~.departures`)."""
        self.control = Control(
            self, cfg, links=self.links, linker=self.linker, monitor=self.monitor, schedule=self.schedule,
            agreement=self.agreement, ingress=lambda: self.ingress, rejects=self.rejects, result=self.result,
            clock=self.admission.clock,
            replica_resume=lambda: run_policy.replica_resume if run_policy is not None else None,
            credits=credits or Credits.of(cfg),
            step=lambda: self.schedule.step)
        """The handlers of admitted control messages, by type."""
        self.ingress = Ingress(self.name, self.links, self.admission, self.monitor, self.rejects,
                               self.schedule.arrived, self.mailbox, handle=self.control.handle, spawn=self.tasks.spawn,
                               held_bound=4 * mailbox_bound(cfg) + 64, run_steps=cfg.run.steps,
                               dialbacks=DialBacks(self.name, stage, cfg.run.run_id, membership))
        self.receive = self.ingress.receive
        """Admit one received message and handle it at once (tests; the receive loops queue instead)."""
        self.stop_reason: BaseException | None = None
        """Why the session was stopped (the first :meth:`stop`), None while it was not."""
        self.transport: Any = None
        self._stop_event = asyncio.Event()

    @property
    def started(self) -> bool:
        """Training started: pipeline messages are no longer held, the run epoch is the swarm's."""
        return self.state.started

    @property
    def resuming(self) -> bool:
        """This peer resumes from its checkpoints (``--resume``, or a session that re-forms)."""
        return self.run_policy is not None and self.run_policy.resume

    @property
    def handshaking(self) -> bool:
        """The handshake runs: a neighbour's BYE frees its stage instead of being a departure."""
        return self.state is PeerState.HANDSHAKING

    def bad_frame(self, sender: str, why: str) -> None:
        """Count, log and drop a message the links cannot use (``not_allowed``)."""
        self.rejects("not_allowed", sender, why)

    def _enter(self, state: PeerState, why: str) -> None:
        """Move the lifecycle on (one log line per transition)."""
        if state is self.state:
            return
        if not self.state.may_become(state):
            raise RuntimeError(f"{self.name}: no transition {self.state.value} -> {state.value}")
        log.info("%s: %s -> %s: %s", self.name, self.state.value, state.value, why)
        self.state = state

    # ------------------------------------------------------------------ the session
    async def run(self, transport: Transport | None = None) -> PeerResult:
        """:meth:`serve` on ``transport`` (a started one, kept open: the next session of this process
        uses it, :mod:`~.sessions`), or on a transport of its own, closed at the end."""
        if transport is not None:
            return await self.serve(transport)
        async with peer_transport(self.name, self.cfg, self.membership) as own:
            result = await self.serve(own)
            # a clean end: what is still queued (the last BYE) gets up to a second to leave
            await own.aclose(linger_s=_LAST_WORDS_S)
            return result

    async def serve(self, transport: Any) -> PeerResult:
        """Announce, find the neighbours, shake hands, train until the end (or a drain), collect the
        counters. ``transport`` is a started :class:`~mapl_swarm.net.transport.Transport` (tests: a
        fake). A stop ends the work wherever it waits (see the module docstring for the ends)."""
        self.admission.replies_on_link = hasattr(transport, "reply") and hasattr(transport, "recv_reply")
        self.transport = transport  # its counters are read by the metrics export (:mod:`.figures`)
        endpoint = transport.start()
        unwatch = transport.add_connection_listener(self.monitor.connection)  # a neighbour's process ended
        work = asyncio.create_task(self._work(transport, endpoint), name=f"{self.name} work")
        stopping = asyncio.create_task(self._stop_event.wait())
        codebooks = None
        try:
            try:
                await asyncio.wait({work, stopping}, return_when=asyncio.FIRST_COMPLETED)
                finished = work.done() and not work.cancelled() and work.exception() is None
                if not finished and self.stop_reason is not None:
                    work.cancel()
                    await asyncio.gather(work, return_exceptions=True)
                    await self._stopped(transport)
                else:
                    codebooks = await work
            except NonFiniteError as exc:  # BYE upstream stops that neighbour at once (SPEC §9.5); downstream
                up = self.links.upstream  # a BYE would end the run as finished: it finds this peer lost instead
                await self._say_bye(transport, [up] if up is not None and up.welcomed else [], {"reason": str(exc)})
                raise
        finally:
            unwatch()
            for task in (work, stopping):
                task.cancel()
            await asyncio.gather(work, stopping, return_exceptions=True)
            await self.tasks.aclose()
            await self.monitor.aclose()
            self.compute.close()
            self.decoder.close()
            self.schedule.close()
            if self.run_policy is not None:  # its metrics stream: pending records written, file closed
                self.run_policy.close()
        collect(self.result, transport, self.links, self.rejects, codebooks)
        return self.result

    async def _work(self, transport: Any, endpoint: str) -> dict[str, Any] | None:
        """Everything :meth:`serve` does until the end, as one cancellable task."""
        net = self.cfg.net
        await self.announce(endpoint)
        if self.rejoining:  # new connections at once, not after the old ones time out (SPEC §9.6)
            transport.new_routing_id()
        timeout_s, why = net.timeout_s, "net.timeout_s"
        if self.rejoining:  # the wait for a departed stage's replacement, its record included (SPEC §9.6)
            timeout_s, why = net.rejoin_timeout_s, ("net.rejoin_timeout_s: no replacement of the departed stage "
                                                    "came; start one with --resume on a host with its checkpoints")
        await self.linker.link_all(transport, endpoint, fresh=self.rejoining, timeout_s=timeout_s, why=why,
                                   joining=self.joining)
        self.tasks.spawn(self.ingress.receive_loop(transport))
        if self.admission.replies_on_link:
            self.tasks.spawn(self.ingress.reply_loop(transport))
        self.tasks.spawn(self.ingress.dispatch_loop(transport))
        self.monitor.start()
        if self.admission.s.identity is not None and self.admission.s.identity.watch is not None:
            self.tasks.spawn(self._watch_revocations(self.admission.s.identity))
        self._enter(PeerState.HANDSHAKING, f"HELLO to stage(s) {self.links.stages}")
        if self.joining:
            await self.linker.greet_all(transport)
        else:
            await self.linker.handshake(transport, self._starting_replicas, timeout_s=timeout_s, why=why)
            self.schedule.starting = self._starting_replicas(self.stage)
        self._enter(PeerState.AGREEING, f"welcomed by stage(s) {self.links.stages}")
        start = await self._agree_start(transport)
        self.schedule.begin(start, self.epoch, behind=self.run_policy is not None and self.run_policy.behind)
        self._enter(PeerState.TRAINING, f"from step {self.schedule.step} (run epoch {self.epoch})")
        await self.ingress.start(transport)
        if self.replicas_on:  # replicas that join the running swarm
            self.tasks.spawn(self.linker.watch(transport, self.tasks.spawn))
        await self.schedule.run()
        await self.ingress.settled(net.timeout_s)
        self._enter(PeerState.ENDED, f"at step {self.schedule.step}")
        drained = self.schedule.drained_at
        if self.replicas_on and drained is not None:  # every replica saves the drain step
            self.agreement.drained(drained, self.schedule.core.stopping.reason or "asked by another stage")
            if self.run_policy is not None:
                await self.run_policy.drain_at(drained)
        self._ended()
        await transport.flush(net.timeout_s)
        if self.rt.vq is None:
            return None
        return await self.compute.run(codebook_summary, self.rt.vq,  # digests read device memory
                                      [link.codebooks for link in self.links])

    async def _agree_start(self, transport: Transport) -> int | None:
        """The step to start from, agreed by every stage on resume (SPEC §5.2), its state loaded."""
        self.agreement.neighbours({link.stage: link.capabilities for link in self.links})
        if self.run_policy is None:
            return None
        try:
            start = await self.run_policy.begin(epoch=self.epoch, rejoin=self.rejoining)
        except MaplError as exc:
            await transport.flush(self.cfg.net.timeout_s)  # a refusal reaches the other stages first
            if isinstance(exc, MissingCheckpoints) and self.rejoining and self.stage not in exc.stages:
                # the replacement came without its stage's files: it stops, the swarm waits for another
                self.pause(f"the replacement of stage(s) {exc.stages} cannot resume: {exc}", epoch=self.epoch + 1,
                           lost=exc.stages[0])
            raise
        self.epoch = self.run_policy.epoch
        self.links.set_epoch(self.epoch)
        self.result.start_step, self.result.epoch = start, self.epoch
        return start

    # ------------------------------------------------------------------ liveness and departures
    async def _heartbeat(self, name: str) -> None:
        """One HEARTBEAT to neighbour ``name``, with its round-trip timestamps (SPEC §9.5) and, once
        this peer is anchored, saying so (SPEC §9.2)."""
        link = self.links.named(name)
        if link is not None:
            await link.send_heartbeat(lambda: self.monitor.heartbeat_meta(name), anchored=self.links.anchored)

    def _on_silent(self, silence: Silence) -> None:
        link = self.links.named(silence.peer)
        if link is not None and not self._replica_left(link, silence.describe()):
            self.departures.report(Departure(stage=link.stage, endpoint=link.endpoint, kind="silent",
                                             last_seen=silence.last_seen, detail=silence.describe()))

    async def _watch_revocations(self, identity: PeerIdentity) -> None:
        """A newer revocation list (SPEC §7.2 item 8) cuts off each neighbour it revokes, as a
        departure (the swarm re-forms without it; its HELLO is refused), and ends this peer if it
        revokes this peer's own certificate."""
        while True:
            await asyncio.sleep(REVOCATION_POLL_S)  # a file's change, polled
            if not identity.watch.poll(identity):
                continue
            if identity.body.serial in identity.revoked:
                self.stop(MaplError(f"{self.name}: this peer's certificate (serial {identity.body.serial}) is revoked"))
                return
            for link in self.links:
                cert = link.peer_certificate
                if cert is not None and cert.serial in identity.revoked and self.departures.gone(link.stage) is None:
                    self.cut_off(link, f"its certificate (serial {cert.serial}) is revoked")

    def _struck_out(self, member: str, why: str) -> None:
        """Neighbour ``member`` keeps sending what no honest peer sends (:meth:`exclude`)."""
        link = self.links.named(member)
        if link is not None:
            self.exclude(link, why)

    def exclude(self, link: PeerLink, why: str) -> None:
        """Neighbour ``link`` acts as no honest member does: its certificate is refused from now on,
        as if revoked (a new certificate has another serial), and it is cut off."""
        identity = self.admission.s.identity
        cert = link.peer_certificate
        if identity is not None and cert is not None:
            identity.revoked.add(cert.serial)
        self.cut_off(link, why)

    def cut_off(self, link: PeerLink, why: str) -> None:
        """Neighbour ``link`` is no longer let in: it departs (with replicas, while its stage keeps a
        live replica, that one replica: the schedule goes on without it), then its sessions end."""
        self.depart(link, "left", why)  # first: the schedule tells a replica from its stage's last by its session
        link.end_sessions()

    def depart(self, link: PeerLink, kind: str, detail: str, *, after: int | None = None) -> None:
        """Neighbour ``link`` left (``kind`` ``"drain"``: planned, ``"left"``: before the end; ``after``:
        a replica that left on purpose once it took that many steps)."""
        if self._replica_left(link, f"{kind}: {detail}", after=after):
            return
        self.departures.report(Departure(stage=link.stage, endpoint=link.endpoint, kind=kind,  # type: ignore[arg-type]
                                         last_seen=time.time(), detail=detail))

    def _replica_left(self, link: PeerLink, why: str, *, after: int | None = None) -> bool:
        """With replicas, during training: a neighbour replica whose stage keeps another is the
        schedule's to drop (SPEC §9.10 "Replicas that leave"); True when it did."""
        if not (self.replicas_on and self.state in (PeerState.TRAINING, PeerState.DRAINING)):
            return False
        if not self.schedule.replica_gone(link, why, after=after):
            return False
        self.monitor.forget(link.name)
        return True

    def _on_departure(self, departure: Departure) -> None:
        """A departure during training (or while the swarm re-forms) while this peer is not draining
        pauses it: the swarm re-forms and waits for a replacement of the stage (SPEC "Rejoin"; with
        ``net.rejoin_timeout_s`` and checkpoints on). Otherwise a planned departure ends this peer
        cleanly (its other neighbour is told with BYE ``"drain"``), any other one ends it with
        :class:`NeighbourLost`. After the schedule's end neighbours leave as they finish: logged only."""
        for link in self.links.of_stage(departure.stage):
            self.monitor.forget(link.name)
        if self.state is PeerState.ENDED:
            log.info("%s: %s after the end of the run", self.name, departure.describe())
            return
        if (self.state.started or self.rejoining) and self._can_rejoin and not self.agreement.draining:
            if self.replicas_on:  # a stage's last replica; the run epoch goes past the session's redos
                self.pause(f"{departure.describe()}; it was its stage's last replica", lost=departure.stage,
                           epoch=max(self.epoch, self.schedule.epoch) + 1)
            else:
                self.pause(departure.describe(), epoch=self.epoch + 1, lost=departure.stage)
        elif departure.planned:
            self.stop(_CleanStop("stopped", f"stage {self.stage} stopped: {departure.describe()}"))
        else:
            self.stop(NeighbourLost(self.name, departure, _LAST_REPLICA_HINT if self.replicas_on else ""))

    def _starting_replicas(self, stage: int) -> int:
        """The replicas of ``stage`` this session starts with (:func:`~.linker.starting_replicas`)."""
        return starting_replicas(stage, own_stage=self.stage, initial=self.cfg.replicas_of(stage), reform=self.reform,
                                 links=self.links)

    @property
    def _can_rejoin(self) -> bool:
        """A departure can be survived: this peer and every neighbour take part in rejoin (replicas
        advertise no capability: a run with replicas takes part as a whole)."""
        return (_rejoin_configured(self.cfg, self.run_policy)
                and (self.replicas_on or all(REJOIN_CAPABILITY in link.capabilities for link in self.links)))

    def pause(self, why: str, *, epoch: int, lost: int | None, told_by: int | None = None) -> None:
        """End this session so that the swarm re-forms at run epoch ``epoch`` (SPEC "Rejoin")."""
        if self.stop_reason is None:
            log.warning("%s: %s; pausing: the swarm re-forms (run epoch %d) and rolls back to the newest step "
                        "every stage saved", self.name, why, epoch)
        self.stop(_Rejoin(f"stage {self.stage} paused at step {self.schedule.step}: {why}", epoch=epoch, lost=lost,
                          told_by=told_by))

    def stop(self, reason: BaseException) -> None:
        """End the session now with ``reason`` (raised, or a :class:`_CleanStop`); the first one counts."""
        if self.stop_reason is None:
            self.stop_reason = reason
            if self.state is not PeerState.ENDED:
                self._enter(PeerState.STOPPED, str(reason))
        self._stop_event.set()

    async def _stopped(self, transport: Any) -> None:
        """The work was stopped: a clean stop tells the neighbours still here (BYE ``"drain"``) and
        becomes the result's end; anything else is raised."""
        reason = self.stop_reason
        if not isinstance(reason, _CleanStop):
            if not self.ingress.started:  # before training: the neighbours that welcomed it free its stage
                await self._say_bye(transport, [link for link in self.links if link.welcomed],
                                    {"reason": f"stopped before training: {reason}"})
            elif isinstance(reason, TakenForGone):  # the neighbours that still count it take it as one that left
                await self._say_bye(transport, [link for link in self.links if link.welcomed],
                                    {"reason": f"taken for gone: {reason.why}"})
            raise reason
        if isinstance(reason, _Rejoin):  # the other neighbours re-form too
            bye = {"reason": REJOIN_REASON, **({"lost": reason.lost} if reason.lost is not None else {})}
            if self.replicas_on:  # the replicas of this stage live now start the next session
                self.next_reform = Reform(self.schedule.live_replicas(), reason.lost)
            self.result.epoch = reason.epoch
            self.result.rejoins.append(reason.note)
        else:
            bye = {"reason": DRAIN_REASON}
        told_by = getattr(reason, "told_by", None)  # a neighbour that re-forms already: not told again
        await self._say_bye(transport, [link for link in self.links if link.welcomed and link.stage != told_by
                                        and self.departures.gone(link.stage) is None], bye)
        self.result.end, self.result.end_note = reason.end, reason.note

    async def _say_bye(self, transport: Any, links: list[PeerLink], meta: dict) -> None:
        """Best effort: BYE ``meta`` on ``links`` (5 s each), then what is queued flushed."""
        for link in links:
            try:
                await within(link.send_bye(meta, step=self.schedule.step), 5.0)
            except (NetError, asyncio.TimeoutError) as err:
                log.warning("%s: could not tell stage %d: %s", self.name, link.stage, err)
        try:
            await transport.flush(5.0)
        except (NetError, asyncio.TimeoutError):
            pass

    # ------------------------------------------------------------------ drain
    def request_drain(self, signal_name: str) -> None:
        """A first SIGINT/SIGTERM (:class:`~.signals.DrainSignals`): drain the swarm at the next step
        boundary; before training started, or at a certified stage > 0 whose certificate lacks the
        ``drain`` role, stop at once (it leaves). With replicas this replica leaves after its stage's
        next round, the swarm draining when none of its stage would stay (:mod:`mapl_swarm.step.stopping`)."""
        reason = f"{signal_name} at stage {self.stage}"
        if not self.state.started:
            self.stop(_CleanStop("stopped", f"stage {self.stage} stopped before training started ({signal_name})"))
            return
        if self.replicas_on:  # it leaves after its stage's next round, or, alone in its stage, the swarm drains
            self._enter(PeerState.DRAINING, reason)
            self.schedule.stop(reason)
            return
        identity = self.admission.s.identity  # a certified stage > 0 without the drain role may always leave
        if self.stage > 0 and identity is not None and "drain" not in identity.body.roles:
            self.stop(Interrupted(f"stage {self.stage} left at once ({signal_name}): its certificate does not allow "
                                  f"it to drain the whole swarm (role drain); the others wait for a replacement"))
            return
        log.info("%s: %s: draining (finishing the current step, then a checkpoint; again to stop at once)",
                 self.name, signal_name)
        if self.state is PeerState.TRAINING:
            self._enter(PeerState.DRAINING, reason)

        async def ask() -> None:
            try:
                await self.agreement.request(reason)
            except MaplError as exc:
                self.stop(Interrupted(f"{exc}; stopped at once"))

        self.tasks.spawn(ask())

    def abort(self, signal_name: str) -> None:
        """A second SIGINT/SIGTERM: stop at once (the step in flight is lost)."""
        self.stop(Interrupted(f"stage {self.stage} stopped at once by a second {signal_name}: the step in "
                              f"flight is lost; the newest complete checkpoint is kept"))

    async def _drain_decided(self, step: int) -> None:
        """The swarm drains at ``step`` (told here): the run policy saves it."""
        if self.state is PeerState.TRAINING:
            self._enter(PeerState.DRAINING, f"the swarm drains at step {step}")
        if self.run_policy is not None:
            await self.run_policy.drain_at(step)

    def _send_checkpoint(self, dst: int, meta: dict) -> Awaitable[None]:
        return _checkpoint_on(self.links.route(dst), meta)

    def _ended(self) -> None:
        """The schedule ended: after a drain (decided here, or a BYE ``"drain"``), say so; a replica
        that left while its stage went on says so; after the last step, say so only when its checkpoint
        will never be complete (a stage could not save it)."""
        stopping = self.schedule.core.stopping
        if self.schedule.left:
            self.result.end = "stopped"
            self.result.end_note = (f"stage {self.stage} replica left after {self.schedule.step} steps "
                                    f"({stopping.reason}); its stage goes on with its other replicas")
            return
        step = self.agreement.drained_at(self.schedule.bye)
        if step is None:
            last = self.cfg.run.steps
            if self.run_policy is not None and self.run_policy.unsaved_reason(last) is not None:
                self.result.checkpoint_note = checkpoint_note(self.run_policy, last, self.schedule.core.s.start_step)
                log.warning("%s: %s", self.name, self.result.checkpoint_note)
            return
        why = self.agreement.drain_reason or self.agreement.requested or stopping.reason or "asked by another stage"
        note = checkpoint_note(self.run_policy, step, self.schedule.core.s.start_step)
        self.result.end, self.result.drained_at, self.result.checkpoint_note = "drained", step, note
        self.result.end_note = f"stage {self.stage} drained at step {step} ({why}): {note}"
