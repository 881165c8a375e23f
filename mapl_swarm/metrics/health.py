"""Compression diagnostics: pure functions on boundary tensors and projectors (MAPL §3.1, §3.4).

Everything here takes plain tensors, computes in float32 (float64 where it matters) and returns
Python floats or CPU tensors, so the same code serves live health metrics during training
(:mod:`mapl_swarm.pipeline.stage`), end-of-run analysis and the sweep plots:

- :func:`energy_captured` — ``‖R A‖² / ‖R‖²``: the fraction of the residual ``R = X − anchor`` that a
  projector keeps (paper Fig. 4b);
- :func:`orthonormality_error` — ``‖AᵀA − I‖_F`` (0 on the Stiefel manifold);
- :func:`gradient_fidelity` — ``cos(g, g A Aᵀ)``: how much of the receiver's gradient survives the
  backward projection;
- :func:`principal_angles` / :func:`mean_principal_angle` / :func:`pairwise_mean_angles` — angles
  between projector subspaces, ``θ̄ = (1/r) Σ arccos σ_k(Q_iᵀ Q_j)`` (paper Fig. 4a);
- :func:`cumulative_energy` — cumulative singular-value energy of a token matrix (paper Fig. 3);
- :func:`cosine_pairs` — pairwise token cosine similarity before vs after projection and its
  Pearson r (paper Fig. 4c);
- :func:`quantization_stats` / :func:`dead_code_fraction` — for vector-quantized payloads.
"""

from __future__ import annotations

import torch

__all__ = [
    "as_tokens",
    "energy_captured",
    "orthonormality_error",
    "gradient_fidelity",
    "cosine",
    "principal_angles",
    "mean_principal_angle",
    "pairwise_mean_angles",
    "cumulative_energy",
    "rank_for_energy",
    "pearson",
    "cosine_pairs",
    "quantization_stats",
    "dead_code_fraction",
]


def as_tokens(x: torch.Tensor) -> torch.Tensor:
    """(..., d) -> (N, d) float32 on the same device, detached."""
    return x.detach().reshape(-1, x.shape[-1]).float()


def energy_captured(residual: torch.Tensor, projector: torch.Tensor) -> float:
    """``‖R A‖²_F / ‖R‖²_F`` for R (..., d) and A (d, r); 1.0 when R lies in span(A) (A orthonormal)."""
    r = as_tokens(residual)
    a = projector.detach().float().to(r.device)
    total = float((r * r).sum())
    if total == 0.0:
        return float("nan")
    z = r @ a  # (N, d) @ (d, r) -> (N, r)
    return float((z * z).sum()) / total


def orthonormality_error(projector: torch.Tensor) -> float:
    """``‖AᵀA − I‖_F`` of A (d, r)."""
    a = projector.detach().double()
    eye = torch.eye(a.shape[1], dtype=a.dtype, device=a.device)
    return float(torch.linalg.matrix_norm(a.T @ a - eye))


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    """Cosine similarity of two tensors flattened to vectors (nan if either is zero)."""
    a, b = a.detach().reshape(-1).double(), b.detach().reshape(-1).double().to(a.device)
    den = float(a.norm() * b.norm())
    return float(a @ b) / den if den > 0 else float("nan")


def gradient_fidelity(grad: torch.Tensor, projector: torch.Tensor) -> float:
    """``cos(g, g A Aᵀ)`` for the receiver's gradient g = dL/dX̂ (..., d) and A (d, r): the share of
    the gradient direction that survives the compressed backward (1.0 when g lies in span(A))."""
    g = as_tokens(grad)
    a = projector.detach().float().to(g.device)
    return cosine(g, (g @ a) @ a.T)  # (N,d)@(d,r)@(r,d) -> (N,d)


def _orthonormal_basis(a: torch.Tensor) -> torch.Tensor:
    q, _ = torch.linalg.qr(a.detach().double())
    return q


