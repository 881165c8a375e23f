"""A peer's steps, carried out: the step core (:mod:`mapl_swarm.step`) driven over the links, the compute
thread and the stage's averaging.

:class:`Schedule` asks its :class:`~mapl_swarm.step.core.StepCore` for the next intent, does it
(sends on the links in payload terms, computes on the compute thread through
:class:`~.host.HostRuntime`, runs the stage's averaging round or state download, records through
the run policy's hooks, waits on the mailbox) and hands the result back; control messages from
the dispatcher (REPORT, ROUTE) and departures go to the core at once and what it wants sent then is
sent by the caller. Every decision is the core's: this module only moves bytes and tensors.

Threads: every runtime call that touches tensors runs on the compute thread, so the event loop only
reads versions and flags, encodes bytes and moves frames, and stays responsive (heartbeats,
receives, the link shaper) while the device computes. A compute that encodes a payload and the
sends that follow from it happen under the compute thread's ``encode_lock`` (a VQ retransmission
takes it too). A joining replica's download reads this replica's state under the lock the
optimizer step and the projector's load hold, so it gets one step's state, whole.
"""

from __future__ import annotations

import asyncio
import copy
import logging
import threading
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from mapl_swarm.aio import within
from mapl_swarm.errors import MaplError
from mapl_swarm.metrics.progress import StepProgress
from mapl_swarm.net.errors import NetError
from mapl_swarm.peer.host import HostRuntime
from mapl_swarm.peer.vq_link import Retransmitting
from mapl_swarm.pipeline.payload import ACT_WIRE, GRAD_WIRE, WireName
from mapl_swarm.pipeline.stage import loss_values, mean_loss
from mapl_swarm.replicas.errors import AveragingFailed, Behind
from mapl_swarm.replicas.state import prime_optimizers
from mapl_swarm.step import intents as do
from mapl_swarm.step.core import CoreSettings, StepCore
from mapl_swarm.wire import Message, MessageType
from mapl_swarm.wire.spec import DRAIN_REASON, LEAVE_REASON

if TYPE_CHECKING:
    import torch

    from mapl_swarm.config import TrainConfig
    from mapl_swarm.peer.checkpoints import CheckpointAgreement, PeerRunPolicy
    from mapl_swarm.peer.compute import ComputeThread
    from mapl_swarm.peer.link import Links, PeerLink
    from mapl_swarm.peer.mailbox import Mailbox
    from mapl_swarm.peer.result import PeerResult
    from mapl_swarm.peer.waiting import WaitingLog
    from mapl_swarm.pipeline.stage import StageRuntime
    from mapl_swarm.replicas.gradients import ReplicaGradients
    from mapl_swarm.wire import WireTensor

log = logging.getLogger(__name__)

__all__ = ["Schedule", "NoRunHooks", "RuntimeProjectors"]

MT = MessageType


def _payload(msg: Message, names: Mapping[str, str]) -> dict[str, WireTensor]:
    """A received ACT's or GRAD's wire tensors by payload key (``ACT_WIRE``, ``GRAD_WIRE``). They stay
    in wire form (read-only views of the frames): the compute thread makes torch tensors."""
    return {key: msg.tensors[name] for key, name in names.items() if name in msg.tensors}


class NoRunHooks:
    """What the schedule reports to the run policy (:class:`~.checkpoints.PeerRunPolicy` does the
    same); these record nothing (peers built without a run policy, e.g. in tests)."""

    async def step_end(self, steps_done: int, step_metrics: dict) -> None:
        """After each optimizer step and its PROJ send: metrics record, checkpoint and its agreement."""

    def train_loss(self, step: int, loss: float, tokens: int) -> None:
        """Stage 0: the swarm's training loss of ``step`` (steps done)."""

    def val_loss(self, step: int, loss: float) -> None:
        """Stage 0: the validation loss after ``step``."""

    async def finish(self, step: int | None = None) -> None:
        """Stage 0, before BYE: until every stage has heard the final checkpoint (``step``: of a
        drain) is complete."""


class RuntimeProjectors:
    """The stage runtime's projectors as the core reads them (flags and versions, no tensors)."""

    def __init__(self, runtime: StageRuntime) -> None:
        self.rt = runtime

    @property
    def takes(self) -> bool:
        return self.rt.inbound is not None and self.rt.inbound.trainable

    @property
    def owns(self) -> bool:
        return self.rt.outbound is not None and self.rt.outbound.trainable

    @property
    def inbound_pver(self) -> int:
        return self.rt.inbound.version if self.rt.inbound is not None else 0

    @property
    def outbound_pver(self) -> int:
        return self.rt.outbound.version if self.rt.outbound is not None else 0


