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
  average their gradients (:class:`~mapl_swarm.replicas.gradients.ReplicaGradients`: a round of
  every live replica of the stage in which each micro-batch of s was accumulated exactly once, with
  equal digests);
- **commit**: no replica takes step s before every live replica's round of s was whole. The last
  stage's replicas send the step's REPORT (the loss over the M micro-batches, summed in the round)
  on every upstream link once their round is whole; a middle replica sends it upstream once its
  own round is whole and every live downstream replica's REPORT is in; a stage-0 replica then says
  ROUTE ``commit`` on its downstream links, and a stage-1 replica that has one from every live
  stage-0 replica knows every round was whole: it takes the step and says ROUTE ``taken``
  upstream (stage 0 takes the step and records the loss on the first) and ``commit`` downstream
  (a later replica takes the step on the first and says it on). A round that failed after its
  all-reduce began may have counted at a partner: the replica redoes the step, and since it says
  nothing of the commit, no replica takes it. After its step every sender replica sends the next
  PROJ on every downstream link.

**A replica that leaves** (silent past its liveness deadline, or BYE before the end) while its
stage keeps another: its neighbours drop its links (:meth:`ReplicaSchedule.replica_gone`), stop
waiting for what it owed and tell its stage's other replicas (ROUTE ``gone``), which average
without it from then on. What it had accumulated is lost; while its neighbours serve the step (or
flush it before their round is whole) they **repair** it (SPEC §9.10 item 10): a sender sends the
ACTs that went to it again, with the bytes it kept (ROUTE ``reopen`` first, :meth:`_forget`,
:meth:`_reopen`), and drops the GRAD of one it had backwarded; its partners route each to the
replica of the next stage that took it from the gone one (the ``held`` of that replica's ``gone``,
:meth:`_send_waiting`), which gives the GRAD it computed again instead of computing it
(:meth:`_take_rerun`; its gradients count the micro-batch already) and passes the gone link's part
of the inbound projector's gradient on with a live link's PROJ_GRAD; what the gone replica had not
passed on comes as new ACTs, which the next stage waits for (:meth:`_answer`). A replica that
flushed already and gets a ``reopen`` before its round is whole serves the step again
(:class:`_Resume`; its PROJ_GRADs go again over all the link's ACTs, a receiver replaces the one it
added). Every micro-batch then counts once per stage and no step is redone. Otherwise (a stage-0
replica gone: its share of the data is read by no one else; a loss found after a round was
whole; a re-run whose bytes differ) a round is not whole (such a round sends no tensor bytes:
:func:`~mapl_swarm.replicas.gradients.round_counts`) and the replica says ROUTE ``redo`` (the
step, the run epoch one higher, the replicas gone) on every link; every replica that gets it
passes it on, forgets the step's work (:meth:`~mapl_swarm.pipeline.stage.StageRuntime.abandon_step`),
moves to that epoch (what else of the earlier one comes is dropped unread, but PROJ and BYE; a
payload of it computed once the redo was known is not sent: the links carry the new epoch's) and
runs the step again with the replicas left, stage 0 re-splitting its micro-batches among its live
replicas. A round that is whole commits, so a step is either taken once by every stage or redone
by all of them: every micro-batch counts once per stage and the step's tokens are exact. A stage
whose last replica leaves is the peer's (:class:`~.runtime.Peer`: the swarm re-forms, or the run
ends).

**Codebooks** (MAPL+VQ, learned per step, SPEC §9.10 item 12): a CODEBOOK_SLICE is applied as soon
as the schedule takes messages, whatever it waits for (a slice precedes its link's next payload in
the mailbox, and none of a step comes before the previous step's last payload was taken); decodes
go through the link's guard (codes of another version ask for a retransmission and are dropped).

**A replica that joins** the running swarm (``joining``, SPEC §9.10 item 11; its links come from
:mod:`~.replica_links`) downloads its stage's state from a live replica (:meth:`ReplicaSchedule._join`:
what :meth:`ReplicaSchedule._served_state` gives, read under the lock the optimizer step holds) and
starts at that state's step: it takes no ACTs in it, takes part in its stage's round with no
micro-batch and in the step's commit, and is a full replica from the next step. Every replica's
round expects the stage's replicas announced in the DHT since its last round (:meth:`_expected`),
so the partners wait for the joiner; a neighbour counts a link in a step's commit only when the
link was live when the step began, and replays its latest commit messages to a link welcomed
later (:meth:`ReplicaSchedule.on_linked`). A joiner whose state turns out a step old (its round
meets replicas of the next step) downloads it again.

