"""A peer session's lifecycle (SPEC §9.9): its states, the moves between them, and what the parts
that handle its messages may read of it and ask of it.

=============  ==============================================================  =====================
state          what the peer does                                              next
=============  ==============================================================  =====================
starting       announces itself, finds and connects its neighbours             handshaking
handshaking    HELLO until every neighbour welcomed it; answers theirs         agreeing
agreeing       agrees the start step (resume, rollback) and loads it;          training
               pipeline messages are held
training       runs the schedule, the held messages first                      draining, ended
draining       finishes the current step and saves it                          ended
ended          the schedule ran to its end; neighbours leave as they finish    (the session ends)
stopped        the session ends early: a pause for a re-form, a departure,     (the session ends)
               a refusal, an error, a signal
=============  ==============================================================  =====================

Any state but ``ended`` may become ``stopped``. :class:`~.runtime.Peer` runs the machine.
"""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from mapl_swarm.peer.link import PeerLink

__all__ = ["PeerState", "Lifecycle"]


class PeerState(enum.Enum):
    """A session's state (the table of the module docstring)."""

    STARTING = "starting"
    HANDSHAKING = "handshaking"
    AGREEING = "agreeing"
    TRAINING = "training"
    DRAINING = "draining"
    ENDED = "ended"
    STOPPED = "stopped"

    @property
    def started(self) -> bool:
        """Training started (pipeline messages are no longer held, the run epoch is the swarm's)."""
        return self in (PeerState.TRAINING, PeerState.DRAINING, PeerState.ENDED)

    def may_become(self, state: PeerState) -> bool:
        """A move of the table (``stopped`` from any state but ``ended``)."""
        return state in _NEXT[self] or (state is PeerState.STOPPED and self is not PeerState.ENDED)


_NEXT: dict[PeerState, frozenset[PeerState]] = {
    PeerState.STARTING: frozenset({PeerState.HANDSHAKING}),
    PeerState.HANDSHAKING: frozenset({PeerState.AGREEING}),
    PeerState.AGREEING: frozenset({PeerState.TRAINING}),
    PeerState.TRAINING: frozenset({PeerState.DRAINING, PeerState.ENDED}),
    PeerState.DRAINING: frozenset({PeerState.ENDED}),
    PeerState.ENDED: frozenset(),
    PeerState.STOPPED: frozenset(),
}


class Lifecycle(Protocol):
    """What the handlers of a session's control messages (:class:`~.control.Control`) read of it and
    ask of it (:class:`~.runtime.Peer` is one); the rest they are given as parts."""

    name: str
    stage: int
    epoch: int  # the session's run epoch
    started: bool  # training started
    handshaking: bool  # the handshake runs
    joining: bool  # a replica that joins the running swarm
    resuming: bool  # the peer resumes from its checkpoints

    def stop(self, reason: BaseException) -> None: ...

    def pause(self, why: str, *, epoch: int, lost: int | None, told_by: int | None = None) -> None: ...

    def depart(self, link: PeerLink, kind: str, detail: str, *, after: int | None = None) -> None: ...

    def exclude(self, link: PeerLink, why: str) -> None: ...
