"""Exact autograd ops for boundary projection and reconstruction.

``project(R, A) = R @ A`` and ``reconstruct(Z, A) = Z @ A.T`` with hand-written backward passes,
so the backward provably routes gradients through the *same* projector A as the forward
(``dL/dZ = dL/dX_hat @ A``: the chain rule, no approximation). Gradients for A are the summed
outer products over all tokens; on a split pipeline the sender computes ``R^T dZ`` and the
receiver ``dX_hat^T Z``, and their sum is ``dL/dA`` (checked by gradcheck in float64).

Precision: both ops compute in at least fp32 with autocast switched off, whatever the inputs'
dtypes or an enclosing ``torch.autocast`` (bf16 on CUDA or CPU). The projector is an fp32
Stiefel matrix (a bf16 copy lands ~4e-3 off the manifold, DESIGN §3), the ops are a small share of
a stage's compute, and under autocast the backward runs outside the autocast region, where a bf16
incoming gradient would otherwise meet the fp32 tensors saved by the forward. Outputs are in the
compute dtype; input gradients are returned in each input's own dtype.
"""

from __future__ import annotations

import torch

__all__ = ["project", "reconstruct"]


def _compute_dtype(*tensors: torch.Tensor) -> torch.dtype:
    """fp32, or wider when an input is wider (float64 gradchecks)."""
    dtype = torch.float32
    for t in tensors:
        dtype = torch.promote_types(dtype, t.dtype)
    return dtype


class _Project(torch.autograd.Function):
    @staticmethod
    def forward(ctx, r: torch.Tensor, a: torch.Tensor) -> torch.Tensor:  # (B,T,d),(d,k)->(B,T,k)
        ctx.save_for_backward(r, a)
        ct = _compute_dtype(r, a)
        with torch.autocast(device_type=r.device.type, enabled=False):
            return r.to(ct) @ a.to(ct)

    @staticmethod
    def backward(ctx, dz: torch.Tensor):  # dz: (B,T,k)
        r, a = ctx.saved_tensors
        ct = _compute_dtype(r, a, dz)
        dz, ra, aa = dz.to(ct), r.to(ct), a.to(ct)
        with torch.autocast(device_type=dz.device.type, enabled=False):
            dr = (dz @ aa.T).to(r.dtype) if ctx.needs_input_grad[0] else None  # (B,T,d)
            da = None
            if ctx.needs_input_grad[1]:
                da = (ra.reshape(-1, ra.shape[-1]).T @ dz.reshape(-1, dz.shape[-1])).to(a.dtype)  # (d,N)@(N,k)
        return dr, da


class _Reconstruct(torch.autograd.Function):
    @staticmethod
    def forward(ctx, z: torch.Tensor, a: torch.Tensor) -> torch.Tensor:  # (B,T,k),(d,k)->(B,T,d)
        ctx.save_for_backward(z, a)
        ct = _compute_dtype(z, a)
        with torch.autocast(device_type=z.device.type, enabled=False):
            return z.to(ct) @ a.to(ct).T

    @staticmethod
    def backward(ctx, dx: torch.Tensor):  # dx: (B,T,d)
        z, a = ctx.saved_tensors
        ct = _compute_dtype(z, a, dx)
        dx, za, aa = dx.to(ct), z.to(ct), a.to(ct)
        with torch.autocast(device_type=dx.device.type, enabled=False):
            dz = (dx @ aa).to(z.dtype) if ctx.needs_input_grad[0] else None  # (B,T,k)
            da = None
            if ctx.needs_input_grad[1]:
                da = (dx.reshape(-1, dx.shape[-1]).T @ za.reshape(-1, za.shape[-1])).to(a.dtype)  # (d,N)@(N,k)
        return dz, da


def project(r: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
    """(B, T, d) residual -> (B, T, k) coordinates in span(A), computed in at least fp32."""
    return _Project.apply(r, a)


def reconstruct(z: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
    """(B, T, k) coordinates -> (B, T, d) vectors in span(A), computed in at least fp32."""
    return _Reconstruct.apply(z, a)
