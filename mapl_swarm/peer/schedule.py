"""The pipeline schedule of a stage peer, given its runtime, links, mailbox and compute thread.

Every stage runs its list of actions of each step (:func:`~mapl_swarm.pipeline.actions.stage_actions`:
1F1B, the in-process driver's list too): ``F m`` takes the ACT of micro-batch m from upstream (stage
0: reads the data), computes and sends the ACT downstream (the last stage keeps the loss); ``B m``
takes the GRAD of m from downstream (the last stage: from its own loss), computes and sends the
GRAD upstream. A due ACT or GRAD that comes before its action's turn (after a retransmission)
waits for it. Stage 0 keeps ``max_in_flight`` micro-batches in flight this way; the later stages
follow what comes. After a step's actions every stage flushes: receiver sends PROJ_GRAD upstream,
sender adds it, steps, and sends the new PROJ (with its version) downstream before the next
step's first ACT; then the step-end hook (health record, checkpoint: the run policy's business)
runs. The last stage reports each step's loss upstream (REPORT, relayed stage by stage) so stage 0
shows one progress bar for the whole swarm. Validation: stage 0 sends eval ACTs between steps; the
last stage reports the mean loss. The end: stage 0 sends BYE down the pipeline once the last report
arrived.

The schedule sends and receives only through ``links.upstream`` / ``links.downstream``
(:class:`PeerLink`, e.g. :class:`~.link.PeerLink`), in payload terms: never stage numbers,
the transport or message framing. MAPL+VQ: a compute that encodes and the send of its payload
happen under the compute thread's ``encode_lock`` (a retransmission takes it too); a received
message whose codes cannot be decoded raises :class:`~.vq_link.Retransmitting` and is dropped,
its copy follows.

Window: the schedule's :class:`~.window.StepWindow` (``self.window``) knows which messages can
come next; one outside it (a second ACT for a micro-batch, a GRAD nobody asked for, an ACT made
with another projector, a PROJ_GRAD of another step, a REPORT twice) is dropped there, naming the
rule, and the schedule waits on. The receive path asks the same window first, on the header.
GRAD and PROJ_GRAD carry the projector version their ACTs were made with; the last stage's REPORT
of step ``s`` says ``s`` (eval REPORTs: the step of their eval ACTs).

Threads: every runtime call that touches tensors runs on the compute thread through
:class:`~.host.HostRuntime` (``self.host``): it takes the received messages' wire tensors and
returns what goes out in host memory, so the event loop only reads versions and flags of the
runtime, encodes bytes and moves frames, and stays responsive (heartbeats, receives, the link
shaper) while the device computes.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from mapl_swarm.aio import until
from mapl_swarm.errors import MaplError
from mapl_swarm.metrics.progress import StepProgress
from mapl_swarm.peer.host import HostRuntime
from mapl_swarm.peer.vq_link import Retransmitting
from mapl_swarm.peer.window import StepWindow
from mapl_swarm.pipeline.actions import Op, stage_actions
from mapl_swarm.pipeline.payload import ACT_WIRE, GRAD_WIRE, WireName
from mapl_swarm.pipeline.run_policy import due
from mapl_swarm.pipeline.stage import mean_loss
from mapl_swarm.wire import Message, MessageType
from mapl_swarm.wire.spec import DRAIN_REASON

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
    from mapl_swarm.wire import WireTensor

log = logging.getLogger(__name__)

__all__ = ["PipelineSchedule", "ScheduleSettings", "NoRunHooks", "BYE_FINISHED"]

MT = MessageType

BYE_FINISHED = "training finished"
"""Stage 0's BYE ``reason`` after the last step."""


def _payload(msg: Message, names: Mapping[str, str]) -> dict[str, WireTensor]:
    """A received ACT's or GRAD's wire tensors by payload key (``names``: ``ACT_WIRE``, ``GRAD_WIRE``).
    They stay in wire form (read-only views of the frames): the compute thread makes torch tensors."""
    return {key: msg.tensors[name] for key, name in names.items() if name in msg.tensors}


class NoRunHooks:
    """What the schedule reports to the run policy (:class:`~.checkpoints.PeerRunPolicy` does the
    same); these record nothing (peers built without a run policy, e.g. in tests)."""

    async def step_end(self, steps_done: int, step_metrics: dict) -> None:
        """After each optimizer step and its PROJ send: metrics record, checkpoint and its agreement."""

    def train_loss(self, step: int, loss: float, tokens: int) -> None:
        """Stage 0: the swarm's training loss of ``step`` (from the last stage's REPORT)."""

    def val_loss(self, step: int, loss: float) -> None:
        """Stage 0: the validation loss after ``step``."""

    async def finish(self, step: int | None = None) -> None:
        """Stage 0, before BYE: until every stage has heard the final checkpoint (``step``: of a
        drain) is complete."""


