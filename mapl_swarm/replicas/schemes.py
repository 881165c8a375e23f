"""What the replicas of a stage send to average their gradients: ``replicas.averaging`` (SPEC §9.10 item 16).

The averaged tensors of a stage replica are, in order, the gradients of its optimized parameters
(:meth:`~mapl_swarm.pipeline.stage.StageRuntime.optimized_parameters`), the codec's step statistics,
and, with ``powersgd``, one warm-start factor Q per compressed matrix.

- ``fp32``: every part of hivemind's all-reduce crosses as it is (4 bytes a value).
- ``fp16``: the weight matrices' gradients (:func:`compressible`) cross in one all-reduce whose
  every part is hivemind's ``Float16Compression`` (2 bytes a value), and so does each reducer's
  average on its way back; the reducer keeps, for its own part, the average as its partners decode
  it, so every member holds the same bytes (:class:`~.exact_allreduce.ExactAllReduceRunner`); the
  exact tensors cross in a second one, as they are.
- ``powersgd`` (Vogels et al., NeurIPS 2019; hivemind's ``PowerSGDGradientAverager``, one power
  iteration with a warm start): a gradient matrix M (d x n; :func:`matrix_view`) crosses as two
  all-reduces of rank-r factors, P = M Q (d x r), orthonormalized once averaged, and then
  Q = Mᵀ P̂ (n x r), which also carries every tensor averaged exactly; each member ends with
  P̂ Q̂ᵀ, the projection of the replicas' mean M onto span(P̂). The matrices compressed are the
  parameter gradients of 2 dimensions or more whose factors are at most half their values
  (:func:`low_rank_plan`), except the MAPL projectors' (small, and the manifold step wants them
  exact); vectors (norms, biases) and the codec's statistics are averaged exactly.
  **Error feedback:** each replica adds to its gradient what compression left out of its previous
  ones. The buffer e holds the replica's part of the stage's average that was left out, so a
  replica of n of the step's M micro-batches sends M = g + e·M/n and, when the round counts, keeps
  e ← (n/M)(M − P̂ Q̂ᵀ); a replica of no micro-batch sends zeros with weight 0 and keeps its e for
  a later step. The stage's whole feedback, the sum of its replicas' e, so enters every average
  whatever the routing gave each replica (PowerSGD's round then sees only the stage's sums). The
  buffer is the replica's own, in its checkpoints, zero for a joining replica. The host fills M into
  the averaged tensors, so a round that fails changes no buffer and is simply tried again.
  **Same bytes everywhere:** the averaged factors are the same bytes at every member (exact
  all-reduces); the orthonormalization and the product are computed in float64 and rounded to
  float32, so that hosts whose float32 kernels sum in another order still end with the same bytes
  (a float64 result within 2^-29 of a float32 rounding boundary is the exception the stage's
  digest check then catches).
- ``topk`` (sparse, with error feedback, as SparseLoCo and DGC): of each weight matrix's gradient
  (:func:`compressible`) a replica sends the ``k = ⌈f n⌉``
  values of largest magnitude of its M (indices as int32, ascending; values as float16) and its
  weight; every member fetches every other member's share (an all-gather, the averager's
  ``sparse_share`` call) and sums them, weighted, in the group's order, so every member holds the
  same bytes; the exact tensors go through one all-reduce. Error feedback as PowerSGD's, with the
  replica's own share (decoded) in place of P̂ Q̂ᵀ: its own share is what it contributed.

With ``replicas.averaged = "updates"`` the M of a compressed matrix holds the replica's own optimizer
update in place of its gradient g (:mod:`.updates`); the arithmetic here is the same.

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
           "orthonormal", "product", "emulate", "MIN_SAVING", "Sparse", "sparse_plan", "sparse_share", "compressible",
           "sparse_decoded", "sparse_sum", "check_share", "with_feedback", "feedback"]

SCHEMES = ("fp32", "fp16", "powersgd", "topk")
FLOAT16_MAX = 65504.0
"""The largest finite float16."""
MIN_SAVING = 0.5
"""A matrix is compressed only when its factors are at most this fraction of its values (hivemind's
``min_compression_ratio``)."""


def part_compression(scheme: str) -> CompressionBase:
    """The hivemind compression every all-reduce part of ``scheme`` crosses in."""
    if scheme == "fp16":
        return Float16Compression()
    if scheme in ("fp32", "powersgd", "topk"):
        return NoCompression()
    raise ValueError(f"unknown averaging scheme {scheme!r}; one of {SCHEMES}")


def _others(chosen: Sequence[int], count: int) -> list[int]:
    """The indices among ``count`` not in ``chosen``."""
    return [i for i in range(count) if i not in set(chosen)]


def with_feedback(g: torch.Tensor, e: torch.Tensor, n: int, total: int) -> torch.Tensor:
    """X = g + e · total / n, in place in ``g`` (a replica's scaled gradient; ``e`` its error
    feedback, its part of the stage's average; ``n`` of the step's ``total`` micro-batches, n > 0)."""
    return g.add_(e, alpha=total / n)


def feedback(x: torch.Tensor, sent: torch.Tensor, n: int, total: int) -> torch.Tensor:
    """The error feedback a replica keeps after a counted round: its part, n / total, of what of its
    X the round did not carry (``sent``: P̂ Q̂ᵀ, or its own top-k share decoded)."""
    return (x - sent).mul_(n / total)


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
        return _others(self.matrices, count)

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


@dataclass(frozen=True)
class Sparse:
    """Which averaged tensors ``topk`` sends sparse (``tensors``: indices among the averaged
    tensors) and how many values of each (``counts``)."""

    fraction: float
    tensors: tuple[int, ...]
    counts: tuple[int, ...]

    def exact(self, count: int) -> list[int]:
        """The indices, among ``count`` averaged tensors, averaged exactly."""
        return _others(self.tensors, count)

    def values(self, count_of: Sequence[int]) -> tuple[int, int]:
        """(4-byte words one member's share and exact tensors take, values fp32 would send): a
        sparse value takes an int32 index and a float16 value, 1.5 words."""
        sparse = math.ceil(1.5 * sum(self.counts)) + 1
        exact = sum(count_of[i] for i in self.exact(len(count_of)))
        return sparse + exact, sum(count_of)


def compressible(shapes: Sequence[Sequence[int]], exact: Sequence[int] = ()) -> tuple[int, ...]:
    """The averaged tensors (of ``shapes``) that ``fp16`` and ``topk`` compress: every one of 2
    dimensions or more (the weight matrices) not in ``exact``."""
    return tuple(i for i, shape in enumerate(shapes) if len(shape) >= 2 and i not in exact)


def sparse_plan(shapes: Sequence[Sequence[int]], fraction: float, exact: Sequence[int] = ()) -> Sparse:
    """The :class:`Sparse` of averaged tensors of ``shapes``: every :func:`compressible` one,
    ``⌈fraction × its values⌉`` of it."""
    if not 0.0 < fraction <= 1.0:
        raise ValueError(f"a top-k fraction must be within (0, 1], got {fraction}")
    chosen = compressible(shapes, exact)
    return Sparse(fraction, tuple(chosen), tuple(math.ceil(fraction * math.prod(shapes[i])) for i in chosen))


def sparse_share(m: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``k`` values of ``m`` of largest magnitude: (their flat indices, int32 ascending; the
    values, float16, clamped to ±65504 as hivemind's ``Float16Compression`` does: a share holds no
    infinity, and error feedback keeps what the clamp left out)."""
    flat = m.reshape(-1)
    idx = torch.topk(flat.abs(), k, sorted=False).indices.sort().values
    return idx.to(torch.int32), flat[idx].clamp(-FLOAT16_MAX, FLOAT16_MAX).to(torch.float16)


def sparse_decoded(idx: torch.Tensor, values: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """A share as the dense tensor of ``like``'s shape it stands for (float32)."""
    out = torch.zeros(like.numel(), dtype=torch.float32)
    out[idx.long()] = values.float()
    return out.reshape(like.shape)


def sparse_sum(shares: Sequence[tuple[torch.Tensor, torch.Tensor, float]], like: torch.Tensor) -> torch.Tensor:
    """The weighted mean of members' shares ``(indices, values, weight)`` in the given order (the
    group's: every member adds in the same order, so all hold the same bytes); weight-0 ones
    contribute nothing."""
    total = sum(w for _, _, w in shares)
    out = torch.zeros(like.numel(), dtype=torch.float32)
    for idx, values, w in shares:
        if w > 0:
            out.index_add_(0, idx.long(), values.float() * (w / total))
    return out.reshape(like.shape)


def check_share(idx: torch.Tensor, values: torch.Tensor, k: int, numel: int) -> str | None:
    """Why a member's sparse share of a tensor of ``numel`` values cannot be summed, or None:
    ``k`` int32 indices, strictly ascending, within range; ``k`` finite float16 values."""
    if idx.dtype != torch.int32 or values.dtype != torch.float16 or idx.shape != (k,) or values.shape != (k,):
        return f"a share of {tuple(idx.shape)} {idx.dtype} indices and {tuple(values.shape)} {values.dtype} values"
    if k and (int(idx[0]) < 0 or int(idx[-1]) >= numel or (k > 1 and not bool((idx[1:] > idx[:-1]).all()))):
        return "indices out of range or not strictly ascending"
    if not bool(torch.isfinite(values).all()):
        return "values that are not finite"
    return None


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