def principal_angles(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Principal angles in degrees (ascending) between span(A) and span(B), A (d, r), B (d, s).

    Both are orthonormalised first (QR), so off-manifold projectors (the naive baseline) compare by
    their spans. Returns min(r, s) angles as a CPU float64 tensor."""
    qa, qb = _orthonormal_basis(a), _orthonormal_basis(b.to(a.device))
    s = torch.linalg.svdvals(qa.T @ qb).clamp(-1.0, 1.0)  # cosines of the angles, descending
    return torch.rad2deg(torch.arccos(s)).cpu()


def mean_principal_angle(a: torch.Tensor, b: torch.Tensor) -> float:
    """``θ̄ = (1/r) Σ_k arccos σ_k(Q_aᵀ Q_b)`` in degrees: 0 for equal subspaces, 90 for orthogonal ones."""
    return float(principal_angles(a, b).mean())


def pairwise_mean_angles(projectors: list[torch.Tensor]) -> list[list[float]]:
    """Matrix of :func:`mean_principal_angle` between every pair of projectors."""
    n = len(projectors)
    out = [[0.0] * n for _ in range(n)]
    for i in range(n):
        for j in range(i + 1, n):
            out[i][j] = out[j][i] = mean_principal_angle(projectors[i], projectors[j])
    return out


def cumulative_energy(x: torch.Tensor) -> torch.Tensor:
    """Cumulative energy fraction ``Σ_{k≤i} σ_k² / Σ σ²`` of the token matrix (N, d) of x (..., d);
    a CPU float64 tensor of length min(N, d), ending at 1.0."""
    s = torch.linalg.svdvals(as_tokens(x).double())
    e = s * s
    total = e.sum()
    if float(total) == 0.0:
        return torch.zeros_like(e).cpu()
    return (torch.cumsum(e, 0) / total).cpu()


def rank_for_energy(cum: torch.Tensor, fraction: float = 0.99) -> int:
    """Smallest k whose cumulative energy reaches ``fraction``."""
    hits = torch.nonzero(cum >= fraction - 1e-12)
    return int(hits[0]) + 1 if len(hits) else len(cum)


def pearson(x: torch.Tensor, y: torch.Tensor) -> float:
    """Pearson correlation of two equal-length vectors."""
    x, y = x.double().reshape(-1), y.double().reshape(-1)
    x, y = x - x.mean(), y - y.mean()
    den = float(x.norm() * y.norm())
    return float(x @ y) / den if den > 0 else float("nan")


def cosine_pairs(x: torch.Tensor, projector: torch.Tensor, num_pairs: int = 1000,
                 seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, float]:
    """Cosine similarity of ``num_pairs`` random token pairs of x (..., d) before, ``cos(x_i, x_j)``,
    and after projection, ``cos(x_i A, x_j A)``; returns (before, after, Pearson r) on the CPU.
    For tokens inside span(A) with A orthonormal, after == before exactly."""
    t = as_tokens(x).cpu().double()
    a = projector.detach().cpu().double()
    gen = torch.Generator().manual_seed(seed)
    n = t.shape[0]
    i = torch.randint(0, n, (num_pairs,), generator=gen)
    j = (i + torch.randint(1, max(n, 2), (num_pairs,), generator=gen)) % n  # j != i when n > 1
    z = t @ a  # (N, d) @ (d, r) -> (N, r)
    before = torch.nn.functional.cosine_similarity(t[i], t[j], dim=-1)
    after = torch.nn.functional.cosine_similarity(z[i], z[j], dim=-1)
    return before, after, pearson(before, after)


def quantization_stats(z: torch.Tensor, z_hat: torch.Tensor) -> dict[str, float]:
    """``cos(Z, Ẑ)`` and relative error ``‖Z − Ẑ‖ / ‖Z‖`` of a quantized payload."""
    z64, zh = z.detach().double(), z_hat.detach().double().to(z.device)
    norm = float(z64.norm())
    return {"vq_cos": cosine(z64, zh),
            "vq_rel_error": float((z64 - zh).norm()) / norm if norm > 0 else float("nan")}


def dead_code_fraction(counts: torch.Tensor) -> float:
    """Fraction of codebook entries never selected, given per-code usage counts (any shape)."""
    c = counts.detach().reshape(-1)
    return float((c == 0).sum()) / max(c.numel(), 1)
