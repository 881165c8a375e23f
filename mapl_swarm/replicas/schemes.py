"""What the replicas of a stage send to average their gradients: ``replicas.averaging`` (SPEC §9.10 item 16).

The averaged tensors of a stage replica are, in order, the gradients of its optimized parameters
(:meth:`~mapl_swarm.pipeline.stage.StageRuntime.optimized_parameters`), the codec's step statistics,
and, with ``powersgd``, one warm-start factor Q per compressed matrix.

- ``fp32``: every part of hivemind's all-reduce crosses as it is (4 bytes a value).
- ``fp16``: every part crosses as hivemind's ``Float16Compression`` (2 bytes a value), and so does
  each reducer's average on its way back; the reducer keeps, for its own part, the average as its partners decode it, so every member
  holds the same bytes (:class:`~.exact_allreduce.ExactAllReduceRunner`).
- ``powersgd`` (Vogels et al., NeurIPS 2019; hivemind's ``PowerSGDGradientAverager``, one power
  iteration with a warm start): a gradient matrix M (d x n; :func:`matrix_view`) crosses as two
  all-reduces of rank-r factors, P = M Q (d x r), orthonormalized once averaged, and then
  Q = Mᵀ P̂ (n x r), which also carries every tensor averaged exactly; each member ends with
  P̂ Q̂ᵀ, the projection of the replicas' mean M onto span(P̂). The matrices compressed are the
  parameter gradients of 2 dimensions or more whose factors are at most half their values
  (:func:`low_rank_plan`), except the MAPL projectors' (small, and the manifold step wants them
  exact); vectors (norms, biases) and the codec's statistics are averaged exactly.
  **Error feedback:** each replica adds to its gradient what compression left out of its previous
  ones (M = e + g; e ← M − P̂ Q̂ᵀ when the round counts and the replica computed micro-batches): a
  buffer of the replica's own, in its checkpoints, zero for a joining replica. The host fills M into
  the averaged tensors, so a round that fails changes no buffer and is simply tried again.
  **Same bytes everywhere:** the averaged factors are the same bytes at every member (exact
  all-reduces); the orthonormalization and the product are computed in float64 and rounded to
  float32, so that hosts whose float32 kernels sum in another order still end with the same bytes
  (a float64 result within 2^-29 of a float32 rounding boundary is the exception the stage's
  digest check then catches).

:func:`emulate` runs the same arithmetic for R replicas in one process (the quality benchmark).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from hivemind.compression import CompressionBase, Float16Compression, NoCompression
from hivemind.utils.math import get_flatten_greedy_dims

__all__ = ["SCHEMES", "part_compression", "LowRank", "low_rank_plan", "matrix_view", "initial_factors",
           "orthonormal", "product", "emulate", "MIN_SAVING"]

SCHEMES = ("fp32", "fp16", "powersgd")
MIN_SAVING = 0.5
"""A matrix is compressed only when its factors are at most this fraction of its values (hivemind's
``min_compression_ratio``)."""


def part_compression(scheme: str) -> CompressionBase:
    """The hivemind compression every all-reduce part of ``scheme`` crosses in."""
    if scheme == "fp16":
        return Float16Compression()
    if scheme in ("fp32", "powersgd"):
        return NoCompression()
    raise ValueError(f"unknown averaging scheme {scheme!r}; one of {SCHEMES}")


def matrix_view(shape: Sequence[int]) -> tuple[int, int]:
    """The (rows, columns) a tensor of ``shape`` is compressed as (hivemind's
    ``get_flatten_greedy_dims``: the adjacent pair of dimensions of smallest product is merged until
    two remain)."""
    rows, cols = get_flatten_greedy_dims(torch.empty(tuple(shape), device="meta"))
    return int(rows), int(cols)


@dataclass(frozen=True)
class LowRank:
    """Which averaged tensors PowerSGD compresses: ``matrices`` (indices among the averaged
    tensors), each seen as ``views[i]`` (rows, columns), at ``rank``; the rest are exact."""

    rank: int
    matrices: tuple[int, ...]
    views: tuple[tuple[int, int], ...]

    @property
    def factor_shapes(self) -> list[tuple[int, int]]:
        """The shapes of the warm-start factors Q, one per compressed matrix (columns x rank)."""
        return [(cols, self.rank) for _, cols in self.views]

    def exact(self, count: int) -> list[int]:
        """The indices, among ``count`` averaged tensors, averaged exactly."""
        chosen = set(self.matrices)
        return [i for i in range(count) if i not in chosen]

    def values(self, count_of: Sequence[int]) -> tuple[int, int]:
        """(values sent by PowerSGD's two all-reduces, values fp32 would send) for tensors of
        ``count_of`` values each."""
        compressed = sum(self.rank * (rows + cols) for rows, cols in self.views)
        exact = sum(count_of[i] for i in self.exact(len(count_of)))
        return compressed + exact, sum(count_of)


def low_rank_plan(shapes: Sequence[Sequence[int]], rank: int, exact: Sequence[int] = ()) -> LowRank:
    """The :class:`LowRank` of averaged tensors of ``shapes`` at ``rank``: every tensor of 2
    dimensions or more, not in ``exact``, whose factors save at least :data:`MIN_SAVING` of it."""
    if rank < 1:
        raise ValueError(f"a PowerSGD rank must be >= 1, got {rank}")
    matrices, views = [], []
    for i, shape in enumerate(shapes):
        if len(shape) < 2 or i in exact:
            continue
        rows, cols = matrix_view(shape)
        if rank * (rows + cols) <= MIN_SAVING * math.prod(shape):
            matrices.append(i)
            views.append((rows, cols))
    return LowRank(rank, tuple(matrices), tuple(views))


def initial_factors(plan: LowRank, seed: int) -> list[torch.Tensor]:
    """The first warm-start factors Q, the same at every replica of a run (drawn from ``seed``)."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=gen, dtype=torch.float32) for shape in plan.factor_shapes]


def orthonormal(p: torch.Tensor) -> torch.Tensor:
    """The averaged factor P with orthonormal columns (Gram-Schmidt, as hivemind's
    ``orthogonalize_``, in float64), rounded to float32: the same bytes from the same P on any host."""
    m = p.to(torch.float64).clone()
    for i in range(m.shape[1]):
        col = m[:, i:i + 1]
        col /= torch.sqrt(torch.sum(col ** 2)) + 1e-8
        if i + 1 < m.shape[1]:
            rest = m[:, i + 1:]
            rest -= torch.sum(col * rest, dim=0) * col
    return m.to(torch.float32)


def product(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """P̂ Q̂ᵀ in float64, rounded to float32 (module docstring: the same bytes on any host)."""
    return (p.to(torch.float64) @ q.to(torch.float64).t()).to(torch.float32)


def emulate(ms: Sequence[Sequence[torch.Tensor]], weights: Sequence[float], plan: LowRank,
            qs: list[torch.Tensor]) -> list[torch.Tensor]:
    """What a PowerSGD round of replicas holding ``ms`` (per replica: its averaged tensors before the
    round, M with error feedback in the compressed ones) with ``weights`` ends with, every
    all-reduce a weighted mean in one process: the averaged tensors (compressed ones as P̂ Q̂ᵀ);
    ``qs`` (the warm-start factors) are updated in place."""
    total = float(sum(weights))

    def mean(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
        return sum(t * (w / total) for t, w in zip(tensors, weights, strict=True))

    out = [mean([m[i] for m in ms]) for i in range(len(ms[0]))]
    for j, (i, (rows, cols)) in enumerate(zip(plan.matrices, plan.views)):
        p = orthonormal(mean([m[i].reshape(rows, cols) @ qs[j] for m in ms]))
        q = mean([m[i].reshape(rows, cols).t() @ p for m in ms])
        qs[j].copy_(q)
        out[i] = product(p, q).reshape(out[i].shape)
    return out
