"""The step protocol of one stage peer as a pure state machine (SPEC §9.7, §9.10): events in, intents out.

:class:`StepCore` holds everything a peer decides about its steps — which micro-batches went where,
what it computed, held, re-ran, repaired or redid, its stage's averaging round, the commit, the
validations, the end — and nothing it does: no socket, no event loop, no tensor. Its driver
(:class:`~mapl_swarm.peer.driver.StepDriver`, or a test's simulated swarm) asks :meth:`StepCore.next`
for the next intent (:mod:`~.intents`: a send, a compute, a round, a record, a wait), carries it out
and answers with the result (:meth:`~StepCore.forwarded`, :meth:`~StepCore.averaged`...); control
messages and departures go to :meth:`~StepCore.on_route`, :meth:`~StepCore.on_report`,
:meth:`~StepCore.on_ready`, :meth:`~StepCore.replica_gone`, whose sends wait in :meth:`~StepCore.urgent`.
Pipeline messages are taken from the peer's inbox by predicate (a later step's wait their turn).

The run moves through the :class:`Phase` s of each step::

    START ─▶ (SYNC | JOIN) ─▶ BOUNDARY ─▶ [VALIDATE] ─▶ SERVE ─▶ FLUSH ─▶ [AVERAGE ─▶ [REPAIR]] ─▶ COMMIT ─▶ STEP ─┐
                                 ▲                          ▲                  │            │                        │
                                 │                          └── serve again ◀──┴────────────┘ (a reopen)            │
                                 └──────────────────────────────────────────────────────────────────────────────────┘
    any step phase ─▶ (a redo of the step: a new run epoch) ─▶ SERVE        BOUNDARY ─▶ FINISH ─▶ OVER

The parts, one concern each: :mod:`~.flow` (serving: the order of the work, each message of the
step), :mod:`~.repair` (replicas that leave), :mod:`~.commit` (the commit and the REPORTs),
:mod:`~.rounds` (a round's result), :mod:`~.members` (the stage's replicas), :mod:`~.validation`,
:mod:`~.window` (what admission lets in). A chain is the same machine with one link each way and
no ROUTE on the wire (:attr:`CoreSettings.replicas` False).
"""

from __future__ import annotations

import enum
import logging
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from typing import Any

from mapl_swarm.errors import MaplError
from mapl_swarm.pipeline.payload import WireName
from mapl_swarm.pipeline.run_policy import due
from mapl_swarm.step import intents as do
from mapl_swarm.step.commit import Commit
from mapl_swarm.step.context import Inbox, LinksView, LinkView
from mapl_swarm.step.flow import SERVED, Flow
from mapl_swarm.step.members import Members
from mapl_swarm.step.repair import Repair
from mapl_swarm.step.rounds import ReplicaStep
from mapl_swarm.step.router import Router
from mapl_swarm.step.state import StepState
from mapl_swarm.step.validation import Validation
from mapl_swarm.step.window import Projectors, StepWindow
from mapl_swarm.wire import Message, MessageType

log = logging.getLogger(__name__)

__all__ = ["StepCore", "CoreSettings", "Phase", "LinkView", "LinksView", "Inbox", "BYE_FINISHED", "DRAIN_BYE"]

MT = MessageType

BYE_FINISHED = "training finished"
"""Stage 0's BYE ``reason`` after the last step."""
DRAIN_BYE = "drain"
"""Stage 0's BYE ``reason`` after a drain (SPEC §5.2)."""


class Phase(enum.Enum):
    """Where a peer is in its run (module docstring)."""

    START = "start"
    SYNC = "sync"
    """The stage's replicas' round before the first step."""
    JOIN = "join"
    """A joining replica downloads its stage's state (again, when it was a step old)."""
    RESYNC = "resync"
    """This replica's parameters differ from its stage's: it downloads a partner's."""
    BOUNDARY = "boundary"
    VALIDATE = "validate"
    SERVE = "serve"
    FLUSH = "flush"
    """PROJ_GRADs up and in, the step's losses."""
    AVERAGE = "average"
    REPAIR = "repair"
    """A round not whole after a replica left: waiting for word whether its work comes again."""
    COMMIT = "commit"
    STEP = "step"
    FINISH = "finish"
    OVER = "over"


_STEP_PHASES = frozenset({Phase.SERVE, Phase.FLUSH, Phase.AVERAGE, Phase.REPAIR, Phase.COMMIT})
"""Phases a redo of the current step interrupts."""
_ACTIVE = frozenset({Phase.SERVE, Phase.FLUSH, Phase.AVERAGE, Phase.REPAIR})
"""Phases in which a neighbour's loss is repaired (the round is not whole yet), not redone."""
_LATER_READIES = 64
"""ROUTE ``ready`` of later steps kept at most (each neighbour replica sends one per step)."""


@dataclass(frozen=True, kw_only=True)
class CoreSettings:
    """What the core needs of the run's configuration."""

    name: str
    """The peer's name in log lines."""
    stage: int
    num_stages: int
    M: int
    """Micro-batches per step."""
    steps: int
    """Steps of the whole run."""
    start_step: int = 0
    max_in_flight: int
    """Micro-batches stage 0 keeps in flight (per ready link with replicas)."""
    val_interval_steps: int = 0
    val_batches: int = 0
    timeout_s: float
    """Longest wait for any one message (``net.timeout_s``)."""
    tokens_per_step: int
    replicas: bool = False
    """The run has replicas (ROUTE, rounds, commit, SPEC §9.10); False: a chain."""
    averaged: bool = False
    """This stage averages with its replicas (a run with replicas: every stage)."""
    averaging_timeout_s: float = 0.0
    matchmaking_s: float = 0.0
    routing: str = "uniform"
    routing_seed: int = 0
    max_redos: int = 3
    """Redos of one step at most, then the run ends."""
    starting: int = 1
    """The replicas of this stage that start together (``replicas.initial``'s, or a re-form's)."""


def _never(msg: Message) -> bool:
    return False


