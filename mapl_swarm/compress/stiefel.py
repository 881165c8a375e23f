"""Random points of the Stiefel manifold ``St(d, r)``: the codecs' initial projectors and fixed bases.

MAPL's and the fixed/naive codecs' initial projectors (:mod:`.boundary`), the factorized anchors'
frozen rows (:mod:`.anchors`) and SSN's global basis (:mod:`.ssn`) are all drawn here, from keyed
generators (:func:`mapl_swarm.rng.generator`), so every partition of a run starts from the same
bases. The optimizer that keeps projectors on the manifold is :class:`mapl_swarm.optim.spel.SPEL`.
"""

from __future__ import annotations

import logging

import torch
from torch import Tensor

log = logging.getLogger(__name__)

__all__ = ["random_stiefel"]


def random_stiefel(d: int, r: int, generator: torch.Generator | None = None) -> Tensor:
    """A uniformly random point of ``St(d, r)``: fp32 ``(d, r)`` with orthonormal columns (CPU).

    QR of a Gaussian in fp64, with the sign of each column fixed by ``diag(R) > 0`` so the result is
    Haar-distributed and deterministic for a given generator.
    """
    if not 0 < r <= d:
        raise ValueError(f"St(d, r) needs 0 < r <= d, got d={d} r={r}")
    G = torch.randn(d, r, generator=generator, dtype=torch.float64)  # (d, r)
    Q, R = torch.linalg.qr(G)  # Q (d, r), R (r, r)
    signs = torch.sign(torch.diagonal(R))
    signs[signs == 0] = 1.0
    return (Q * signs).to(torch.float32)  # (d, r) · (r,) flips columns
