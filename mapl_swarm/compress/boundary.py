"""Boundary codecs: what one side of a stage boundary does to activations and gradients.

Every codec is one class, :class:`Boundary`, configured by kind and role:

=========  =====================================================  ==========================
codec      forward payload per token                              projector
=========  =====================================================  ==========================
none       X (d channels)                                         -
mapl       (X - anchor_send[ids]) @ A   (r channels)               A in St(d, r), SPEL
fixed      same                                                   A random orthonormal, frozen
naive      same                                                   A under plain Muon (no manifold)
ssn        (X - T_fixed[ids]) @ U       (k channels)               one global U for all boundaries
mapl_vq    residual VQ codes of mapl's Z (R x r/G bytes)           as mapl (SPEL)
=========  =====================================================  ==========================

The receiver computes ``X_hat = Z @ A.T + anchor_recv[ids]``; backward sends ``dL/dZ = dL/dX_hat @ A``.
The sender owns A (boundary b's projector is seeded by (run seed, "projector", b)); the receiver
holds a copy whose gradient (``dL/dX_hat^T Z``, summed over the step) travels back to the sender
once per step. Payloads cross the wire in the wire dtype; ids as uint16 (uint32 above 65,536 ids).
``mapl_vq`` projects exactly like ``mapl``; the quantization of Z and dL/dZ and the codebook
streams live in :mod:`.vq` and :mod:`.codebook_sync` (driven by the stage runtime).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from mapl_swarm.compress.ops import project, reconstruct
from mapl_swarm.config import VQConfig
from mapl_swarm.optim.spel import random_stiefel
from mapl_swarm.rng import generator

if TYPE_CHECKING:
    from mapl_swarm.config import TrainConfig

__all__ = [
    "Boundary",
    "BoundaryBytes",
    "WIRE_TORCH_DTYPES",
    "boundary_bytes",
    "config_boundary_bytes",
    "id_wire_dtype",
    "payload_width",
]

WIRE_TORCH_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
PROJECTED_CODECS = ("mapl", "fixed", "naive", "ssn", "mapl_vq")
TRAINABLE_PROJECTOR_CODECS = ("mapl", "naive", "mapl_vq")


def id_wire_dtype(vocab_size: int) -> torch.dtype:
    """uint16 when every id fits, else uint32."""
    return torch.uint16 if vocab_size <= 1 << 16 else torch.uint32


def payload_width(codec: str, hidden_size: int, rank: int) -> int:
    """Channels per token on the wire."""
    return hidden_size if codec == "none" else rank


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

    @property
    def forward_bytes(self) -> float:
        return self.forward_act_bytes + self.forward_ids_bytes

    @property
    def total_bytes(self) -> float:
        return self.forward_bytes + self.backward_bytes


def boundary_bytes(codec: str, hidden_size: int, rank: int, wire_dtype: str, vocab_size: int,
                   seq_len: int, *, vq: VQConfig | None = None,
                   tokens_per_micro: int | None = None) -> BoundaryBytes:
    """Exact payload bytes per token of one boundary for the given codec settings.

    ``mapl_vq`` needs ``vq`` (its codes: R x r/G bytes per token each way for K <= 256); with
    ``tokens_per_micro`` its amortised codebook slices are reported in ``codebook_bytes``."""
    id_item = torch.empty((), dtype=id_wire_dtype(vocab_size)).element_size()
    ids = id_item * (seq_len + 1) / seq_len
    if codec == "mapl_vq":
        if vq is None:
            raise ValueError("boundary_bytes: mapl_vq needs its VQConfig")
        codes = float(vq.code_bytes_per_token)
        slices = vq.slice_bytes_per_micro / tokens_per_micro if tokens_per_micro else 0.0
        return BoundaryBytes(forward_act_bytes=codes, forward_ids_bytes=ids, backward_bytes=codes,
                             codebook_bytes=slices)
    width = payload_width(codec, hidden_size, rank)
    item = torch.empty((), dtype=WIRE_TORCH_DTYPES[wire_dtype]).element_size()
    return BoundaryBytes(
        forward_act_bytes=float(width * item),
        forward_ids_bytes=ids,
        backward_bytes=float(width * item),
    )


def config_boundary_bytes(cfg: "TrainConfig") -> BoundaryBytes:
    """:func:`boundary_bytes` of a run config (micro-batch of B x T tokens)."""
    c, m = cfg.compression, cfg.model
    vq = c.vq if c.codec == "mapl_vq" else None
    return boundary_bytes(c.codec, m.hidden_size, c.rank, c.wire_dtype, m.vocab_size, m.context_length,
                          vq=vq, tokens_per_micro=cfg.pipeline.micro_batch_size * m.context_length)


class Boundary(nn.Module):
    """One side (``role`` = "send" or "recv") of boundary ``index`` for one codec.

    ``shared_basis`` is the global SSN basis U, owned by the stage and shared with its other side.
    """

    def __init__(self, codec: str, role: str, index: int, hidden_size: int, rank: int, seed: int,
                 shared_basis: nn.Parameter | None = None) -> None:
        super().__init__()
        if role not in ("send", "recv"):
            raise ValueError(f"role must be send or recv, got {role!r}")
        self.codec = codec
        self.role = role
        self.index = index
        self.width = payload_width(codec, hidden_size, rank)
        self.version = 0
        """Number of optimizer updates applied to the projector."""
        self.projector: torch.Tensor | None
        if codec == "ssn":
            if shared_basis is None:
                raise ValueError("ssn boundaries need the stage's shared basis U")
            self.projector = shared_basis
        elif codec in PROJECTED_CODECS:
            a = random_stiefel(hidden_size, rank, generator(seed, "projector", index))
            if codec in TRAINABLE_PROJECTOR_CODECS:
                self.projector = nn.Parameter(a)
            else:
                self.register_buffer("projector", a)
        else:
            self.projector = None

    @property
    def trainable(self) -> bool:
        return self.codec in TRAINABLE_PROJECTOR_CODECS

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
