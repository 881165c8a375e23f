"""Muon for 2D hidden weights, with the Polar Express orthogonalization.

Per parameter ``W`` of shape ``(rows, cols)`` with gradient ``g`` (Keller Jordan's Muon, Nesterov form)::

    buf ← buf.lerp(g, 1 - β)                     # buf = β buf + (1 - β) g
    u   = g.lerp(buf, β)                         # Nesterov look-ahead
    W   ← W · (1 - lr · wd)                      # decoupled weight decay
    W   ← W - lr · max(1, rows/cols)^½ · msign(u, ns_steps)

``torch.optim.Muon`` (torch ≥ 2.9) runs one fixed (a, b, c) for every Newton–Schulz step, so it
cannot use the Polar Express schedule; this class does. Parameters of equal shape, dtype and device
are orthogonalized together in one batched ``msign`` call (one launch per shape instead of per
matrix). Embeddings, norms, biases, the lm_head and anchors belong to AdamW, not here.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor

from mapl_swarm.optim.polar import msign

__all__ = ["Muon", "muon_scale"]


def muon_scale(rows: int, cols: int) -> float:
    """Shape factor ``max(1, rows/cols) ** 0.5`` applied to the orthogonalized update."""
    return max(1.0, rows / cols) ** 0.5


class Muon(torch.optim.Optimizer):
    """Momentum-orthogonalized SGD for 2D weights (param-group keys: lr, momentum, weight_decay, ns_steps).

    Args:
        params: 2D tensors (or param-group dicts of them).
        lr: learning rate (the step moves ``W`` by ``lr · scale`` in spectral norm).
        momentum: Nesterov momentum β.
        weight_decay: decoupled weight decay; ``W *= 1 - lr · weight_decay`` before the update.
        ns_steps: Polar Express steps for the direction.
        direction_dtype: dtype ``msign`` computes in; ``None`` picks bf16 for CUDA parameters and
            fp32 otherwise. The update is applied in the parameter's own dtype.
    """

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict[str, Any]],
        *,
        lr: float = 0.02,
        momentum: float = 0.95,
        weight_decay: float = 0.0,
        ns_steps: int = 5,
        direction_dtype: torch.dtype | None = None,
    ) -> None:
        if lr < 0 or not 0 <= momentum < 1 or weight_decay < 0 or ns_steps < 1:
            raise ValueError(f"bad Muon hyper-parameters lr={lr} momentum={momentum} "
                             f"weight_decay={weight_decay} ns_steps={ns_steps}")
        defaults = dict(lr=lr, momentum=momentum, weight_decay=weight_decay, ns_steps=ns_steps)
        super().__init__(params, defaults)
        self.direction_dtype = direction_dtype
        for group in self.param_groups:
            for p in group["params"]:
                if p.ndim != 2:
                    raise ValueError(f"Muon takes 2D weights only, got shape {tuple(p.shape)}")

    def _dtype_for(self, p: Tensor) -> torch.dtype:
        if self.direction_dtype is not None:
            return self.direction_dtype
        return torch.bfloat16 if p.is_cuda else torch.float32

    @torch.no_grad()
    def step(self, closure=None):  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lr, beta, wd, steps = group["lr"], group["momentum"], group["weight_decay"], group["ns_steps"]
            # Bucket by (shape, dtype, device) so each bucket is one batched msign.
            buckets: dict[tuple, list[tuple[Tensor, Tensor]]] = {}
            for p in group["params"]:
                if p.grad is None:
                    continue
                g = p.grad
                if g.is_sparse:
                    raise RuntimeError("Muon does not support sparse gradients")
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                buf = state["momentum_buffer"]
                buf.lerp_(g, 1 - beta)  # buf = β buf + (1-β) g
                u = g.lerp(buf, beta)  # Nesterov: (1-β) g + β buf
                buckets.setdefault((tuple(p.shape), p.dtype, p.device), []).append((p, u))
            for (shape, _, _), items in buckets.items():
                rows, cols = shape
                U = torch.stack([u for _, u in items])  # (k, rows, cols)
                O = msign(U, steps, dtype=self._dtype_for(items[0][0]))  # (k, rows, cols)
                scale = muon_scale(rows, cols)
                for (p, _), o in zip(items, O.unbind(0)):
                    if wd != 0:
                        p.mul_(1 - lr * wd)
                    p.add_(o, alpha=-lr * scale)
        return loss
