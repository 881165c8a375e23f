"""The step protocol of one stage peer as a pure state machine (SPEC §9.7, §9.10): events in, intents out.

:class:`StepCore` holds everything a peer decides about its steps — which micro-batches went where,
what it computed, held, re-ran, repaired or redid, its stage's averaging round, the commit, the
validations, the end — and nothing it does: no socket, no event loop, no tensor. Its driver
(:class:`~mapl_swarm.peer.driver.Schedule`, or a test's simulated swarm) asks :meth:`StepCore.next`
for the next intent (:mod:`~.intents`: a send, a compute, a round, a record, a wait), carries it out
and hands the result back (:meth:`~StepCore.answer`, :meth:`~StepCore.failed`); control messages
(:meth:`~StepCore.on_control`), departures (:meth:`~StepCore.replica_gone`) and arrivals
(:meth:`~StepCore.arrived`) go to it at once, and what it wants done then waits in
:meth:`~StepCore.urgent`. Pipeline messages are taken from the peer's inbox by predicate (a later
step's wait their turn).

The run moves through the :class:`~.phase.Phase` s of each step::

    START ─▶ (SYNC | JOIN) ─▶ BOUNDARY ─▶ [VALIDATE] ─▶ SERVE ─▶ FLUSH ─▶ [AVERAGE ─▶ [REPAIR]] ─▶ COMMIT ─▶ STEP ─┐
                                 ▲                        ▲                    │            │                      │
                                 │                        └── serve again ◀────┴────────────┘ (a reopen)          │
                                 └────────────────────────────────────────────────────────────────────────────────┘
    SERVE .. COMMIT ─▶ (a redo: the step again, one run epoch later) ─▶ SERVE       BOUNDARY ─▶ FINISH ─▶ OVER

The parts, one concern each: :mod:`~.flow` (serving: the order of the work, each message of the
step), :mod:`~.projector` (PROJ and PROJ_GRAD), :mod:`~.averaging` (the stage's rounds and
downloads), :mod:`~.repair` (replicas that leave), :mod:`~.redo` (a step's attempts),
:mod:`~.commit` (the commit and the REPORTs), :mod:`~.validation`, :mod:`~.members` (the stage's
replicas), :mod:`~.window` (what admission lets in). A chain is the same machine with one link each
way and no ROUTE on the wire (:attr:`CoreSettings.replicas` False).
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from mapl_swarm.errors import MaplError
from mapl_swarm.step.cadence import due
from mapl_swarm.step import intents as do
from mapl_swarm.step.averaging import Rounds
from mapl_swarm.step.commit import Commit
from mapl_swarm.step.context import Inbox, LinksView, LinkView
from mapl_swarm.step.flow import SERVED, Flow
from mapl_swarm.step.members import Members
from mapl_swarm.step.phase import ACTIVE, STEP_PHASES, WAITING, Phase
from mapl_swarm.step.projector import ProjectorExchange
from mapl_swarm.step.redo import Redo
from mapl_swarm.step.repair import Repair
from mapl_swarm.step.router import Router
from mapl_swarm.step.state import StepState
from mapl_swarm.step.stopping import Stopping
from mapl_swarm.step.validation import Validation
from mapl_swarm.step.window import Projectors, StepWindow
from mapl_swarm.wire import Message, MessageType
from mapl_swarm.wire.spec import DRAIN_REASON, FINISHED_REASON, LEAVE_REASON

log = logging.getLogger(__name__)

__all__ = ["StepCore", "CoreSettings", "Phase", "LinkView", "LinksView", "Inbox"]

MT = MessageType


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
    monotonic seconds; ``joining``: a replica that joins the running swarm; ``may_drain``: it may ask
    the swarm to drain (:class:`~.stopping.Stopping`)."""

    def __init__(self, settings: CoreSettings, *, links: LinksView, inbox: Inbox, projectors: Projectors,
                 reject: Callable[[str, str, str], None], clock: Callable[[], float],
                 joining: bool = False, may_drain: bool = True) -> None:
        s = self.s = settings
        self.links, self.inbox, self.proj, self.reject, self.clock = links, inbox, projectors, reject, clock
        self.first, self.last = links.up is None, links.down is None
        self.stage = s.stage
        self.window = StepWindow(projectors, stage=s.stage, steps=s.steps, start_step=s.start_step,
                                 upstream_lag=1 if s.replicas else 0)
        self.window.joining = joining
        self.members = Members(s.name, s.stage, starting=s.starting, timeout_s=s.timeout_s)
        self.router = Router(routing=s.routing, seed=s.routing_seed, stage=s.stage)
        self.flow, self.projector, self.rounds = Flow(self), ProjectorExchange(self), Rounds(self)
        self.repair, self.redo, self.commit, self.validation = Repair(self), Redo(self), Commit(self), Validation(self)
        self.stopping = Stopping(self, may_drain=may_drain)
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
        self.woken = False
        """The core changed while the driver waited: it looks again."""
        self.bye: Message | None = None
        """The BYE that ended the run (its ``reason``)."""
        self.byes: set[str] = set()
        """Upstream links that said BYE."""
        self.drained = False
        """Stage 0: the swarm drains at the current step (its BYE says so)."""
        self._out: deque[do.Intent] = deque()
        self._urgent: list[do.Intent] = []
        self._asked: dict[str, Any] = {}
        """What the current step's boundary, flush and end asked already (once each)."""
        self._answers: dict[type, Callable[..., None]] = {
            do.Feed: self.flow.forwarded, do.Forward: self.flow.forwarded, do.Backward: self.flow.backwarded,
            do.EvalForward: self.validation.forwarded, do.SumLosses: self.rounds.summed, do.Sync: self.rounds.synced,
            do.Average: self.rounds.averaged, do.Download: self.rounds.downloaded, do.TakeStep: self._stepped,
            do.SendProjector: self.projector.sent, do.SendProjectorGrad: self.projector.grad_sent,
            do.Boundary: self._drain}
        """The core's answer to each intent's result (:meth:`answer`)."""

    # ------------------------------------------------------------------ what others read
    @property
    def step(self) -> int:
        """The step this stage works on: the next one to flush."""
        return self.window.step

    @property
    def token(self) -> do.Token:
        return do.Token(self.step, self.epoch)

    @property
    def active(self) -> bool:
        """This replica serves the current step, or flushes it before its round is whole: a
        neighbour's loss is repaired (the step goes on), not redone."""
        return self.phase in ACTIVE and self.cur.step == self.step

    @property
    def committing(self) -> bool:
        """This replica's round of the current step is whole: it waits for the step's commit."""
        return self.phase is Phase.COMMIT and self.cur.step == self.step

    @property
    def joining(self) -> bool:
        """A replica that joins the running swarm, before its state came (the window admits any step)."""
        return self.window.joining

    @property
    def redo_due(self) -> bool:
        return self.redo.pending is not None and self.redo.pending[0] == self.step

    def interrupted(self) -> bool:
        """A wait of the driver ends: the core changed."""
        return self.woken or self.redo.resume or self.redo_due

    # ------------------------------------------------------------------ the driver's side
    def begin(self, start_step: int | None, epoch: int = 0, *, behind: bool = False) -> None:
        """Training starts at ``start_step`` (None: the settings') in run epoch ``epoch``; ``behind``:
        this replica resumed without that step's file, so the sync round gives it a partner's state."""
        start = self.s.start_step if start_step is None else start_step
        self.s = replace(self.s, start_step=start)
        self.window.behind = behind
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

    def answer(self, intent: do.Intent, *result: Any) -> None:
        """The result of ``intent`` (what its docstring names); one asked in an earlier step or run
        epoch than the current one's, or before a redo now due, no longer counts."""
        token = getattr(intent, "token", None)
        if token is not None and (token != self.token or self.redo_due):
            return
        self._answers[type(intent)](intent, *result)

    def failed(self, intent: do.Intent, *, unsure: bool = False, behind: bool = False, why: str = "") -> None:
        """``intent`` gave no result: a round that failed (``why``; ``unsure``: after its all-reduce
        began; ``behind``: its members are a step ahead), or a decode whose codes need a
        retransmission (dropped: its copy follows on the link)."""
        if isinstance(intent, (do.Sync, do.Average)):
            self.rounds.failed(unsure=unsure, behind=behind, why=why)
        elif intent.token == self.token and not self.redo_due:
            self.flow.retransmitting(intent)

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

    # ------------------------------------------------------------------ control messages and departures
    def on_control(self, msg: Message, link: str) -> None:
        """A REPORT or a ROUTE ``ready``, ``commit``, ``taken``, ``gone`` or ``redo`` (SPEC §9.10), taken
        at once, whatever the step's work waits for (``end`` and ``reopen`` are the serving's)."""
        view = self.links.named(link)
        if view is None or not self.flow.live(link):
            return
        if msg.type is MT.REPORT:
            self.commit.on_report(msg, link)
            return
        phase = msg.meta["phase"]
        if phase == "ready":
            self.flow.on_ready(msg, link)
        elif phase in ("commit", "taken"):
            self.commit.on_route(phase, link, msg.step, msg.epoch)
        else:
            self.repair.on_route(msg, view)
            if phase == "redo" and not self.repair.leaving:
                self.redo.on_route(msg, link)

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
            self.repair.said_gone(msg, link)

    def on_linked(self, link: str) -> None:
        """A neighbour replica linked while training (one that joins)."""
        view = self.links.named(link)
        if view is not None:
            self.commit.on_linked(link, upstream=view.stage == self.links.up)

    def replica_gone(self, link: LinkView, why: str, *, after: int | None = None) -> bool:
        """Neighbour replica ``link`` left (``after``: on purpose, having taken that many steps;
        :meth:`~.repair.Repair.replica_gone`)."""
        return self.repair.replica_gone(link, why, after=after)

    def on_bye(self, msg: Message, link: str, *, during_step: bool) -> do.Intent | None:
        """BYE from upstream: a replica whose stage goes on left; else the run ends here (passed on)."""
        reason = str(msg.meta.get("reason", ""))
        view = self.links.named(link)
        if reason not in (FINISHED_REASON, DRAIN_REASON) and view is not None and self.repair.replica_gone(
                view, f"BYE ({reason})", after=msg.step if reason == LEAVE_REASON else None):
            return None  # its stage goes on with its other replicas
        self.byes.add(link)
        self.bye = msg
        if during_step or reason != FINISHED_REASON:
            return self._over(dict(msg.meta), msg.step)
        return None

    # ------------------------------------------------------------------ the phases
    def _advance(self) -> do.Intent | None:
        if self.redo_due and (self.phase in STEP_PHASES or self.phase is Phase.VALIDATE):
            self._out.clear()  # nothing more of the earlier epoch goes out
            validating = self.phase is Phase.VALIDATE
            self.redo.restart()
            if validating:  # the validation before the step speaks its run epoch too: it starts again in it
                self.phase = Phase.VALIDATE
                self.validation.start(self.validation.step)
            return None
        if self.phase in ACTIVE and self.phase is not Phase.SERVE and not self.rounds.in_round and (
                self.redo.resume or self.repair.reopen_queued()):
            self.redo.resume = False
            log.info("%s: step %d: more ACTs come after a replica left: serving the step again", self.s.name,
                     self.step)
            self.phase = Phase.SERVE
            return None
        if self.phase in WAITING:
            raise RuntimeError(f"{self.s.name}: asked for the next step while the {self.phase.value} runs")
        return getattr(self, f"_{self.phase.value}")()

    def _start(self) -> do.Intent | None:
        if self.joining:
            self.phase = Phase.JOIN
            self.send(do.Abandon())
            return self.rounds.download("join")
        behind = self.window.behind
        if not behind:  # one behind sends the stage's projector once its partner's state came
            self.projector.send(self.s.start_step)
        if self.s.averaged:
            self.phase = Phase.SYNC
            return self.rounds.start(do.Sync(self.members.starting, 0.0, behind))
        self.phase = Phase.BOUNDARY
        return None

    def _boundary(self) -> do.Intent | None:
        step = self.step
        if step >= self.s.steps or self.drained or (self.bye is not None and self.bye.step <= step):
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
            self.repair.began(self.cur)
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
            return self.take_message(lambda m: (m.type is MT.PROJ and m.step <= cur.step) or self.flow.bye_from_up(m),
                                     f"PROJ of step {cur.step}", self._on_step_message)
        intent = self.flow.next(cur, self.clock())
        if intent is SERVED:
            self.phase = Phase.FLUSH
            return None
        if isinstance(intent, do.Wait) and cur.repair_by:
            left = cur.repair_by - self.clock()
            if left < intent.timeout_s:  # the repair's deadline comes first: look again then
                return replace(intent, timeout_s=max(left, 0.01), fatal=False)
        return intent

    def _flush(self) -> do.Intent | None:
        """PROJ_GRADs up (over each upstream link's ACTs), PROJ_GRADs in (from each downstream link
        this stage sent ACTs on), the step's losses; then the round (replicas) or the commit."""
        cur = self.cur
        if self.proj.takes:
            self.projector.send_grads(cur)  # those a link's ACTs since its last PROJ_GRAD call for
            if self._out or self.redo_due:
                return None
        if self.proj.owns:
            intent = self.projector.take_grads(cur)
            if intent is not None or self._out or self.redo_due:
                return intent
        if self.last and cur.losses and self._asked.get("losses") != (cur.step, len(cur.losses)):
            self._asked["losses"] = (cur.step, len(cur.losses))
            return do.SumLosses(self.token, tuple(cur.losses))
        if not cur.losses:
            self.rounds.loss_sum = 0.0
        if self.s.averaged:
            self.phase = Phase.AVERAGE
            return self.rounds.start(do.Average(self.token, tuple(cur.done), self.rounds.loss_sum, 0.0,
                                                leave=self.stopping.leaving, going=self.stopping.going,
                                                drain=self.stopping.drain))
        if sorted(cur.done) != list(range(self.s.M)):
            raise MaplError(f"{self.s.name}: step {cur.step}: this stage computed {len(cur.done)} of the step's "
                            f"{self.s.M} micro-batches")
        self.whole()
        return None

    def _repair(self) -> do.Intent | None:
        return self.rounds.repair_wait()

    def _commit(self) -> do.Intent | None:
        waits = self.commit.ready(self.step)
        if waits is None:
            self.phase = Phase.STEP
            return do.TakeStep(self.step)
        return self.take_message(lambda m: self.flow.bye_from_up(m) or self.repair.rerun_wanted(m)
                                 or self.repair.replayed_reply(m), waits,
                                 self.commit.on_message, timeout_s=self.s.timeout_s + self.s.averaging_timeout_s)

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
            return self._over({"reason": DRAIN_REASON if self.drained else FINISHED_REASON}, self.step)
        if not set(self.flow.up_links()) <= self.byes:
            return self.take_message(
                lambda m: self.flow.bye_from_up(m) or m.type is MT.ROUTE or (m.type is MT.PROJ and m.step <= s.steps)
                or (m.type is MT.ACT and m.meta.get("mode") == "eval" and self.projector.ready(m.step)),
                "BYE from every upstream replica", self.validation.last_words)
        assert self.bye is not None
        return self._over(dict(self.bye.meta), self.bye.step)

    def _over(self, meta: dict, step: int, *, everyone: bool = False) -> do.Intent:
        """The run is over here: BYE ``meta`` downstream (``everyone``: on every link)."""
        self.phase = Phase.OVER
        for name in self.flow.up_links() + self.flow.down_links() if everyone else self.flow.down_links():
            self.send(do.SendBye(name, step, meta))
        return do.Done(meta)

    # ------------------------------------------------------------------ transitions the parts make
    def whole(self) -> None:
        """This stage's round of the step is whole (a chain: the flush is done): the commit."""
        self.phase = Phase.COMMIT
        self.commit.begin(self.step, {"mode": "train", "loss": self.rounds.loss_sum / self.s.M,
                                      "tokens": self.s.tokens_per_step})

    def restarted(self, step: int, epoch: int) -> None:
        """A redo of ``step`` in run ``epoch`` is carried out: a fresh attempt of the step (its
        validation, if one ran before it, is not redone)."""
        self.epoch = epoch
        self.cur = self.flow.new_step(step)
        self.commit.redone(epoch)
        self.members.rerank()
        self._asked = {k: v for k, v in self._asked.items() if k == "validated"}
        self.phase = Phase.SERVE

    def joined_at(self, step: int, epoch: int, projector: int, members: str, gone: str) -> None:
        """A joiner's download came: the stage's state of ``step`` in run ``epoch`` (its projector of
        step ``projector``), the stage's live replicas and those gone."""
        self.members.joined(members, gone)
        self.projector_step = projector
        self.joined = step
        self.window.joining = False
        self.begin(step, epoch)
        self.send(do.SetEpoch(epoch))
        self.commit.joined()
        log.info("%s: joined stage %d at step %d (run epoch %d) with the state of a live replica; %d other "
                 "replica(s) of the stage live", self.s.name, self.stage, step, epoch, len(self.members.hint))
        self.projector.send(step)
        self.phase = Phase.BOUNDARY

    def _stepped(self, intent: do.TakeStep, metrics: dict) -> None:
        """The optimizer step of the current step was taken (``metrics``: its figures)."""
        step = self.step
        self.joined = -1
        round_, self.rounds.round = self.rounds.round, None
        if round_ is not None:
            self.members.ranked(round_)
            metrics.update(averaging_sent_bytes=round_.sent_bytes, averaging_received_bytes=round_.received_bytes)
        self.window.step += 1
        self.commit.taken(step)
        self.projector.send(step + 1)
        self.send(do.StepEnd(step + 1, metrics))
        self.redo.count = 0
        self.phase = Phase.BOUNDARY
        if self.stopping.after(round_):  # this replica leaves: its stage goes on without it
            self.send(self._over({"reason": LEAVE_REASON}, self.step, everyone=True))

    def _drain(self, intent: do.Boundary) -> None:
        """Stage 0 of a chain: the swarm drains at this step (decided)."""
        self.drained = True

    # ------------------------------------------------------------------ taking messages
    def take_message(self, wanted: Callable[[Message], bool], what: str,
                     handle: Callable[[Message, str], do.Intent | None], *,
                     timeout_s: float | None = None) -> do.Intent | None:
        """The oldest message ``wanted`` accepts (codebook slices too) handled, or a wait for one."""
        def taking(m: Message) -> bool:
            return m.type is MT.CODEBOOK_SLICE or wanted(m)

        got = self.inbox.take_from(taking)
        if got is None:
            return do.Wait(taking, what, self.s.timeout_s if timeout_s is None else timeout_s,
                           self.flow.up_links() + self.flow.down_links())
        return self.take(got, handle)

    def take(self, got: tuple[Message, LinkView], handle: Callable[[Message, str], do.Intent | None]) \
            -> do.Intent | None:
        """A message taken from the inbox: a codebook slice applied, one of an earlier run epoch or of a
        replica gone dropped, any other to ``handle``."""
        msg, link = got
        if msg.type is MT.CODEBOOK_SLICE:
            return do.ApplySlice(msg, link.name) if self.flow.live(link.name) else None
        if msg.epoch < self.epoch and msg.type not in (MT.PROJ, MT.BYE):  # a PROJ is the same in every epoch
            log.debug("%s: %s of run epoch %d dropped (the step runs in epoch %d)", self.s.name, msg.type.name,
                      msg.epoch, self.epoch)
            return None
        if not self.flow.live(link.name):
            return None
        return handle(msg, link.name)

    def _on_step_message(self, msg: Message, link: str) -> do.Intent | None:
        if msg.type is MT.BYE:
            return self.on_bye(msg, link, during_step=True)
        return self.projector.take(msg, self.cur.step)
