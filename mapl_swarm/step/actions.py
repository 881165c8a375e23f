"""The pipeline schedule as per-stage lists of actions, written once for every driver.

A training step of M micro-batches is, for each stage, an ordered list of :class:`Action`:
forward micro-batch m (``F m``: receive its ACT unless stage 0, compute, send the ACT unless the
last stage) and backward micro-batch m (``B m``: receive its GRAD unless the last stage, compute,
send the GRAD unless stage 0); the step's flush follows the list. The in-process driver
(:class:`~mapl_swarm.pipeline.inprocess.InProcessPipeline`) runs every stage's list in one
process, the peers of a chain each run their own (:class:`~mapl_swarm.step.flow.Flow`), so
``train`` and ``launch`` compute in the same order. (PyTorch's ``torch.distributed.pipelining``
and torchtitan describe their schedules the same way.)

Orders:

- ``1f1b`` (the default; SPEC §9.7): stage p first runs ``w_p = clamp(in_flight - p, 1, M)``
  forwards (warm-up), then alternates one backward and one forward until its forwards are done,
  then the remaining backwards. ``in_flight`` (``net.max_in_flight``, default P) is how many
  micro-batches stage 0 keeps in flight; the last stage runs each backward right after its
  forward.
- ``gpipe``: every forward, then every backward.

Every stage runs its forwards and its backwards in micro-batch order 0..M-1 under both orders, so
gradients accumulate in the same order and the two orders give bit-identical steps; they differ
only in how many activations a stage holds and how long the pipeline stays full. Any interleaving
of the stages' lists that respects the messages between them is deadlock-free: stage p + 1's
warm-up is at most stage p's, so a GRAD stage p waits for never needs a forward that
waits on stage p (a warm-up is never longer than the one upstream of it).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

__all__ = ["Op", "Action", "ORDERS", "stage_actions", "warmup"]


class Op(enum.Enum):
    FORWARD = "F"
    BACKWARD = "B"


@dataclass(frozen=True)
class Action:
    """One step of a stage's list: ``op`` of micro-batch ``micro``."""

    op: Op
    micro: int

    def __str__(self) -> str:
        return f"{self.op.value}{self.micro}"


ORDERS = ("1f1b", "gpipe")


def warmup(stage: int, num_micro_batches: int, in_flight: int) -> int:
    """1F1B: the forwards stage ``stage`` runs before its first backward."""
    return max(1, min(num_micro_batches, in_flight - stage))


def stage_actions(stage: int, num_stages: int, num_micro_batches: int, *, order: str = "1f1b",
                  in_flight: int | None = None) -> list[Action]:
    """Stage ``stage``'s actions of one training step (see the module docstring)."""
    if order not in ORDERS:
        raise ValueError(f"unknown pipeline order {order!r}; one of {', '.join(ORDERS)}")
    if not 0 <= stage < num_stages or num_micro_batches < 1:
        raise ValueError(f"stage {stage} of {num_stages} with {num_micro_batches} micro-batches")
    M = num_micro_batches
    forwards = [Action(Op.FORWARD, m) for m in range(M)]
    backwards = [Action(Op.BACKWARD, m) for m in range(M)]
    if order == "gpipe":
        return forwards + backwards
    w = 1 if stage == num_stages - 1 else warmup(stage, M, in_flight or num_stages)
    out = forwards[:w]
    for m in range(M):
        out.append(backwards[m])
        if w + m < M:
            out.append(forwards[w + m])
    return out