REPORTs (from the dispatcher, :meth:`ReplicaSchedule.on_report`): each downstream link's train
REPORT of the current step is kept for the commit; eval REPORTs are relayed at once (the other
replicas' copies dropped quietly). Validation: the stage-0 replica of rank 0 sends the
eval ACTs, each replica forwards them on its first downstream link (by contact), so one last-stage
replica takes them all (each eval micro-batch once) and reports; a replica that leaves before the
eval REPORT came makes the stage-0 replica of rank 0 send them all again (:meth:`_validate`). The
end: stage 0's replicas say BYE on every downstream link after the last REPORT; a later replica
ends once every upstream link said BYE, and says it on.

A message that is not due is dropped through ``reject`` with its code and the rule, as the chain's
:class:`~.window.StepWindow` does; the window keeps the admission's header checks (step range, run
epoch, the stage's projector version) in step with this schedule.
"""

from __future__ import annotations

import asyncio
import copy
import hashlib
import logging
import threading
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, TypeVar

from mapl_swarm.aio import until
from mapl_swarm.errors import MaplError
from mapl_swarm.metrics.progress import StepProgress
from mapl_swarm.peer.host import HostRuntime
from mapl_swarm.peer.session import Rejected
from mapl_swarm.peer.vq_link import Retransmitting
from mapl_swarm.peer.window import StepWindow
from mapl_swarm.pipeline.payload import ACT_WIRE, GRAD_WIRE, WireName
from mapl_swarm.pipeline.run_policy import due
from mapl_swarm.pipeline.stage import loss_values, mean_loss
from mapl_swarm.replicas.assignment import replica_share
from mapl_swarm.replicas.errors import AveragingFailed, Behind
from mapl_swarm.replicas.state import prime_optimizers
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
_R = TypeVar("_R")
"""What one attempt of a round gives (:meth:`ReplicaSchedule._retried`)."""

__all__ = ["ReplicaSchedule", "Router"]

MT = MessageType

_MAX_GONE = 64
_MAX_CONTACT = 512
"""Bounds on a ROUTE ``gone`` list a neighbour sends (entries beyond them are not read)."""

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
    members: frozenset[str] = frozenset()
    """Neighbour links live when the step began: those whose REPORT (downstream) or ``commit``
    (stage 1, from stage 0) the step's commit waits for. A replica that joins mid-step counts
    from the next one."""
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
    done: list[int] = field(default_factory=list)
    """Micro-batches whose backward ran here: what this replica's gradients hold."""
    via: dict[int, PeerLink] = field(default_factory=dict)
    """Micro-batch -> the downstream link its train ACT went on last."""
    payloads: dict[int, dict] = field(default_factory=dict)
    """Micro-batch -> the ACT payload sent (kept while the downstream stage has several replicas:
    what went to one that leaves is sent again, :meth:`ReplicaSchedule._forget`)."""
    replayed: set[int] = field(default_factory=set)
    """Micro-batches sent again whose backward ran here already: their GRAD is dropped."""
    notices: list[str] = field(default_factory=list)
    """Contacts of downstream replicas gone: ROUTE ``reopen`` names them to their partners before the
    re-sends (:meth:`ReplicaSchedule._reopen`)."""
    resend: list[tuple[int, dict]] = field(default_factory=list)
    """ACTs to send again (their replica left), once the notices and any ``reopen`` went."""
    reopen: bool = False
    """ROUTE ``reopen`` goes on the ready links first: more ACTs follow the ``end`` they had."""
    grads: dict[int, dict] = field(default_factory=dict)
    """Micro-batch -> the GRAD payload its backward gave here (kept while the upstream stage has
    several replicas: given again to the replica that re-runs a micro-batch whose origin left)."""
    digests: dict[int, bytes] = field(default_factory=dict)
    """Micro-batch -> the digest of its train ACT (a re-run must bring the same bytes)."""
    held: set[int] = field(default_factory=set)
    """Micro-batches taken from an upstream replica that left, whose re-run has not come yet."""
    held_from: set[str] = field(default_factory=set)
    """Names of the gone upstream links whose micro-batches this replica holds (their part of the
    inbound projector's gradient goes to a live one)."""
    partners_gone: set[str] = field(default_factory=set)
    """Contacts of this stage's replicas gone during the step (ROUTE ``gone`` from a neighbour)."""
    told: dict[str, set[str]] = field(default_factory=dict)
    """Downstream link -> the gone replicas of this stage it said which micro-batches it holds of."""
    hold_at: dict[int, PeerLink] = field(default_factory=dict)
    """Micro-batch -> the downstream link that holds it (its re-run goes there)."""
    answered_down: set[str] = field(default_factory=set)
    """Partners gone that this replica said ``gone`` of downstream (:meth:`ReplicaSchedule._answer`)."""
    await_answers: bool = False
    """An upstream replica left before its ``end``: every live upstream link says ``gone`` or
    ``reopen`` before this replica counts its ACTs of the step as all in."""
    answered: set[str] = field(default_factory=set)
    """Upstream links that said ``gone`` or ``reopen`` in the step (whether a partner's ACTs come again)."""
    reopened: set[str] = field(default_factory=set)
    """Downstream links told ``reopen``: a PROJ_GRAD over fewer ACTs than they carried is superseded."""
    proj_sent: dict[str, tuple[int, Any]] = field(default_factory=dict)
    """Upstream link -> the ACTs and inbound projector gradient its PROJ_GRAD covered (a flush after
    a reopen sends the sum over all of them)."""
    proj_added: dict[str, tuple[int, Any]] = field(default_factory=dict)
    """Downstream link -> the ACTs and PROJ_GRAD tensor added to the outbound projector's gradient."""
    untake: set[str] = field(default_factory=set)
    """Downstream links gone whose ACTs went again: a PROJ_GRAD of theirs added is taken back."""
    started: bool = False
    """The step's start (readies, stage 0's share) is done: serving again after a reopen skips it."""
    gone_before: frozenset[str] = frozenset()
    """Contacts known gone when this attempt of the step began (its work never went through them)."""
    repair_by: float = 0.0
    """When (``time.monotonic``) the wait for a repair (re-runs, upstream word, downstream ``held``)
    gives up and the step is redone (0: none awaited)."""
    todo: list[int] = field(default_factory=list)
    """Stage 0: micro-batches of its share not computed yet."""
    losses: list = field(default_factory=list)
    """The last stage: its micro-batches' losses (on the device)."""

    @property
    def taken(self) -> int:
        return sum(self.received.values())


def _act_digest(msg: Message) -> bytes:
    """What identifies a train ACT's content: its versions and tensors (names, dtypes, shapes, bytes)."""
    h = hashlib.sha256(f"{msg.pver}/{msg.cver}".encode())
    for name in sorted(msg.tensors):
        t = msg.tensors[name]
        h.update(f"/{name}/{t.dtype}/{t.data.shape}/".encode())
        h.update(t.data.tobytes())
    return h.digest()


class _RunOver(Exception):
    """An upstream BYE ended the run before its last step (its sender stopped)."""


class _Rejoin(Exception):
    """A joining replica's state is a step old (its stage's other replicas averaged the step it
    began without it): it downloads the state again."""


class _Resume(Exception):
    """A reopen came while this replica flushed the step, before its round: it serves the step again."""


class _Redo(Exception):
    """The current step is to be run again, in a later run epoch (a replica left before it was taken)."""


class ReplicaSchedule:
    """Stage 0's driver, every replica's serving loop, the flush with its averaging round, REPORTs
    (see the module docstring). ``replicas``: this stage's averaging (None: the stage has one peer)."""

    def __init__(self, runtime: StageRuntime, links: Links, mailbox: Mailbox, compute: ComputeThread, *,
                 name: str, settings: ScheduleSettings, result: PeerResult, waits: WaitingLog,
                 hooks: PeerRunPolicy | NoRunHooks, routing: ReplicasConfig, replicas: ReplicaGradients | None,
                 sampler=None, val_batches: Sequence[torch.Tensor] = (),
                 reject: Callable[[str, str, str], None] | None = None,
                 spawn: Callable[[Coroutine[Any, Any, None]], Any] | None = None, joining: bool = False,
                 stage_contacts: Callable[[], Awaitable[Sequence[str]]] | None = None) -> None:
        self.rt, self.host = runtime, HostRuntime(runtime)
        self.links, self.mailbox, self.compute = links, mailbox, compute
        self.name, self.s, self.result, self.waits, self.hooks = name, settings, result, waits, hooks
        self.replicas, self.sampler, self.val_batches = replicas, sampler, list(val_batches)
        self.averaging_timeout_s, self.matchmaking_s = routing.averaging_timeout_s, routing.matchmaking_s
        self.bye: Message | None = None
        """The BYE that ended the run (its ``reason``)."""
        self.M = settings.num_micro_batches
        self.stage = 0 if links.up is None else links.up + 1
        self.first, self.last = links.up is None, links.down is None
        self._reject = reject or (lambda code, sender, text: log.warning("%s: dropped a message from %s: %s (%s)",
                                                                         name, sender, text, code))
        self.window = StepWindow(runtime, stage=self.stage, M=self.M, val_batches=settings.val_batches,
                                 steps=settings.steps, start_step=settings.start_step, reject=self._reject,
                                 upstream_lag=1)
        """The admission's header checks (step range, run epoch, the stage's projector version)."""
        self.router = Router(routing=routing.routing, seed=routing.routing_seed, stage=self.stage)
        self.rank, self.replica_count = 0, 1
        """Stage 0: this replica's rank among the stage's replicas of the current step, and their number."""
        self._cur = _Step(settings.start_step)
        self.joining = joining
        """This replica joins a running swarm (SPEC §9.10 item 11): its state comes from another replica."""
        self._joined = -1
        """The step a joining replica downloaded its state for, until it completed it."""
        self._stage_contacts = stage_contacts
        """The contacts of this stage's replicas announced in the DHT (a joining one among them)."""
        self._announced: dict[str, float] = {}
        """Contacts of this stage's DHT records not in a round yet: when this replica first saw each
        (-1 once it stopped waiting for it)."""
        self._hint: list[str] = []
        """A joining replica's partners before its first round: the contacts the state's sender named."""
        self._state_lock = threading.Lock()
        """Held by the optimizer step and the projector's load: a joining replica's download reads the
        stage's state under it, so it gets one step's state, whole."""
        self._served_members = self._served_gone = ""
        """The stage's live replicas and those gone (contacts, one per line), as the event loop
        last wrote them (a download reads them in another thread)."""
        self._early: dict[tuple[str, str], tuple[int, int]] = {}
        """A joining replica's ROUTE ``commit``/``taken`` that came before its download, by (phase,
        link): (step, run epoch)."""
        if joining:
            self.window.joining = True
        self._replay: dict[str, tuple[int, int, dict]] = {}
        """The commit messages of the latest step this replica sent (``report`` upstream, ``taken``
        upstream, ``commit`` downstream): (step, run epoch, REPORT meta). A neighbour replica linked
        later (one that joins) gets them too (:meth:`on_linked`)."""
        self._reported: set[tuple[str, int]] = set()
        """(mode, step) of the REPORTs this replica passed upstream (the last stage: sent) or recorded."""
        self._reports: dict[tuple[str, int], float] = {}
        self._report_event = asyncio.Event()
        self._byes: set[str] = set()
        self._eval_losses: dict[int, dict[int, Any]] = {}
        """The last stage: per validation (its step), each eval micro-batch's loss (on the device)."""
        self._projector_step = -1
        """The step whose PROJ this stage loaded last (set under :attr:`_state_lock`)."""
        self._progress: StepProgress | None = None
        self._t0 = 0.0
        self._spawn = spawn or asyncio.ensure_future
        self.gone: set[str] = set()
        """Contacts of the replicas (of any stage) known to have left the run."""
        self._round: ReplicaStep | None = None
        """This stage's last averaging round: its members, ranks and contacts."""
        self._redo: tuple[int, int] | None = None
        """(step, run epoch) of a redo this replica was told of and has not carried out yet."""
        self._redos = 0
        """Redos of the current step so far (bounded by :attr:`_max_redos`)."""
        self._max_redos = max(3, sum(routing.initial))
        self.starting = runtime.cfg.replicas_of(self.stage)
        """The replicas of this stage that start together (their first round's size): ``replicas.initial``'s,
        or a re-formed swarm's (set after the handshake: :func:`~.replica_links.starting_replicas`)."""
        self._woken = False
        """The replicas changed while the schedule waited (a neighbour left): it looks again."""
        self._averaging = False
        self._serving = False
        """The schedule serves the current step (:meth:`_run_step`): what a replica that leaves took
        goes again, a ``reopen`` is taken in its link's order."""
        self._resumable = False
        """The schedule flushes the current step and its round is not whole: a ``reopen`` makes it
        serve the step again (:class:`_Resume`); after a whole round one changes nothing (every
        micro-batch passed this stage: what comes again goes to the replicas that hold it)."""
        self._resume = False
        self._down_reports: dict[str, tuple[int, int, dict]] = {}
        """The latest train REPORT from each downstream link: (step, run epoch, meta)."""
        self._votes: set[str] = set()
        """Stage 1: the upstream links that said ROUTE ``commit`` of the current step and run epoch."""
        self._committed = -1
        """The last step this replica may take: said by ROUTE ``commit`` from upstream (stage 2 on)
        or ROUTE ``taken`` from downstream (stage 0); decided by stage 1 itself."""
        self.epoch = 0
        """The run epoch of the current step's attempt: one more per redo. The admission's floor
        (``window.epoch``) stays where training started: a neighbour's heartbeats of the epoch
        before keep counting; the schedule drops what else of it comes (:meth:`_next`)."""

    @property
    def step(self) -> int:
        """The step this stage works on: the next one to flush."""
        return self.window.step

    # ------------------------------------------------------------------ entry points
    def begin(self, start_step: int | None, epoch: int = 0) -> None:
        if start_step is not None:
            self.s = replace(self.s, start_step=start_step)
        self.window.begin(self.s.start_step, epoch)
        self.epoch = epoch
        self._cur = self._new_step(self.s.start_step)

    async def run(self) -> None:
        """Every step from :meth:`begin`'s (a joining replica: from its download's), then the end
        (module docstring); sets ``result.wall_s``."""
        if self.replicas is not None:
            self.replicas.serve(self._served_state)
        if self.joining:
            await self._join()
        else:
            await self._send_projector(self.s.start_step)
        if self.replicas is not None and not self.joining:
            replicas = self.replicas
            round_ = await self._retried("sync round", lambda left, _: replicas.sync(
                timeout=left, epoch=self.epoch, contact=self.contact, expected=self.starting))
            if not round_.in_sync:
                await self._resync(round_, "before the first step")
            self._ranked(round_, sync=True)
        self._t0 = time.perf_counter()
        if self.first and self.s.progress:
            self._progress = StepProgress(self.s.steps, initial=self.s.start_step, desc=self.s.progress_desc)
        try:
            while (step := self.step) < self.s.steps:
                if self.first and step > self.s.start_step and due(self.s.val_interval_steps, step, self.s.steps):
                    await self._validate(step)
                while True:
                    try:
                        await self._run_step(step)
                        await self._flush(step)
                        break
                    except _Redo:
                        await self._restart(step)
                    except _Resume:
                        self._resume = self._resumable = False
                        log.info("%s: step %d: more ACTs come after a replica left: serving the step again", self.name,
                                 step)
                    except _Rejoin:
                        await self._join()
                        break
                self._redos = 0
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

    async def _join(self) -> None:
        """Join the running swarm (SPEC §9.10 item 11): the stage's state from one of its live
        replicas (parameters, optimizer, projector and its version, step, run epoch, the stage's
        live replicas and those gone), checked against this replica's own; its step is this
        replica's first, in which it takes part in the stage's round (no share of stage 0's data
        before that round ranks it) and from which its parameters equal its partners'."""
        replicas = self.replicas
        if replicas is None:
            raise MaplError(f"{self.name}: a replica joins a run with replicas (replicas.enabled = true)")
        await self.compute.run(self.rt.abandon_step)
        # a state taken before its step's projector came is asked for again
        got = await self._download(lambda got: got["projector"] >= got["step"] or not self._takes_projector(),
                                   "its state")
        await self.compute.run(self.rt.load_state_dict, got["runtime"])
        step, epoch = int(got["step"]), int(got["epoch"])
        self._learn_gone([c for c in got["gone"].split("\n")[:_MAX_GONE] if c])
        self._hint = [c for c in got["members"].split("\n")[:_MAX_GONE] if c]
        self._projector_step = int(got["projector"])
        self._joined = step
        self.begin(step, epoch)
        self.window.joining = False
        self.links.set_epoch(epoch)
        self._woken = False
        for (phase, name), (at, at_epoch) in self._early.items():  # what a neighbour replayed before
            self._take_commit(phase, name, at, at_epoch)
        self._early.clear()
        log.info("%s: joined stage %d at step %d (run epoch %d) with the state of a live replica; %d other "
                 "replica(s) of the stage live", self.name, self.stage, step, epoch, len(self._hint))
        await self._send_projector(step)

    async def resume_round(self, saved: Sequence[int], reason: str) -> dict[str, tuple[list[int], str]]:
        """A resumed run's round of the stage's starting replicas, before anything is loaded (SPEC
        §9.10 item 13): each one's usable checkpoint steps and why it has none, by peer."""
        replicas = self.replicas
        if replicas is None:
            return {"": (sorted(saved), reason)}
        return await self._retried("resume round", lambda left, _: replicas.resume_round(
            saved, reason, timeout=left, contact=self.contact, expected=self.starting))

    async def _resync(self, round_: ReplicaStep, when: str) -> None:
        """The replicas of this stage hold different parameters (the round's digests, SPEC §9.10
        item 6): a replica that does not hold the stage's (:attr:`ReplicaStep.reference`) loads the
        state of a partner (hivemind's state download, as a joiner's: one of the same step); the
        others go on. The next round compares the digests again (after a step's round the step is
        redone), so a state that came from another replica that differed is found there."""
        held = len(set(round_.digests.values()))
        if round_.digests[round_.me] == round_.reference:
            log.warning("%s: the replicas of stage %d hold %d different parameter digests %s; this one holds the "
                        "stage's (most replicas'): the others load a partner's state", self.name, self.stage, held,
                        when)
            return
        log.warning("%s: this replica's parameters differ from the stage's (%d digests among %d replicas %s): "
                    "loading a partner's state", self.name, held, round_.group_size, when)
        step = self.rt.step_count
        got = await self._download(lambda got: int(got["step"]) == step, f"its state of step {step} (to re-sync)")
        await self.compute.run(self._load_served, got)
        counts = self.result.averaging
        counts["resyncs"] = counts.get("resyncs", 0) + 1

    async def _download(self, good: Callable[[dict], bool], what: str) -> dict:
        """The stage's state from a live replica (:meth:`_served_state`'s, checked against this
        replica's own form), asked for again until one answers with a state ``good`` takes, within
        ``net.timeout_s``; else :class:`MaplError` naming ``what``."""
        replicas = self.replicas
        assert replicas is not None
        like = await self.compute.run(self._join_template)
        deadline = time.monotonic() + self.s.timeout_s
        while (left := deadline - time.monotonic()) > 0:
            got = await self.compute.wait(lambda: replicas.download(like, timeout=min(left, 30.0)))
            if got is not None and good(got):
                return got
            await asyncio.sleep(min(0.5, max(0.0, deadline - time.monotonic())))
        raise MaplError(f"{self.name}: no replica of stage {self.stage} gave {what} within {self.s.timeout_s:g} s "
                        f"(net.timeout_s)")

    def _load_served(self, got: dict) -> None:
        """Load a partner's downloaded state (compute thread), under the lock a download of this
        replica's own state reads under; the inbound projector it holds counts as taken."""
        with self._state_lock:
            self.rt.load_state_dict(got["runtime"])
            self._projector_step = max(self._projector_step, int(got["projector"]))

    def _join_template(self) -> dict:
        """This replica's own served state, with optimizer state entries as a stepped one holds
        (what a downloaded state must match, :func:`~mapl_swarm.replicas.state.restore_like`)."""
        prime_optimizers(self.rt.optimizers)
        return self._served_state()

    async def _expected(self) -> int:
        """How many replicas this stage's round of the step needs (SPEC §9.10 items 6, 11), counted
        by contact: its live ones (the last round's, or a joining replica's partners as its state's
        sender named them, less those gone) and any replica of the stage announced in the DHT since
        (one that joins), for ``net.timeout_s`` from when this replica first saw its record: one
        that has not come to a round by then (a stale record, or a member that announces itself and
        never joins) is not waited for any longer."""
        r = self._round
        live = {r.contacts.get(p, p) for p in self._live_members()} if r is not None else {*self._hint, self.contact}
        if self._stage_contacts is not None:
            try:
                announced = await self._stage_contacts()
            except MaplError as exc:  # the DHT did not answer: the round goes by the replicas known
                log.debug("%s: the DHT gave no replicas of stage %d: %s", self.name, self.stage, exc)
                announced = []
            now = time.monotonic()
            for c in announced:
                if c and c not in self.gone and c not in live:
                    since = self._announced.setdefault(c, now)
                    if now - since <= self.s.timeout_s:
                        live.add(c)
                    elif since > 0:
                        self._announced[c] = -1.0  # said once
                        log.warning("%s: the replica of stage %d at %s announced itself %.0f s ago and has not come "
                                    "to a round: not waited for", self.name, self.stage, c, now - since)
        return len(live)

    def _ranked(self, round_: ReplicaStep, *, sync: bool = False) -> None:
        self._round = round_
        self._rerank()
        self._served_members = "\n".join(round_.contacts.get(p, "") for p in self._live_members())
        if sync:
            log.info("%s: replica %d of %d of stage %d", self.name, self.rank, self.replica_count, self.stage)

    def _live_members(self) -> list[str]:
        """The peer ids of this stage's live replicas, this one included, in rank order (the last
        round's, less those gone)."""
        r = self._round
        if r is None:
            return []
        return [p for p in r.group if p == r.me or r.contacts.get(p) not in self.gone]

    def _rerank(self) -> None:
        """This replica's rank among its stage's live replicas."""
        live = self._live_members()
        if live:
            self.rank, self.replica_count = live.index(self._round.me), len(live)

    @property
    def contact(self) -> str:
        """This peer's own contact (what its neighbours' links name it by)."""
        return next((link.local_contact for link in self.links if link.local_contact), "")

    def live_replicas(self) -> int:
        """The live replicas of this stage, this one included (before its first round: those that
        start with it)."""
        return len(self._live_members()) or self.starting

    async def _say_bye(self, meta: dict, step: int) -> None:
        for link in self._down_links():
            await link.send_bye(meta, step=step)

    # ------------------------------------------------------------------ links and waiting
    def _live(self, link: PeerLink) -> bool:
        return link.welcomed and link.contact not in self.gone

    def _up_links(self) -> list[PeerLink]:
        return [link for link in self.links.of_stage(self.links.up) if self._live(link)]

    def _down_links(self) -> list[PeerLink]:
        """The downstream links, in contact order (every replica of a stage orders them alike)."""
        return sorted((link for link in self.links.of_stage(self.links.down) if self._live(link)),
                      key=lambda link: link.contact or link.name)

    def _drop(self, code: str, msg: Message, rule: str, text: str) -> None:
        self._reject(code, f"stage{msg.src}", f"{msg.type.name} step {msg.step} micro-batch {msg.micro} dropped by "
                                              f"the replicas' schedule ({rule}): {text}")

    async def _next(self, wanted: Callable[[Message], bool], what: str,
                    timeout_s: float | None = None) -> tuple[Message, PeerLink] | None:
        """The oldest queued message ``wanted`` accepts (waiting up to ``timeout_s``, by default
        ``net.timeout_s``), or None when the replicas changed meanwhile (the caller looks again);
        raises :class:`_Redo` when the current step is to be redone."""
        self._check()
        if not self._woken:
            wait = self.mailbox.get_from(lambda m: m.type is MT.CODEBOOK_SLICE or wanted(m),
                                         self.s.timeout_s if timeout_s is None else timeout_s, what,
                                         stop=self._interrupted)
            got = await self.waits.wait(wait, self._waited)
            self._check()
            if got is not None and got[0].type is MT.CODEBOOK_SLICE:
                # whatever the caller waits for: a slice precedes its link's next payload, and
                # with codebooks learned per step none comes before the step's last payload is in
                await self._apply_slice(*got)
                return None
            return None if got is None or self._stale(got[0]) else got
        self._woken = False
        return None

    def _stale(self, msg: Message) -> bool:
        """``msg`` belongs to an earlier run epoch than the step's (dropped, logged at debug); a PROJ
        is the same in every epoch of its step, a BYE counts whenever."""
        if msg.epoch >= self.epoch or msg.type in (MT.PROJ, MT.BYE):
            return False
        log.debug("%s: %s of run epoch %d dropped (the step runs in epoch %d)", self.name, msg.type.name, msg.epoch,
                  self.epoch)
        return True

    async def _apply_slice(self, msg: Message, link: PeerLink) -> None:
        """A CODEBOOK_SLICE taken from the mailbox, applied unless its replica is gone."""
        if self._live(link):
            await link.on_codebook_slice(msg)

    def _interrupted(self) -> bool:
        return self._woken or self._resume or (self._redo is not None and self._redo[0] == self.step)

    def _check(self) -> None:
        """:class:`_Redo` when the dispatcher took a redo of the current step, :class:`_Resume` when
        a reopen came while this replica flushed it."""
        if self._redo is not None and self._redo[0] == self.step:
            raise _Redo()
        if self._resume or (self._resumable and self._reopen_queued()):
            raise _Resume()

    def _reopen_queued(self) -> bool:
        """A ROUTE ``reopen`` of the current step waits in the mailbox."""
        return self.mailbox.has(lambda m: m.type is MT.ROUTE and m.meta["phase"] == "reopen"
                                and (m.step, m.epoch) == (self.step, self.epoch))

    def _wake(self) -> None:
        self._woken = True
        self.mailbox.poke()
        self._report_event.set()  # a validation's wait looks again too

    def _waited(self) -> list[PeerLink]:
        """The links this replica waits on now (the waiting log names them)."""
        cur = self._cur
        return [link for link in self._up_links() if link.name in cur.readied and link.name not in cur.announced] + \
            list({link.name: link for link, _ in cur.dest.values()}.values())

    # ------------------------------------------------------------------ a step
    def _new_step(self, step: int) -> _Step:
        return _Step(step, frozenset(link.name for link in self.links if self._live(link)),
                     gone_before=frozenset(self.gone))

    async def _run_step(self, step: int) -> None:
        if self._cur.step != step:  # else a fresh one (the start, a redo): it may hold readies already
            self._cur = self._new_step(step)
        cur = self._cur
        if cur.started:  # serving it again after a reopen (_Resume)
            pass
        elif self.first and self._joined != step:  # a joining replica gets a share once its round ranked it
            cur.todo = [g - step * self.M for g in replica_share(step, self.M, self.rank, self.replica_count)]
        elif self._joined != step:  # a joining replica takes no ACTs before its first round
            await self._take_projector(step)
            for link in self._up_links():
                await link.send_route(step, "ready")
                cur.readied.add(link.name)
        cur.started = True
        self._serving = True
        while True:
            self._check()  # a redo noted meanwhile: no more of this epoch's work goes on the links
            if cur.repair_by and time.monotonic() > cur.repair_by and (
                    cur.held or cur.await_answers and not self._upstream_answered(cur)):
                self._issue_redo(step, f"the repair after a replica left did not come within {self.s.timeout_s / 2:g} s "
                                       f"({len(cur.held)} re-run(s) awaited here)")
            if cur.notices or cur.reopen or cur.resend:
                await self._reopen(cur)
            if cur.waiting and cur.ready:
                await self._send_waiting(cur)
            if not self.last and not cur.ended and self._all_computed(cur) and not cur.waiting:
                cur.ended = True
                for link in cur.ready:
                    await link.send_route(step, "end", acts=cur.sent[link.name])
            if self._done(cur):
                # a reopen queued meanwhile comes after its link's end: the step is not done here yet
                got = self.mailbox.take_from(lambda m: m.type is MT.ROUTE and m.meta["phase"] == "reopen"
                                             and (m.step, m.epoch) == (step, self.epoch))
                if got is not None:
                    await self._handle(*got, cur)
                    continue
                self._serving, self._resumable = False, True  # a reopen now: back to serving (_Resume)
                await self._end_queued_readies(cur)
                return
            if self.first and cur.todo and cur.ready and len(cur.dest) < self.s.max_in_flight * len(cur.ready):
                await self._feed(cur, cur.todo.pop(0))
                continue
            # GRADs first (with the grad stream's codebook slices that come before them)
            got = self.mailbox.take_from(lambda m: (m.type is MT.GRAD and m.step == step) or (
                m.type is MT.CODEBOOK_SLICE and m.meta.get("stream") == "grad"))
            if got is not None and got[0].type is MT.CODEBOOK_SLICE:
                await self._apply_slice(*got)
                continue
            if got is not None and self._stale(got[0]):  # a GRAD of the epoch a redo left
                continue
            if got is None:
                got = await self._next(lambda m: self._wanted(m, step), f"ACT, GRAD or ROUTE of step {step}")
            if got is not None:
                await self._handle(*got, cur)

    async def _reopen(self, cur: _Step) -> None:
        """After a downstream replica left (:meth:`_forget`): ROUTE ``reopen`` naming it on the
        ready links (``gone`` on the others), then the ACTs it took go again, in that order on
        every link (a partner knows its partner's loss, and takes ACTs after its ``end``, before
        the re-sends reach it). A replica told ``reopen`` that had said its own ``end`` says
        ``reopen`` (naming no one) on its ready links too (:meth:`_on_route`)."""
        notices, cur.notices = cur.notices, []
        relay, cur.reopen = cur.reopen, False
        for link in self._down_links():
            if link in cur.ready and (relay or notices):
                cur.reopened.add(link.name)
                await link.send_route(cur.step, "reopen", gone=notices)
            elif notices:
                await link.send_route(cur.step, "gone", gone=notices)
        cur.waiting.extend(cur.resend)
        cur.resend.clear()

    async def _end_queued_readies(self, cur: _Step) -> None:
        """A ``ready`` of the step still queued when the step is done (it came before the step began)
        gets its ``end`` with 0 ACTs: its sender waits for it."""
        while (got := self.mailbox.take_from(lambda m: m.type is MT.ROUTE and m.meta["phase"] == "ready"
                                             and m.step <= cur.step and m.epoch <= self.epoch)) is not None:
            await got[1].send_route(got[0].step, "end", acts=0)

    def _all_computed(self, cur: _Step) -> bool:
        """Every train ACT of the step this stage will compute was computed (of the live upstream
        links: one that left owes nothing more)."""
        if self.first:
            return not cur.todo
        if cur.await_answers and not self._upstream_answered(cur):
            return False  # what an upstream replica that left had not passed on may come again
        live = {link.name for link in self._up_links()}
        return set(cur.announced) >= cur.readied & live and cur.forwarded == cur.taken \
            and all(cur.received[name] == n for name, n in cur.announced.items() if name in live)

    def _done(self, cur: _Step) -> bool:
        """Every micro-batch of the step passed this stage both ways (one that went to a replica
        that left went again), every re-run of one taken from an upstream replica that left came,
        and every ready link had its ``end``."""
        return self._all_computed(cur) and not cur.dest and not cur.waiting and not cur.resend and not cur.notices \
            and not cur.reopen and not cur.held and len(cur.done) == cur.forwarded and (self.last or cur.ended)

    def _wanted(self, msg: Message, step: int) -> bool:
        if msg.type is MT.BYE:
            return msg.src == self.links.up
        if msg.type is MT.ACT and msg.meta.get("mode") == "eval":
            return msg.step <= step
        return msg.type is not MT.PROJ_GRAD and msg.step <= step  # later steps' messages wait their turn

    async def _handle(self, msg: Message, link: PeerLink, cur: _Step) -> None:
        if not self._live(link):  # queued before its replica was found gone
            return
        if msg.type is MT.BYE:
            self._on_bye(msg, link, during_step=True)
        elif msg.type is MT.ROUTE:
            await self._on_route(msg, link, cur)
        elif msg.type is MT.ACT and msg.meta.get("mode") == "eval":
            await self._eval_forward(msg, link)
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
        reason = str(msg.meta.get("reason", ""))
        if reason != "training finished" and self.replica_gone(link, f"BYE ({reason})"):
            return  # its stage goes on with its other replicas
        self._byes.add(link.name)
        self.bye = msg
        if during_step or reason != "training finished":
            raise _RunOver()

    async def on_ready(self, msg: Message, link: PeerLink) -> None:
        """ROUTE ``ready`` from downstream, from the dispatcher: for a step this replica ended, ``end``
        with 0 ACTs at once (whatever the schedule waits for: its averaging round may wait, through
        the stage's other replicas, for this answer); for the step it routes now, the link is one
        to route to from now on; one of a later step (or run epoch) waits for that step."""
        cur = self._cur
        if not self._live(link) or msg.epoch < self.epoch:
            return
        if msg.epoch == self.epoch and (msg.step < cur.step or (msg.step == cur.step and cur.ended)):
            await link.send_route(msg.step, "end", acts=0)
            return
        if msg.epoch == self.epoch and msg.step == cur.step:
            await self._on_route(msg, link, cur)
            self._wake()
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
        if phase == "reopen":  # in the link's order: more ACTs, then a fresh end follow
            if msg.step != cur.step or msg.epoch != self.epoch:
                return
            cur.announced.pop(link.name, None)
            if cur.ended and not self.last:  # what comes now goes on: this stage's links reopen too
                cur.ended, cur.reopen = False, True
            self._partners_gone(link, self._gone_named(msg))
            if self._resumable:  # taken while flushing, before its round: the step is served again
                self._resume = True
            return
        if msg.step < cur.step:  # a fresh end after a reopen that came once this stage's round was whole
            log.debug("%s: ROUTE end of step %d from %s not used (step %d)", self.name, msg.step, link.name, cur.step)
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
        """The computed ACTs, each on the link :class:`Router` draws; once a replica of this stage
        left during the step, only after every ready downstream link said which of its micro-batches
        it holds (ROUTE ``gone``, :meth:`_partners_gone`), and a held one's re-run on its holder's."""
        keep = len(self.links.of_stage(self.links.down)) > 1
        while cur.waiting and cur.ready:
            self._check()
            if cur.partners_gone and not all(cur.partners_gone <= cur.told.get(x.name, set()) for x in cur.ready):
                if time.monotonic() < cur.repair_by:
                    return  # the notice wakes the schedule
                self._issue_redo(cur.step, f"a downstream replica did not say within {self.s.timeout_s / 2:g} s which "
                                           f"micro-batches of the step it took from this stage's replica that left")
            micro, payload = cur.waiting[0]
            link = cur.hold_at.get(micro)
            if link is None:
                link = self.router.pick(cur.ready, cur.step, micro)
            elif link not in cur.ready:
                return  # its holder's ready has not come yet
            cur.waiting.pop(0)
            await link.send_act(cur.step, micro, payload, eval_mode=False, pver=self.window.outbound_pver)
            self.router.sent(link)
            cur.sent[link.name] += 1
            cur.dest[micro] = (link, time.monotonic())
            cur.via[micro] = link
            if keep:
                cur.payloads[micro] = payload

    async def _on_act(self, msg: Message, link: PeerLink, cur: _Step) -> None:
        micro = msg.micro
        if link.name not in cur.readied or link.name in cur.announced and cur.received[link.name] >= \
                cur.announced[link.name]:
            self._drop("not_allowed", msg, "ACTs only on links told ready, up to their end",
                       f"from {link.name}")
            return
        if not 0 <= micro < self.M or (micro in cur.origin and micro not in cur.held):
            self._drop("out_of_window", msg, "one ACT per micro-batch of the step", f"micro-batch {micro} of {self.M}"
                                                                                     f" (taken already?)")
            return
        if msg.pver != self.window.inbound_pver:
            self._drop("stale_projector", msg, "ACTs use the projector this stage holds",
                       f"made with projector v{msg.pver}, this stage holds v{self.window.inbound_pver}")
            return
        if micro in cur.held:
            await self._take_rerun(msg, link, cur)
            return
        try:
            res = await link.decoded(self.compute.run(self.host.forward, micro, wire=self._payload(msg, ACT_WIRE),
                                                      train=True, cver=msg.cver), msg)
        except Retransmitting:
            return  # codes of another codebook version: asked again, the copy comes on the link
        cur.origin[micro] = link
        cur.received[link.name] += 1
        cur.forwarded += 1
        if len(self.links.of_stage(self.links.up)) > 1:
            cur.digests[micro] = _act_digest(msg)
        if not self.last:
            cur.waiting.append((micro, res.payload))
            return
        cur.losses.append(res.loss)
        grad = await self.compute.run(self.host.backward, micro, None, origin=link.name)
        cur.done.append(micro)
        self._check()
        if grad is not None:  # a last stage that is not stage 0
            await self._send_grad(cur, micro, grad)

    async def _send_grad(self, cur: _Step, micro: int, grad: dict) -> None:
        """The GRAD of ``micro`` to the link its ACT came on; kept (:attr:`_Step.grads`) while a
        replica of the upstream stage may leave and its re-run ask for it again."""
        if micro in cur.digests:
            cur.grads[micro] = grad
        origin = cur.origin.get(micro)
        if origin is not None and self._live(origin):
            await origin.send_grad(cur.step, micro, grad, pver=self.window.inbound_pver)

    async def _take_rerun(self, msg: Message, link: PeerLink, cur: _Step) -> None:
        """The re-run of micro-batch ``msg.micro``, taken here from an upstream replica that left:
        this replica's gradients count it already (its parameters' part, the inbound projector's
        part kept for the gone link, :meth:`_flush`), so it is not computed again; it comes from
        ``link`` now, whose replica gets the GRAD computed for it (now, or when its backward runs).
        The re-run must bring the ACT the gone replica sent (its partners hold the same parameters
        and got the same input): one that differs redoes the step."""
        micro = msg.micro
        if _act_digest(msg) != cur.digests.get(micro):
            self._issue_redo(cur.step, f"the re-run of train micro-batch {micro} from {link.name} is not the ACT the "
                                       f"replica that left sent")
        gone = cur.origin[micro]
        cur.received[gone.name] -= 1
        cur.received[link.name] += 1
        cur.origin[micro] = link
        cur.held.discard(micro)
        log.debug("%s: step %d micro-batch %d re-run from %s: its GRAD %s", self.name, cur.step, micro, link.name,
                  "given again" if micro in cur.grads else "goes there")
        if micro in cur.grads:
            await link.send_grad(cur.step, micro, cur.grads[micro], pver=self.window.inbound_pver)

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
        if micro in cur.replayed:  # sent again for the next stage's sake: this stage counts it already
            cur.replayed.discard(micro)
            del cur.dest[micro]
            self.router.returned(link, time.monotonic() - went[1])
            return
        origin = cur.origin.get(micro)
        try:
            grad = await link.decoded(self.compute.run(self.host.backward, micro, self._payload(msg, GRAD_WIRE),
                                                       cver=msg.cver, origin=None if origin is None else origin.name),
                                      msg)
        except Retransmitting:
            return  # codes of another codebook version: asked again, the copy comes on the link
        del cur.dest[micro]
        self.router.returned(link, time.monotonic() - went[1])
        cur.done.append(micro)
        log.debug("%s: step %d micro-batch %d backward (%d of the step)", self.name, cur.step, micro, len(cur.done))
        self._check()
        if grad is not None:
            await self._send_grad(cur, micro, grad)

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
            got = await self._next(lambda m: (m.type is MT.PROJ and m.step <= step) or m.type is MT.BYE,
                                   f"PROJ of step {step}")
            if got is None or not self._live(got[1]):
                continue
            msg, link = got
            if msg.type is MT.BYE:
                self._on_bye(msg, link, during_step=True)
            if msg.step == step and msg.pver >= self.window.inbound_pver:
                await self.compute.run(self._load_projector, step, msg.tensors[WireName.PROJ], msg.pver)
                return

    async def _flush(self, step: int) -> None:
        """PROJ_GRADs, the averaging round, the commit, the optimizer step, the next PROJ (module docstring)."""
        cur = self._cur
        self._resumable = True
        if self._takes_projector():
            pver = self.window.inbound_pver
            # the part of micro-batches taken from a replica that left goes with the first live
            # link's (their re-runs came on live links; the sender stage's round adds every part)
            # (and what went to such a replica before it left: that was lost with it)
            gone = sorted(cur.held_from)
            for link in self._up_links():
                n = cur.received[link.name]
                sent_n, before = cur.proj_sent.get(link.name, (0, None))
                if n > sent_n:  # after a reopen: the sum over every ACT of the link, once more
                    parts = [before, *(cur.proj_sent.pop(name, (0, None))[1] for name in gone)]
                    g = await self.compute.run(self._inbound_projector_grad, [link.name, *gone], parts)
                    gone = []
                    cur.held_from.clear()
                    cur.proj_sent[link.name] = (n, g)
                    await link.send_projector_grad(step, g, micro_batches=n, pver=pver)
            if cur.held_from:
                self._issue_redo(step, "no live upstream link carried ACTs of the step to take the inbound projector's "
                                       "gradient of the replica that left")
        if self._owns_projector():
            await self._projector_grads(cur)
        loss_sum = sum(await self.compute.run(loss_values, cur.losses)) if self.last and cur.losses else 0.0
        round_ = None
        if self.replicas is not None:
            round_ = await self._average(cur, loss_sum)
            loss_sum = round_.loss_sum
            counts = self.result.averaging
            for key, n in (("rounds", 1), ("sent_bytes", round_.sent_bytes), ("received_bytes", round_.received_bytes)):
                counts[key] = counts.get(key, 0) + n
        elif sorted(cur.done) != list(range(self.M)):
            self._issue_redo(step, f"this stage computed {len(cur.done)} of the step's {self.M} micro-batches "
                                   f"({len(set(cur.done))} distinct)")
        self._resumable = False  # the round is whole: a reopen now changes nothing
        await self._commit(step, {"mode": "train", "loss": loss_sum / self.M, "tokens": self.rt.cfg.tokens_per_step})
        metrics = await self.compute.run(self._take_step)
        self._joined = -1
        if round_ is not None:
            self._ranked(round_)
            metrics.update(averaging_sent_bytes=round_.sent_bytes, averaging_received_bytes=round_.received_bytes)
        self.window.advance()
        self._down_reports = {name: r for name, r in self._down_reports.items() if r[0] > step}
        self._votes.clear()
        if self.stage == 1:
            self._replay["taken"] = (step, self.epoch, {})
            for link in self._up_links():
                await link.send_route(step, "taken")
        if not self.first:
            self._replay["commit"] = (step, self.epoch, {})
            for link in self._down_links():
                await link.send_route(step, "commit")
        await self._send_projector(step + 1)
        await self.hooks.step_end(step + 1, metrics)

    def _inbound_projector_grad(self, origins: list[str], sent: list[Any]) -> Any:
        """The inbound projector's gradient over the micro-batches whose ACTs came from ``origins``
        (link names), plus ``sent`` (what an earlier flush of the step sent; None: nothing; compute
        thread)."""
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
            return self.rt.step()

    def _load_projector(self, step: int, tensor: Any, pver: int) -> None:
        """The inbound projector of ``step`` (compute thread), under the served state's lock."""
        with self._state_lock:
            self.host.load_inbound_projector(tensor, pver)
            self._projector_step = step

    def _served_state(self) -> dict:
        """What a joining replica downloads (SPEC §9.10 item 11; read in a thread of this process):
        a copy of the stage's state for its next step, that step (the optimizer steps taken), the
        run epoch, the step whose inbound projector the state holds, this stage's live replicas and
        those gone."""
        with self._state_lock:
            state = copy.deepcopy(self.rt.state_dict())
            projector = self._projector_step
        return {"runtime": state, "step": state["step"], "projector": projector, "epoch": self.epoch,
                "members": self._served_members, "gone": self._served_gone}

    async def _retried(self, what: str, attempt: Callable[[float, int], _R], redo_step: int | None = None) -> _R:
        """``attempt(seconds left, replicas expected)`` on the compute thread (the replicas of the
        stage a round needs, :meth:`_expected`, read again for every attempt), again while it raises
        :class:`~mapl_swarm.replicas.errors.AveragingFailed` (a round that failed, was cancelled
        because a replica of the stage left, formed without one or with members of another step or
        epoch), up to ``averaging_timeout_s``. A round of step ``redo_step`` that failed *unsure*
        (a partner may have kept it) redoes the step instead (:class:`_Redo`)."""
        deadline = time.monotonic() + self.averaging_timeout_s
        while True:
            self._check()
            left = deadline - time.monotonic()
            if left <= self.matchmaking_s:  # hivemind needs one matchmaking's time at least
                raise MaplError(f"{self.name}: no {what} among the {self.live_replicas()} live replicas of stage "
                                f"{self.stage} within {self.averaging_timeout_s:g} s")
            self._averaging = True
            try:
                return await self.compute.wait(attempt, left, await self._expected())
            except AveragingFailed as exc:
                if isinstance(exc, Behind) and redo_step is not None and redo_step == self._joined:
                    log.info("%s: %s; downloading the stage's state again", self.name, exc)
                    raise _Rejoin() from None
                if exc.unsure and redo_step is not None:
                    self._issue_redo(redo_step, f"{exc} (a partner may have kept the round)")
                log.info("%s: %s: %s; averaging again", self.name, what, exc)
            finally:
                self._averaging = False

    async def _average(self, cur: _Step, loss_sum: float) -> ReplicaStep:
        """This stage's round of the step among its live replicas (:meth:`_retried`); one that
        misses a micro-batch or counts one twice redoes the step (raises :class:`_Redo`)."""
        replicas = self.replicas
        assert replicas is not None
        t0 = time.perf_counter()
        round_ = await self._retried(f"averaging round of step {cur.step}", lambda left, expected: replicas.average(
            list(cur.done), step=cur.step, timeout=left, loss_sum=loss_sum, epoch=self.epoch, contact=self.contact,
            expected=expected), redo_step=cur.step)
        problem = round_.problem(self.M)
        if problem is None:
            # the round is whole and counts at every member: a reopen's ACTs go to the replicas that
            # hold them, not here; a neighbour's loss this replica would have repaired is only told
            self._resume = self._resumable = False
            notices, cur.notices = cur.notices, []
            if notices:
                self._spawn(self._tell(self._down_links(), cur.step, "gone", notices, self.epoch))
        self._check()
        if not round_.in_sync:
            await self._resync(round_, f"at step {cur.step}")
            self._issue_redo(cur.step, problem or "")
        if problem is not None:
            if await self._repairs_coming(cur):
                raise _Resume()
            self._issue_redo(cur.step, problem)
        log.debug("%s: step %d averaged among %d replicas in %.2f s", self.name, cur.step, round_.group_size,
                  time.perf_counter() - t0)
        return round_

    async def _repairs_coming(self, cur: _Step) -> bool:
        """This stage's round of the step is not whole after a partner or an upstream replica left
        during it: whether what went through it comes here again (a ``reopen``, :class:`_Resume`).
        Every live upstream replica says either ``reopen`` (it sends it again) or ``gone`` (it
        cannot, or it has nothing more); this waits for all of them, half ``net.timeout_s`` at most."""
        if not (cur.partners_gone or cur.await_answers) or self.first:
            return False
        if not await until(lambda: self._resume or self._reopen_queued()
                           or self._upstream_answered(cur), self.mailbox.changed,
                           self.s.timeout_s / 2):
            log.warning("%s: step %d: not every upstream replica said within %g s whether what went through the "
                        "replica that left comes again", self.name, cur.step, self.s.timeout_s / 2)
        return self._resume or self._reopen_queued()

    def _reports_in_epoch(self) -> dict | None:
        """The train REPORT of the current step and run epoch (its meta) once every live downstream
        link sent one, else None."""
        want = (self.step, self.epoch)
        got = [self._down_reports.get(link.name) for link in self._down_links() if link.name in self._cur.members]
        if not got or any(r is None or r[:2] != want for r in got):
            return None
        return got[0][2]  # equal: the last stage's replicas report the same round's loss

    async def _commit(self, step: int, report: dict) -> None:
        """This stage's round of ``step`` is whole: wait until every replica of every stage says so
        too, then return (the caller takes the step). The last stage's replicas say so upstream
        (REPORT), a middle one once every downstream replica did; a stage-0 replica with REPORTs
        from every downstream replica says ROUTE ``commit`` downstream; a stage-1 replica takes the
        step once every stage-0 replica did, other stages on ``commit`` from upstream (stage 0:
        ``taken`` from downstream). Module docstring."""
        if not self.last:
            await self._until(lambda: self._reports_in_epoch() is not None,
                              f"REPORT of step {step} from every downstream replica")
            report = self._reports_in_epoch() or report
        if self.first:
            self._replay["commit"] = (step, self.epoch, {})
            for link in self._down_links():
                await link.send_route(step, "commit")
            await self._until(lambda: self._committed >= step, f"ROUTE taken of step {step}")
            self._record_train(step, report)
            return
        self._replay["report"] = (step, self.epoch, report)
        for link in self._up_links():
            await link.send_report(step, report)
        if self.stage == 1:
            await self._until(lambda: {link.name for link in self._up_links()} & self._cur.members <= self._votes,
                              f"ROUTE commit of step {step} from every stage-0 replica")
        else:
            await self._until(lambda: self._committed >= step, f"ROUTE commit of step {step}")

    async def _until(self, ready: Callable[[], bool], what: str) -> None:
        """Wait until ``ready()`` (set by the dispatcher), taking an upstream BYE meanwhile. The
        wait spans the other stages' rounds, so it allows an averaging timeout on top of
        ``net.timeout_s``."""
        while not ready():
            got = await self._next(lambda m: m.type is MT.BYE and m.src == self.links.up, what,
                                   self.s.timeout_s + self.averaging_timeout_s)
            if got is not None and self._live(got[1]):
                self._on_bye(*got, during_step=True)

    async def _projector_grads(self, cur: _Step) -> None:
        """A PROJ_GRAD of the step from every downstream link this stage sent ACTs on, added; after a
        reopen, one over the link's ACTs since (it replaces the one added before)."""
        for name in sorted(cur.untake & set(cur.proj_added)):
            await self.compute.run(self._add_projector_grad, None, cur.proj_added.pop(name)[1])
        due_from = {name for name, n in cur.sent.items() if n and cur.proj_added.get(name, (0, None))[0] != n}
        while True:
            due_from &= {link.name for link in self._down_links()}  # none from a replica that left
            if not due_from:
                return
            got = await self._next(lambda m: (m.type is MT.PROJ_GRAD and m.step == cur.step)
                                   or (m.type is MT.ROUTE and m.step <= cur.step), f"PROJ_GRAD of step {cur.step}")
            if got is None or not self._live(got[1]):
                continue
            msg, link = got
            count = msg.meta.get("micro_batches")
            if msg.type is MT.ROUTE:
                await self._on_route(msg, link, cur)
            elif link.name in cur.reopened and count is not None and count < cur.sent[link.name]:
                log.debug("%s: a PROJ_GRAD over %d ACTs from %s superseded (the link reopened)", self.name, count,
                          link.name)
            elif link.name not in due_from or count != cur.sent[link.name]:
                self._drop("out_of_window", msg, "one PROJ_GRAD per link that carried ACTs, over them",
                           f"from {link.name} over {msg.meta.get('micro_batches')} micro-batch(es)")
            elif msg.pver != self.window.outbound_pver:
                self._drop("stale_projector", msg, "PROJ_GRAD of the projector this stage holds",
                           f"computed at projector v{msg.pver}, this stage holds v{self.window.outbound_pver}")
            else:
                due_from.discard(link.name)
                grad, before = msg.tensors[WireName.PROJ_GRAD], cur.proj_added.get(link.name, (0, None))[1]
                await self.compute.run(self._add_projector_grad, grad, before)
                cur.proj_added[link.name] = (count, grad)

    # ------------------------------------------------------------------ reports, validation, the end
    async def on_linked(self, link: PeerLink) -> None:
        """A neighbour replica linked while training (one that joins, SPEC §9.10 item 11): it gets
        the commit messages of the latest step this replica sent before the link existed, which
        its first step may wait for (it drops those of another step)."""
        up = link.stage == self.links.up
        for kind in ("report", "taken") if up else ("commit",):
            if kind not in self._replay:
                continue
            step, epoch, meta = self._replay[kind]
            if kind == "report":
                if epoch == self.epoch:  # a REPORT goes in the link's (the current) epoch
                    await link.send_report(step, meta)
            else:
                await link.send_route(step, kind, epoch=epoch)

    async def on_report(self, msg: Message, link: PeerLink) -> None:
        """A REPORT from downstream. Train: each link's of the current step (or a later one, or
        a later run epoch: it may come before this replica moved there) is kept for the commit
        (:meth:`_commit`). Eval: the first of a validation is relayed upstream (stage 0 records
        it), the other replicas' copies are dropped quietly."""
        mode = msg.meta.get("mode", "train")
        if mode == "train":
            if (msg.step, msg.epoch) >= (self.step, self.epoch) and self.s.start_step <= msg.step < self.s.steps:
                self._down_reports[link.name] = (msg.step, msg.epoch, dict(msg.meta))
                self._wake()
            elif not self.s.start_step <= msg.step < self.s.steps:
                self._drop("out_of_window", msg, "REPORTs of the run's steps", "train REPORT")
            return
        key = (mode, msg.step)
        if key in self._reported:
            return
        if not due(self.s.val_interval_steps, msg.step, self.s.steps):
            self._drop("out_of_window", msg, "REPORTs of the run's validations", f"{mode} REPORT")
            return
        self._reported.add(key)
        if not self.first:
            for up in self._up_links():
                await up.send_report(msg.step, dict(msg.meta))
            return
        self._reports[key] = float(msg.meta["loss"])
        self._report_event.set()

    def _record_train(self, step: int, report: dict) -> None:
        """Stage 0: the loss of a step every stage can take (its commit)."""
        loss, tokens = float(report["loss"]), int(report["tokens"])
        self._reports[("train", step)] = loss
        self._report_event.set()
        self.result.train_losses.append(loss)
        self.result.report_times_s.append(time.perf_counter() - self._t0)
        self.result.tokens += tokens
        self.hooks.train_loss(step + 1, loss, tokens)
        if self._progress is not None:
            elapsed = max(time.perf_counter() - self._t0, 1e-9)
            self._progress.step(loss=f"{loss:.3f}", tok_s=f"{self.result.tokens / elapsed:.0f}")

    # ------------------------------------------------------------------ replicas that leave
    def replica_gone(self, link: PeerLink, why: str) -> bool:
        """Neighbour replica ``link`` left (``why``: silent past its deadline, its BYE): True when its
        stage keeps a live replica (this one goes on without it, module docstring), False when it
        was its stage's last (the caller's, as any departure: the swarm re-forms or the run ends)."""
        if link.contact is None or not link.welcomed:
            return False
        if link.contact in self.gone:
            return True
        if not any(self._live(other) for other in self.links.of_stage(link.stage) if other is not link):
            return False
        log.warning("%s: the replica of stage %d at %s left (%s); going on with the stage's other replicas",
                    self.name, link.stage, link.contact, why)
        cur = self._cur
        active = self._active()
        downstream = link.stage == self.links.down
        held = sorted(m for m, came in cur.origin.items() if came is link) if cur.step == self.step else []
        self._learn_gone([link.contact])  # what went to it goes again (_forget)
        if cur.resend:  # the notice goes before the re-sends, from the schedule (_reopen)
            cur.notices.append(link.contact)
            self._wake()
        else:
            notice = [other for other in self.links.of_stage(link.stage) if self._live(other)]
            self._spawn(self._tell(notice, self.step, "gone", [link.contact], self.epoch,
                                   held=None if downstream else held))
        if link.stage == 0:
            if self._serving and cur.step == self.step:
                # its share of the step's data is not read again by another replica: stage 0 splits
                # the step again among the replicas left (a redo), before this replica's round
                self._redo_soon(self.step, "the replica of stage 0 that left had its share of the step's "
                                           "micro-batches")
        elif active and not downstream and link.name not in cur.announced:
            cur.await_answers = True
            self._repair_deadline(cur)
        if link.stage != 0 and active and held:
            # what it accumulated of them is lost at its stage: their re-runs come through its
            # partners, which route them here (the ``held`` of the notice); this replica gives
            # each the GRAD it computed (its own gradients count them already) and waits for them
            cur.held.update(held)
            cur.held_from.add(link.name)
            self._repair_deadline(cur)
            log.warning("%s: %d train micro-batch(es) of step %d came through it; their re-runs come through its "
                        "stage's other replicas", self.name, len(held), cur.step)
            self._serve_again()
        return True

    def _upstream_answered(self, cur: _Step) -> bool:
        """Every live upstream link said ``gone`` or ``reopen`` in the step."""
        return {x.name for x in self._up_links()} <= cur.answered

    def _repair_deadline(self, cur: _Step) -> None:
        """The repair this replica waits for (re-runs of what it holds, its upstream links' word,
        its downstream links' ``held``) comes within half ``net.timeout_s`` of the first loss of the
        step it learned of, else the step is redone (:meth:`_run_step`, :meth:`_send_waiting`); the
        schedule looks again then."""
        if not cur.repair_by:
            cur.repair_by = time.monotonic() + self.s.timeout_s / 2
            asyncio.get_running_loop().call_later(self.s.timeout_s / 2, lambda: cur is self._cur and self._wake())

    def _active(self) -> bool:
        """This replica serves the current step, or flushes it before its round is whole: a
        neighbour's loss is repaired (the step goes on), not redone."""
        return (self._serving or self._resumable) and self._cur.step == self.step

    def _serve_again(self) -> None:
        """A flush before its round is whole goes back to serving the step (:class:`_Resume`)."""
        if self._serving:
            return
        self._resume = True
        if self._averaging and self.replicas is not None:
            self.replicas.cancel()
        self._wake()

    async def _tell(self, links: Sequence[PeerLink], step: int, phase: str, gone: Sequence[str],
                    epoch: int | None = None, held: Sequence[int] | None = None) -> None:
        for link in links:
            await link.send_route(step, phase, gone=list(gone), epoch=epoch,
                                  held=None if held is None else list(held))

    def _learn_gone(self, contacts: Sequence[str]) -> None:
        """Replicas at ``contacts`` left: their links are dropped (what they owe is no longer
        awaited), a round of this stage waiting for one of them starts again without it."""
        for contact in contacts:
            if contact in self.gone:
                continue
            self.gone.add(contact)
            self._served_gone = "\n".join(sorted(self.gone))
            for link in self.links:
                if link.contact == contact:
                    self._forget(link)
            if self._round is not None and contact in self._round.contacts.values():
                self._rerank()
                if self._averaging and self.replicas is not None:
                    self.replicas.cancel()
        self._wake()

    def _forget(self, link: PeerLink) -> None:
        """The current step stops waiting for what ``link``'s replica owed: its ``end``, its GRADs.
        While this replica is active in the step (:meth:`_active`), every train ACT that went to it
        is sent again (the replica's accumulated gradients died with it, SPEC §9.10 item 10), after
        ROUTE ``reopen`` naming it (:meth:`_reopen`); the GRAD of one whose backward ran here
        already is dropped when it comes."""
        cur = self._cur
        if link in cur.ready:
            cur.ready.remove(link)
        for micro, (to, _) in list(cur.dest.items()):
            if to is link:
                del cur.dest[micro]
                self.router.in_flight[link.name] -= 1
        for micro, at in list(cur.hold_at.items()):
            if at is link:
                del cur.hold_at[micro]
        if not self._active():
            return
        again = sorted(m for m, to in cur.via.items() if to is link)
        if not again:
            return
        if any(m not in cur.payloads for m in again):  # sent while it was its stage's only replica
            self._redo_soon(cur.step, f"the replica of stage {link.stage} that left took train micro-batch(es) of "
                                      f"the step this replica kept no copy of")
            return
        cur.replayed.update(m for m in again if m in cur.done)
        cur.resend.extend((m, cur.payloads[m]) for m in again)
        cur.untake.add(link.name)  # its PROJ_GRAD, if added: the re-runs' receivers send those parts
        if cur.ended:
            cur.ended, cur.reopen = False, True
        self._serve_again()
        log.warning("%s: %d train micro-batch(es) of step %d went through the replica of stage %d at %s: sent again "
                    "(%d of them backwarded here already)", self.name, len(again), cur.step, link.stage, link.contact,
                    sum(m in cur.done for m in again))

    async def on_route(self, msg: Message, link: PeerLink) -> None:
        """ROUTE ``commit``, ``redo`` or ``gone`` (SPEC §9.10), from the dispatcher: taken at once,
        whatever the schedule waits for (``ready`` is :meth:`on_ready`'s, ``end`` the schedule's)."""
        if not self._live(link):
            return
        phase = msg.meta["phase"]
        if phase in ("commit", "taken"):
            if self.window.joining:  # before its download: kept for the step it joins at
                self._early[phase, link.name] = (msg.step, msg.epoch)
            else:
                self._take_commit(phase, link.name, msg.step, msg.epoch)
            return
        now = (msg.step, msg.epoch) == (self.step, self.epoch) and self._cur.step == msg.step
        # a neighbour's word is taken for replicas this one has no link to (its stage's partners,
        # far stages): of its own links this replica's liveness deadline and their BYEs decide
        contacts = self._gone_named(msg)
        if phase == "gone" and now:
            self._partners_gone(link, contacts, msg.meta.get("held", []))
        self._learn_gone(contacts)
        if phase == "redo":
            pending = self._redo[1] if self._redo is not None else -1
            if msg.epoch > max(self.epoch, pending) and msg.step >= self.step:
                self._spawn(self._tell([x for x in self.links if self._live(x) and x is not link], msg.step, "redo",
                                       sorted(self.gone), msg.epoch))
                self._take_redo(msg.step, msg.epoch)

    def _gone_named(self, msg: Message) -> list[str]:
        """The contacts a ROUTE names gone, but this replica's own and its links' (of its own links
        its liveness deadline and their BYEs decide)."""
        own = {x.contact for x in self.links} | {self.contact}
        return [c for c in msg.meta.get("gone", [])[:_MAX_GONE] if c and len(c) <= _MAX_CONTACT and c not in own]

    def _partners_gone(self, link: PeerLink, contacts: list[str], held: Sequence[int] = ()) -> None:
        """ROUTE ``gone`` or ``reopen`` of the current step: a neighbour names replicas of this
        stage that left (it sends the notice to the gone replica's partners only; an upstream one
        says ``reopen`` instead when what went to them comes here again after its ``end``). One
        from downstream also says which of the step's micro-batches it took from them (``held``):
        their re-runs, which come here or to another partner, go to it. Until every ready
        downstream link said so of every partner gone, this replica routes no ACT
        (:meth:`_send_waiting`)."""
        cur = self._cur
        if link.stage == self.links.up:
            cur.answered.add(link.name)
        fresh = [c for c in contacts if c not in cur.gone_before]  # not gone when this attempt of the step began
        if fresh:
            self._repair_deadline(cur)
        cur.partners_gone.update(fresh)
        if fresh and link.stage == self.links.down:
            cur.told.setdefault(link.name, set()).update(fresh)
            for m in held[:self.M]:
                if 0 <= m < self.M:
                    cur.hold_at[m] = link
        self._answer(cur)
        self._wake()

    def _answer(self, cur: _Step) -> None:
        """Once every live upstream replica said whether what went through this stage's replicas
        that left comes again (``gone`` or ``reopen``), say so downstream: ROUTE ``gone`` naming
        them. A downstream replica that found one of them gone before its ``end`` waits for this
        from every live upstream replica before it counts its ACTs of the step as all in (what the
        gone replica had not passed on comes again through its partners)."""
        due = sorted(cur.partners_gone - cur.answered_down)
        if due and not self.last and self._upstream_answered(cur):
            cur.answered_down.update(due)
            self._spawn(self._tell(self._down_links(), cur.step, "gone", due, self.epoch))

    def _take_commit(self, phase: str, name: str, step: int, epoch: int) -> None:
        """ROUTE ``commit`` (the admission lets it through from upstream only) or ``taken`` (from
        downstream only) of ``step`` in run ``epoch`` on link ``name``."""
        if step != self.step or epoch != self.epoch:
            return  # another upstream replica's copy, a step late
        if self.stage == 1 and phase == "commit":
            self._votes.add(name)  # a stage-0 replica's round and every REPORT are in
        elif (phase == "taken") == self.first:
            self._committed = max(self._committed, step)
        self._wake()

    def _issue_redo(self, step: int, problem: str) -> None:
        """This stage's round of ``step`` cannot be whole: the step is redone everywhere."""
        if self._redos >= self._max_redos:
            raise MaplError(f"{self.name}: step {step} cannot be taken after {self._redos} redos: {problem}")
        log.warning("%s: step %d is redone (run epoch %d): %s", self.name, step, self.epoch + 1, problem)
        self._redo = (step, self.epoch + 1)
        raise _Redo()

    def _redo_soon(self, step: int, problem: str) -> None:
        """:meth:`_issue_redo` from the dispatcher: the schedule carries it out (:meth:`_restart`) as
        soon as it looks at its mailbox, or its averaging round gives up; nothing when a redo of
        the step (or a later one) is already on its way here."""
        if self._redo is not None and self._redo[0] >= step:
            return
        log.warning("%s: step %d is redone (run epoch %d): %s", self.name, step, self.epoch + 1, problem)
        self._take_redo(step, self.epoch + 1)

    def _take_redo(self, step: int, epoch: int) -> None:
        """Note a redo of ``step`` in run ``epoch`` for the schedule to carry out; a round of the
        current step in progress gives up."""
        self._redo = (step, epoch)
        if self._averaging and self.replicas is not None and step == self.step:
            self.replicas.cancel()
        self._wake()

    async def _restart(self, step: int) -> None:
        """Carry out the redo of ``step`` (module docstring): the neighbours are told first, so that
        nothing of the new epoch reaches them before the redo does."""
        assert self._redo is not None and self._redo[0] == step
        self._serving = self._resumable = self._resume = False
        epoch = self._redo[1]
        self._redo = None
        self._redos += 1
        # the new epoch's state at once: what the dispatcher answers meanwhile answers for it
        self.epoch = epoch
        self.links.set_epoch(epoch)
        self._cur = self._new_step(step)
        dropped = self.mailbox.drop(lambda m: m.epoch < epoch and m.type not in (MT.PROJ, MT.BYE, MT.CODEBOOK_SLICE))
        self._down_reports = {name: r for name, r in self._down_reports.items() if r[1] >= epoch}
        self._votes.clear()
        self._woken = False
        self._rerank()
        await self._tell([link for link in self.links if self._live(link)], step, "redo", sorted(self.gone))
        await self.compute.run(self.rt.abandon_step)
        log.warning("%s: step %d runs again in run epoch %d (%d message(s) of the earlier one dropped; %d "
                    "replica(s) gone)", self.name, step, epoch, dropped, len(self.gone))

    async def _reports_in(self, keys: list[tuple[str, int]]) -> None:
        if not await self.waits.wait(until(lambda: all(k in self._reports for k in keys), self._report_event,
                                           self.s.timeout_s), self._down_links):
            missing = [k for k in keys if k not in self._reports]
            raise MaplError(f"{self.name}: no REPORT of {missing[:3]} from the last stage within "
                            f"{self.s.timeout_s:g} s")

    async def _validate(self, step: int) -> None:
        """Stage 0: the validation after ``step`` steps. The replica of rank 0 sends the eval ACTs;
        while the eval REPORT has not come, a replica that leaves (what went through it is lost)
        makes the one of rank 0 then (another, if the sender left) send them all again, and every
        stage-0 replica's wait for the REPORT starts again; the last stage counts each eval
        micro-batch once."""
        key = ("eval", step)
        seen: frozenset[str] | None = None
        deadline = 0.0
        while key not in self._reports:
            if seen != self.gone:  # the start, or a replica left: the validation (again), a new wait
                again, seen = seen is not None, frozenset(self.gone)
                deadline = time.monotonic() + self.s.timeout_s
                down = self._down_links()
                if self.rank == 0 and down:
                    if again:
                        log.warning("%s: a replica left during the validation after step %d: its eval ACTs go "
                                    "again", self.name, step)
                    for i, ids in enumerate(self.val_batches):
                        res = await self.compute.run(self.host.forward, -1 - i, ids=ids, train=False)
                        await down[0].send_act(step, i, res.payload, eval_mode=True, pver=self.window.outbound_pver)
            left = deadline - time.monotonic()
            if left <= 0 or not await self.waits.wait(until(lambda: key in self._reports or self.gone != seen,
                                                            self._report_event, left), self._down_links):
                raise MaplError(f"{self.name}: no eval REPORT of step {step} from the last stage within "
                                f"{self.s.timeout_s:g} s")
        loss = self._reports[key]
        self.result.val_history.append((step, loss))
        self.hooks.val_loss(step, loss)
        log.info("step %d: val loss %.4f", step, loss)

    async def _eval_forward(self, msg: Message, link: PeerLink) -> None:
        await self._take_projector(msg.step)  # after the last step: the PROJ of the steps done
        if not 0 <= msg.micro < self.s.val_batches or msg.pver != self.window.inbound_pver:
            self._drop("out_of_window", msg, "eval ACTs of a validation, at the projector this stage holds",
                       f"eval micro-batch {msg.micro} of {self.s.val_batches} at v{msg.pver}")
            return
        work = self.compute.run(self.host.forward, -1 - msg.micro, wire=self._payload(msg, ACT_WIRE), train=False,
                                cver=msg.cver)
        try:
            res = await link.decoded(work, msg)
        except Retransmitting:
            return  # asked again: the copy comes on the link
        if not self.last:
            down = self._down_links()
            log.debug("%s: eval micro-batch %d of the validation after step %d forwarded", self.name, msg.micro,
                      msg.step)
            await down[0].send_act(msg.step, msg.micro, res.payload, eval_mode=True, pver=self.window.outbound_pver)
            return
        if ("eval", msg.step) in self._reported:
            return  # a copy sent again after a replica left, of a validation reported already
        losses = self._eval_losses.setdefault(msg.step, {})
        losses[msg.micro] = res.loss  # once per eval micro-batch: one sent again replaces its copy
        if len(losses) == self.s.val_batches:
            del self._eval_losses[msg.step]
            self._reported.add(("eval", msg.step))
            loss = await self.compute.run(mean_loss, [losses[i] for i in range(self.s.val_batches)])
            for link in self._up_links():
                await link.send_report(msg.step, {"mode": "eval", "loss": loss, "tokens": 0})

    async def _until_byes(self) -> None:
        """After the last step: eval ACTs of the last validation, until every upstream link said BYE;
        then BYE on every downstream link."""
        while not {link.name for link in self._up_links()} <= self._byes:
            got = await self._next(lambda m: m.type is MT.BYE or (m.type is MT.ACT and m.meta.get("mode") ==
                                                                   "eval") or m.type is MT.ROUTE,
                                   "BYE from every upstream replica")
            if got is None or not self._live(got[1]):
                continue
            msg, link = got
            if msg.type is MT.BYE:
                self._on_bye(msg, link, during_step=False)
            elif msg.type is MT.ROUTE:
                await self._on_route(msg, link, self._cur)
            else:
                await self._eval_forward(msg, link)
        await self._say_bye(dict(self.bye.meta), self.bye.step)