@dataclass(frozen=True, kw_only=True)
class ScheduleSettings:
    """What the schedule needs of the run's configuration."""

    num_stages: int = 1
    """P: stages of the pipeline."""
    num_micro_batches: int
    """M: micro-batches per optimizer step."""
    steps: int
    """Optimizer steps of the whole run."""
    start_step: int = 0
    """First step to run (resumed runs)."""
    max_in_flight: int
    """Micro-batches stage 0 keeps in flight."""
    val_interval_steps: int = 0
    """Validate every this many steps (and after the last); 0 never."""
    val_batches: int = 0
    """Held-out micro-batches per validation."""
    timeout_s: float
    """Longest wait for any one message."""
    progress: bool = False
    """Stage 0: show the swarm's progress bar."""
    progress_desc: str = ""
    """Its label."""

    @classmethod
    def from_config(cls, cfg: TrainConfig, *, start_step: int = 0, progress: bool = False) -> "ScheduleSettings":
        pipe = cfg.pipeline
        return cls(num_stages=pipe.num_stages, num_micro_batches=pipe.num_micro_batches, steps=cfg.run.steps, start_step=start_step,
                   max_in_flight=cfg.net.max_in_flight or pipe.num_stages, val_interval_steps=cfg.eval.interval_steps,
                   val_batches=cfg.eval.batches, timeout_s=cfg.net.timeout_s, progress=progress,
                   progress_desc=f"swarm {cfg.compression.codec} P={pipe.num_stages}")


