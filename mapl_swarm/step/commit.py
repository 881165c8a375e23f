"""The commit of a step and the REPORTs (SPEC §9.7 item 5, §9.10 items 7, 8, 11).

**A chain** takes each step once its flush is done (nothing can fail at a stage without ending
the session); the last stage's REPORT of the step travels upstream, each middle stage relays it
as it comes and stage 0 records it.

**With replicas** no replica takes step s before every live replica's round of s was whole: the
last stage's replicas say so upstream with the step's REPORT, a middle replica passes it on once
its own round is whole and every live downstream replica's REPORT is in, a stage-0 replica then
says ROUTE ``commit`` downstream; a stage-1 replica that has one from every live stage-0 replica
takes the step and says ``taken`` upstream (stage 0 takes the step and records the loss on it) and
``commit`` downstream (a later replica takes the step on the first ``commit`` and says it on). A
neighbour linked while training (one that joins) gets the commit messages of the latest step
(:meth:`Commit.on_linked`). Eval REPORTs are relayed once (the other replicas' copies dropped).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from mapl_swarm.step.cadence import due
from mapl_swarm.step import intents as do
from mapl_swarm.wire import Message, MessageType
from mapl_swarm.wire.spec import DRAIN_REASON, FINISHED_REASON

if TYPE_CHECKING:
    from mapl_swarm.step.context import Core

log = logging.getLogger(__name__)

__all__ = ["Commit"]

MT = MessageType



class Commit:
    """Stage ``core.stage``'s side of each step's commit and of the REPORTs (module docstring)."""

    def __init__(self, core: Core) -> None:
        self.c = core
        self.down_reports: dict[str, tuple[int, int, dict]] = {}
        """The latest train REPORT from each downstream link: (step, run epoch, meta)."""
        self.votes: set[str] = set()
        """Stage 1: the upstream links that said ROUTE ``commit`` of the current step and run epoch."""
        self.committed = -1
        """The last step this replica may take: said by ROUTE ``commit`` from upstream (stage 2 on) or
        ``taken`` from downstream (stage 0); decided by stage 1 itself."""
        self.replay: dict[str, tuple[int, int, dict]] = {}
        """The commit messages of the latest step this replica sent (``report`` upstream, ``taken``
        upstream, ``commit`` downstream): (step, run epoch, REPORT meta)."""
        self.early: dict[tuple[str, str], tuple[int, int]] = {}
        """A joining replica's ROUTE ``commit``/``taken`` that came before its download, by (phase,
        link): (step, run epoch)."""
        self.reported: set[tuple[str, int]] = set()
        """(mode, step) of the REPORTs this stage passed upstream (the last stage: sent) or recorded."""
        self.reports: dict[tuple[str, int], float] = {}
        """Stage 0: the losses recorded, by (mode, step)."""
        self.eval_steps: set[int] = set()
        """A chain: the validations this stage sent or served eval ACTs of (their REPORT is due)."""
        self.report: dict = {}
        """The REPORT meta of the step being committed (stage 0 records its loss)."""
        self.awaiting: str | None = None
        """What the commit of the current step waits for: ``reports`` (every downstream REPORT),
        ``commit`` (the word of the stages that decide), None (nothing)."""

    # ------------------------------------------------------------------ the commit of a step
    def report_in_epoch(self) -> dict | None:
        """The train REPORT of the current step and run epoch (its meta) once every live downstream
        link live when the step began sent one, else None."""
        c = self.c
        want = (c.step, c.epoch)
        got = [self.down_reports.get(name) for name in c.flow.down_links() if name in c.cur.members]
        if not got or any(r is None or r[:2] != want for r in got):
            return None
        return got[0][2]  # equal: the last stage's replicas report the same round's loss

    def begin(self, step: int, report: dict) -> None:
        """This stage's round of ``step`` is whole (a chain: its flush is done) and ``report`` is its
        own REPORT meta (the last stage's loss): say what can be said now (module docstring)."""
        c = self.c
        self.report = report
        if not c.s.replicas:
            if c.last:
                self.reported.add(("train", step))
                for name in c.flow.up_links():
                    c.send(do.SendReport(name, step, report))
            self.committed = max(self.committed, step)
            self.awaiting = None
        elif c.last:
            self._say_report(step, report)
            self.awaiting = "commit"
        else:
            self.awaiting = "reports"

    def ready(self, step: int) -> str | None:
        """None once ``step`` may be taken here; else what its commit waits for."""
        c = self.c
        if self.awaiting == "reports":
            got = self.report_in_epoch()
            if got is None:
                return f"REPORT of step {step} from every downstream replica"
            self.report = got
            if c.first:
                self.replay["commit"] = (step, c.epoch, {})
                for name in c.flow.down_links():
                    c.send(do.SendRoute(name, step, "commit"))
            else:
                self._say_report(step, got)
            self.awaiting = "commit"
        if self.awaiting == "commit":
            if c.stage == 1 and set(c.flow.up_links()) & c.cur.members <= self.votes:
                self.committed = max(self.committed, step)
            if self.committed < step:
                if c.first:
                    return f"ROUTE taken of step {step}"
                return f"ROUTE commit of step {step}" + (" from every stage-0 replica" if c.stage == 1 else "")
            self.awaiting = None
            if c.first:
                self.record_train(step, self.report)
        return None

    def _say_report(self, step: int, report: dict) -> None:
        c = self.c
        self.replay["report"] = (step, c.epoch, report)
        for name in c.flow.up_links():
            c.send(do.SendReport(name, step, report))

    def taken(self, step: int) -> None:
        """The step is taken here: its commit messages go on (stage 1: ``taken`` up; later stages:
        ``commit`` down), the step's REPORTs and votes are forgotten."""
        c = self.c
        self.down_reports = {name: r for name, r in self.down_reports.items() if r[0] > step}
        self.votes.clear()
        if not c.s.replicas:
            return
        if c.stage == 1:
            self.replay["taken"] = (step, c.epoch, {})
            for name in c.flow.up_links():
                c.send(do.SendRoute(name, step, "taken"))
        if not c.first:
            self.replay["commit"] = (step, c.epoch, {})
            for name in c.flow.down_links():
                c.send(do.SendRoute(name, step, "commit"))

    def on_message(self, msg: Message, link: str) -> do.Intent | None:
        """A message taken while the commit is awaited: a BYE from upstream, the re-run of a
        micro-batch taken from a replica that left (answered with the GRAD kept), or what comes back
        of ACTs this replica sent again after its round was whole (dropped: counted already)."""
        c = self.c
        if msg.type in (MT.GRAD, MT.PROJ_GRAD):  # of what went again after a replica left (Repair.replay)
            log.debug("%s: %s of step %d from %s: counted here already", c.s.name, msg.type.name, msg.step, link)
            return None
        if msg.type is not MT.BYE:
            c.repair.rerun_after_whole(msg, link)
            return None
        if msg.meta.get("reason") in (FINISHED_REASON, DRAIN_REASON) and msg.step > c.step:
            # an upstream replica that took this step (the run's last, or the drain's) and ended: its
            # word of the commit, which may not have come yet from its partners
            c.byes.add(link)
            c.bye = msg
            self.on_route("commit", link, c.step, c.epoch)
            return None
        return c.on_bye(msg, link, during_step=True)

    def redone(self, epoch: int) -> None:
        """A redo moved the run to ``epoch``: what was kept of an earlier one is forgotten."""
        self.down_reports = {name: r for name, r in self.down_reports.items() if r[1] >= epoch}
        self.votes.clear()

    def on_route(self, phase: str, link: str, step: int, epoch: int) -> None:
        """ROUTE ``commit`` (the admission lets it through from upstream only) or ``taken`` (from
        downstream only) of ``step`` in run ``epoch`` on ``link``."""
        c = self.c
        if c.window.joining:  # before its download: kept for the step it joins at
            self.early[phase, link] = (step, epoch)
            return
        if step != c.step or epoch != c.epoch:
            return  # another upstream replica's copy, a step late
        if c.stage == 1 and phase == "commit":
            self.votes.add(link)  # a stage-0 replica's round and every REPORT are in
        elif (phase == "taken") == c.first:
            self.committed = max(self.committed, step)
        c.wake()

    def joined(self) -> None:
        """A joining replica's state came: what its neighbours replayed before counts now."""
        early, self.early = self.early, {}
        for (phase, name), (step, epoch) in early.items():
            self.on_route(phase, name, step, epoch)

    def on_linked(self, link: str, upstream: bool) -> None:
        """A neighbour replica linked while training (one that joins): the commit messages of the
        latest step this replica sent before the link existed, which its first step may wait for."""
        c = self.c
        for kind in ("report", "taken") if upstream else ("commit",):
            if kind not in self.replay:
                continue
            step, epoch, meta = self.replay[kind]
            if kind == "report":
                if epoch == c.epoch:  # a REPORT goes in the link's (the current) epoch
                    c.spawn(do.SendReport(link, step, meta))
            else:
                c.spawn(do.SendRoute(link, step, kind, epoch=epoch))

    # ------------------------------------------------------------------ REPORTs
    def on_report(self, msg: Message, link: str) -> None:
        """A REPORT from downstream (module docstring); one out of place is dropped."""
        c = self.c
        mode = msg.meta.get("mode", "train")
        if c.s.replicas and mode == "train":
            if (msg.step, msg.epoch) >= (c.step, c.epoch) and c.s.start_step <= msg.step < c.s.steps:
                self.down_reports[link] = (msg.step, msg.epoch, dict(msg.meta))
                c.wake()
            elif not c.s.start_step <= msg.step < c.s.steps:
                c.drop("out_of_window", msg, "REPORTs of the run's steps", "train REPORT")
            return
        key = (mode, msg.step)
        if key in self.reported:
            if not c.s.replicas:  # a chain's one REPORT per step (replicas: the others' copies)
                c.drop("out_of_window", msg, "one REPORT per step", f"a second {mode} REPORT of step {msg.step}")
            return
        if mode == "train":
            reached = c.s.start_step <= msg.step <= min(c.step, c.s.steps - 1)
        elif c.s.replicas:
            reached = due(c.s.val_interval_steps, msg.step, c.s.steps)
        else:
            reached = msg.step in self.eval_steps
        if not reached:
            c.drop("out_of_window", msg, "REPORTs of steps and validations this stage reached",
                   f"{mode} REPORT of step {msg.step} (this stage is at step {c.step})")
            return
        self.reported.add(key)
        if mode == "eval":
            c.validation.reported(msg.step)
        if not c.first:
            for name in c.flow.up_links():
                c.spawn(do.SendReport(name, msg.step, dict(msg.meta)))
            return
        if mode == "train":
            self.record_train(msg.step, dict(msg.meta))
        else:
            self.reports[key] = float(msg.meta["loss"])
            c.wake()

    def record_train(self, step: int, report: dict) -> None:
        """Stage 0: the loss of a step (a chain's REPORT, or a step every replica takes)."""
        loss, tokens = float(report["loss"]), int(report["tokens"])
        self.reports[("train", step)] = loss
        self.c.spawn(do.RecordTrain(step, loss, tokens))
        self.c.wake()

    def missing(self, keys: list[tuple[str, int]]) -> list[tuple[str, int]]:
        return [k for k in keys if k not in self.reports]
