"""The schedule of a peer whose run has several peers per stage (SPEC §9.10, capability ``replicas``).

A stage's neighbours are sets of links, one per replica. Each step s runs as follows:

- **start**: a receiver (stage > 0) takes the first PROJ of s (its sender replicas all send the
  same) and says ROUTE ``ready`` on every upstream link; stage 0 takes its share of the step's
  micro-batches (:func:`~mapl_swarm.replicas.assignment.replica_share`, by its rank in the stage's
  last averaging round), each read by its global index;
- **routing**: each train ACT a stage computes goes to one of the downstream links that said
  ``ready`` for s, drawn per micro-batch by :class:`Router`; once a stage computed every ACT it
  will get of s (stage 0: its share; a later stage: every upstream link said ``end`` and its ACTs
  came), it says ROUTE ``end`` (the ACTs of s the link carried) on those links, and ``end`` with 0
  at once to a ``ready`` that comes later;
- **backward**: a GRAD comes back on the link its ACT went on and goes on, after the backward, on the
  link the ACT came from; due GRADs are computed before waiting ACTs (activations are freed as
  early as they can be); stage 0 keeps at most ``max_in_flight`` micro-batches per ready link
  without their GRAD;
- **flush**: a receiver sends each upstream link that carried ACTs of s a PROJ_GRAD over those ACTs;
  a sender waits for one from every link it sent ACTs on and adds them; the stage's replicas
  average their gradients (:class:`~mapl_swarm.replicas.gradients.ReplicaGradients`: a round whose
  counts add up to M, with equal digests) and take the same optimizer step; every sender replica
  sends the next PROJ on every downstream link; the last stage's replicas send the step's REPORT
  (the loss over the M micro-batches, summed in the round) on every upstream link.

REPORTs (from the dispatcher, :meth:`ReplicaSchedule.on_report`): a middle replica relays the first
of a step on every upstream link, stage 0's replicas record it, later ones are dropped quietly
(every replica of the last stage sends one). Validation: the stage-0 replica of rank 0 sends the
eval ACTs, each replica forwards them on its first downstream link (by contact), so one last-stage
replica takes them all and reports. The end: stage 0's replicas say BYE on every downstream link
after the last REPORT; a later replica ends once every upstream link said BYE, and says it on.

A message that is not due is dropped through ``reject`` with its code and the rule, as the chain's
:class:`~.window.StepWindow` does; the window keeps the admission's header checks (step range, run
epoch, the stage's projector version) in step with this schedule.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from mapl_swarm.aio import until
from mapl_swarm.errors import MaplError
from mapl_swarm.metrics.progress import StepProgress
from mapl_swarm.peer.host import HostRuntime
from mapl_swarm.peer.session import Rejected
from mapl_swarm.peer.window import StepWindow
from mapl_swarm.pipeline.payload import ACT_WIRE, GRAD_WIRE, WireName
from mapl_swarm.pipeline.run_policy import due
from mapl_swarm.pipeline.stage import loss_values, mean_loss
from mapl_swarm.replicas.assignment import replica_share
from mapl_swarm.wire import Message, MessageType

if TYPE_CHECKING:
    import torch

    from mapl_swarm.config import ReplicasConfig
    from mapl_swarm.peer.checkpoints import PeerRunPolicy
    from mapl_swarm.peer.compute import ComputeThread
    from mapl_swarm.peer.link import Links, PeerLink
    from mapl_swarm.peer.mailbox import Mailbox
    from mapl_swarm.peer.result import PeerResult
    from mapl_swarm.peer.schedule import NoRunHooks, ScheduleSettings
    from mapl_swarm.peer.waiting import WaitingLog
    from mapl_swarm.pipeline.stage import StageRuntime
    from mapl_swarm.replicas.gradients import ReplicaGradients, ReplicaStep

log = logging.getLogger(__name__)

__all__ = ["ReplicaSchedule", "Router"]

MT = MessageType

_EMA = 0.3
"""Weight of the newest round trip in a link's mean (:class:`Router`)."""