class PipelineSchedule:
    """Stage 0's driver, every stage's serving loop, the step flush and the loss reports."""

    def __init__(self, runtime: StageRuntime, links: Links, mailbox: Mailbox, compute: ComputeThread, *,
                 name: str, settings: ScheduleSettings, result: PeerResult, waits: WaitingLog,
                 hooks: PeerRunPolicy | NoRunHooks, sampler: Iterator[torch.Tensor] | None = None,
                 val_batches: Sequence[torch.Tensor] = (),
                 reject: Callable[[str, str, str], None] | None = None,
                 drain: CheckpointAgreement | None = None) -> None:
        self.rt = runtime
        """Read on the loop only for versions and flags; tensor work goes through ``self.host``."""
        self.host = HostRuntime(runtime)
        """The runtime's calls on the compute thread: wire tensors in, host tensors out."""
        self.links = links
        self.mailbox = mailbox
        self.compute = compute
        self.name = name
        self.s = settings
        self.result = result
        self.waits = waits
        self.hooks = hooks
        self.drain = drain
        """Stage 0: asked at every step boundary whether the swarm drains (None: never)."""
        self.bye: Message | None = None
        """Stages 1..P-1: the BYE that ended the run (its ``reason``: finished, or a drain)."""
        self.sampler = sampler
        self.val_batches = list(val_batches)
        self.M = settings.num_micro_batches
        self._reports: list[Message] = []
        self._report_event = asyncio.Event()
        self._progress: StepProgress | None = None
        self._t0 = 0.0
        self._losses: list[torch.Tensor] = []  # last stage: losses of the current step (on device)
        self._tokens = 0  # last stage: tokens of the current step
        self._eval_losses: list[torch.Tensor] = []
        self._early: dict[tuple[MessageType, int], Message] = {}
        """Due ACTs / GRADs of the current step that came before their action's turn."""
        self._reject = reject or (lambda code, sender, text: log.warning("%s: dropped a message from %s: %s (%s)",
                                                                         name, sender, text, code))
        stage = 0 if links.upstream is None else links.upstream.stage + 1
        self.window = StepWindow(runtime, stage=stage, M=self.M, val_batches=settings.val_batches,
                                 steps=settings.steps, start_step=settings.start_step, reject=self._reject)
        """What can come next, and what the receive path lets in (:mod:`~.window`)."""
        self.actions = stage_actions(stage, settings.num_stages, self.M, in_flight=settings.max_in_flight)
        """This stage's actions of every training step, the in-process driver's too."""

    @property
    def step(self) -> int:
        """The step this stage works on: the next one to flush."""
        return self.window.step

    # ------------------------------------------------------------------ entry points
    def begin(self, start_step: int | None, epoch: int = 0) -> None:
        """Training starts at ``start_step`` (a resume agreed after the handshake; None: the
        settings' one) in run epoch ``epoch``: the step window follows them from now on."""
        if start_step is not None:
            self.s = replace(self.s, start_step=start_step)
        self.window.begin(self.s.start_step, epoch)

    async def run(self) -> None:
        """Stage 0 drives the steps from :meth:`begin`'s, later stages serve until BYE; sets
        ``result.wall_s``."""
        # a resumed receiver's checkpoint may hold the projector of before the sender's last
        # step: the sender's copy is authoritative, so send it before any ACT
        await self._send_projector(self.s.start_step)
        self._t0 = time.perf_counter()
        if self.links.upstream is not None and self.s.progress:  # stage 0's comes with the REPORTs
            self._progress = StepProgress(self.s.steps, initial=self.s.start_step, desc=self.name)
        try:
            if self.links.upstream is None:
                await self._drive()
            else:
                await self._serve()
        finally:  # a session that pauses (rejoin) trained too: its time counts with its tokens
            self.result.wall_s = time.perf_counter() - self._t0

    async def on_report(self, msg: Message, link: PeerLink | None = None) -> None:
        """A REPORT from downstream (on ``link``: a chain has one): stage 0 records it, other stages relay it upstream. A train
        REPORT of a step this stage has not reached, or one already seen, is dropped; so is an
        eval REPORT of a validation this stage did not take part in."""
        if not self.window.report_due(msg):
            return
        mode = msg.meta.get("mode", "train")
        if self.links.upstream is not None:
            await self.links.upstream.send_report(msg.step, dict(msg.meta))
            return
        self._reports.append(msg)
        self._report_event.set()
        if mode == "train":
            done = msg.step + 1  # records are keyed by steps done
            self.result.train_losses.append(float(msg.meta["loss"]))
            self.result.report_times_s.append(time.perf_counter() - self._t0)
            self.result.tokens += int(msg.meta["tokens"])
            self.hooks.train_loss(done, float(msg.meta["loss"]), int(msg.meta["tokens"]))
            if self._progress is not None:
                elapsed = max(time.perf_counter() - self._t0, 1e-9)
                self._progress.step(loss=f"{msg.meta['loss']:.3f}", tok_s=f"{self.result.tokens / elapsed:.0f}")

    def close(self) -> None:
        if self._progress is not None:
            self._progress.close()

    # ------------------------------------------------------------------ waiting
    def _downstream(self) -> list[PeerLink]:
        return [self.links.downstream] if self.links.downstream is not None else []

    async def _next(self, link: PeerLink, types: tuple[MessageType, ...], what: str) -> Message:
        """The next message of ``types`` from ``link``'s neighbour, or a BYE from upstream, applying
        that neighbour's codebook slices that come before it (the other neighbour's wait their turn,
        in order with its payloads)."""
        up = self.links.upstream

        def wanted(msg: Message) -> bool:
            if msg.type is MT.BYE:
                return up is not None and msg.src == up.stage
            return msg.src == link.stage and (msg.type in types or msg.type is MT.CODEBOOK_SLICE)

        while True:
            msg = await self.waits.wait(self.mailbox.get(wanted, self.s.timeout_s, f"{what} from stage {link.stage}"),
                                        lambda: [link])
            if msg.type is not MT.CODEBOOK_SLICE:
                return msg
            await link.on_codebook_slice(msg)

    async def _wait_report(self, mode: str, count: int) -> None:
        await self.waits.wait(self._reports_in(mode, count, self.s.timeout_s), self._downstream)

    async def _reports_in(self, mode: str, count: int, timeout_s: float) -> None:
        if not await until(lambda: sum(1 for r in self._reports if r.meta.get("mode") == mode) >= count,
                           self._report_event, timeout_s):
            raise MaplError(f"{self.name}: no {mode} REPORT from the last stage within {timeout_s:g} s")

    # ------------------------------------------------------------------ stage 0
    async def _drive(self) -> None:
        s = self.s
        down = self.links.downstream
        if s.progress:
            self._progress = StepProgress(s.steps, initial=s.start_step, desc=s.progress_desc)
        drained = False
        for step in range(s.start_step, s.steps):
            if self.drain is not None and self.drain.should_stop():
                drained = True  # the swarm stops here: every stage has finished step - 1
                await self.drain.decide(step)
                break
            await self._step(step, [next(self.sampler) for _ in range(self.M)])
            await self._flush(step)
            done_steps = step + 1
            if due(s.val_interval_steps, done_steps, s.steps) and not (self.drain is not None and self.drain.draining):
                await self._validate(done_steps)
        await self._wait_report("train", self.step - s.start_step)
        await self.hooks.finish(self.step if drained else None)
        if down is not None:
            await down.send_bye({"reason": DRAIN_REASON if drained else BYE_FINISHED}, step=self.step)

    async def _validate(self, step: int) -> None:
        down = self.links.downstream
        if down is None:
            return
        before = sum(1 for r in self._reports if r.meta.get("mode") == "eval")
        self.window.eval_steps.add(step)
        for i, ids in enumerate(self.val_batches):
            async with self.compute.encode_lock:
                res = await self.compute.run(self.host.forward, -1 - i, ids=ids, train=False)
                await down.send_act(step, i, res.payload, eval_mode=True, pver=self.window.outbound_pver)
        await self._wait_report("eval", before + 1)
        report = [r for r in self._reports if r.meta.get("mode") == "eval"][-1]
        self.result.val_history.append((step, float(report.meta["loss"])))
        self.hooks.val_loss(step, float(report.meta["loss"]))
        log.info("step %d: val loss %.4f", step, report.meta["loss"])

    def _step_seconds(self) -> float:
        """Mean seconds per step since training started in this session."""
        done = self.step - self.s.start_step
        return (time.perf_counter() - self._t0) / max(done, 1)

    def _owns_projector(self) -> bool:
        """This stage steps and sends a trainable outbound projector (reads flags only)."""
        return self.rt.outbound is not None and self.rt.outbound.trainable

    async def _send_projector(self, step: int) -> None:
        if not self._owns_projector():
            return
        proj = await self.compute.run(self.host.outbound_projector)
        if proj is not None:
            self.window.projector(self.links.downstream.stage, proj[1])  # before its send: what comes back is at it
            await self.links.downstream.send_projector(step, proj[0], proj[1])

    async def _flush(self, step: int) -> None:
        """End of step: projector gradient up, optimizer step, projector down, step-end hook."""
        up = self.links.upstream
        if up is not None:
            pver = self.window.inbound_pver  # before the next PROJ is loaded
            g = await self.compute.run(self.host.take_inbound_projector_grad)
            if g is not None:
                await up.send_projector_grad(step, g, micro_batches=self.M, pver=pver)
        if self._owns_projector():
            msg = await self._projector_grad(step)
            await self.compute.run(self.host.add_outbound_projector_grad, msg.tensors[WireName.PROJ_GRAD])
        step_metrics = await self.compute.run(self.rt.step)
        self.window.advance()
        await self._send_projector(step + 1)
        await self.hooks.step_end(step + 1, step_metrics)
        if up is not None and self._progress is not None:
            self._progress.step(step_s=f"{self._step_seconds():.2f}")

    async def _projector_grad(self, step: int) -> Message:
        """The downstream stage's PROJ_GRAD of ``step``, at this projector's version, over M micro-batches."""
        while True:
            msg = await self._next(self.links.downstream, (MT.PROJ_GRAD,), f"PROJ_GRAD of step {step}")
            if msg.type is not MT.BYE and self.window.proj_grad_due(msg, step):
                return msg

    # ------------------------------------------------------------------ the actions of a step
    async def _step(self, step: int, batches: list[torch.Tensor] | None = None) -> bool:
        """This stage's actions of ``step`` (:func:`~mapl_swarm.pipeline.actions.stage_actions`,
        stage 0 on ``batches``); False when upstream said BYE instead (the run is over)."""
        for action in self.actions:
            forward = action.op is Op.FORWARD
            link = self.links.upstream if forward else self.links.downstream
            while True:
                msg = None if link is None else await self._take(MT.ACT if forward else MT.GRAD, action.micro)
                if link is not None and msg is None:
                    return False
                try:
                    if forward:
                        await self._forward(step, action.micro, batches[action.micro] if batches else None, msg)
                    else:
                        await self._backward(step, action.micro, msg)
                    break
                except Retransmitting:  # undecodable VQ codes: dropped, their copy follows
                    if forward:
                        self.window.taken.discard(("train", action.micro))
        return True

    async def _take(self, mtype: MessageType, micro: int) -> Message | None:
        """The train ``mtype`` (ACT from upstream, GRAD from downstream) of micro-batch ``micro`` of
        this step; due ones of later micro-batches that come first wait their turn. Meanwhile, from
        upstream: the step's PROJ and a validation's eval ACTs. None: BYE from upstream."""
        early = self._early.pop((mtype, micro), None)
        if early is not None:
            return early
        act = mtype is MT.ACT
        link = self.links.upstream if act else self.links.downstream
        what = f"{mtype.name} of step {self.step} micro-batch {micro}"
        while True:
            msg = await self._next(link, (MT.ACT, MT.PROJ) if act else (MT.GRAD,), what)
            if msg.type is MT.BYE:
                self.bye = msg
                return None
            if msg.type is MT.PROJ:
                if self.window.proj_due(msg):
                    await self.compute.run(self.host.load_inbound_projector, msg.tensors[WireName.PROJ], msg.pver)
                    self.window.taken.add(("proj", msg.step))
                continue
            if not (self.window.act_due(msg) if act else self.window.grad_due(msg)):
                continue
            mode = msg.meta.get("mode", "train")
            if act:
                self.window.taken.add((mode, msg.micro))
            if mode == "eval":
                try:
                    await self._eval_forward(msg)
                except Retransmitting:
                    self.window.taken.discard((mode, msg.micro))
            elif msg.micro == micro:
                return msg
            else:
                self._early.setdefault((mtype, msg.micro), msg)

    async def _forward(self, step: int, micro: int, ids: torch.Tensor | None, msg: Message | None) -> None:
        """Forward of a micro-batch (stage 0: ``ids``; later: the ACT ``msg``), then its ACT
        downstream (the last stage keeps its loss)."""
        up, down = self.links.upstream, self.links.downstream
        async with self.compute.encode_lock:
            work = self.compute.run(self.host.forward, micro, ids=ids, wire=None if msg is None else _payload(msg, ACT_WIRE),
                                    train=True, cver=None if msg is None else msg.cver)
            res = await (work if msg is None else up.decoded(work, msg))
            if down is not None:
                await down.send_act(step, micro, res.payload, eval_mode=False, pver=self.window.outbound_pver)
        if down is not None:
            self.window.awaiting.add(micro)
        else:
            self._losses.append(res.loss)
            self._tokens += res.tokens

    async def _backward(self, step: int, micro: int, msg: Message | None) -> None:
        """Backward of a micro-batch (the last stage: from its loss; earlier: the GRAD ``msg``), then
        its GRAD upstream (stage 0 sends none)."""
        up, down = self.links.upstream, self.links.downstream
        async with self.compute.encode_lock:
            work = self.compute.run(self.host.backward, micro, None if msg is None else _payload(msg, GRAD_WIRE),
                                    cver=None if msg is None else msg.cver)
            grad = await (work if msg is None else down.decoded(work, msg))
            if up is not None:
                await up.send_grad(step, micro, grad, pver=self.window.inbound_pver)
        self.window.awaiting.discard(micro)

    async def _serve(self) -> None:
        """Stages 1..P-1: each step's actions and flush until BYE (passed on downstream); the last
        stage reports each step's loss upstream."""
        up, down = self.links.upstream, self.links.downstream
        while True:
            step = self.step
            if not await self._step(step):
                if down is not None:
                    await down.send_bye(dict(self.bye.meta), step=self.bye.step)
                return
            losses, tokens, self._losses, self._tokens = self._losses, self._tokens, [], 0
            await self._flush(step)  # checks the step's losses before its optimizer step (NonFiniteError)
            if down is None:
                loss = await self.compute.run(mean_loss, losses)  # one host sync per step, in the worker
                await up.send_report(step, {"mode": "train", "loss": loss, "tokens": tokens})

    async def _eval_forward(self, msg: Message) -> None:
        up, down = self.links.upstream, self.links.downstream
        self.window.eval_steps.add(msg.step)
        async with self.compute.encode_lock:
            res = await up.decoded(self.compute.run(self.host.forward, -1 - msg.micro, wire=_payload(msg, ACT_WIRE),
                                                    train=False, cver=msg.cver), msg)
            if down is not None:
                await down.send_act(msg.step, msg.micro, res.payload, eval_mode=True, pver=self.window.outbound_pver)
                return
        self._eval_losses.append(res.loss)
        if len(self._eval_losses) == self.s.val_batches:
            losses, self._eval_losses = self._eval_losses, []
            loss = await self.compute.run(mean_loss, losses)
            await up.send_report(msg.step, {"mode": "eval", "loss": loss, "tokens": 0})
