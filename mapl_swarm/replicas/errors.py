"""What an averaging round among a stage's replicas raises (importable without hivemind)."""

from __future__ import annotations

from mapl_swarm.errors import MaplError

__all__ = ["AveragingFailed", "Behind", "RoundCancelled"]


class AveragingFailed(MaplError):
    """The replicas of a stage formed no group in time, or a round failed or did not count.

    ``unsure``: the round failed at this replica after its group began the all-reduce, so another
    member may have received every averaged part and kept the round: this replica cannot tell
    whether the round counted for its partners (the caller redoes the step rather than running
    the round again alone)."""

    def __init__(self, message: str, *, unsure: bool = False) -> None:
        super().__init__(message)
        self.unsure = unsure


class RoundCancelled(AveragingFailed):
    """The round was cancelled (:meth:`~.gradients.ReplicaGradients.cancel`) before it gave a result."""


class Behind(AveragingFailed):
    """A round with replicas at a later step than this one's: this replica (a joining one whose
    state is a step old) downloads its stage's state again."""
