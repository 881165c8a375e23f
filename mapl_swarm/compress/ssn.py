"""Subspace Networks (Ramasinghe et al. 2025) baseline: one global basis U for every boundary.

Every stage holds the same frozen ``T_fixed`` (V x d, N(0, s^2) with s = ``compression.ssn_offset_std``,
by default the model's embedding init std) token offsets and the same
``U`` (d x k, orthonormal columns), both seeded by the run seed alone. Stage 0 adds
``T_fixed[ids]`` to its embedding output; each boundary sends ``(X - T_fixed[ids]) @ U`` and
the receiver adds ``T_fixed[ids]`` back. After every optimizer step the residual-stream writers
of every layer before the last boundary are projected onto span(U) — ``W <- U U^T W`` for the
(out, in)-layout o_proj and down_proj, ``E <- E U U^T`` for the token embedding — so
``X - T_fixed[ids]`` lies in span(U) and the boundary is lossless for the constrained model.

U is frozen (node0's choice) when ``ssn_refresh_interval_steps == 0``; otherwise every that many
steps it takes one Grassmann gradient step (lr ``ssn_refresh_lr``, the SSN paper's 1e-2 / 500)
on the gradient summed over every boundary, followed by a QR retraction and re-projection of the
weights. The refresh needs all stages' U gradients, so it runs in single-process training only.
"""

from __future__ import annotations

import torch
from torch import nn

from mapl_swarm.compress.stiefel import random_stiefel
from mapl_swarm.rng import generator

__all__ = ["ssn_basis", "ssn_offsets", "constrain_", "grassmann_step"]


def ssn_basis(hidden_size: int, rank: int, seed: int) -> torch.Tensor:
    """The global U (d x k), identical on every stage."""
    return random_stiefel(hidden_size, rank, generator(seed, "ssn_basis"))


def ssn_offsets(vocab_size: int, hidden_size: int, seed: int, std: float) -> torch.Tensor:
    """The frozen N(0, std^2) token offsets T_fixed (V x d), identical on every stage (and the same
    table, up to its scale, for every ``std`` of a seed)."""
    return torch.randn(vocab_size, hidden_size, generator=generator(seed, "ssn_offsets")) * std


@torch.no_grad()
def constrain_(basis: torch.Tensor, writers: list[nn.Parameter], embedding: nn.Parameter | None) -> None:
    """Project residual writers (out, in) as ``W <- U U^T W`` and the embedding as ``E <- E U U^T``."""
    u = basis.detach().to(torch.float32)
    for w in writers:
        w.copy_((u @ (u.T @ w.float())).to(w.dtype))  # (d,k)@((k,d)@(d,in)) -> (d,in)
    if embedding is not None:
        embedding.copy_(((embedding.float() @ u) @ u.T).to(embedding.dtype))  # (V,d)@(d,k)@(k,d)


@torch.no_grad()
def grassmann_step(basis: torch.Tensor, grad: torch.Tensor, lr: float) -> torch.Tensor:
    """One Riemannian gradient step on the Grassmannian with a QR retraction: (d, k) -> (d, k)."""
    g = grad - basis @ (basis.T @ grad)  # horizontal part of the gradient
    q, r = torch.linalg.qr(basis - lr * g)
    return q * torch.sign(torch.diagonal(r)).unsqueeze(0)
