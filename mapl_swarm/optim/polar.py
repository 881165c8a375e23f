"""Polar Express orthogonalization: ``msign(G)``, the polar factor ``U Vᵀ`` of ``G = U Σ Vᵀ``.

Polar Express (Amsel et al., ICLR 2026) runs a schedule of odd quintic polynomials
``X ← a X + b X³ + c X⁵`` whose coefficients change per step, optimised (ℓ = 1e-3, cushion 0.02)
so that every singular value in ``[ℓ, 1]`` is driven towards 1 as fast as possible. Each step is
computed on the wide orientation (rows ≤ cols) as ``A = X Xᵀ; X = a X + (b A + c A²) X`` so the
Gram matrix is the small one.

This is the one orthogonalization used everywhere in the project:

* the Muon direction (5 steps, bf16 on GPU; singular values land in roughly [0.84, 1.12]);
* the SPEL direction ``msign(G)`` on the Stiefel tangent space (5 steps);
* the SPEL retraction ``msign(A - lr D)`` back onto ``St(d, r)`` (8 steps, always fp32; see
  :mod:`mapl_swarm.optim.spel` for how tightly 7 vs 8 steps land on the manifold).

``torch.optim.Muon`` (torch ≥ 2.9) takes a single fixed (a, b, c) for all steps, so it cannot
run this schedule.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["POLAR_EXPRESS_COEFFS", "SAFETY_FACTOR", "polar_express_coeffs", "msign"]

SAFETY_FACTOR = 1.01
"""Safety factor: normalisation divides by ``‖X‖_F · 1.01``; every tuple but the last is damped by it."""

_NORM_EPS = 1e-7

POLAR_EXPRESS_COEFFS: tuple[tuple[float, float, float], ...] = (
    (8.28721201814563, -23.595886519098837, 17.300387312530933),
    (4.107059111542203, -2.9478499167379106, 0.5448431082926601),
    (3.9486908534822946, -2.908902115962949, 0.5518191394370137),
    (3.3184196573706015, -2.488488024314874, 0.51004894012372),
    (2.300652019954817, -1.6689039845747493, 0.4188073119525673),
    (1.891301407787398, -1.2679958271945868, 0.37680408948524835),
    (1.8750014808534479, -1.2500016453999487, 0.3750001645474248),
    (1.875, -1.25, 0.375),
)
"""The authors' raw 8-step schedule (ℓ = 1e-3, cushion 0.02), before the safety damping."""


def polar_express_coeffs(steps: int) -> list[tuple[float, float, float]]:
    """The (a, b, c) used for each of ``steps`` iterations.

    Every tuple but the last is divided by the safety factor as ``(a/1.01, b/1.01³, c/1.01⁵)``;
    steps past the eighth repeat the last (undamped) tuple ``(1.875, -1.25, 0.375)``, whose fixed
    point at σ = 1 is superattracting.
    """
    if steps < 1:
        raise ValueError(f"msign needs steps >= 1, got {steps}")
    s = SAFETY_FACTOR
    damped = [(a / s, b / s**3, c / s**5) for a, b, c in POLAR_EXPRESS_COEFFS[:-1]]
    table = damped + [POLAR_EXPRESS_COEFFS[-1]]
    return [table[min(i, len(table) - 1)] for i in range(steps)]


def msign(G: Tensor, steps: int, dtype: torch.dtype | None = None) -> Tensor:
    """Approximate polar factor of ``G`` (shape ``(..., m, n)``) by ``steps`` Polar Express steps.

    Args:
        G: a matrix or a batch of matrices, shape ``(..., m, n)``; tall and wide both work.
        steps: number of polynomial iterations (5 for update directions, 8 for retractions).
        dtype: computation dtype. ``None`` computes in fp32 (fp64 inputs stay fp64); pass
            ``torch.bfloat16`` for Muon directions on GPU. Retractions must use fp32.

    Returns:
        A tensor of ``G``'s shape and dtype whose singular values are ≈ 1 (``U Vᵀ``).
    """
    if G.ndim < 2:
        raise ValueError(f"msign needs a (..., m, n) tensor, got shape {tuple(G.shape)}")
    if dtype is None:
        dtype = torch.float64 if G.dtype == torch.float64 else torch.float32
    X = G.to(dtype)
    transposed = X.size(-2) > X.size(-1)
    if transposed:
        X = X.mT  # (..., n, m): wide orientation, so X Xᵀ is the smaller Gram matrix
    # Scale so the spectral norm is ≤ 1/1.01 (Frobenius bounds spectral); norm taken in fp32+.
    norm = torch.linalg.matrix_norm(X.float() if dtype != torch.float64 else X, ord="fro", keepdim=True)
    X = X / (norm * SAFETY_FACTOR + _NORM_EPS).to(dtype)  # (..., k, K), k ≤ K
    for a, b, c in polar_express_coeffs(steps):
        A = X @ X.mT  # (..., k, k)
        B = torch.addmm(A, A, A, beta=b, alpha=c) if A.ndim == 2 else b * A + c * (A @ A)  # bA + cA²
        X = torch.addmm(X, B, X, beta=a) if X.ndim == 2 else a * X + B @ X  # aX + (bA + cA²) X
    if transposed:
        X = X.mT  # back to (..., m, n)
    return X.to(G.dtype)