class StepCore:
    """Stage ``settings.stage``'s steps (module docstring). ``links``: its links (read: names,
    stages, contacts, welcomed); ``inbox``: its pipeline messages; ``projectors``: its projectors'
    flags and versions; ``reject(code, sender, text)`` counts a dropped message; ``clock``:
    monotonic seconds; ``joining``: a replica that joins the running swarm."""

    def __init__(self, settings: CoreSettings, *, links: LinksView, inbox: Inbox, projectors: Projectors,
                 reject: Callable[[str, str, str], None], clock: Callable[[], float],
                 joining: bool = False) -> None:
        s = self.s = settings
        self.links, self.inbox, self.proj, self.reject, self.clock = links, inbox, projectors, reject, clock
        self.first, self.last = links.up is None, links.down is None
        self.stage = s.stage
        self.window = StepWindow(projectors, stage=s.stage, steps=s.steps, start_step=s.start_step,
                                 upstream_lag=1 if s.replicas else 0)
        self.window.joining = joining
        self.members = Members(s.name, s.stage, starting=s.starting, timeout_s=s.timeout_s)
        self.router = Router(routing=s.routing, seed=s.routing_seed, stage=s.stage)
        self.flow, self.repair, self.commit = Flow(self), Repair(self), Commit(self)
        self.validation = Validation(self)
        self.joining = joining
        self.epoch = 0
        """The run epoch of the current step's attempt: one more per redo. The admission's floor
        (``window.epoch``) stays where training started: a neighbour's heartbeats of the epoch before
        keep counting; the core drops what else of it comes."""
        self.phase = Phase.START
        self.cur = StepState(s.start_step)
        self.joined = -1
        """The step a joining replica downloaded its state for, until it completed it."""
        self.projector_step = -1
        """The step whose PROJ this stage loaded last."""
        self.redo: tuple[int, int] | None = None
        """(step, run epoch) of a redo this peer was told of and has not carried out yet."""
        self.redos = 0
        """Redos of the current step so far (:attr:`CoreSettings.max_redos` at most)."""
        self.resume = False
        """A reopen came while this replica flushed the step before its round was whole: it serves
        the step again."""
        self.in_round = False
        """The stage's round is in progress (a departure or a redo cancels it)."""
        self.woken = False
        """The core changed while the driver waited: it looks again."""
        self.bye: Message | None = None
        """The BYE that ended the run (its ``reason``)."""
        self.byes: set[str] = set()
        """Upstream links that said BYE."""
        self.drained = False
        """Stage 0 of a chain: the swarm drains at the current step (its BYE says so)."""
        self.round: ReplicaStep | None = None
        """The round of the step being taken (it ranks the stage's replicas for the next)."""
        self._out: deque[do.Intent] = deque()
        self._urgent: list[do.Intent] = []
        self._later_readies: list[tuple[Message, str]] = []
        self._asked: dict[str, Any] = {}
        """What the current phase asked its driver already (once per phase and step)."""
        self._loss_sum = 0.0
        self._round_deadline = 0.0
        self._repair_until = 0.0
        self._problem = ""

    # ------------------------------------------------------------------ what others read
    @property
    def step(self) -> int:
        """The step this stage works on: the next one to flush."""
        return self.window.step

    @property
    def token(self) -> do.Token:
        return do.Token(self.step, self.epoch)

    @property
    def serving(self) -> bool:
        return self.phase is Phase.SERVE

    @property
    def active(self) -> bool:
        """This replica serves the current step, or flushes it before its round is whole: a
        neighbour's loss is repaired (the step goes on), not redone."""
        return self.phase in _ACTIVE and self.cur.step == self.step

    @property
    def committing(self) -> bool:
        """This replica's round of the current step is whole: it waits for the step's commit."""
        return self.phase is Phase.COMMIT and self.cur.step == self.step

    @property
    def redo_due(self) -> bool:
        return self.redo is not None and self.redo[0] == self.step

    @property
    def contact(self) -> str:
        """This peer's own contact (what its neighbours' links name it by)."""
        return next((link.local_contact for link in self.links if link.local_contact), "")

    @property
    def gone(self) -> set[str]:
        return self.members.gone

    def live_replicas(self) -> int:
        return self.members.live_count()

    def interrupted(self) -> bool:
        """A wait of the driver ends: the core changed."""
        return self.woken or self.resume or self.redo_due

    # ------------------------------------------------------------------ the driver's side
    def begin(self, start_step: int | None, epoch: int = 0) -> None:
        """Training starts at ``start_step`` (None: the settings') in run epoch ``epoch``."""
        start = self.s.start_step if start_step is None else start_step
        self.s = _replace(self.s, start_step=start)
        self.window.begin(start, epoch)
        self.epoch = epoch
        self.cur = self.flow.new_step(start)

    def next(self) -> do.Intent:
        """The next thing to do (module docstring); intents queued by the core come first."""
        for _ in range(10_000):
            if self._out:
                return self._out.popleft()
            self.woken = False
            intent = self._advance()
            if intent is not None:
                if not self._out:
                    return intent
                self._out.append(intent)
        raise RuntimeError(f"{self.s.name}: the step core made no progress in phase {self.phase.value}")

    def take_sends(self) -> list[do.Intent]:
        """The sends a compute's result queued first (the driver sends them under the encode lock)."""
        out = []
        while self._out and isinstance(self._out[0], (do.SendAct, do.SendGrad)):
            out.append(self._out.popleft())
        return out

    def urgent(self) -> list[do.Intent]:
        """What the core wants sent or recorded now, whatever the driver is doing (taken)."""
        out, self._urgent = self._urgent, []
        return out

    def queued(self) -> bool:
        """Intents wait for :meth:`next`."""
        return bool(self._out)

    def send(self, intent: do.Intent) -> None:
        """Queue ``intent`` for :meth:`next` (in order with the step's work)."""
        self._out.append(intent)

    def spawn(self, intent: do.Intent) -> None:
        """Queue ``intent`` for :meth:`urgent`."""
        self._urgent.append(intent)

    def wake(self) -> None:
        self.woken = True

    def drop(self, code: str, msg: Message, rule: str, text: str) -> None:
        self.reject(code, f"stage{msg.src}", f"{msg.type.name} step {msg.step} micro-batch {msg.micro} dropped by "
                                             f"the step's rules ({rule}): {text}")

    # ------------------------------------------------------------------ the phases
    def _advance(self) -> do.Intent | None:
        if self.phase in _STEP_PHASES and self.redo_due:
            self._out.clear()  # nothing more of the earlier epoch goes out
            return self._restart()
        if self.phase is Phase.VALIDATE and self.redo_due:
            # the step after the validation is redone: the validation speaks its run epoch too (what it
            # sent in the earlier one is dropped on the way), so it starts again in it
            self._out.clear()
            self._restart()
            self.phase = Phase.VALIDATE
            self.validation.start(self.validation.step)
            return None
        if self.phase in (Phase.FLUSH, Phase.AVERAGE, Phase.REPAIR) and not self.in_round and (
                self.resume or self.repair.reopen_queued()):
            return self._serve_again()
        handler = getattr(self, f"_{self.phase.value}")
        return handler()

    def _start(self) -> do.Intent | None:
        if self.joining:
            self.phase = Phase.JOIN
            self.send(do.Abandon())
            return self._download("join")
        self.send_projector(self.s.start_step)
        if self.s.averaged:
            self.phase = Phase.SYNC
            self._round_deadline = self.clock() + self.s.averaging_timeout_s
            return self._attempt(do.Sync(self.members.starting, 0.0))
        self.phase = Phase.BOUNDARY
        return None

    def _sync(self) -> do.Intent | None:
        return self._asked_wait("sync round")

    def _join(self) -> do.Intent | None:
        return self._asked_wait("join download")

    def _resync(self) -> do.Intent | None:
        return self._asked_wait("resync download")

    def _boundary(self) -> do.Intent | None:
        step = self.step
        if step >= self.s.steps or self.drained:
            self.phase = Phase.FINISH
            return None
        if not self.s.replicas and self.first and self._asked.get("boundary") != step:
            self._asked["boundary"] = step
            return do.Boundary(step)
        if self.first and step > self.s.start_step and due(self.s.val_interval_steps, step, self.s.steps) \
                and self._asked.get("validated") != step:
            self._asked["validated"] = step
            self.phase = Phase.VALIDATE
            self.validation.start(step)
            return None
        self._asked.clear()
        if self.cur.step != step:  # else a fresh one (the start, a redo): it may hold readies already
            self.cur = self.flow.new_step(step)
        self.phase = Phase.SERVE
        return None

    def _validate(self) -> do.Intent | None:
        intent = self.validation.next()
        if self.validation.done:  # its REPORT is in
            self.phase = Phase.FINISH if self.step >= self.s.steps else Phase.BOUNDARY
        return intent

    def _serve(self) -> do.Intent | None:
        cur = self.cur
        if not self.flow.start(cur):  # a receiver takes the step's PROJ before its ACTs
            return self._take(lambda m: (m.type is MT.PROJ and m.step <= cur.step) or self._bye_from_up(m),
                              f"PROJ of step {cur.step}", self._on_step_proj)
        intent = self.flow.next(cur, self.clock())
        if intent is SERVED:
            self.phase = Phase.FLUSH
            return None
        if isinstance(intent, do.Wait) and cur.repair_by:
            left = cur.repair_by - self.clock()
            if left < intent.timeout_s:  # the repair's deadline comes first: look again then
                return do.Wait(intent.wanted, intent.what, max(left, 0.01), intent.waiting_on, fatal=False)
        return intent

    def _flush(self) -> do.Intent | None:
        """PROJ_GRADs up (over each upstream link's ACTs), PROJ_GRADs in (from each downstream link
        this stage sent ACTs on), the step's losses; then the round (replicas) or the commit."""
        cur = self.cur
        if self.proj.takes:
            self._send_projector_grads(cur)  # those a link's ACTs since its last PROJ_GRAD call for
            if self._out or self.redo_due:
                return None
        if self.proj.owns:
            intent = self._take_projector_grads(cur)
            if intent is not None:
                return intent
        if self.last and cur.losses and self._asked.get("losses") != (cur.step, len(cur.losses)):
            self._asked["losses"] = (cur.step, len(cur.losses))
            return do.SumLosses(self.token, tuple(cur.losses))
        if not cur.losses:
            self._loss_sum = 0.0
        if self.s.averaged:
            self.phase = Phase.AVERAGE
            self._round_deadline = self.clock() + self.s.averaging_timeout_s
            return self._attempt(do.Average(self.token, tuple(cur.done), self._loss_sum, 0.0))
        if sorted(cur.done) != list(range(self.s.M)):
            raise MaplError(f"{self.s.name}: step {cur.step}: this stage computed {len(cur.done)} of the step's "
                            f"{self.s.M} micro-batches")
        return self._whole(None)

    def _average(self) -> do.Intent | None:
        return self._asked_wait("averaging round")

    def _repair(self) -> do.Intent | None:
        """A round that is not whole after a partner or an upstream replica left during the step:
        whether what went through the one that left comes here again (a ``reopen``). Every live
        upstream replica says ``reopen`` (it sends it again) or ``gone`` (it cannot, or it has
        nothing more); this waits for all of them, half ``net.timeout_s`` at most."""
        cur = self.cur
        now = self.clock()
        if self.repair.upstream_answered(cur) or now >= self._repair_until:
            if now >= self._repair_until:
                log.warning("%s: step %d: not every upstream replica said within %g s whether what went through the "
                            "replica that left comes again", self.s.name, cur.step, self.s.timeout_s / 2)
            self.issue_redo(cur.step, self._problem)
            return None
        return do.Wait(self.repair.reopen_wanted, f"word of a repair of step {cur.step}", self._repair_until - now,
                       self.flow.up_links(), fatal=False)

    def _commit(self) -> do.Intent | None:
        waits = self.commit.ready(self.step)
        if waits is None:
            self.phase = Phase.STEP
            return do.TakeStep(self.step)
        return self._take(lambda m: self._bye_from_up(m) or self._rerun(m), waits, self._on_commit_message,
                          timeout_s=self.s.timeout_s + self.s.averaging_timeout_s)

    def _rerun(self, msg: Message) -> bool:
        """A train ACT of the step re-running a micro-batch this replica took from an upstream replica
        that left (its round is whole: answered with the GRAD it kept)."""
        return msg.type is MT.ACT and msg.meta.get("mode", "train") == "train" and msg.micro in self.cur.held \
            and (msg.step, msg.epoch) == (self.cur.step, self.epoch)

    def _step(self) -> do.Intent | None:
        return self._asked_wait("optimizer step")

    def _finish(self) -> do.Intent | None:
        """After the last step (or a drain): stage 0 validates, waits for every REPORT and says BYE;
        a later stage serves the last validation's eval ACTs until every upstream link said BYE."""
        s = self.s
        if self.first:
            if not self.drained and due(s.val_interval_steps, s.steps, s.steps) \
                    and self._asked.get("validated") != s.steps and self.step >= s.steps:
                self._asked["validated"] = s.steps
                self.phase = Phase.VALIDATE
                self.validation.start(s.steps)
                return None
            missing = self.commit.missing([("train", n) for n in range(s.start_step, self.step)])
            if missing:
                return do.Wait(_never, f"REPORT of {missing[:3]} from the last stage", s.timeout_s,
                               self.flow.down_links())
            if self._asked.get("finish") is None:
                self._asked["finish"] = True
                return do.Finish(self.step if self.drained else None)
            return self._over({"reason": DRAIN_BYE if self.drained else BYE_FINISHED}, self.step)
        if not set(self.flow.up_links()) <= self.byes:
            return self._take(lambda m: self._bye_from_up(m) or (m.type is MT.ACT and m.meta.get("mode") == "eval"
                                                                  and self.projector_ready(m.step))
                              or m.type is MT.ROUTE or (m.type is MT.PROJ and m.step <= self.s.steps),
                              "BYE from every upstream replica", self._on_last_words)
        assert self.bye is not None
        return self._over(dict(self.bye.meta), self.bye.step)

    def _over(self, meta: dict, step: int) -> do.Intent:
        self.phase = Phase.OVER
        for name in self.flow.down_links():
            self.send(do.SendBye(name, step, meta))
        return do.Done(meta)

    # ------------------------------------------------------------------ taking messages
    def _take(self, wanted: Callable[[Message], bool], what: str,
              handle: Callable[[Message, str], do.Intent | None], *,
              timeout_s: float | None = None) -> do.Intent | None:
        """The oldest message ``wanted`` accepts (codebook slices too) handled, or a wait for one."""
        def taking(m: Message) -> bool:
            return m.type is MT.CODEBOOK_SLICE or wanted(m)

        got = self.inbox.take_from(taking)
        if got is None:
            return do.Wait(taking, what, self.s.timeout_s if timeout_s is None else timeout_s,
                           self.flow.up_links() + self.flow.down_links())
        msg, link = got
        if msg.type is MT.CODEBOOK_SLICE:
            return do.ApplySlice(msg, link.name) if self.flow.live(link.name) else None
        if self.stale(msg) or not self.flow.live(link.name):
            return None
        return handle(msg, link.name)

    def take(self, got: tuple[Message, LinkView], cur: StepState) -> do.Intent | None:
        """A message the serving took from the inbox."""
        msg, link = got
        if msg.type is MT.CODEBOOK_SLICE:
            return do.ApplySlice(msg, link.name) if self.flow.live(link.name) else None
        if self.stale(msg) or not self.flow.live(link.name):
            return None
        return self.flow.handle(msg, link.name, cur)

    def stale(self, msg: Message) -> bool:
        """``msg`` belongs to an earlier run epoch than the step's (dropped, logged at debug); a PROJ
        is the same in every epoch of its step, a BYE counts whenever."""
        if msg.epoch >= self.epoch or msg.type in (MT.PROJ, MT.BYE):
            return False
        log.debug("%s: %s of run epoch %d dropped (the step runs in epoch %d)", self.s.name, msg.type.name, msg.epoch,
                  self.epoch)
        return True

    def _bye_from_up(self, msg: Message) -> bool:
        return msg.type is MT.BYE and msg.src == self.links.up

    def _on_step_proj(self, msg: Message, link: str) -> do.Intent | None:
        if msg.type is MT.BYE:
            return self.on_bye(msg, link, during_step=True)
        return self._proj(msg, self.cur.step)

    def _on_commit_message(self, msg: Message, link: str) -> do.Intent | None:
        if msg.type is MT.BYE:
            if msg.meta.get("reason") == BYE_FINISHED and msg.step > self.step:
                # an upstream replica that took this step (the run's last) and ended: its word of the
                # commit, which may not have come yet from its partners
                self.byes.add(link)
                self.bye = msg
                self.commit.on_route("commit", link, self.step, self.epoch)
                return None
            return self.on_bye(msg, link, during_step=True)
        self.repair.take_rerun(msg, link, self.cur)
        if not self.cur.held and self.proj.takes:
            self._send_projector_grads(self.cur)
        return None

    def _on_last_words(self, msg: Message, link: str) -> do.Intent | None:
        if msg.type is MT.BYE:
            return self.on_bye(msg, link, during_step=False)
        if msg.type is MT.ROUTE:
            self.flow.on_route(msg, link, self.cur)
            return None
        if msg.type is MT.PROJ:
            return self._proj(msg, msg.step, copy=True)
        return self.validation.eval_act(msg, link)

    # ------------------------------------------------------------------ the projector
    def send_projector(self, step: int) -> None:
        """The outbound projector as the PROJ of ``step`` on every downstream link (this stage owns one)."""
        if self.proj.owns:
            self.send(do.SendProjector(step, tuple(self.flow.down_links())))

    def projector_sent(self, pver: int) -> None:
        """The driver sent a PROJ at ``pver``: what comes back on the link is made with it."""
        self.window.projector(self.links.down, pver)

    def projector_ready(self, step: int) -> bool:
        """The inbound projector of ``step`` is loaded (or there is none)."""
        return not self.proj.takes or self.projector_step >= step

    def _proj(self, msg: Message, step: int, *, copy: bool = False) -> do.Intent | None:
        """A PROJ taken while the projector of ``step`` is awaited: loaded when it is that one (from
        any upstream replica: they all send the same); another is a copy (replicas) or dropped."""
        if msg.step == step and msg.pver >= self.proj.inbound_pver and self.projector_step < step:
            self.projector_step = step
            return do.LoadProjector(msg, step)
        self.proj_copy(msg, copy=copy)
        return None

    def proj_copy(self, msg: Message, link: str | None = None, *, copy: bool = False) -> None:
        """A PROJ of a step whose projector this stage holds: another upstream replica's copy
        (dropped unread), or a chain neighbour's second one."""
        if self.s.replicas or copy:
            log.debug("%s: PROJ of step %d not used (projector of step %d held)", self.s.name, msg.step,
                      self.projector_step)
        elif msg.pver < self.proj.inbound_pver:
            self.drop("stale_projector", msg, "a PROJ moves the projector forward",
                      f"projector v{msg.pver}, this stage holds v{self.proj.inbound_pver}")
        else:
            self.drop("out_of_window", msg, "one PROJ per step, before its ACTs",
                      f"PROJ for step {msg.step} at step {self.step} (or a second one)")

    def _send_projector_grads(self, cur: StepState) -> None:
        """The inbound projector's gradient up, per upstream link over the ACTs it carried; the part
        of micro-batches taken from a replica that left goes with the first live link's (their
        re-runs came on live links; the sender stage's round adds every part). After a reopen: the
        sum over every ACT of the link, once more."""
        pver = self.proj.inbound_pver
        gone = sorted(cur.held_from)
        for name in self.flow.up_links():
            n = cur.received[name]
            sent_n, before = cur.proj_sent.get(name, (0, None))
            if n > sent_n:
                if not self.s.replicas:  # a chain: the step's whole gradient, none kept apart by origin
                    self.send(do.SendProjectorGrad(name, cur.step, n, pver, None))
                    cur.proj_sent[name] = (n, None)
                    continue
                parts = tuple(p for p in (before, *(cur.proj_sent.pop(g, (0, None))[1] for g in gone))
                              if p is not None)
                self.send(do.SendProjectorGrad(name, cur.step, n, pver, (name, *gone), parts))
                gone = []
                cur.held_from.clear()
                cur.proj_sent[name] = (n, None)  # the gradient itself comes with projector_grad_sent
        if cur.held_from:
            self.issue_redo(cur.step, "no live upstream link carried ACTs of the step to take the inbound projector's "
                                      "gradient of the replica that left")

    def projector_grad_sent(self, intent: do.SendProjectorGrad, grad: Any) -> None:
        """The PROJ_GRAD ``intent`` asked for went, with ``grad``."""
        if intent.step == self.cur.step and intent.origins is not None:
            self.cur.proj_sent[intent.link] = (intent.micro_batches, grad)

    def _take_projector_grads(self, cur: StepState) -> do.Intent | None:
        """A PROJ_GRAD of the step from every downstream link this stage sent ACTs on, added; after a
        reopen, one over the link's ACTs since (it replaces the one added before)."""
        for name in sorted(cur.untake & set(cur.proj_added)):
            self.send(do.AddProjectorGrad(None, cur.proj_added.pop(name)[1]))
        if self._out:
            return None
        live = set(self.flow.down_links())
        due_from = {name for name, n in cur.sent.items()
                    if n and cur.proj_added.get(name, (0, None))[0] != n and name in live}
        if not due_from:
            return None
        now = self.clock()
        if cur.repair_by and due_from & cur.reopened:
            if now > cur.repair_by:  # the next stage's round counted them already: nothing comes again
                self.issue_redo(cur.step, f"no PROJ_GRAD over the ACTs sent again after a replica left came within "
                                          f"{self.s.timeout_s / 2:g} s")
                return None
        intent = self._take(lambda m: (m.type is MT.PROJ_GRAD and m.step == cur.step)
                            or (m.type is MT.ROUTE and m.step <= cur.step) or self._bye_from_up(m),
                            f"PROJ_GRAD of step {cur.step}", lambda m, link: self._on_proj_grad(m, link, due_from))
        if isinstance(intent, do.Wait) and cur.repair_by and due_from & cur.reopened:
            return _replace(intent, timeout_s=max(0.01, min(intent.timeout_s, cur.repair_by - now)), fatal=False)
        return intent

    def _on_proj_grad(self, msg: Message, link: str, due_from: set[str]) -> do.Intent | None:
        cur = self.cur
        if msg.type is MT.BYE:
            return self.on_bye(msg, link, during_step=True)
        if msg.type is MT.ROUTE:
            self.flow.on_route(msg, link, cur)
            return None
        count = msg.meta.get("micro_batches")
        if link in cur.reopened and count is not None and count < cur.sent[link]:
            log.debug("%s: a PROJ_GRAD over %d ACTs from %s superseded (the link reopened)", self.s.name, count, link)
        elif link not in due_from or count != cur.sent[link]:
            self.drop("out_of_window", msg, "one PROJ_GRAD per link that carried ACTs, over them",
                      f"from {link} over {count} micro-batch(es)")
        elif msg.pver != self.proj.outbound_pver:
            self.drop("stale_projector", msg, "PROJ_GRAD of the projector this stage holds",
                      f"computed at projector v{msg.pver}, this stage holds v{self.proj.outbound_pver}")
        else:
            grad, before = msg.tensors[WireName.PROJ_GRAD], cur.proj_added.get(link, (0, None))[1]
            cur.proj_added[link] = (count, grad)
            return do.AddProjectorGrad(grad, before)
        return None

    # ------------------------------------------------------------------ the round and the commit
    def _attempt(self, intent: do.Sync | do.Average) -> do.Intent | None:
        """One attempt of the stage's round (the sync round, or the step's), within
        ``replicas.averaging_timeout_s`` of the first."""
        left = self._round_deadline - self.clock()
        if left <= self.s.matchmaking_s:  # hivemind needs one matchmaking's time at least
            what = "sync round" if isinstance(intent, do.Sync) else f"averaging round of step {self.step}"
            raise MaplError(f"{self.s.name}: no {what} among the {self.live_replicas()} live replicas of stage "
                            f"{self.stage} within {self.s.averaging_timeout_s:g} s")
        if isinstance(intent, do.Sync):  # a starting replica that left before the first step is not waited for
            intent = _replace(intent, expected=max(1, self.members.starting - len(self.cur.partners_gone)))
        self.in_round = True
        self._asked[self.phase.value] = intent = _replace(intent, timeout_s=left)
        return intent

    def _asked_wait(self, what: str) -> do.Intent:
        """The phase waits for its driver's answer (it asked already)."""
        raise RuntimeError(f"{self.s.name}: the core was asked for its next step while the {what} runs")

    def synced(self, round_: ReplicaStep) -> None:
        """The sync round before the first step (SPEC §9.10 item 2) gave ``round_``."""
        self.in_round = False
        if not round_.in_sync and self._digests_differ(round_, "before the first step", then=Phase.BOUNDARY):
            return
        self.members.ranked(round_)
        log.info("%s: replica %d of %d of stage %d", self.s.name, self.members.rank, self.members.count, self.stage)
        self.phase = Phase.BOUNDARY

    def averaged(self, round_: ReplicaStep) -> None:
        """This stage's round of the step gave ``round_``: whole, it commits; not whole, the step is
        repaired (a reopen serves it again) or redone; differing digests re-sync first."""
        self.in_round = False
        cur = self.cur
        if self.redo_due:
            return
        problem = round_.problem(self.s.M)
        if problem is None:
            # the round is whole and counts at every member: a reopen's ACTs go to the replicas that
            # hold them, not here; a neighbour's loss this replica would have repaired is only told
            self.resume = False
            notices, cur.notices = tuple(cur.notices), []
            for name in self.flow.down_links() if notices else ():
                self.spawn(do.SendRoute(name, cur.step, "gone", gone=notices, epoch=self.epoch))
        if not round_.in_sync:
            self._problem = problem or ""
            self._digests_differ(round_, f"at step {cur.step}", then=Phase.SERVE)
            return
        if problem is not None:
            if (cur.partners_gone or cur.await_answers) and not self.first:
                self.phase, self._problem = Phase.REPAIR, problem
                self._repair_until = self.clock() + self.s.timeout_s / 2
                return
            self.issue_redo(cur.step, problem)
            return
        self.round = round_
        self._loss_sum = round_.loss_sum  # the members' sums: the step's whole batch
        self._whole(round_)

    def round_failed(self, *, unsure: bool, behind: bool, why: str) -> None:
        """The round of the phase failed (``why``): a joiner a step behind downloads again, one that
        failed after its all-reduce began redoes the step, any other is run again."""
        self.in_round = False
        if self.phase is Phase.AVERAGE:
            if behind and self.cur.step == self.joined:
                log.info("%s: %s; downloading the stage's state again", self.s.name, why)
                self.phase = Phase.JOIN
                self._download("join")
                return
            if unsure:
                self.issue_redo(self.cur.step, f"{why} (a partner may have kept the round)")
                return
            if self.redo_due or self.resume or self.repair.reopen_queued():
                return  # the step is redone, or served again: a round of it later
        log.info("%s: %s; averaging again", self.s.name, why)
        self.send(self._attempt(self._asked[self.phase.value]))

    def _whole(self, round_: ReplicaStep | None) -> None:
        """This stage's round of the step is whole (a chain: the flush is done): the commit."""
        self.phase = Phase.COMMIT
        self.commit.begin(self.step, {"mode": "train", "loss": self._loss_sum / self.s.M,
                                      "tokens": self.s.tokens_per_step})

    def losses_summed(self, intent: do.SumLosses, total: float) -> None:
        if intent.token == self.token:
            self._loss_sum = total

    def stepped(self, metrics: dict) -> None:
        """The optimizer step of the current step was taken (``metrics``: its figures)."""
        step = self.step
        self.joined = -1
        if self.round is not None:
            self.members.ranked(self.round)
            metrics.update(averaging_sent_bytes=self.round.sent_bytes,
                           averaging_received_bytes=self.round.received_bytes)
            self.round = None
        self.window.step += 1
        self.commit.taken(step)
        self.send_projector(step + 1)
        self.send(do.StepEnd(step + 1, metrics))
        self.redos = 0
        self.phase = Phase.BOUNDARY

    def drain(self) -> None:
        """Stage 0 of a chain: the swarm drains at the current step (decided)."""
        self.drained = True

    # ------------------------------------------------------------------ downloads
    def _download(self, kind: str) -> do.Intent:
        step = self.step
        if kind == "join":
            good = lambda got: got["projector"] >= got["step"] or not self.proj.takes  # noqa: E731
            what = "its state"
        else:
            good = lambda got: int(got["step"]) == step  # noqa: E731
            what = f"its state of step {step} (to re-sync)"
        intent = do.Download(kind, step, good, what)
        self._asked["download"] = intent
        return intent

    def _digests_differ(self, round_: ReplicaStep, when: str, *, then: Phase) -> bool:
        """The replicas of this stage hold different parameters (the round's digests, SPEC §9.10 item
        6): one that does not hold the stage's (:attr:`ReplicaStep.reference`) loads the state of a
        partner; the others go on. True when this one downloads (the phase waits for it)."""
        held = len(set(round_.digests.values()))
        if round_.digests[round_.me] == round_.reference:
            log.warning("%s: the replicas of stage %d hold %d different parameter digests %s; this one holds the "
                        "stage's (most replicas'): the others load a partner's state", self.s.name, self.stage, held,
                        when)
            self._after_resync(round_, then)
            return False
        log.warning("%s: this replica's parameters differ from the stage's (%d digests among %d replicas %s): "
                    "loading a partner's state", self.s.name, held, round_.group_size, when)
        self.phase = Phase.RESYNC
        self._asked["resync"] = (round_, then)
        self.send(self._download("resync"))
        return True

    def _after_resync(self, round_: ReplicaStep, then: Phase) -> None:
        if then is Phase.SERVE:  # after a step's round: the step is redone
            self.phase = Phase.SERVE
            self.issue_redo(self.cur.step, self._problem)
        else:
            self.members.ranked(round_)
            self.phase = then

    def downloaded(self, got: dict) -> None:
        """The download the phase asked for came (``got``: its step, run epoch, projector step,
        members and gone; the driver loaded its state)."""
        if self.phase is Phase.RESYNC:
            self.projector_step = max(self.projector_step, int(got["projector"]))
            round_, then = self._asked.pop("resync")
            self._after_resync(round_, then)
            return
        step, epoch = int(got["step"]), int(got["epoch"])
        self.members.joined(str(got["members"]), str(got["gone"]))
        self.projector_step = int(got["projector"])
        self.joined = step
        self.joining = False
        self.window.joining = False
        self.begin(step, epoch)
        self.send(do.SetEpoch(epoch))
        self.commit.joined()
        log.info("%s: joined stage %d at step %d (run epoch %d) with the state of a live replica; %d other "
                 "replica(s) of the stage live", self.s.name, self.stage, step, epoch, len(self.members.hint))
        self.send_projector(step)
        self.phase = Phase.BOUNDARY

    def expected(self, announced: Iterable[str]) -> int:
        """How many replicas this stage's round waits for (:meth:`~.members.Members.expected`)."""
        return self.members.expected(self.contact, list(announced), self.clock())

    # ------------------------------------------------------------------ redo and resume
    def issue_redo(self, step: int, problem: str) -> None:
        """This stage's round of ``step`` cannot be whole: the step is redone everywhere."""
        if not self.s.replicas:
            raise MaplError(f"{self.s.name}: step {step} cannot be taken: {problem}")
        if self.redos >= self.s.max_redos:
            raise MaplError(f"{self.s.name}: step {step} cannot be taken after {self.redos} redos: {problem}")
        log.warning("%s: step %d is redone (run epoch %d): %s", self.s.name, step, self.epoch + 1, problem)
        self.redo = (step, self.epoch + 1)

    def redo_soon(self, step: int, problem: str) -> None:
        """:meth:`issue_redo` from a control message: nothing when a redo of the step (or a later one)
        is on its way here already."""
        if self.redo is not None and self.redo[0] >= step:
            return
        log.warning("%s: step %d is redone (run epoch %d): %s", self.s.name, step, self.epoch + 1, problem)
        self.take_redo(step, self.epoch + 1)

    def take_redo(self, step: int, epoch: int) -> None:
        """Note a redo of ``step`` in run ``epoch``; a round of the current step in progress gives up."""
        self.redo = (step, epoch)
        if step == self.step:
            self.cancel_round()
        self.wake()

    def _restart(self) -> do.Intent | None:
        """Carry out the redo of the current step (module docstring): the neighbours are told first,
        so that nothing of the new epoch reaches them before the redo does."""
        assert self.redo is not None
        step, epoch = self.redo
        self.redo, self.resume = None, False
        self.redos += 1
        self.epoch = epoch  # at once: what the control messages answer meanwhile answers for it
        self.cur = self.flow.new_step(step)
        self.commit.redone(epoch)
        self.members.rerank()
        self._asked = {k: v for k, v in self._asked.items() if k == "validated"}  # the validation is not redone
        self.send(do.Redo(step, epoch))
        for link in self.links:
            if self.flow.live(link.name):
                self.send(do.SendRoute(link.name, step, "redo", gone=tuple(sorted(self.members.gone))))
        self.send(do.Abandon())
        self.phase = Phase.SERVE
        return None

    def _serve_again(self) -> do.Intent | None:
        self.resume = False
        log.info("%s: step %d: more ACTs come after a replica left: serving the step again", self.s.name, self.step)
        self.phase = Phase.SERVE
        return None

    def serve_again(self) -> None:
        """A flush before its round is whole goes back to serving the step."""
        if self.phase is Phase.SERVE:
            return
        self.resume = True
        self.cancel_round()
        self.wake()

    def resume_if_flushing(self) -> None:
        """A ``reopen`` taken while this replica flushed the step before its round: it serves the step again."""
        if self.phase in (Phase.FLUSH, Phase.AVERAGE, Phase.REPAIR):
            self.resume = True

    def cancel_round(self) -> None:
        if self.in_round:
            self.spawn(do.CancelRound())

    # ------------------------------------------------------------------ control messages
    def on_bye(self, msg: Message, link: str, *, during_step: bool) -> do.Intent | None:
        """BYE from upstream: a replica whose stage goes on left; else the run ends here (passed on)."""
        reason = str(msg.meta.get("reason", ""))
        view = self.links.named(link)
        if reason != BYE_FINISHED and view is not None and self.replica_gone(view, f"BYE ({reason})"):
            return None  # its stage goes on with its other replicas
        self.byes.add(link)
        self.bye = msg
        if during_step or reason != BYE_FINISHED:
            return self._over(dict(msg.meta), msg.step)
        return None

    def replica_gone(self, link: LinkView, why: str) -> bool:
        """Neighbour replica ``link`` left (:meth:`~.repair.Repair.replica_gone`)."""
        return self.repair.replica_gone(link, why)

    def on_ready(self, msg: Message, link: str) -> None:
        """ROUTE ``ready`` from downstream: for a step this replica ended, ``end`` with 0 ACTs at once
        (its averaging round may wait, through the stage's other replicas, for this answer); for
        the step it routes now, a link to route to; one of a later step waits for that step."""
        cur = self.cur
        if not self.flow.live(link) or msg.epoch < self.epoch:
            return
        if msg.epoch == self.epoch and (msg.step < cur.step or (msg.step == cur.step and cur.ended)):
            self.spawn(do.SendRoute(link, msg.step, "end", acts=0))
            return
        if msg.epoch == self.epoch and msg.step == cur.step:
            self.flow.on_route(msg, link, cur)
            self.wake()
            return
        if len(self._later_readies) >= _LATER_READIES:
            self.reject("queue_full", link, f"{_LATER_READIES} ROUTE ready of later steps wait already")
            return
        self._later_readies.append((msg, link))

    def take_later_readies(self, cur: StepState) -> None:
        """The ``ready``s of ``cur``'s step (and run epoch) that came before it began."""
        keep = []
        for msg, link in self._later_readies:
            if msg.epoch < self.epoch or not self.flow.live(link):
                continue  # of an attempt a redo ended, or of a replica gone
            if msg.step == cur.step and msg.epoch == self.epoch:
                self.flow.on_route(msg, link, cur)
            elif msg.step > cur.step or msg.epoch > self.epoch:
                keep.append((msg, link))
            else:
                self.send(do.SendRoute(link, msg.step, "end", acts=0))
        self._later_readies = keep

    def end_queued_readies(self, cur: StepState) -> None:
        """A ``ready`` of the step still kept when the step is done gets its ``end`` with 0 ACTs."""
        keep = []
        for msg, link in self._later_readies:
            if msg.epoch < self.epoch:
                continue  # of an attempt a redo ended
            if msg.step <= cur.step and msg.epoch == self.epoch:
                self.send(do.SendRoute(link, msg.step, "end", acts=0))
            else:
                keep.append((msg, link))
        self._later_readies = keep

    def on_route(self, msg: Message, link: str) -> None:
        """ROUTE ``commit``, ``taken``, ``redo`` or ``gone`` (SPEC §9.10), taken at once, whatever the
        step's work waits for (``ready`` is :meth:`on_ready`'s, ``end`` and ``reopen`` the serving's)."""
        view = self.links.named(link)
        if view is None or not self.flow.live(link):
            return
        phase = msg.meta["phase"]
        if phase in ("commit", "taken"):
            self.commit.on_route(phase, link, msg.step, msg.epoch)
            return
        now = (msg.step, msg.epoch) == (self.step, self.epoch) and self.cur.step == msg.step
        contacts = self.gone_named(msg)
        if phase == "gone" and now:
            self.repair.on_gone(msg, view, contacts)
        self.repair.learn_gone(contacts)
        if phase == "redo":
            pending = self.redo[1] if self.redo is not None else -1
            if msg.epoch > max(self.epoch, pending) and msg.step >= self.step:
                for other in self.links:  # passed on first: nothing of the new epoch before it
                    if other.name != link and self.flow.live(other.name):
                        self.spawn(do.SendRoute(other.name, msg.step, "redo", gone=tuple(sorted(self.members.gone)),
                                                epoch=msg.epoch))
                self.take_redo(msg.step, msg.epoch)

    def gone_named(self, msg: Message) -> list[str]:
        """The contacts a ROUTE names gone, but this replica's own and its links'."""
        own = {x.contact for x in self.links if x.contact} | {self.contact}
        return self.members.named(msg.meta.get("gone", []), own)

    def arrived(self, msg: Message, link: str) -> None:
        """A pipeline message admitted, before it waits its turn in the inbox: a PROJ moves its link's
        projector version (SPEC §9.6: what admission checks next on the link), a ``reopen`` names
        replicas of this stage that left, which its rounds stop waiting for at once (the ``reopen``
        itself is taken in its link's order)."""
        view = self.links.named(link)
        if view is None:
            return
        if msg.type is MT.PROJ:
            self.window.projector(view.stage, msg.pver)
        elif msg.type is MT.ROUTE and msg.meta.get("phase") == "reopen" and self.flow.live(link):
            self.repair.learn_gone(self.gone_named(msg))

    def on_report(self, msg: Message, link: str) -> None:
        self.commit.on_report(msg, link)

    def on_linked(self, link: str) -> None:
        view = self.links.named(link)
        if view is not None:
            self.commit.on_linked(link, upstream=view.stage == self.links.up)

    # ------------------------------------------------------------------ compute results
    def _current(self, token: do.Token) -> bool:
        """A result of ``token`` still counts: its step and run epoch are the current ones, no redo is due."""
        return token == self.token and not self.redo_due

    def forwarded(self, intent: do.Feed | do.Forward, payload: Any, loss: Any = None, tokens: int = 0) -> None:
        if self._current(intent.token):
            if isinstance(intent, do.Feed):
                self.flow.forwarded(intent.micro, None, payload, loss, tokens)
            else:
                self.flow.forwarded(intent.msg.micro, intent.link, payload, loss, tokens, intent.msg)

    def backwarded(self, intent: do.Backward, grad: Any) -> None:
        if self._current(intent.token):
            self.flow.backwarded(intent.micro, intent.link, grad)

    def retransmitting(self, intent: do.Forward | do.Backward) -> None:
        if self._current(intent.token):
            self.flow.retransmitting(intent.msg.micro if isinstance(intent, do.Forward) else intent.micro,
                                     isinstance(intent, do.Forward))

    def eval_forwarded(self, intent: do.EvalForward, payload: Any, loss: Any) -> None:
        self.validation.forwarded(intent.msg, intent.link, payload, loss)


_replace = replace