BEST_EFFORT_S = 5.0
"""How long a best-effort send (:class:`~.intents.SendRoute` ``best_effort``) may wait for its link."""


async def _best_effort(send: Awaitable[None], what: str) -> None:
    """``send``, given up after :data:`BEST_EFFORT_S` or when its link fails (logged, not raised)."""
    try:
        await within(send, BEST_EFFORT_S)
    except (NetError, TimeoutError) as exc:
        log.debug("%s not sent: %s", what, exc)


class Schedule:
    """Stage ``runtime.stage``'s steps over ``links`` (module docstring). ``replicas``: this stage's
    averaging with its other replicas (None: a chain's stage); ``stage_contacts()``: the contacts of
    this stage's replicas announced in the DHT; ``drain``: stage 0 of a chain asks it at every step
    boundary whether the swarm drains; ``may_drain``: with replicas, this replica may ask the swarm to
    drain (a certified stage > 0 needs the ``drain`` role)."""

    def __init__(self, runtime: StageRuntime, links: Links, mailbox: Mailbox, compute: ComputeThread, *,
                 name: str, cfg: TrainConfig, result: PeerResult, waits: WaitingLog, start_step: int = 0,
                 progress: bool = False,
                 hooks: PeerRunPolicy | NoRunHooks, replicas: ReplicaGradients | None = None, sampler: Any = None,
                 val_batches: Sequence[torch.Tensor] = (), reject: Callable[[str, str, str], None] | None = None,
                 spawn: Callable[[Awaitable[Any]], Any] | None = None, joining: bool = False,
                 stage_contacts: Callable[[], Awaitable[Sequence[str]]] | None = None,
                 drain: CheckpointAgreement | None = None, may_drain: bool = True,
                 leave: Callable[[str], None] | None = None) -> None:
        self.rt, self.host = runtime, HostRuntime(runtime)
        self.links, self.mailbox, self.compute = links, mailbox, compute
        self.name, self.result, self.waits, self.hooks = name, result, waits, hooks
        self.progress, self.progress_desc = progress, f"swarm {cfg.compression.codec} P={cfg.pipeline.num_stages}"
        self.replicas, self.sampler, self.val_batches = replicas, sampler, list(val_batches)
        self.drain, self._stage_contacts = drain, stage_contacts
        self._leave = leave or (lambda why: None)
        """Ends this replica's session when the swarm took it for gone (:class:`~.intents.Leave`)."""
        self._spawn = spawn or asyncio.ensure_future
        r, pipe = cfg.replicas, cfg.pipeline
        stage = 0 if links.up is None else links.up + 1
        self.core = StepCore(
            CoreSettings(name=name, stage=stage, num_stages=pipe.num_stages, M=pipe.num_micro_batches,
                         steps=cfg.run.steps, start_step=start_step,
                         max_in_flight=cfg.net.max_in_flight or pipe.num_stages,
                         val_interval_steps=cfg.eval.interval_steps, val_batches=cfg.eval.batches,
                         timeout_s=cfg.net.timeout_s, tokens_per_step=cfg.tokens_per_step, replicas=r.enabled,
                         averaged=replicas is not None, averaging_timeout_s=r.averaging_timeout_s,
                         matchmaking_s=r.matchmaking_s, routing=r.routing, routing_seed=r.routing_seed,
                         max_redos=max(3, sum(r.initial)), starting=cfg.replicas_of(stage) if r.enabled else 1),
            links=links, inbox=mailbox, projectors=RuntimeProjectors(runtime),
            reject=reject or (lambda code, sender, text: log.warning("%s: dropped a message from %s: %s (%s)",
                                                                     name, sender, text, code)),
            clock=time.monotonic, joining=joining, may_drain=may_drain)
        self.window = self.core.window
        """What the receive path lets in (admission reads it on every message)."""
        self._state_lock = threading.Lock()
        """Held by the optimizer step and the projector's load: a joining replica's download reads the
        stage's state under it, so it gets one step's state, whole."""
        self._projector_step = -1
        """The step whose PROJ the runtime holds (set under :attr:`_state_lock`, for a download)."""
        self._progress: StepProgress | None = None
        self._t0 = 0.0
        self.redos = 0
        """Steps this schedule ran again (its metrics export them)."""
        self.left = False
        """With replicas: this replica left on purpose (a signal) and its stage went on."""

    # ------------------------------------------------------------------ what the peer reads
    @property
    def step(self) -> int:
        return self.core.step

    @property
    def epoch(self) -> int:
        return self.core.epoch

    @property
    def gone(self) -> set[str]:
        return self.core.members.gone

    @property
    def starting(self) -> int:
        return self.core.members.starting

    @starting.setter
    def starting(self, count: int) -> None:
        self.core.members.starting = count

    @property
    def bye(self) -> Message | None:
        return self.core.bye

    @property
    def drained_at(self) -> int | None:
        """The step the swarm drained at (stage 0: decided here; later stages: the BYE ``"drain"``
        that ended the run), or None."""
        if self.core.drained:
            return self.core.step
        bye = self.core.bye
        return bye.step if bye is not None and bye.meta.get("reason") == DRAIN_REASON else None

    def live_replicas(self) -> int:
        return self.core.members.live_count()

    def begin(self, start_step: int | None, epoch: int = 0, *, behind: bool = False) -> None:
        """Training starts at ``start_step`` (a resume agreed after the handshake; None: the
        settings' one) in run epoch ``epoch``; ``behind``: a replica without that step's file."""
        self.core.begin(start_step, epoch, behind=behind)

    def close(self) -> None:
        if self._progress is not None:
            self._progress.close()

    # ------------------------------------------------------------------ the run
    async def run(self) -> None:
        """Every step from :meth:`begin`'s (a joining replica: from its download's), then the end; sets
        ``result.wall_s``."""
        if self.replicas is not None:
            self.replicas.serve(self._served_state)
        self._t0 = time.perf_counter()
        if self.progress:
            first = self.links.up is None
            self._progress = StepProgress(self.core.s.steps, initial=self.core.s.start_step,
                                          desc=self.progress_desc if first else self.name)
        try:
            while True:
                await self.flush_urgent()
                intent = self.core.next()
                await self.flush_urgent()
                if isinstance(intent, do.Done):
                    self.left = (intent.bye or {}).get("reason") == LEAVE_REASON
                    break
                await self._do(intent)
        finally:  # a session that pauses (rejoin) trained too: its time counts with its tokens
            self.result.wall_s = time.perf_counter() - self._t0
        await self.flush_urgent()

    async def flush_urgent(self) -> None:
        """Carry out what the core wants done now (sends of its control decisions, records)."""
        for intent in self.core.urgent():
            await self._do(intent)
        if self.core.woken:
            self.mailbox.poke()

    def spawn_urgent(self) -> None:
        """:meth:`flush_urgent` from code that cannot wait (a departure found by the heartbeat monitor)."""
        if self.core.woken:
            self.mailbox.poke()
        pending = self.core.urgent()
        if pending:
            async def carry_out() -> None:
                for intent in pending:
                    await self._do(intent)
            self._spawn(carry_out())

    # ------------------------------------------------------------------ control messages (the dispatcher)
    def arrived(self, msg: Message, link: PeerLink) -> None:
        """A pipeline message admitted, before it waits its turn in the mailbox (:meth:`StepCore.arrived`)."""
        self.core.arrived(msg, link.name)
        self.spawn_urgent()

    async def on_control(self, msg: Message, link: PeerLink) -> None:
        """A REPORT or a ROUTE of the dispatcher's (:meth:`StepCore.on_control`)."""
        self.core.on_control(msg, link.name)
        await self.flush_urgent()

    async def on_linked(self, link: PeerLink) -> None:
        """A neighbour replica linked while training (one that joins)."""
        self.core.on_linked(link.name)
        await self.flush_urgent()

    def replica_gone(self, link: PeerLink, why: str, *, after: int | None = None) -> bool:
        """Neighbour replica ``link`` left (``after``: on purpose, having taken that many steps): True
        when its stage goes on without it (the core's)."""
        gone = self.core.replica_gone(link, why, after=after)
        self.spawn_urgent()
        return gone

    def stop(self, reason: str) -> None:
        """With replicas, a signal: this replica leaves after its stage's next round (alone in its
        stage: the swarm drains, :mod:`~mapl_swarm.step.stopping`)."""
        self.core.stopping.stop(reason)
        self.spawn_urgent()

    def drain_requested(self, reason: str) -> None:
        """With replicas, CHECKPOINT ``drain_request`` from downstream (its sender's role checked)."""
        self.core.stopping.drain_requested(reason)
        self.spawn_urgent()

    async def resume_round(self, saved: Sequence[int], reason: str) -> dict[str, tuple[list[int], str]]:
        """A resumed run's round of the stage's starting replicas, before anything is loaded (SPEC
        §9.10 item 13): each one's usable checkpoint steps and why it has none, by peer."""
        replicas = self.replicas
        if replicas is None:
            return {"": (sorted(saved), reason)}
        deadline = time.monotonic() + self.core.s.averaging_timeout_s
        while True:
            left = deadline - time.monotonic()
            if left <= self.core.s.matchmaking_s:
                raise MaplError(f"{self.name}: no resume round among the {self.starting} replicas of stage "
                                f"{self.core.stage} within {self.core.s.averaging_timeout_s:g} s")
            try:
                return await self.compute.wait(lambda: replicas.resume_round(
                    saved, reason, timeout=left, contact=self.core.flow.contact, expected=self.starting))
            except AveragingFailed as exc:
                log.info("%s: resume round: %s; again", self.name, exc)

    # ------------------------------------------------------------------ carrying out an intent
    async def _do(self, intent: do.Intent) -> None:  # noqa: C901 - one branch per intent
        links, core = self.links, self.core
        match intent:
            case do.SendAct(link, step, micro, payload, eval_mode, pver):
                await links.named(link).send_act(step, micro, payload, eval_mode=eval_mode, pver=pver)
            case do.SendGrad(link, step, micro, payload, pver):
                await links.named(link).send_grad(step, micro, payload, pver=pver)
            case do.SendRoute(link, step, phase, acts, gone, held, epoch, proof, best_effort):
                target = links.named(link)
                if target is not None:
                    send = target.send_route(step, phase, acts=acts, gone=None if gone is None else list(gone),
                                             epoch=epoch, held=None if held is None else list(held), proof=proof)
                    if best_effort:
                        self._spawn(_best_effort(send, f"{self.name}: ROUTE {phase} to {link}"))
                    else:
                        await send
            case do.SendReport(link, step, meta):
                await links.named(link).send_report(step, meta)
            case do.SendBye(link, step, meta):
                await links.named(link).send_bye(meta, step=step)
            case do.SendProjector():
                await self._send_projector(intent)
            case do.SendProjectorGrad():
                await self._send_projector_grad(intent)
            case do.Feed() | do.Forward() | do.Backward() | do.EvalFeed() | do.EvalForward():
                async with self.compute.encode_lock:  # what it encodes goes out before anything else encodes
                    await self._compute(intent)
                    for send in core.take_sends():
                        await self._do(send)
            case do.ApplySlice(msg, link):
                await links.named(link).on_codebook_slice(msg)
            case do.LoadProjector(msg, step):
                await self.compute.run(self._load_projector, step, msg.tensors[WireName.PROJ], msg.pver)
            case do.AddProjectorGrad(msg, before):
                await self.compute.run(self._add_projector_grad, *(None if m is None else m.tensors[WireName.PROJ_GRAD]
                                                                  for m in (msg, before)))
            case do.SumLosses(_, losses):
                core.answer(intent, sum(await self.compute.run(loss_values, list(losses))))
            case do.MeanLoss(step, losses, to):
                loss = await self.compute.run(mean_loss, list(losses))
                for name in to:
                    await links.named(name).send_report(step, {"mode": "eval", "loss": loss, "tokens": 0})
            case do.Sync() | do.Average():
                await self._round(intent)
            case do.CancelRound():
                if self.replicas is not None:
                    self.replicas.cancel()
            case do.Download():
                await self._download(intent)
            case do.SetEpoch(epoch):
                links.set_epoch(epoch)
            case do.TakeStep():
                core.answer(intent, await self.compute.run(self._take_step))
            case do.Abandon():
                await self.compute.run(self.rt.abandon_step)
            case do.Redo(step, epoch):
                self.redos += 1
                links.set_epoch(epoch)
                dropped = self.mailbox.drop(lambda m: m.epoch < epoch and m.type not in (MT.PROJ, MT.BYE,
                                                                                         MT.CODEBOOK_SLICE))
                log.warning("%s: step %d runs again in run epoch %d (%d message(s) of the earlier one dropped; %d "
                            "replica(s) gone)", self.name, step, epoch, dropped, len(core.members.gone))
            case do.RecordTrain(step, loss, tokens):
                self._record_train(step, loss, tokens)
            case do.RecordVal(step, loss):
                self.result.val_history.append((step, loss))
                self.hooks.val_loss(step, loss)
                log.info("step %d: val loss %.4f", step, loss)
            case do.StepEnd(done, metrics):
                for link in self.links:  # payload bytes sent so far per link: the plots' bandwidth over time
                    metrics[f"link_tx_bytes/{link.name}"] = float(sum(link.counter.bytes.values()))
                await self.hooks.step_end(done, metrics)
                if self.links.up is not None and self._progress is not None:
                    self._progress.step(step_s=f"{self._step_seconds():.2f}")
            case do.Finish(step):
                await self.hooks.finish(step)
            case do.Leave(why):
                self._leave(why)
            case do.Boundary(step):
                if self.drain is not None and self.drain.should_stop():
                    await self.drain.decide(step)  # every stage has finished step - 1
                    core.answer(intent)
            case do.AskDrain(to, reason):
                for name in to:
                    link = links.named(name)
                    if link is not None:
                        await link.send(MT.CHECKPOINT, meta={"phase": "drain_request", "reason": reason})
            case do.Wait():
                await self._wait(intent)
            case _:
                raise TypeError(f"{self.name}: no way to carry out {intent!r}")

    async def _compute(self, intent: do.Intent) -> None:
        """A forward or backward on the compute thread, its result to the core (a message whose codes
        need a retransmission is dropped: its copy follows on the link)."""
        core, host, compute = self.core, self.host, self.compute
        match intent:
            case do.Feed(token, micro):
                # a chain reads its data in order (its cursor is checkpointed); a stage-0 replica reads
                # its share by global index (replica_share)
                ids = self.sampler.batch_at(token.step * core.s.M + micro) if core.s.replicas \
                    else next(self.sampler)
                res = await compute.run(host.forward, micro, ids=ids, train=True)
                core.answer(intent, res.payload, res.loss, res.tokens)
            case do.Forward(_, msg, link):
                work = compute.run(host.forward, msg.micro, wire=_payload(msg, ACT_WIRE), train=True, cver=msg.cver,
                                   proof=self.links.named(link).proof_of(msg))
                try:
                    res = await self.links.named(link).decoded(work, msg)
                except Retransmitting:
                    core.failed(intent)
                    return
                core.answer(intent, res.payload, res.loss, res.tokens)
            case do.Backward(_, micro, msg, link, origin):
                work = compute.run(host.backward, micro, None if msg is None else _payload(msg, GRAD_WIRE),
                                   cver=None if msg is None else msg.cver, origin=origin,
                                   proof=None if msg is None else self.links.named(link).proof_of(msg))
                try:
                    grad = await (work if msg is None else self.links.named(link).decoded(work, msg))
                except Retransmitting:
                    core.failed(intent)
                    return
                core.answer(intent, grad)
            case do.EvalFeed(step, index, link):
                res = await compute.run(host.forward, -1 - index, ids=self.val_batches[index], train=False)
                await self.links.named(link).send_act(step, index, res.payload, eval_mode=True,
                                                      pver=core.proj.outbound_pver)
            case do.EvalForward(msg, link):
                work = compute.run(host.forward, -1 - msg.micro, wire=_payload(msg, ACT_WIRE), train=False,
                                   cver=msg.cver)
                try:
                    res = await self.links.named(link).decoded(work, msg)
                except Retransmitting:
                    return
                core.answer(intent, res.payload, res.loss)

    async def _wait(self, intent: do.Wait) -> None:
        links = self.links

        def waiting_for() -> list[PeerLink]:
            return [link for link in (links.named(name) for name in intent.waiting_on) if link is not None]

        ready = await self.waits.wait(self.mailbox.wait_for(intent.wanted, intent.timeout_s,
                                                            stop=self.core.interrupted), waiting_for)
        if not ready and intent.fatal:
            raise MaplError(f"{self.name}: no {intent.what} within {intent.timeout_s:g} s")

    # ------------------------------------------------------------------ the projector and the step
    async def _send_projector(self, intent: do.SendProjector) -> None:
        proj = await self.compute.run(self.host.outbound_projector)
        if proj is None:
            return
        self.core.answer(intent, proj[1])  # before its send: what comes back is at it
        for name in intent.links:
            link = self.links.named(name)
            if link is not None:
                await link.send_projector(intent.step, proj[0], proj[1])

    async def _send_projector_grad(self, intent: do.SendProjectorGrad) -> None:
        g = await self.compute.run(self._inbound_projector_grad, intent.origins, intent.parts)
        self.core.answer(intent, g)
        if g is not None:
            await self.links.named(intent.link).send_projector_grad(intent.step, g, micro_batches=intent.micro_batches,
                                                                    pver=intent.pver)

    def _inbound_projector_grad(self, origins: Sequence[str] | None, sent: Sequence[Any]) -> Any:
        """The inbound projector's gradient over the micro-batches whose ACTs came from ``origins``
        (link names; None: every micro-batch of the step, none kept apart), plus ``sent`` (what an
        earlier flush of the step sent; compute thread)."""
        if origins is None:
            return self.host.take_inbound_projector_grad()
        taken = (self.host.take_inbound_projector_grad(origin=name) for name in origins)
        parts = [g for g in (*taken, *sent) if g is not None]
        return sum(parts[1:], parts[0]) if parts else None

    def _add_projector_grad(self, grad: Any, before: Any) -> None:
        """Add a PROJ_GRAD tensor (None: none) to the outbound projector's gradient in place of
        ``before`` (the link's earlier one, or None; compute thread)."""
        if grad is not None:
            self.host.add_outbound_projector_grad(grad)
        if before is not None:
            self.host.add_outbound_projector_grad(before, sign=-1.0)

    def _take_step(self) -> dict:
        """The optimizer step (compute thread), under the served state's lock."""
        with self._state_lock:
            if self.replicas is not None:
                self.replicas.apply_updates()
            metrics = self.rt.step()
        if self.replicas is not None and self.replicas.errors is not None:
            metrics["averaging_error_norm"] = round(self.replicas.error_norm, 6)
        return metrics

    def _load_projector(self, step: int, tensor: Any, pver: int) -> None:
        """The inbound projector of ``step`` (compute thread), under the served state's lock."""
        with self._state_lock:
            self.host.load_inbound_projector(tensor, pver)
            self._projector_step = step

    def _record_train(self, step: int, loss: float, tokens: int) -> None:
        """Stage 0: the loss of a step (``step`` + 1 steps done)."""
        self.result.train_losses.append(loss)
        self.result.report_times_s.append(time.perf_counter() - self._t0)
        self.result.tokens += tokens
        self.hooks.train_loss(step + 1, loss, tokens)
        if self._progress is not None:
            elapsed = max(time.perf_counter() - self._t0, 1e-9)
            self._progress.step(loss=f"{loss:.3f}", tok_s=f"{self.result.tokens / elapsed:.0f}")

    def _step_seconds(self) -> float:
        """Mean seconds per step since training started in this session."""
        done = self.core.step - self.core.s.start_step
        return (time.perf_counter() - self._t0) / max(done, 1)

    # ------------------------------------------------------------------ the stage's replicas
    async def _round(self, intent: do.Sync | do.Average) -> None:
        """One attempt of the stage's round; its result (or failure) to the core."""
        replicas, core = self.replicas, self.core
        assert replicas is not None
        try:
            if isinstance(intent, do.Sync):
                round_ = await self.compute.wait(lambda: replicas.sync(
                    timeout=intent.timeout_s, epoch=core.epoch, contact=core.flow.contact, expected=intent.expected,
                    behind=intent.behind))
            else:
                expected = core.rounds.expected(await self._announced())
                log.debug("%s: averaging round of step %d: %d micro-batch(es), %d replica(s) expected", self.name,
                          intent.token.step, len(intent.micro), expected)
                round_ = await self.compute.wait(lambda: replicas.average(
                    list(intent.micro), step=intent.token.step, timeout=intent.timeout_s, loss_sum=intent.loss_sum,
                    epoch=intent.token.epoch, contact=core.flow.contact, expected=expected, leave=intent.leave,
                    going=intent.going, drain=intent.drain))
        except AveragingFailed as exc:
            if isinstance(intent, do.Average):
                await self._checked(intent.token.step)
            core.failed(intent, unsure=exc.unsure, behind=isinstance(exc, Behind), why=str(exc))
            return
        if isinstance(intent, do.Sync):
            core.answer(intent, round_)
            return
        self._count(sent_bytes=round_.sent_bytes, received_bytes=round_.received_bytes)
        await self._checked(intent.token.step)
        core.answer(intent, round_)
        if core.rounds.round is round_:  # whole: the step's round (one that is retried, repaired or redone is not)
            self._count(rounds=1)

    async def _checked(self, step: int) -> None:
        """After a round of ``step`` (SPEC §9.10 item 15): what checking cost and found, to the result;
        each member the stage's rounds excluded since, named in ROUTE ``exclude`` on every link (the
        neighbours cut it off on the word of most of its stage)."""
        replicas = self.replicas
        assert replicas is not None
        if replicas.checker is not None:
            self.result.checking = {**replicas.checker.report(),
                                    "excluded": [[c, s] for _, c, s, _ in replicas.excluded]}
        for _peer, contact, _step, _accusers in replicas.take_excluded():
            for link in list(self.links):
                if contact and link.welcomed and link.contact is not None:
                    await self._do(do.SendRoute(link.name, step, "exclude", gone=(contact,)))

    def _count(self, **added: int) -> None:
        """Add to the result's averaging counters (rounds, bytes, re-syncs)."""
        counts = self.result.averaging
        for key, n in added.items():
            counts[key] = counts.get(key, 0) + n

    async def _announced(self) -> Sequence[str]:
        """The contacts of this stage's DHT records (none when the DHT does not answer: the round goes
        by the replicas known)."""
        if self._stage_contacts is None:
            return []
        try:
            return await self._stage_contacts()
        except MaplError as exc:
            log.debug("%s: the DHT gave no replicas of stage %d: %s", self.name, self.core.stage, exc)
            return []

    async def _download(self, intent: do.Download) -> None:
        """The stage's state from a live replica (asked for again until one answers with a state the
        core takes, within ``net.timeout_s``), loaded; its description to the core."""
        replicas = self.replicas
        if replicas is None:
            raise MaplError(f"{self.name}: a replica joins a run with replicas (replicas.enabled = true)")
        likes = await self.compute.run(self._join_templates)
        deadline = time.monotonic() + self.core.s.timeout_s
        got = None
        while (left := deadline - time.monotonic()) > 0:
            got = await self.compute.wait(lambda: replicas.download(likes, timeout=min(left, 30.0),
                                                                    sources=intent.sources))
            if got is not None and intent.good(got):
                break
            got = None
            await asyncio.sleep(min(0.5, max(0.0, deadline - time.monotonic())))
        if got is None:
            raise MaplError(f"{self.name}: no replica of stage {self.core.stage} gave {intent.what} within "
                            f"{self.core.s.timeout_s:g} s (net.timeout_s)")
        await self.compute.run(self._load_served, got)
        if intent.kind == "resync":
            self._count(resyncs=1)
        self.core.answer(intent, got)

    def _load_served(self, got: dict) -> None:
        """Load a partner's downloaded state (compute thread), under the lock a download of this
        replica's own state reads under; the inbound projector it holds counts as taken."""
        with self._state_lock:
            self.rt.load_state_dict(got["runtime"])
            self._projector_step = max(self._projector_step, int(got["projector"]))

    def _join_templates(self) -> tuple[dict, ...]:
        """The forms a downloaded state may have (:func:`~mapl_swarm.replicas.state.restore_like`):
        this replica's own served state with optimizer state entries as a stepped one holds, and as
        one that never stepped (a re-sync before the stage's first step)."""
        fresh = self._served_state() if not any(opt.state for opt in self.rt.optimizers) else None
        prime_optimizers(self.rt.optimizers)
        stepped = self._served_state()
        return (stepped,) if fresh is None else (stepped, fresh)

    def _served_state(self) -> dict:
        """What a joining replica downloads (SPEC §9.10 item 11; read in a thread of this process): a
        copy of the stage's state for its next step, that step (the optimizer steps taken), the run
        epoch, the step whose inbound projector the state holds, this stage's live replicas and
        those gone."""
        with self._state_lock:
            state = copy.deepcopy(self.rt.state_dict())
            projector = self._projector_step
        members = self.core.members
        return {"runtime": state, "step": state["step"], "projector": projector, "epoch": self.core.epoch,
                "members": members.members_text, "gone": members.gone_text}
