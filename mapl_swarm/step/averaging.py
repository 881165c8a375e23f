"""A stage's rounds (SPEC §9.10 items 2, 6, 10, 11): the sync round, each step's averaging round and what
their results decide, and the state downloads (a joiner's, a re-sync's).

A round that formed no group, or failed before its all-reduce began, is run again, within
``replicas.averaging_timeout_s``. One that failed after its all-reduce began may have counted at a
partner: the step is redone. A whole round (every micro-batch once, equal digests) commits; one
that is not whole after a replica left during the step waits for word whether the gone replica's
work comes again (a ``reopen``: the step is served again), else the step is redone. Different
parameters (digests that differ beyond what other kernels' rounding makes) are re-synced: a
replica that does not hold the stage's loads a partner's state (and after a step's round the step
is redone); a tie is drawn in the next round. A joiner whose round meets replicas a step ahead
downloads again.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import replace
from typing import TYPE_CHECKING

from mapl_swarm.errors import MaplError
from mapl_swarm.step import intents as do
from mapl_swarm.step.phase import Phase
from mapl_swarm.step.rounds import ReplicaStep

if TYPE_CHECKING:
    from mapl_swarm.step.context import Core

log = logging.getLogger(__name__)

__all__ = ["Rounds"]


class Rounds:
    """Stage ``core.stage``'s rounds and downloads (module docstring)."""

    def __init__(self, core: Core) -> None:
        self.c = core
        self.in_round = False
        """A round is in progress (a departure or a redo cancels it)."""
        self.round: ReplicaStep | None = None
        """The whole round of the step being taken (it ranks the stage's replicas for the next)."""
        self.loss_sum = 0.0
        """The step's summed losses: the last stage's own, then its round's (every member's)."""
        self._asked: do.Sync | do.Average | None = None
        self._deadline = 0.0
        self._repair_until = 0.0
        self._problem = ""
        self._resync: tuple[ReplicaStep, Phase] | None = None
        self._prior: ReplicaStep | None = None
        """This replica's last round (its commitments settle a tie of digests in the next)."""

    # ------------------------------------------------------------------ attempts
    def start(self, intent: do.Sync | do.Average) -> do.Intent:
        """The first attempt of a round."""
        self._deadline = self.c.clock() + self.c.s.averaging_timeout_s
        return self._attempt(intent)

    def _attempt(self, intent: do.Sync | do.Average) -> do.Intent:
        """One attempt, within ``replicas.averaging_timeout_s`` of the first."""
        c = self.c
        left = self._deadline - c.clock()
        if left <= c.s.matchmaking_s:  # hivemind needs one matchmaking's time at least
            what = "sync round" if isinstance(intent, do.Sync) else f"averaging round of step {c.step}"
            raise MaplError(f"{c.s.name}: no {what} among the {c.members.live_count()} live replicas of stage "
                            f"{c.stage} within {c.s.averaging_timeout_s:g} s")
        if isinstance(intent, do.Sync):  # a starting replica that left before the first step is not waited for
            intent = replace(intent, expected=max(1, c.members.starting - len(c.cur.partners_gone)))
        self.in_round = True
        self._asked = intent = replace(intent, timeout_s=left)
        return intent

    def cancel(self) -> None:
        """The round in progress gives up (a replica of the stage left, or a redo came)."""
        if self.in_round:
            self.c.spawn(do.CancelRound())

    def expected(self, announced: Iterable[str]) -> int:
        """How many replicas this stage's round waits for (:meth:`~.members.Members.expected`)."""
        c = self.c
        return c.members.expected(c.flow.contact, list(announced), c.clock())

    # ------------------------------------------------------------------ results
    def summed(self, intent: do.SumLosses, total: float) -> None:
        """The last stage's micro-batch losses of the step sum to ``total``."""
        self.loss_sum = total

    def synced(self, intent: do.Sync, round_: ReplicaStep) -> None:
        """The sync round before the first step (SPEC §9.10 item 2) gave ``round_``."""
        c = self.c
        self.in_round = False
        prior, self._prior = self._prior, round_
        if not round_.agrees and self._differ(round_, prior, "before the first step", then=Phase.BOUNDARY):
            return
        c.members.ranked(round_)
        log.info("%s: replica %d of %d of stage %d", c.s.name, c.members.rank, c.members.count, c.stage)
        c.phase = Phase.BOUNDARY

    def averaged(self, intent: do.Average, round_: ReplicaStep) -> None:
        """This stage's round of the step gave ``round_``: whole, it commits; not whole, the step is
        repaired (a reopen serves it again) or redone; differing digests re-sync first."""
        c = self.c
        self.in_round = False
        prior, self._prior = self._prior, round_
        cur = c.cur
        if c.redo_due:
            return
        problem = round_.problem(c.s.M)
        if problem is None:
            # the round is whole and counts at every member: a reopen's ACTs go to the replicas that
            # hold them, not here; a neighbour's loss this replica would have repaired is only told
            c.redo.resume = False
            notices, cur.notices = tuple(cur.notices), []
            for name in c.flow.down_links() if notices else ():
                c.spawn(do.SendRoute(name, cur.step, "gone", gone=notices, epoch=c.epoch))
        if not round_.agrees:
            self._problem = problem or ""
            self._differ(round_, prior, f"at step {cur.step}", then=Phase.SERVE)
            return
        if problem is not None:
            if (cur.partners_gone or cur.awaited) and not c.first:
                c.phase, self._problem = Phase.REPAIR, problem
                self._repair_until = c.clock() + c.s.timeout_s / 2
                return
            c.redo.issue(cur.step, problem)
            return
        self.round = round_
        self.loss_sum = round_.loss_sum  # the members' sums: the step's whole batch
        c.whole()

    def failed(self, *, unsure: bool, behind: bool, why: str) -> None:
        """The round of the phase failed (``why``): a joiner a step behind downloads again, one that
        failed after its all-reduce began redoes the step, any other is run again."""
        c = self.c
        self.in_round = False
        if c.phase is Phase.AVERAGE:
            if behind and c.cur.step == c.joined:
                log.info("%s: %s; downloading the stage's state again", c.s.name, why)
                c.phase = Phase.JOIN
                c.send(self.download("join"))
                return
            if unsure:
                c.redo.issue(c.cur.step, f"{why} (a partner may have kept the round)")
                return
            if c.redo_due or c.redo.resume or c.repair.reopen_queued():
                return  # the step is redone, or served again: a round of it later
        log.info("%s: %s; averaging again", c.s.name, why)
        assert self._asked is not None
        c.send(self._attempt(self._asked))

    def repair_wait(self) -> do.Intent | None:
        """A round that is not whole after a partner or an upstream replica left during the step:
        whether what went through the one that left comes here again (a ``reopen``). Every live
        upstream replica says ``reopen`` (it sends it again) or ``gone`` (it cannot, or it has
        nothing more); this waits for all of them, half ``net.timeout_s`` at most, then redoes the
        step."""
        c = self.c
        cur = c.cur
        now = c.clock()
        if c.repair.upstream_answered(cur, cur.partners_gone | cur.awaited) or now >= self._repair_until:
            if now >= self._repair_until:
                log.warning("%s: step %d: not every upstream replica said within %g s whether what went through the "
                            "replica that left comes again", c.s.name, cur.step, c.s.timeout_s / 2)
            c.redo.issue(cur.step, self._problem)
            return None
        return do.Wait(c.repair.reopen_wanted, f"word of a repair of step {cur.step}", self._repair_until - now,
                       c.flow.up_links(), fatal=False)

    # ------------------------------------------------------------------ downloads
    def download(self, kind: str, round_: ReplicaStep | None = None, digest: str = "") -> do.Download:
        """Ask for the stage's state: a joiner's (``join``: one whose projector is its step's) or a
        re-sync's (``resync``: of this replica's step, from a member of ``round_`` holding
        ``digest``, the stage's)."""
        c = self.c
        step = c.step
        if kind == "join":
            takes = c.proj.takes
            return do.Download(kind, step, lambda got: got["projector"] >= got["step"] or not takes, "its state")
        assert round_ is not None
        return do.Download(kind, step, lambda got: int(got["step"]) == step, f"its state of step {step} (to re-sync)",
                           sources=tuple(round_.holders(digest)))

    def _differ(self, round_: ReplicaStep, prior: ReplicaStep | None, when: str, *, then: Phase) -> bool:
        """The replicas of this stage hold different parameters (the round's digests, SPEC §9.10 item
        6): one that does not hold the stage's (:meth:`ReplicaStep.reference`, ``prior`` this
        replica's round before) loads the state of a partner that does; the others go on; a tie
        nobody's word decides waits for the next round's draw (nobody loads anything now). True
        when this one downloads (the phase waits for it)."""
        c = self.c
        held = len(set(round_.digests.values()))
        reference = round_.reference(prior)
        if reference is None:
            log.warning("%s: the replicas of stage %d hold %d different parameter digests %s, as many replicas "
                        "each: the draw of the next round decides which the stage keeps", c.s.name, c.stage, held, when)
            self._resynced(round_, then)
            return False
        if round_.digests[round_.me] == reference:
            log.warning("%s: the replicas of stage %d hold %d different parameter digests %s; this one holds the "
                        "stage's: the others load a partner's state", c.s.name, c.stage, held, when)
            self._resynced(round_, then)
            return False
        log.warning("%s: this replica's parameters differ from the stage's (%d digests among %d replicas %s): "
                    "loading a partner's state", c.s.name, held, round_.group_size, when)
        c.phase = Phase.RESYNC
        self._resync = (round_, then)
        c.send(self.download("resync", round_, reference))
        return True

    def _resynced(self, round_: ReplicaStep, then: Phase) -> None:
        c = self.c
        if then is Phase.SERVE:  # after a step's round: the step is redone
            c.phase = Phase.SERVE
            c.redo.issue(c.cur.step, self._problem)
        else:
            c.members.ranked(round_)
            c.phase = then

    def downloaded(self, intent: do.Download, got: dict) -> None:
        """The download the phase asked for came (``got``: its step, run epoch, projector step,
        members and gone; the driver loaded its state)."""
        c = self.c
        if c.phase is Phase.RESYNC:
            assert self._resync is not None
            if c.window.behind:  # its projector versions are the stage's now: its PROJ goes
                c.window.behind = False
                c.projector.send(c.step)
            c.projector_step = max(c.projector_step, int(got["projector"]))
            (round_, then), self._resync = self._resync, None
            self._resynced(round_, then)
            return
        c.joined_at(int(got["step"]), int(got["epoch"]), int(got["projector"]), str(got["members"]),
                    str(got["gone"]))
