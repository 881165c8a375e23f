"""What an averaging round among a stage's replicas raises (importable without hivemind)."""

from __future__ import annotations

from mapl_swarm.errors import MaplError

__all__ = ["AveragingFailed", "RoundCancelled"]


class AveragingFailed(MaplError):
    """The replicas of a stage formed no group in time, or a round that was not whole."""


class RoundCancelled(AveragingFailed):
    """The round was cancelled (:meth:`~.gradients.ReplicaGradients.cancel`) before it gave a result."""