class Router:
    """Draws the downstream link of each train micro-batch (SPEC §9.10 item 4): ``uniform``, or
    ``throughput``: weighted by ``1 / (mean round trip × (1 + ACTs in flight))`` of each link (SWARM's
    stochastic wiring: a faster, less loaded replica gets more); a link without a measured round
    trip counts as a typical one. The draw of micro-batch m of step s at stage k is a function of
    (``seed``, k, s, m) and the weights, so runs with the same weights route the same way."""

    def __init__(self, *, routing: str, seed: int, stage: int) -> None:
        self.routing, self.seed, self.stage = routing, seed, stage
        self.mean_s: dict[str, float] = {}
        """Per link name: the mean seconds from an ACT's send to its GRAD."""
        self.in_flight: Counter[str] = Counter()

    def draw(self, step: int, micro: int) -> float:
        """The uniform number in [0, 1) of micro-batch ``micro`` of ``step``."""
        h = hashlib.sha256(f"route/{self.seed}/{self.stage}/{step}/{micro}".encode()).digest()
        return int.from_bytes(h[:8], "big") / 2 ** 64

    def weights(self, links: Sequence[PeerLink]) -> list[float]:
        if self.routing == "uniform":
            return [1.0] * len(links)
        known = [self.mean_s[link.name] for link in links if link.name in self.mean_s]
        typical = sum(known) / len(known) if known else 1.0
        return [1.0 / (self.mean_s.get(link.name, typical) * (1 + self.in_flight[link.name])) for link in links]

    def pick(self, links: Sequence[PeerLink], step: int, micro: int) -> PeerLink:
        """The link micro-batch ``micro`` of ``step`` goes on, of ``links`` (in contact order)."""
        weights = self.weights(links)
        x = self.draw(step, micro) * sum(weights)
        for link, w in zip(links, weights):
            if x < w:
                return link
            x -= w
        return links[-1]

    def sent(self, link: PeerLink) -> None:
        self.in_flight[link.name] += 1

    def returned(self, link: PeerLink, seconds: float) -> None:
        self.in_flight[link.name] -= 1
        old = self.mean_s.get(link.name)
        self.mean_s[link.name] = seconds if old is None else (1 - _EMA) * old + _EMA * seconds


@dataclass
class _Step:
    """What a replica knows of the step it works on."""

    step: int
    readied: set[str] = field(default_factory=set)
    """Upstream links this replica said ``ready`` to."""
    announced: dict[str, int] = field(default_factory=dict)
    """Upstream link -> the train ACTs its ``end`` announced."""
    received: Counter[str] = field(default_factory=Counter)
    """Upstream link -> train ACTs taken."""
    origin: dict[int, PeerLink] = field(default_factory=dict)
    """Micro-batch -> the upstream link its ACT came on."""
    ready: list[PeerLink] = field(default_factory=list)
    """Downstream links that said ``ready`` in time to be routed to."""
    sent: Counter[str] = field(default_factory=Counter)
    """Downstream link -> train ACTs sent."""
    dest: dict[int, tuple[PeerLink, float]] = field(default_factory=dict)
    """Micro-batch awaiting its GRAD -> the link it went on, and when (``time.monotonic``)."""
    waiting: list[tuple[int, dict]] = field(default_factory=list)
    """Computed train ACTs waiting for a ready downstream link: (micro-batch, payload)."""
    ended: bool = False
    """ROUTE ``end`` went to every ready link (later ``ready``s get ``end`` 0 at once)."""
    forwarded: int = 0
    """Train micro-batches computed forward at this stage."""
    backwarded: int = 0
    todo: list[int] = field(default_factory=list)
    """Stage 0: micro-batches of its share not computed yet."""
    losses: list = field(default_factory=list)
    """The last stage: its micro-batches' losses (on the device)."""

    @property
    def taken(self) -> int:
        return sum(self.received.values())


