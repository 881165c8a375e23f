"""Stand-ins for the two-phase decoding of wire 1.4 (branch sec-wire) until it is merged: delete then.

Same names and signatures as ``mapl_swarm.wire.frames.decode_header`` / ``decode_tensors`` /
``DecodeLimits`` there, built on the 1.3 decoder's parts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping

from mapl_swarm.wire import Message, decode, spec
from mapl_swarm.wire.frames import _as_buffer, _authenticate
from mapl_swarm.wire.header import Header, parse_header

__all__ = ["DecodeLimits", "decode_header", "decode_tensors"]


@dataclass(frozen=True, kw_only=True)
class DecodeLimits:
    max_header_bytes: int = spec.DEFAULT_MAX_HEADER_BYTES
    max_frame_bytes: int = spec.DEFAULT_MAX_FRAME_BYTES
    max_rawbytes: Mapping[str, int] | None = None


def decode_header(frames: Iterable[Any], limits: DecodeLimits,
                  *, secret: bytes | None | Callable[[Header], bytes | None] = None) -> tuple[Header, Any]:
    bufs = [_as_buffer(f) for f in frames]
    if not bufs:
        from mapl_swarm.wire import FrameCountMismatch
        raise FrameCountMismatch("empty message: no header frame")
    h = parse_header(bufs[0], max_header_bytes=limits.max_header_bytes)
    key = secret(h) if callable(secret) else secret
    _authenticate(h, bufs, key)
    object.__setattr__(h, "_secret", key)  # for decode_tensors' full decode
    return h, h.tensors


def decode_tensors(header: Header, frames: Iterable[Any], limits: DecodeLimits) -> Message:
    return decode(frames, secret=getattr(header, "_secret", None), max_header_bytes=limits.max_header_bytes,
                  max_frame_bytes=limits.max_frame_bytes)
