"""Exact autograd ops for boundary projection and reconstruction.

``project(R, A) = R @ A`` and ``reconstruct(Z, A) = Z @ A.T`` with hand-written backward passes,
so the backward provably routes gradients through the *same* projector A as the forward
(``dL/dZ = dL/dX_hat @ A``: the chain rule, no approximation). Gradients for A are the summed
outer products over all tokens; on a split pipeline the sender computes ``R^T dZ`` and the
receiver ``dX_hat^T Z``, and their sum is ``dL/dA`` (checked by gradcheck in float64).
"""

from __future__ import annotations

import torch

__all__ = ["project", "reconstruct"]


class _Project(torch.autograd.Function):
    @staticmethod
    def forward(ctx, r: torch.Tensor, a: torch.Tensor) -> torch.Tensor:  # (B,T,d),(d,k)->(B,T,k)
        ctx.save_for_backward(r, a)
        return r @ a

    @staticmethod
    def backward(ctx, dz: torch.Tensor):  # dz: (B,T,k)
        r, a = ctx.saved_tensors
        dr = dz @ a.T if ctx.needs_input_grad[0] else None  # (B,T,d)
        da = None
        if ctx.needs_input_grad[1]:
            da = r.reshape(-1, r.shape[-1]).T @ dz.reshape(-1, dz.shape[-1])  # (d,N)@(N,k) -> (d,k)
        return dr, da


class _Reconstruct(torch.autograd.Function):
    @staticmethod
    def forward(ctx, z: torch.Tensor, a: torch.Tensor) -> torch.Tensor:  # (B,T,k),(d,k)->(B,T,d)
        ctx.save_for_backward(z, a)
        return z @ a.T

    @staticmethod
    def backward(ctx, dx: torch.Tensor):  # dx: (B,T,d)
        z, a = ctx.saved_tensors
        dz = dx @ a if ctx.needs_input_grad[0] else None  # (B,T,k)
        da = None
        if ctx.needs_input_grad[1]:
            da = dx.reshape(-1, dx.shape[-1]).T @ z.reshape(-1, z.shape[-1])  # (d,N)@(N,k) -> (d,k)
        return dz, da


def project(r: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
    """(B, T, d) residual -> (B, T, k) coordinates in span(A)."""
    return _Project.apply(r, a.to(r.dtype))


def reconstruct(z: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
    """(B, T, k) coordinates -> (B, T, d) vectors in span(A)."""
    return _Reconstruct.apply(z, a.to(z.dtype))