class _RunOver(Exception):
    """An upstream BYE ended the run before its last step (its sender stopped)."""


class ReplicaSchedule:
    """Stage 0's driver, every replica's serving loop, the flush with its averaging round, REPORTs
    (see the module docstring). ``replicas``: this stage's averaging (None: the stage has one peer)."""

    def __init__(self, runtime: StageRuntime, links: Links, mailbox: Mailbox, compute: ComputeThread, *,
                 name: str, settings: ScheduleSettings, result: PeerResult, waits: WaitingLog,
                 hooks: PeerRunPolicy | NoRunHooks, routing: ReplicasConfig, replicas: ReplicaGradients | None,
                 sampler=None, val_batches: Sequence[torch.Tensor] = (),
                 reject: Callable[[str, str, str], None] | None = None) -> None:
        self.rt, self.host = runtime, HostRuntime(runtime)
        self.links, self.mailbox, self.compute = links, mailbox, compute
        self.name, self.s, self.result, self.waits, self.hooks = name, settings, result, waits, hooks
        self.replicas, self.sampler, self.val_batches = replicas, sampler, list(val_batches)
        self.averaging_timeout_s = routing.averaging_timeout_s
        self.bye: Message | None = None
        """The BYE that ended the run (its ``reason``)."""
        self.M = settings.num_micro_batches
        self.stage = 0 if links.up is None else links.up + 1
        self.first, self.last = links.up is None, links.down is None
        self._reject = reject or (lambda code, sender, text: log.warning("%s: dropped a message from %s: %s (%s)",
                                                                         name, sender, text, code))
        self.window = StepWindow(runtime, stage=self.stage, M=self.M, val_batches=settings.val_batches,
                                 steps=settings.steps, start_step=settings.start_step, reject=self._reject)
        """The admission's header checks (step range, run epoch, the stage's projector version)."""
        self.router = Router(routing=routing.routing, seed=routing.routing_seed, stage=self.stage)
        self.rank, self.replica_count = 0, 1
        """Stage 0: this replica's rank among the stage's replicas of the current step, and their number."""
        self._cur = _Step(settings.start_step)
        self._reported: set[tuple[str, int]] = set()
        self._reports: dict[tuple[str, int], float] = {}
        self._report_event = asyncio.Event()
        self._byes: set[str] = set()
        self._eval_losses: list = []
        self._projector_step = -1
        """The step whose PROJ this stage loaded last."""
        self._progress: StepProgress | None = None
        self._t0 = 0.0

    @property
    def step(self) -> int:
        """The step this stage works on: the next one to flush."""
        return self.window.step

    # ------------------------------------------------------------------ entry points
    def begin(self, start_step: int | None, epoch: int = 0) -> None:
        if start_step is not None:
            self.s = replace(self.s, start_step=start_step)
        self.window.begin(self.s.start_step, epoch)
        self._cur = _Step(self.s.start_step)

    async def run(self) -> None:
        """Every step from :meth:`begin`'s, then the end (module docstring); sets ``result.wall_s``."""
        await self._send_projector(self.s.start_step)
        if self.replicas is not None:
            self._ranked(await self.compute.run(self.replicas.sync, timeout=self.averaging_timeout_s), sync=True)
        self._t0 = time.perf_counter()
        if self.first and self.s.progress:
            self._progress = StepProgress(self.s.steps, initial=self.s.start_step, desc=self.s.progress_desc)
        try:
            for step in range(self.s.start_step, self.s.steps):
                if self.first and step > self.s.start_step and due(self.s.val_interval_steps, step, self.s.steps):
                    await self._validate(step)
                await self._run_step(step)
                await self._flush(step)
            if self.first:
                if due(self.s.val_interval_steps, self.s.steps, self.s.steps):
                    await self._validate(self.s.steps)
                await self._reports_in([("train", s) for s in range(self.s.start_step, self.s.steps)])
                await self.hooks.finish()
                await self._say_bye({"reason": "training finished"}, self.step)
            else:
                await self._until_byes()
        except _RunOver:
            await self._say_bye(dict(self.bye.meta), self.bye.step)
        finally:
            self.result.wall_s = time.perf_counter() - self._t0

    def close(self) -> None:
        if self._progress is not None:
            self._progress.close()

    def _ranked(self, round_: ReplicaStep, *, sync: bool = False) -> None:
        if not round_.in_sync:
            raise MaplError(f"{self.name}: the replicas of stage {self.stage} hold different parameters "
                            f"({len(set(round_.digests.values()))} digests)")
        self.rank, self.replica_count = round_.rank, round_.group_size
        if sync:
            log.info("%s: replica %d of %d of stage %d", self.name, self.rank, self.replica_count, self.stage)

    async def _say_bye(self, meta: dict, step: int) -> None:
        for link in self._down_links():
            await link.send_bye(meta, step=step)

    # ------------------------------------------------------------------ links and waiting
    def _up_links(self) -> list[PeerLink]:
        return [link for link in self.links.of_stage(self.links.up) if link.welcomed]

    def _down_links(self) -> list[PeerLink]:
        """The downstream links, in contact order (every replica of a stage orders them alike)."""
        return sorted((link for link in self.links.of_stage(self.links.down) if link.welcomed),
                      key=lambda link: link.contact or link.name)

    def _drop(self, code: str, msg: Message, rule: str, text: str) -> None:
        self._reject(code, f"stage{msg.src}", f"{msg.type.name} step {msg.step} micro-batch {msg.micro} dropped by "
                                              f"the replicas' schedule ({rule}): {text}")

    async def _next(self, wanted: Callable[[Message], bool], what: str) -> tuple[Message, PeerLink]:
        return await self.waits.wait(self.mailbox.get_from(wanted, self.s.timeout_s, what), self._waited)

    def _waited(self) -> list[PeerLink]:
        """The links this replica waits on now (the waiting log names them)."""
        cur = self._cur
        return [link for link in self._up_links() if link.name in cur.readied and link.name not in cur.announced] + \
            list({link.name: link for link, _ in cur.dest.values()}.values())

    # ------------------------------------------------------------------ a step
    async def _run_step(self, step: int) -> None:
        cur = self._cur = _Step(step)
        if self.first:
            cur.todo = [g - step * self.M for g in replica_share(step, self.M, self.rank, self.replica_count)]
        else:
            await self._take_projector(step)
            for link in self._up_links():
                await link.send_route(step, "ready")
                cur.readied.add(link.name)
        while True:
            if cur.waiting and cur.ready:
                await self._send_waiting(cur)
            if not self.last and not cur.ended and self._all_computed(cur) and not cur.waiting:
                cur.ended = True
                for link in cur.ready:
                    await link.send_route(step, "end", acts=cur.sent[link.name])
            if self._done(cur):
                return
            if self.first and cur.todo and cur.ready and len(cur.dest) < self.s.max_in_flight * len(cur.ready):
                await self._feed(cur, cur.todo.pop(0))
                continue
            got = self.mailbox.take_from(lambda m: m.type is MT.GRAD and m.step == step)  # GRADs first
            msg, link = got if got is not None else await self._next(
                lambda m: self._wanted(m, step), f"ACT, GRAD or ROUTE of step {step}")
            await self._handle(msg, link, cur)

    def _all_computed(self, cur: _Step) -> bool:
        """Every train ACT of the step this stage will compute was computed."""
        if self.first:
            return not cur.todo
        return set(cur.announced) >= cur.readied and cur.forwarded == cur.taken == sum(cur.announced.values())

    def _done(self, cur: _Step) -> bool:
        """Every micro-batch of the step passed this stage both ways, and every ready link had its ``end``."""
        return self._all_computed(cur) and not cur.dest and not cur.waiting and cur.backwarded == cur.forwarded \
            and (self.last or cur.ended)

    def _wanted(self, msg: Message, step: int) -> bool:
        if msg.type is MT.BYE:
            return msg.src == self.links.up
        if msg.type is MT.ACT and msg.meta.get("mode") == "eval":
            return msg.step <= step
        return msg.type is not MT.PROJ_GRAD and msg.step <= step  # later steps' messages wait their turn

    async def _handle(self, msg: Message, link: PeerLink, cur: _Step) -> None:
        if msg.type is MT.BYE:
            self._on_bye(msg, link, during_step=True)
        elif msg.type is MT.ROUTE:
            await self._on_route(msg, link, cur)
        elif msg.type is MT.ACT and msg.meta.get("mode") == "eval":
            await self._eval_forward(msg)
        elif msg.step < cur.step or msg.type is MT.PROJ:  # a replica's copy of a PROJ taken, or a stale message
            log.debug("%s: %s of step %d from %s not used (step %d)", self.name, msg.type.name, msg.step, link.name,
                      cur.step)
        elif msg.type is MT.ACT:
            await self._on_act(msg, link, cur)
        elif msg.type is MT.GRAD:
            await self._on_grad(msg, link, cur)
        else:
            self._drop("out_of_window", msg, "one step at a time", f"{msg.type.name} while at step {cur.step}")

    def _on_bye(self, msg: Message, link: PeerLink, *, during_step: bool) -> None:
        self._byes.add(link.name)
        self.bye = msg
        if during_step or msg.meta.get("reason") != "training finished":
            raise _RunOver()

    async def on_ready(self, msg: Message, link: PeerLink) -> None:
        """ROUTE ``ready`` from downstream, from the dispatcher: for a step this replica ended, ``end``
        with 0 ACTs at once (whatever the schedule waits for: its averaging round may wait, through
        the stage's other replicas, for this answer); else the schedule takes it in turn."""
        cur = self._cur
        if msg.step < cur.step or (msg.step == cur.step and cur.ended):
            await link.send_route(msg.step, "end", acts=0)
            return
        try:
            self.mailbox.put(msg, link)
        except Rejected as exc:  # queue_full
            self._reject(exc.code, link.name, exc.text)

    async def _on_route(self, msg: Message, link: PeerLink, cur: _Step) -> None:
        phase = msg.meta["phase"]
        if phase == "ready":  # from downstream, through :meth:`on_ready`
            if msg.step == cur.step and not cur.ended and link not in cur.ready:
                cur.ready.append(link)
                cur.ready.sort(key=lambda x: x.contact or x.name)
            else:  # too late to be routed to: nothing of the step comes on it
                await link.send_route(msg.step, "end", acts=0)
            return
        if link.name not in cur.readied or link.name in cur.announced or msg.step != cur.step \
                or msg.meta["acts"] < cur.received[link.name]:
            self._drop("out_of_window", msg, "one ROUTE end per ready link and step, after its ACTs' count",
                       f"from {link.name} (ACTs taken {cur.received[link.name]})")
            return
        cur.announced[link.name] = int(msg.meta["acts"])

    # ------------------------------------------------------------------ forward and backward
    def _payload(self, msg: Message, names: dict[str, str]) -> dict:
        return {key: msg.tensors[name] for key, name in names.items() if name in msg.tensors}

    async def _feed(self, cur: _Step, micro: int) -> None:
        ids = self.sampler.batch_at(cur.step * self.M + micro)
        res = await self.compute.run(self.host.forward, micro, ids=ids, train=True)
        cur.forwarded += 1
        cur.waiting.append((micro, res.payload))
        await self._send_waiting(cur)

    async def _send_waiting(self, cur: _Step) -> None:
        while cur.waiting and cur.ready:
            micro, payload = cur.waiting.pop(0)
            link = self.router.pick(cur.ready, cur.step, micro)
            await link.send_act(cur.step, micro, payload, eval_mode=False, pver=self.window.outbound_pver)
            self.router.sent(link)
            cur.sent[link.name] += 1
            cur.dest[micro] = (link, time.monotonic())

    async def _on_act(self, msg: Message, link: PeerLink, cur: _Step) -> None:
        micro = msg.micro
        if link.name not in cur.readied or link.name in cur.announced and cur.received[link.name] >= \
                cur.announced[link.name]:
            self._drop("not_allowed", msg, "ACTs only on links told ready, up to their end",
                       f"from {link.name}")
            return
        if not 0 <= micro < self.M or micro in cur.origin:
            self._drop("out_of_window", msg, "one ACT per micro-batch of the step", f"micro-batch {micro} of {self.M}"
                                                                                     f" (taken already?)")
            return
        if msg.pver != self.window.inbound_pver:
            self._drop("stale_projector", msg, "ACTs use the projector this stage holds",
                       f"made with projector v{msg.pver}, this stage holds v{self.window.inbound_pver}")
            return
        cur.origin[micro] = link
        cur.received[link.name] += 1
        res = await self.compute.run(self.host.forward, micro, wire=self._payload(msg, ACT_WIRE), train=True)
        cur.forwarded += 1
        if not self.last:
            cur.waiting.append((micro, res.payload))
            return
        cur.losses.append(res.loss)
        grad = await self.compute.run(self.host.backward, micro, None, origin=link.name)
        cur.backwarded += 1
        if grad is not None:  # a last stage that is not stage 0
            await link.send_grad(cur.step, micro, grad, pver=self.window.inbound_pver)

    async def _on_grad(self, msg: Message, link: PeerLink, cur: _Step) -> None:
        micro = msg.micro
        went = cur.dest.get(micro)
        if went is None or went[0] is not link:
            self._drop("out_of_window", msg, "a GRAD answers a train ACT sent on its link",
                       f"no GRAD of micro-batch {micro} due from {link.name}")
            return
        if msg.pver != self.window.outbound_pver:
            self._drop("stale_projector", msg, "GRADs come from ACTs of the projector this stage holds",
                       f"made with projector v{msg.pver}, this stage holds v{self.window.outbound_pver}")
            return
        del cur.dest[micro]
        self.router.returned(link, time.monotonic() - went[1])
        origin = cur.origin.get(micro)
        grad = await self.compute.run(self.host.backward, micro, self._payload(msg, GRAD_WIRE),
                                      origin=None if origin is None else origin.name)
        cur.backwarded += 1
        if origin is not None:
            await origin.send_grad(cur.step, micro, grad, pver=self.window.inbound_pver)

    # ------------------------------------------------------------------ the projector and the flush
    def _owns_projector(self) -> bool:
        return self.rt.outbound is not None and self.rt.outbound.trainable

    def _takes_projector(self) -> bool:
        return self.rt.inbound is not None and self.rt.inbound.trainable

    async def _send_projector(self, step: int) -> None:
        if not self._owns_projector():
            return
        proj = await self.compute.run(self.host.outbound_projector)
        self.window.projector(self.links.down, proj[1])
        for link in self._down_links():
            await link.send_projector(step, proj[0], proj[1])

    async def _take_projector(self, step: int) -> None:
        """The first PROJ of ``step`` from an upstream replica (they all send the same), unless this
        stage holds it already."""
        if not self._takes_projector() or self._projector_step >= step:
            return
        while True:
            msg, link = await self._next(lambda m: (m.type is MT.PROJ and m.step <= step) or m.type is MT.BYE,
                                         f"PROJ of step {step}")
            if msg.type is MT.BYE:
                self._on_bye(msg, link, during_step=True)
            if msg.step == step and msg.pver >= self.window.inbound_pver:
                await self.compute.run(self.host.load_inbound_projector, msg.tensors[WireName.PROJ], msg.pver)
                self._projector_step = step
                return

    async def _flush(self, step: int) -> None:
        """PROJ_GRADs, the averaging round, the optimizer step, the next PROJ, the REPORT (module docstring)."""
        cur = self._cur
        if self._takes_projector():
            pver = self.window.inbound_pver
            for link in self._up_links():
                n = cur.received[link.name]
                if n:
                    g = await self.compute.run(self.host.take_inbound_projector_grad, origin=link.name)
                    await link.send_projector_grad(step, g, micro_batches=n, pver=pver)
        if self._owns_projector():
            await self._projector_grads(cur)
        loss_sum = sum(await self.compute.run(loss_values, cur.losses)) if self.last and cur.losses else 0.0
        if self.replicas is not None:
            t0 = time.perf_counter()
            round_ = await self.compute.run(self.replicas.average, cur.forwarded, timeout=self.averaging_timeout_s,
                                            loss_sum=loss_sum)
            log.debug("%s: step %d averaged among %d replicas in %.2f s", self.name, step, round_.group_size,
                     time.perf_counter() - t0)
            problem = round_.problem(self.M)
            if problem is not None:
                raise MaplError(f"{self.name}: step {step} cannot be taken: {problem}")
            self._ranked(round_)
            loss_sum = round_.loss_sum
            counts = self.result.averaging
            for key, n in (("rounds", 1), ("sent_bytes", round_.sent_bytes), ("received_bytes", round_.received_bytes)):
                counts[key] = counts.get(key, 0) + n
        elif cur.forwarded != self.M:
            raise MaplError(f"{self.name}: step {step} computed {cur.forwarded} of its {self.M} micro-batches")
        metrics = await self.compute.run(self.rt.step)
        if self.replicas is not None:
            metrics.update(averaging_sent_bytes=round_.sent_bytes, averaging_received_bytes=round_.received_bytes)
        self.window.advance()
        await self._send_projector(step + 1)
        await self.hooks.step_end(step + 1, metrics)
        if self.last:
            report = {"mode": "train", "loss": loss_sum / self.M, "tokens": self.rt.cfg.tokens_per_step}
            for link in self._up_links():
                await link.send_report(step, report)

    async def _projector_grads(self, cur: _Step) -> None:
        """A PROJ_GRAD of the step from every downstream link this stage sent ACTs on, added."""
        due_from = {name for name, n in cur.sent.items() if n}
        while due_from:
            msg, link = await self._next(lambda m: (m.type is MT.PROJ_GRAD and m.step == cur.step)
                                         or (m.type is MT.ROUTE and m.step <= cur.step), f"PROJ_GRAD of step {cur.step}")
            if msg.type is MT.ROUTE:
                await self._on_route(msg, link, cur)
            elif link.name not in due_from or msg.meta.get("micro_batches") != cur.sent[link.name]:
                self._drop("out_of_window", msg, "one PROJ_GRAD per link that carried ACTs, over them",
                           f"from {link.name} over {msg.meta.get('micro_batches')} micro-batch(es)")
            elif msg.pver != self.window.outbound_pver:
                self._drop("stale_projector", msg, "PROJ_GRAD of the projector this stage holds",
                           f"computed at projector v{msg.pver}, this stage holds v{self.window.outbound_pver}")
            else:
                due_from.discard(link.name)
                await self.compute.run(self.host.add_outbound_projector_grad, msg.tensors[WireName.PROJ_GRAD])

    # ------------------------------------------------------------------ reports, validation, the end
    async def on_report(self, msg: Message) -> None:
        """A REPORT from downstream: the first of a (mode, step) is relayed upstream (stage 0 records
        it); the other replicas' copies are dropped quietly."""
        mode = msg.meta.get("mode", "train")
        key = (mode, msg.step)
        if key in self._reported:
            return
        if (mode == "train" and not self.s.start_step <= msg.step < self.s.steps) or \
                (mode == "eval" and not due(self.s.val_interval_steps, msg.step, self.s.steps)):
            self._drop("out_of_window", msg, "REPORTs of the run's steps and validations", f"{mode} REPORT")
            return
        self._reported.add(key)
        if not self.first:
            for link in self._up_links():
                await link.send_report(msg.step, dict(msg.meta))
            return
        loss = float(msg.meta["loss"])
        self._reports[key] = loss
        self._report_event.set()
        if mode == "train":
            self.result.train_losses.append(loss)
            self.result.report_times_s.append(time.perf_counter() - self._t0)
            self.result.tokens += int(msg.meta["tokens"])
            self.hooks.train_loss(msg.step + 1, loss, int(msg.meta["tokens"]))
            if self._progress is not None:
                elapsed = max(time.perf_counter() - self._t0, 1e-9)
                self._progress.step(loss=f"{loss:.3f}", tok_s=f"{self.result.tokens / elapsed:.0f}")

    async def _reports_in(self, keys: list[tuple[str, int]]) -> None:
        if not await self.waits.wait(until(lambda: all(k in self._reports for k in keys), self._report_event,
                                           self.s.timeout_s), self._down_links):
            missing = [k for k in keys if k not in self._reports]
            raise MaplError(f"{self.name}: no REPORT of {missing[:3]} from the last stage within "
                            f"{self.s.timeout_s:g} s")

    async def _validate(self, step: int) -> None:
        """Stage 0: the validation after ``step`` steps (the replica of rank 0 sends the eval ACTs)."""
        down = self._down_links()
        if self.rank == 0 and down:
            for i, ids in enumerate(self.val_batches):
                res = await self.compute.run(self.host.forward, -1 - i, ids=ids, train=False)
                await down[0].send_act(step, i, res.payload, eval_mode=True, pver=self.window.outbound_pver)
        await self._reports_in([("eval", step)])
        loss = self._reports[("eval", step)]
        self.result.val_history.append((step, loss))
        self.hooks.val_loss(step, loss)
        log.info("step %d: val loss %.4f", step, loss)

    async def _eval_forward(self, msg: Message) -> None:
        await self._take_projector(msg.step)  # after the last step: the PROJ of the steps done
        if not 0 <= msg.micro < self.s.val_batches or msg.pver != self.window.inbound_pver:
            self._drop("out_of_window", msg, "eval ACTs of a validation, at the projector this stage holds",
                       f"eval micro-batch {msg.micro} of {self.s.val_batches} at v{msg.pver}")
            return
        res = await self.compute.run(self.host.forward, -1 - msg.micro, wire=self._payload(msg, ACT_WIRE),
                                     train=False)
        if not self.last:
            down = self._down_links()
            await down[0].send_act(msg.step, msg.micro, res.payload, eval_mode=True, pver=self.window.outbound_pver)
            return
        self._eval_losses.append(res.loss)
        if len(self._eval_losses) == self.s.val_batches:
            losses, self._eval_losses = self._eval_losses, []
            loss = await self.compute.run(mean_loss, losses)
            for link in self._up_links():
                await link.send_report(msg.step, {"mode": "eval", "loss": loss, "tokens": 0})

    async def _until_byes(self) -> None:
        """After the last step: eval ACTs of the last validation, until every upstream link said BYE;
        then BYE on every downstream link."""
        while not {link.name for link in self._up_links()} <= self._byes:
            msg, link = await self._next(lambda m: m.type is MT.BYE or (m.type is MT.ACT and m.meta.get("mode") ==
                                                                         "eval") or m.type is MT.ROUTE,
                                         "BYE from every upstream replica")
            if msg.type is MT.BYE:
                self._on_bye(msg, link, during_step=False)
            elif msg.type is MT.ROUTE:
                await self._on_route(msg, link, self._cur)
            else:
                await self._eval_forward(msg)
        await self._say_bye(dict(self.bye.meta), self.bye.step)
