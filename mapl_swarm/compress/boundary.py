"""One side of a stage boundary: the projector and the encode/decode around it.

A :class:`Boundary` is the ``send`` or ``recv`` side of boundary ``index`` (between stage ``index``
and ``index + 1``). Which projector it holds — none (uncompressed), a frozen or trainable random
orthonormal A (fixed / mapl / naive / mapl_vq), or SSN's global basis U shared by every boundary —
is decided by the stage's codec object (:mod:`.codecs`), never here.

The sender computes ``Z = (X - offset_send) @ A``; the receiver ``X_hat = Z @ A.T + offset_recv``;
backward sends ``dL/dZ = dL/dX_hat @ A``. The sender owns A; the receiver holds a copy whose gradient
(``dL/dX_hat^T Z``, summed over the step) travels back once per step. Payloads cross the wire in
the wire dtype; ids as uint16 (uint32 above 65,536 ids). Byte accounting per token:
:class:`BoundaryBytes`, computed by each codec from a :class:`BoundaryShape`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from mapl_swarm.compress.ops import project, reconstruct

if TYPE_CHECKING:
    from mapl_swarm.config import VQConfig

__all__ = ["Boundary", "BoundaryBytes", "BoundaryShape", "WIRE_TORCH_DTYPES", "id_wire_dtype"]

WIRE_TORCH_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def id_wire_dtype(vocab_size: int) -> torch.dtype:
    """uint16 when every id fits, else uint32."""
    return torch.uint16 if vocab_size <= 1 << 16 else torch.uint32


@dataclass(frozen=True)
class BoundaryBytes:
    """Payload bytes per token crossing one boundary (headers not included)."""

    forward_act_bytes: float
    """Activation payload forward."""
    forward_ids_bytes: float
    """Token ids forward: (T+1)/T ids per token."""
    backward_bytes: float
    """Gradient payload backward."""
    codebook_bytes: float = 0.0
    """mapl_vq: steady-state CODEBOOK_SLICE bytes per token, each way (amortised over the
    micro-batch; not in forward/backward_bytes; 0 when the micro-batch size is not given). The
    k-means initialisation's full slices (once per run) come on top."""
    projector_bytes: float = 0.0
    """A trainable projector's exchange per token, each way: one d x r fp32 PROJ downstream and one
    PROJ_GRAD upstream per optimizer step, amortised over the step's tokens (not in
    forward/backward_bytes; 0 when the tokens per step are not given)."""

    @property
    def forward_bytes(self) -> float:
        return self.forward_act_bytes + self.forward_ids_bytes

    @property
    def total_bytes(self) -> float:
        return self.forward_bytes + self.backward_bytes


@dataclass(frozen=True, kw_only=True)
class BoundaryShape:
    """What a boundary's byte count depends on."""

    hidden_size: int
    rank: int
    wire_dtype: str
    vocab_size: int
    seq_len: int
    """Tokens T per sequence (each sequence carries T+1 ids)."""
    vq: "VQConfig | None" = None
    """Codebook settings of a quantized codec."""
    tokens_per_micro: int | None = None
    """Tokens per micro-batch, to amortise per-micro-batch traffic (codebook slices)."""
    tokens_per_step: int | None = None
    """Tokens per optimizer step, to amortise per-step traffic (the projector exchange)."""

    @property
    def ids_bytes_per_token(self) -> float:
        item = torch.empty((), dtype=id_wire_dtype(self.vocab_size)).element_size()
        return item * (self.seq_len + 1) / self.seq_len


class Boundary(nn.Module):
    """One side (``role`` = "send" or "recv") of boundary ``index``.

    ``projector``: None (the boundary passes X through), a tensor (held as a trainable parameter
    when ``trainable``, else as a frozen buffer), or an ``nn.Parameter`` owned elsewhere and shared
    (SSN's global basis U; held as is)."""

    def __init__(self, role: str, index: int, projector: torch.Tensor | None, *, trainable: bool) -> None:
        super().__init__()
        if role not in ("send", "recv"):
            raise ValueError(f"role must be send or recv, got {role!r}")
        self.role = role
        self.index = index
        self._trainable = trainable
        self.version = 0
        """Number of optimizer updates applied to the projector."""
        self.projector: torch.Tensor | None
        if projector is None or isinstance(projector, nn.Parameter):
            self.projector = projector
        elif trainable:
            self.projector = nn.Parameter(projector)
        else:
            self.register_buffer("projector", projector)

    @property
    def trainable(self) -> bool:
        """The projector learns and is exchanged once per step (sender -> receiver)."""
        return self._trainable

    def encode(self, x: torch.Tensor, offset: torch.Tensor | None) -> torch.Tensor:
        """Sender: (B, T, d) -> (B, T, width), in x's dtype, inside the autograd graph."""
        if self.projector is None:
            return x
        r = x if offset is None else x - offset
        return project(r, self.projector)

    def decode(self, z: torch.Tensor, offset: torch.Tensor | None) -> torch.Tensor:
        """Receiver: (B, T, width) -> (B, T, d)."""
        if self.projector is None:
            return z
        x = reconstruct(z, self.projector)
        return x if offset is None else x + offset

    @torch.no_grad()
    def load_projector(self, value: torch.Tensor, version: int) -> None:
        """Install the sender's updated projector (receiver side)."""
        assert self.projector is not None
        if tuple(value.shape) != tuple(self.projector.shape):
            raise ValueError(f"projector shape {tuple(value.shape)} != expected {tuple(self.projector.shape)}")
        self.projector.copy_(value.to(self.projector.dtype))
        self.version = version
