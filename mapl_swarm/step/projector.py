"""The boundary projector on the wire (SPEC §9.7 items 1 and 4, §9.10 item 5): PROJ down, PROJ_GRAD up.

The sender stage owns its outbound projector: it sends it as the PROJ of each step before the
step's first ACT (at the start its current one, the receiver's checkpoint may hold the one before),
and after its optimizer step the new one. A receiver takes the first PROJ of the step it starts
(every replica of the sender sends the same) and drops the others of that step. At the step's end
a receiver sends each upstream link that carried ACTs of the step a PROJ_GRAD over them (its
partial gradient of that link's micro-batches; a chain: of all of them); the sender waits for one
from every link it sent ACTs on and adds them. A repair changes both sides (:mod:`~.repair`): the
part of micro-batches taken from a replica that left goes with a live link's PROJ_GRAD, and a
sender takes back the PROJ_GRAD of a link that left when what went on it went again.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from mapl_swarm.step import intents as do
from mapl_swarm.step.state import StepState
from mapl_swarm.wire import Message, MessageType

if TYPE_CHECKING:
    from mapl_swarm.step.context import Core

log = logging.getLogger(__name__)

__all__ = ["ProjectorExchange"]

MT = MessageType


class ProjectorExchange:
    """Stage ``core.stage``'s side of its projectors' exchange (module docstring)."""

    def __init__(self, core: Core) -> None:
        self.c = core

    # ------------------------------------------------------------------ PROJ
    def send(self, step: int) -> None:
        """The outbound projector as the PROJ of ``step`` on every downstream link (one this stage owns)."""
        if self.c.proj.owns:
            self.c.send(do.SendProjector(step, tuple(self.c.flow.down_links())))

    def sent(self, intent: do.SendProjector, pver: int) -> None:
        """The PROJ ``intent`` asked for went at ``pver``: what comes back on the link is made with it."""
        self.c.window.projector(self.c.links.down, pver)

    def ready(self, step: int) -> bool:
        """The inbound projector of ``step`` is loaded (or there is none)."""
        return not self.c.proj.takes or self.c.projector_step >= step

    def take(self, msg: Message, step: int, *, copy: bool = False) -> do.Intent | None:
        """A PROJ taken while the projector of ``step`` is awaited: loaded when it is that one (from any
        upstream replica: they all send the same); another is a copy (replicas) or dropped."""
        c = self.c
        if msg.step == step and msg.pver >= c.proj.inbound_pver and c.projector_step < step:
            c.projector_step = step
            return do.LoadProjector(msg, step)
        self.copy(msg, copy=copy)
        return None

    def copy(self, msg: Message, *, copy: bool = False) -> None:
        """A PROJ of a step whose projector this stage holds: another upstream replica's copy (dropped
        unread), or a chain neighbour's second one."""
        c = self.c
        if c.s.replicas or copy:
            log.debug("%s: PROJ of step %d not used (projector of step %d held)", c.s.name, msg.step, c.projector_step)
        elif msg.pver < c.proj.inbound_pver:
            c.drop("stale_projector", msg, "a PROJ moves the projector forward",
                   f"projector v{msg.pver}, this stage holds v{c.proj.inbound_pver}")
        else:
            c.drop("out_of_window", msg, "one PROJ per step, before its ACTs",
                   f"PROJ for step {msg.step} at step {c.step} (or a second one)")

    # ------------------------------------------------------------------ PROJ_GRAD up
    def send_grads(self, cur: StepState) -> None:
        """The inbound projector's gradient up, per upstream link over the ACTs it carried since its
        last PROJ_GRAD (after a reopen: the sum over every ACT of the link, once more); the part of
        micro-batches taken from a replica that left goes with the first live link's (their re-runs
        came on live links; the sender stage's round adds every part)."""
        c = self.c
        pver = c.proj.inbound_pver
        gone = sorted(cur.held_from)
        for name in c.flow.up_links():
            n = cur.received[name]
            sent_n, before = cur.proj_sent.get(name, (0, None))
            if n <= sent_n:
                continue
            if not c.s.replicas:  # a chain: the step's whole gradient, none kept apart by origin
                c.send(do.SendProjectorGrad(name, cur.step, n, pver, None))
                cur.proj_sent[name] = (n, None)
                continue
            parts = tuple(p for p in (before, *(cur.proj_sent.pop(g, (0, None))[1] for g in gone)) if p is not None)
            c.send(do.SendProjectorGrad(name, cur.step, n, pver, (name, *gone), parts))
            gone = []
            cur.held_from.clear()
            cur.proj_sent[name] = (n, None)  # the gradient itself comes with grad_sent
        if cur.held_from:
            c.redo.issue(cur.step, "no live upstream link carried ACTs of the step to take the inbound projector's "
                                   "gradient of the replica that left")

    def grad_sent(self, intent: do.SendProjectorGrad, grad: Any) -> None:
        """The PROJ_GRAD ``intent`` asked for went, with ``grad`` (kept: a later one of the link sums it)."""
        if intent.step == self.c.cur.step and intent.origins is not None:
            self.c.cur.proj_sent[intent.link] = (intent.micro_batches, grad)

    # ------------------------------------------------------------------ PROJ_GRAD in
    def take_grads(self, cur: StepState) -> do.Intent | None:
        """A PROJ_GRAD of the step from every downstream link this stage sent ACTs on, added (None once
        they all are); after a reopen, one over the link's ACTs since (it replaces the one added
        before). What went again after a replica left comes back within the repair's deadline, else
        the step is redone (the next stage's round counted it already: nothing comes)."""
        c = self.c
        for name in sorted(cur.untake & set(cur.proj_added)):
            c.send(do.AddProjectorGrad(None, cur.proj_added.pop(name)[1]))
        if c.queued():
            return None
        live = set(c.flow.down_links())
        due_from = {name for name, n in cur.sent.items()
                    if n and cur.proj_added.get(name, (0, None))[0] != n and name in live}
        if not due_from:
            return None
        now = c.clock()
        repairing = bool(cur.repair_by and due_from & cur.reopened)
        if repairing and now > cur.repair_by:
            c.redo.issue(cur.step, f"no PROJ_GRAD over the ACTs sent again after a replica left came within "
                                   f"{c.s.timeout_s / 2:g} s")
            return None
        intent = c.take_message(lambda m: (m.type is MT.PROJ_GRAD and m.step == cur.step)
                                or (m.type is MT.ROUTE and m.step <= cur.step) or c.flow.bye_from_up(m),
                                f"PROJ_GRAD of step {cur.step}", lambda m, link: self._on_grad(m, link, due_from))
        if repairing and isinstance(intent, do.Wait):
            return replace(intent, timeout_s=max(0.01, min(intent.timeout_s, cur.repair_by - now)), fatal=False)
        return intent

    def _on_grad(self, msg: Message, link: str, due_from: set[str]) -> do.Intent | None:
        c = self.c
        cur = c.cur
        if msg.type is MT.BYE:
            return c.on_bye(msg, link, during_step=True)
        if msg.type is MT.ROUTE:
            c.flow.on_route(msg, link, cur)
            return None
        count = msg.meta.get("micro_batches")
        if link in cur.reopened and count is not None and count < cur.sent[link]:
            log.debug("%s: a PROJ_GRAD over %d ACTs from %s superseded (the link reopened)", c.s.name, count, link)
        elif link not in due_from or count != cur.sent[link]:
            c.drop("out_of_window", msg, "one PROJ_GRAD per link that carried ACTs, over them",
                   f"from {link} over {count} micro-batch(es)")
        elif msg.pver != c.proj.outbound_pver:
            c.drop("stale_projector", msg, "PROJ_GRAD of the projector this stage holds",
                   f"computed at projector v{msg.pver}, this stage holds v{c.proj.outbound_pver}")
        else:
            before = cur.proj_added.get(link, (0, None))[1]
            cur.proj_added[link] = (count, msg)
            return do.AddProjectorGrad(msg, before)
        return None
