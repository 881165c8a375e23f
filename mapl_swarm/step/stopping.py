"""Stopping a swarm with replicas on purpose (SPEC §9.10 item 14): one replica leaves, or every stage drains.

A replica asked to stop (a signal) says so in its stage's next averaging round (``leave``): every
member reads it, takes the round's step, and then

- when the stage keeps a replica that stays, the leaver goes a round later: it says ``going`` in
  the next round, takes that step too and, unless that round drains (its partners were signalled
  at about the same moment: a Ctrl-C to a whole launch), says BYE ``"leave"`` (with the steps it
  took) on every link and ends; its partners count it out from the next step (stage 0 splits that
  step among the others), its neighbours drop its links without repairing anything (it took no
  work of a later step: it said ``ready`` for none);
- when every member leaves, or one asked for a drain, nobody would be left: the swarm drains.
  Stage 0's replicas stop after the round's step (they all read the same round) and say BYE
  ``"drain"``; a later stage asks upstream first (CHECKPOINT ``drain_request``, relayed to stage 0,
  whose replicas gather ``drain`` in their next round). Every replica then takes the steps up to
  the drain step, saves it and ends: a ``--resume`` of every replica goes on from there.

A chain drains through the checkpoint agreement (SPEC §5.2) instead: its stage 0 is one peer.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from mapl_swarm.step import intents as do
from mapl_swarm.step.rounds import ReplicaStep

if TYPE_CHECKING:
    from mapl_swarm.step.context import Core

log = logging.getLogger(__name__)

__all__ = ["Stopping"]


class Stopping:
    """Stage ``core.stage``'s side of a replica's leave and of a drain with replicas (module docstring).
    ``may_drain``: this replica may ask the swarm to drain (a certified stage > 0 needs the ``drain``
    role; without it, it only leaves)."""

    def __init__(self, core: Core, *, may_drain: bool = True) -> None:
        self.c = core
        self.may_drain = may_drain
        self.leaving = False
        """Asked to stop: said (``leave``) in the stage's next round."""
        self.going = False
        """A round with this replica's ``leave`` kept a replica: it leaves after the next round's
        step (says ``going``), unless that round drains."""
        self.drain = False
        """The swarm drains (asked here, or by a stage downstream): said in the stage's next round."""
        self.reason = ""
        self._asked_upstream = False

    def stop(self, reason: str) -> None:
        """A signal at this replica: it leaves (or, alone in its stage, drains the swarm) after the
        step of its stage's next round."""
        self.leaving, self.reason = True, reason
        log.info("%s: %s: leaving at a step boundary (its other replicas go on; if none stays, the swarm "
                 "drains)", self.c.s.name, reason)

    def drain_requested(self, reason: str) -> None:
        """CHECKPOINT ``drain_request`` from downstream (its sender's role checked): passed on upstream,
        said in this stage's next round (stage 0 stops after it)."""
        self.drain = True
        self.reason = self.reason or reason
        self._ask_upstream()

    def after(self, round_: ReplicaStep | None) -> bool:
        """The round of the step just taken said who stops; True when this replica leaves now."""
        c = self.c
        if round_ is None:
            return False
        if round_.stops and (self.may_drain or not self.leaving):
            if c.first:
                if not c.drained:
                    log.info("%s: the swarm drains at step %d (%s)", c.s.name, c.step, self.reason or "asked")
                c.drained = True
            else:
                self.drain = True
                self._ask_upstream()
            return False
        gone = [round_.contacts[p] for p in round_.going if p != round_.me and p in round_.contacts]
        if gone:
            log.info("%s: %d replica(s) of stage %d leave after step %d: the stage goes on without them",
                     c.s.name, len(gone), c.stage, c.step - 1)
            c.repair.learn_gone(gone)
        if round_.me in round_.leaving:
            self.going = True
        return round_.me in round_.going

    def _ask_upstream(self) -> None:
        c = self.c
        if c.first or self._asked_upstream:
            return
        self._asked_upstream = True
        log.info("%s: asking stage 0 to drain the swarm (%s)", c.s.name, self.reason or "asked")
        c.spawn(do.AskDrain(tuple(c.flow.up_links()), self.reason or "asked downstream"))
