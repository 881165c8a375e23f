"""Which global micro-batches each stage-0 replica feeds into the pipeline.

A step processes the run's global batch: ``num_micro_batches`` micro-batches whose global indices
are ``step * num_micro_batches + m``. The stage-0 replicas that start the step split them into
contiguous, disjoint shares, in the order of their ranks (the replicas' peer ids sorted), the first
``num_micro_batches % replicas`` replicas taking one more. Each replica reads a micro-batch by its
global index (:meth:`~mapl_swarm.data.batches.BatchSampler.batch_at`), so no sample is used twice
per pass whatever the replica count, and a run that resumes, re-forms or changes its replica count
at a step boundary continues the same stream: the data cursor is the step.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["replica_rank", "replica_share"]


def replica_rank(me: bytes, replicas: Sequence[bytes]) -> int:
    """``me``'s rank among ``replicas`` (peer ids; ``me`` among them): its place in sorted order."""
    ordered = sorted(set(replicas))
    if me not in ordered:
        raise ValueError("this replica is not among the stage's replicas")
    return ordered.index(me)


def replica_share(step: int, num_micro_batches: int, rank: int, replicas: int) -> range:
    """The global micro-batch indices replica ``rank`` of ``replicas`` feeds in ``step``."""
    if not (step >= 0 and num_micro_batches > 0 and 0 <= rank < replicas):
        raise ValueError(f"step {step}, {num_micro_batches} micro-batches, rank {rank} of {replicas}")
    base, extra = divmod(num_micro_batches, replicas)
    start = rank * base + min(rank, extra)
    first = step * num_micro_batches + start
    return range(first, first + base + (1 if rank < extra else 0))
