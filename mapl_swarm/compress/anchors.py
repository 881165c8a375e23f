"""Per-stage token anchors added on receive and subtracted on send (MAPL §3.2).

Stage 0 uses its real token embedding as the anchor (owned by the model). Every later stage owns
one of these, chosen by ``CompressionConfig.anchor``:

- ``factorized``: ``E_small[ids] @ P`` with trainable ``E_small`` (V x r_a, N(0, std^2)) and frozen
  ``P`` (r_a x d) with random orthonormal rows (the MAPL paper's choice);
- ``full``: a trainable V x d table (best quality, a whole embedding per stage);
- ``static``: a frozen N(0, std^2) V x d table (SSN-style static offset);
- ``none``: no anchor.
"""

from __future__ import annotations

import torch
from torch import nn

from mapl_swarm.compress.stiefel import random_stiefel
from mapl_swarm.rng import generator

__all__ = ["StageAnchor"]


class StageAnchor(nn.Module):
    """Token anchor of one stage (stages 1..P-1); ``forward(ids) -> (B, T, d)`` or None."""

    def __init__(self, kind: str, vocab_size: int, hidden_size: int, rank: int, init_std: float,
                 seed: int, stage: int) -> None:
        super().__init__()
        self.kind = kind
        gen = generator(seed, "anchor", stage)
        self.table: nn.Parameter | None = None
        if kind == "factorized":
            self.table = nn.Parameter(torch.randn(vocab_size, rank, generator=gen) * init_std)
            self.register_buffer("basis", random_stiefel(hidden_size, rank, gen).T.contiguous())  # (r_a, d)
        elif kind == "full":
            self.table = nn.Parameter(torch.randn(vocab_size, hidden_size, generator=gen) * init_std)
        elif kind == "static":
            self.register_buffer("frozen", torch.randn(vocab_size, hidden_size, generator=gen) * init_std)
        elif kind != "none":
            raise ValueError(f"unknown anchor kind {kind!r}")

    def forward(self, ids: torch.Tensor) -> torch.Tensor | None:
        if self.kind == "factorized":
            return self.table[ids] @ self.basis  # (B,T,r_a) @ (r_a,d) -> (B,T,d)
        if self.kind == "full":
            return self.table[ids]
        if self.kind == "static":
            return self.frozen[ids]
        return None
