"""Validation on the wire (SPEC §9.7 "Evaluation", §9.10 item 8): eval ACTs forward only, one eval REPORT.

After N steps (when due) stage 0 sends the validation's E eval ACTs of step N; every later stage
forwards each on its first downstream link (in contact order), so one last-stage peer takes all of
them and sends the eval REPORT (the mean loss) upstream, relayed to stage 0. With replicas the
stage-0 replica of rank 0 sends them; a replica that leaves before the eval REPORT came takes what
went through it along, so the one of rank 0 (among those left) then sends them all again, and the
last stage counts each eval micro-batch once.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from mapl_swarm.errors import MaplError
from mapl_swarm.step import intents as do
from mapl_swarm.wire import Message, MessageType

if TYPE_CHECKING:
    from mapl_swarm.step.context import Core

log = logging.getLogger(__name__)

__all__ = ["Validation"]

MT = MessageType


def _nothing(msg: Message) -> bool:
    return False


class Validation:
    """Stage ``core.stage``'s part in each validation (module docstring)."""

    def __init__(self, core: Core) -> None:
        self.c = core
        self.step = -1
        """Stage 0: the validation in progress (after this many steps)."""
        self.done = False
        self._seen: frozenset[str] | None = None
        self._deadline = 0.0
        self._losses: dict[int, dict[int, Any]] = {}
        """The last stage: per validation, each eval micro-batch's loss (the driver's)."""
        self._forwarded: dict[int, dict[int, tuple[Any, str]]] = {}
        """With replicas: per validation, each eval ACT this replica forwarded and the link it went on."""
        self._taken: dict[int, set[int]] = {}
        """A chain: per validation, the eval micro-batches taken (a second copy is dropped)."""

    # ------------------------------------------------------------------ stage 0
    def start(self, step: int) -> None:
        self.step, self.done, self._seen, self._deadline = step, False, None, 0.0

    def next(self) -> do.Intent | None:
        """Stage 0: the eval ACTs (again, when a replica left), or a wait for the eval REPORT;
        :attr:`done` once it came (recorded)."""
        c = self.c
        step, key = self.step, ("eval", self.step)
        if key in c.commit.reports:
            self.done = True
            c.spawn(do.RecordVal(step, c.commit.reports[key]))
            return None
        now = c.clock()
        if self._seen != frozenset(c.members.gone):  # the start, or a replica left: (again), a new wait
            again, self._seen = self._seen is not None, frozenset(c.members.gone)
            self._deadline = now + c.s.timeout_s
            down = c.flow.down_links()
            if c.members.rank == 0 and down:
                if again:
                    log.warning("%s: a replica left during the validation after step %d: its eval ACTs go again",
                                c.s.name, step)
                c.commit.eval_steps.add(step)
                for i in range(c.s.val_batches):
                    c.send(do.EvalFeed(step, i, down[0]))
                return None
        left = self._deadline - now
        if left <= 0:
            raise MaplError(f"{c.s.name}: no eval REPORT of step {step} from the last stage within {c.s.timeout_s:g} s")
        return do.Wait(_nothing, f"eval REPORT of step {step} from the last stage", left, c.flow.down_links())

    # ------------------------------------------------------------------ every later stage
    def last_words(self, msg: Message, link: str) -> do.Intent | None:
        """What comes after the last step, until every upstream link said BYE: the last validation's
        eval ACTs (and the PROJ of the steps done, before them), ROUTEs of the last step."""
        c = self.c
        if msg.type is MT.BYE:
            return c.on_bye(msg, link, during_step=False)
        if msg.type is MT.ROUTE:
            c.flow.on_route(msg, link, c.cur)
            return None
        if msg.type is MT.PROJ:
            return c.projector.take(msg, msg.step, copy=True)
        return self.eval_act(msg, link)

    def link_gone(self, name: str) -> None:
        """Downstream link ``name`` left: the eval ACTs this replica forwarded on it, of a validation
        whose REPORT has not passed here, go again on its first live downstream link."""
        c = self.c
        down = c.flow.down_links()
        for step, sent in self._forwarded.items():
            for micro, (payload, link) in sent.items():
                if link == name and down:
                    log.warning("%s: eval micro-batch %d of the validation after step %d went through the replica "
                                "that left: forwarded again", c.s.name, micro, step)
                    sent[micro] = (payload, down[0])
                    c.spawn(do.SendAct(down[0], step, micro, payload, True, c.proj.outbound_pver))

    def reported(self, step: int) -> None:
        """The eval REPORT of the validation after ``step`` passed here: nothing of it is kept."""
        self._forwarded.pop(step, None)

    def eval_act(self, msg: Message, link: str) -> do.Intent | None:
        """An eval ACT (its projector loaded): forward it."""
        c = self.c
        if not 0 <= msg.micro < c.s.val_batches or msg.pver != c.proj.inbound_pver:
            c.drop("out_of_window", msg, "eval ACTs of a validation, at the projector this stage holds",
                   f"eval micro-batch {msg.micro} of {c.s.val_batches} at v{msg.pver}")
            return None
        if not c.s.replicas:
            taken = self._taken.setdefault(msg.step, set())
            if msg.micro in taken:
                c.drop("out_of_window", msg, "one ACT per micro-batch of the validation",
                       f"eval micro-batch {msg.micro} taken already")
                return None
            taken.add(msg.micro)
            c.commit.eval_steps.add(msg.step)
        return do.EvalForward(msg, link)

    def forwarded(self, intent: do.EvalForward, payload: Any, loss: Any) -> None:
        """The eval forward ``intent`` asked for gave ``payload`` (on on the first downstream link) or
        ``loss`` (the last stage: once every eval micro-batch is in, the mean goes upstream as its
        REPORT)."""
        c, msg = self.c, intent.msg
        if payload is not None:
            down = c.flow.down_links()
            if down and ("eval", msg.step) not in c.commit.reported:
                log.debug("%s: eval micro-batch %d of the validation after step %d forwarded", c.s.name, msg.micro,
                          msg.step)
                c.send(do.SendAct(down[0], msg.step, msg.micro, payload, True, c.proj.outbound_pver))
                if c.s.replicas:  # kept until its REPORT passes here: a replica that leaves takes it along
                    self._forwarded.setdefault(msg.step, {})[msg.micro] = (payload, down[0])
            return
        if ("eval", msg.step) in c.commit.reported:
            return  # a copy sent again after a replica left, of a validation reported already
        losses = self._losses.setdefault(msg.step, {})
        losses[msg.micro] = loss  # once per eval micro-batch: one sent again replaces its copy
        if len(losses) == c.s.val_batches:
            del self._losses[msg.step]
            self._taken.pop(msg.step, None)
            c.commit.reported.add(("eval", msg.step))
            c.send(do.MeanLoss(msg.step, tuple(losses[i] for i in range(c.s.val_batches)),
                               tuple(c.flow.up_links())))
