"""How large a legitimate message of a run can be, from its config alone (no torch).

A peer's ROUTER refuses larger frames before buffering them (``ZMQ_MAXMSGSIZE``,
:attr:`TransportConfig.max_message_bytes <mapl_swarm.net.transport.TransportConfig.max_message_bytes>`),
so a sender of a huge message costs the receiver nothing but a dropped connection. The bound is
derived from the run's shapes (``net.max_message_bytes = 0``, the default) as the largest of its
messages' tensor bytes (every frame is at most its tensor's raw bytes: the wire's lz4 falls back to
raw when it does not shrink a frame), plus the header limit and some slack:

- ACT of one micro-batch (B sequences of T tokens; evaluation uses the same B): the boundary
  tensor, B x T x width in the wire dtype (width: d uncompressed, r projected), with mapl_vq its
  codes B x T x R x r/G instead, plus the ids B x (T+1);
- GRAD: the boundary gradient (or its codes), the size of the ACT's boundary tensor;
- PROJ and PROJ_GRAD (projected codecs): d x r fp32;
- CODEBOOK_SLICE (mapl_vq): a full slice of one stream, R x r/G x K x G fp32 codes, plus an
  index of R x r/G x K codes (an indexed slice never carries more).

ZeroMQ applies the limit to each frame; a bound on whole messages bounds their frames too.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from mapl_swarm.config.catalog import codec_info
from mapl_swarm.wire.spec import DEFAULT_MAX_HEADER_BYTES

if TYPE_CHECKING:
    from mapl_swarm.config import TrainConfig

__all__ = ["payload_bounds", "derived_max_message_bytes", "max_message_bytes", "SLACK_FRACTION"]

_WIRE_ITEM_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}
_FP32 = 4
SLACK_FRACTION = 0.125
"""Added on top of the largest message (tensors and the header limit): room for small additions
(meta, a tensor a later minor version adds) without a config change."""
_ROUND_BYTES = 4096


def _id_bytes(vocab_size: int) -> int:
    return 2 if vocab_size <= 1 << 16 else 4  # uint16 when every id fits, else uint32


def payload_bounds(cfg: TrainConfig) -> dict[str, int]:
    """Tensor bytes of the largest legitimate message of each type that carries tensors (types a
    codec never sends are left out)."""
    m, c, p = cfg.model, cfg.compression, cfg.pipeline
    info = codec_info(c.codec)
    tokens = p.micro_batch_size * m.context_length
    width = c.rank if info.projected else m.hidden_size
    if info.quantized:  # codes replace the boundary tensor, in training and evaluation alike
        boundary = tokens * c.vq.code_bytes_per_token
    else:
        boundary = tokens * width * _WIRE_ITEM_BYTES[c.wire_dtype]
    ids = p.micro_batch_size * (m.context_length + 1) * _id_bytes(m.vocab_size)
    out = {"ACT": boundary + ids, "GRAD": boundary}
    if info.projected:
        out["PROJ"] = out["PROJ_GRAD"] = m.hidden_size * c.rank * _FP32
    if info.quantized:
        vq = c.vq
        out["CODEBOOK_SLICE"] = vq.slice_bytes(vq.codebook_size, indexed=True)
    return out


def derived_max_message_bytes(cfg: TrainConfig) -> int:
    """The bound for ``net.max_message_bytes = 0``: the largest :func:`payload_bounds` plus the
    header limit (64 KiB), plus :data:`SLACK_FRACTION`, rounded up to 4 KiB."""
    largest = max(payload_bounds(cfg).values()) + DEFAULT_MAX_HEADER_BYTES
    return math.ceil(largest * (1 + SLACK_FRACTION) / _ROUND_BYTES) * _ROUND_BYTES


def max_message_bytes(cfg: TrainConfig) -> int:
    """The ROUTER's limit for this run: ``net.max_message_bytes``, or the derived bound when 0."""
    return cfg.net.max_message_bytes or derived_max_message_bytes(cfg)
