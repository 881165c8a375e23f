"""The attempts of a step (SPEC §9.10 item 10): redoing it in a later run epoch, or serving it again.

A **redo** runs the current step again everywhere, one run epoch later: a replica whose round
cannot be whole, or a stage-1 replica serving a step whose stage-0 replica left, issues it; a
replica told one (ROUTE ``redo`` of its step in a later epoch) passes it on and carries it out: it
tells its neighbours first (nothing of the new epoch reaches them before the redo), forgets the
step's work and serves it again. A replica redoes one step ``max_redos`` times at most.

**Serving again** is a repair, not a redo: a replica that flushed the step but whose round is not
whole goes back to serving it when more ACTs come (a ``reopen`` from upstream) or when a
neighbour's departure gives it work (re-sends, re-runs); its round, if in progress, gives up.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from mapl_swarm.errors import MaplError
from mapl_swarm.step import intents as do
from mapl_swarm.step.phase import Phase
from mapl_swarm.wire import Message

if TYPE_CHECKING:
    from mapl_swarm.step.context import Core

log = logging.getLogger(__name__)

__all__ = ["Redo"]


class Redo:
    """Stage ``core.stage``'s redos and serve-agains (module docstring)."""

    def __init__(self, core: Core) -> None:
        self.c = core
        self.pending: tuple[int, int] | None = None
        """(step, run epoch) of a redo this peer was told of and has not carried out yet."""
        self.proof: tuple[bytes, bytes] | None = None
        """The pending redo's maker's proof when another peer decided it (passed on unchanged);
        None: this peer decided it (its own signature goes)."""
        self.count = 0
        """Redos of the current step so far."""
        self.resume = False
        """A reopen (or a departure's work) came while this replica flushed the step before its round
        was whole: it serves the step again."""

    def issue(self, step: int, problem: str) -> None:
        """This stage's round of ``step`` cannot be whole: the step is redone everywhere."""
        c = self.c
        if not c.s.replicas:
            raise MaplError(f"{c.s.name}: step {step} cannot be taken: {problem}")
        if self.count >= c.s.max_redos:
            raise MaplError(f"{c.s.name}: step {step} cannot be taken after {self.count} redos: {problem}")
        log.warning("%s: step %d is redone (run epoch %d): %s", c.s.name, step, c.epoch + 1, problem)
        self.pending, self.proof = (step, c.epoch + 1), None

    def soon(self, step: int, problem: str) -> None:
        """:meth:`issue` from a control message: nothing when a redo of the step (or a later one) is on
        its way here already."""
        if self.pending is not None and self.pending[0] >= step:
            return
        log.warning("%s: step %d is redone (run epoch %d): %s", self.c.s.name, step, self.c.epoch + 1, problem)
        self.take(step, self.c.epoch + 1)

    def take(self, step: int, epoch: int, proof: tuple[bytes, bytes] | None = None) -> None:
        """Note a redo of ``step`` in run ``epoch`` (``proof``: its maker's, another peer's); a round
        of the current step in progress gives up."""
        self.pending, self.proof = (step, epoch), proof
        if step == self.c.step:
            self.c.rounds.cancel()
        self.c.wake()

    def news(self, msg: Message) -> bool:
        """ROUTE ``redo`` ``msg`` is one this replica would carry out: of a later run epoch than its
        own and any pending, for its step or a later one."""
        c = self.c
        pending = self.pending[1] if self.pending is not None else -1
        return msg.epoch > max(c.epoch, pending) and msg.step >= c.step

    def on_route(self, msg: Message, link: str) -> None:
        """ROUTE ``redo`` of a later run epoch than this replica's: passed on first (nothing of the new
        epoch before it), then carried out."""
        c = self.c
        if self.news(msg):
            cert, sig = msg.meta.get("cert"), msg.meta.get("sig")
            proof = (cert, sig) if isinstance(cert, bytes) and isinstance(sig, bytes) else None
            for other in c.links:
                if other.name != link and c.flow.live(other.name):
                    c.spawn(do.SendRoute(other.name, msg.step, "redo", gone=tuple(sorted(c.members.gone)),
                                         epoch=msg.epoch, proof=proof))
            self.take(msg.step, msg.epoch, proof)

    def restart(self) -> None:
        """Carry out the pending redo of the current step: a new run epoch, the neighbours told, the
        step's work forgotten, served again."""
        c = self.c
        assert self.pending is not None
        step, epoch = self.pending
        proof, self.pending, self.proof, self.resume = self.proof, None, None, False
        self.count += 1
        c.restarted(step, epoch)  # at once: what the control messages answer meanwhile answers for it
        c.send(do.Redo(step, epoch))
        for link in c.links:
            if c.flow.live(link.name):
                c.send(do.SendRoute(link.name, step, "redo", gone=tuple(sorted(c.members.gone)), proof=proof))
        c.send(do.Abandon())

    # ------------------------------------------------------------------ serving again
    def serve_again(self) -> None:
        """A flush before its round is whole goes back to serving the step."""
        c = self.c
        if c.phase is Phase.SERVE:
            return
        self.resume = True
        c.rounds.cancel()
        c.wake()

    def resume_if_flushing(self) -> None:
        """A ``reopen`` taken while this replica flushed the step before its round: it serves it again."""
        if self.c.phase in (Phase.FLUSH, Phase.AVERAGE, Phase.REPAIR):
            self.resume = True
