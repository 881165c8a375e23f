"""Messages <-> ZeroMQ multipart frames (SPEC §1, §4, §6, §8).

:func:`encode` returns ``[header, *tensor_frames]``; an uncompressed tensor frame is a
``memoryview`` of the source array's memory (no copy), so it must stay unchanged until the send
has completed (pyzmq ``copy=False``). Decoding takes ``bytes``, ``memoryview`` or any buffer
(``zmq.Frame`` via its ``.buffer``) and raises only :class:`WireError` subclasses for any bytes
it is given; ``raw`` tensors come back as read-only numpy views of the received frames.

Decoding runs in two phases so that a receiver checks run, sender and session before any tensor
is unpacked (SPEC §6 order):

1. :func:`decode_header` — header size, msgpack, version, header fields, type; nothing is read
   but the header frame and nothing is allocated beyond the header map.
2. :func:`decode_tensors` — descriptors against :class:`DecodeLimits` (declared sizes, before any
   allocation), frame count, per-type rules, then per frame: length, CRC, LZ4 into a buffer of
   exactly ``rawbytes`` (a block that would write more fails without allocating more).

:func:`decode` is the two in a row.
"""

from __future__ import annotations

import types
import zlib
from dataclasses import dataclass
from typing import Any, Iterable, Mapping

import lz4.block
import numpy as np

from . import spec
from .errors import (
    BadCodec,
    BadShape,
    ChecksumMismatch,
    DecompressionFailed,
    FrameCountMismatch,
    FrameTooLarge,
    LengthMismatch,
    MalformedHeader,
)
from .header import (
    Descriptor,
    Header,
    canonical_meta,
    check_text,
    check_uint,
    pack_header,
    parse_descriptors,
    parse_header,
)
from .message import Message, WireTensor, check_type_rules

__all__ = ["encode", "decode", "decode_header", "decode_tensors", "DecodeLimits", "default_codec", "Frame"]

Frame = bytes | memoryview
"""What :func:`encode` returns per frame."""


@dataclass(frozen=True, kw_only=True)
class DecodeLimits:
    """Size limits a decoder applies to declared sizes before allocating anything (SPEC §8)."""

    max_header_bytes: int = spec.DEFAULT_MAX_HEADER_BYTES
    """Largest header frame; a larger one is FrameTooLarge before it is parsed."""
    max_frame_bytes: int = spec.DEFAULT_MAX_FRAME_BYTES
    """Largest tensor frame, on the wire (``nbytes``) and decoded (``rawbytes``)."""
    max_rawbytes: Mapping[str, int] | None = None
    """Per tensor name, the largest decoded size (``rawbytes``) the run can use (e.g.
    :meth:`mapl_swarm.wire.content.RunShapes.decode_limits`); a tensor of a name not listed here
    with ``rawbytes`` > 0 is FrameTooLarge. None: only ``max_frame_bytes`` applies."""

    def __post_init__(self) -> None:
        for name in ("max_header_bytes", "max_frame_bytes"):
            value = getattr(self, name)
            if type(value) is not int or value < 1:
                raise ValueError(f"DecodeLimits.{name} must be a positive integer, got {value!r}")
        if self.max_rawbytes is not None:
            table = dict(self.max_rawbytes)
            for name, value in table.items():
                if not isinstance(name, str) or type(value) is not int or value < 0:
                    raise ValueError(f"DecodeLimits.max_rawbytes needs str -> int >= 0, got {name!r}: {value!r}")
            object.__setattr__(self, "max_rawbytes", types.MappingProxyType(table))

    def rawbytes_limit(self, name: str) -> int:
        """The largest ``rawbytes`` accepted for a tensor named ``name``."""
        if self.max_rawbytes is None:
            return self.max_frame_bytes
        return min(self.max_frame_bytes, self.max_rawbytes.get(name, 0))


def default_codec(dtype: str) -> str:
    """Codec the encoder picks for a tag: ``lz4`` for integers (ids, codes), ``raw`` for floats."""
    return "raw" if dtype in spec.FLOAT_DTYPES else "lz4"


def _byte_view(arr: np.ndarray) -> Frame:
    """Bytes of a C-contiguous array as a flat uint8 memoryview sharing its memory."""
    if arr.size == 0:
        return b""
    return memoryview(arr.reshape(-1).view(np.uint8))


def encode(
    msg: Message,
    *,
    compress: str | Mapping[str, str] | None = None,
    max_header_bytes: int = spec.DEFAULT_MAX_HEADER_BYTES,
    max_frame_bytes: int = spec.DEFAULT_MAX_FRAME_BYTES,
) -> list[Frame]:
    """Encode ``msg`` into ZeroMQ frames ``[header, *tensor_frames]``.

    ``compress`` chooses codecs: a codec name for every tensor, or a map from tensor name to codec
    (tensors not named use :func:`default_codec`). ``lz4`` falls back to ``raw`` when it would not
    shrink the frame. Invalid messages raise the WireError the receiver would raise
    (MalformedHeader, BadDtype, BadShape, InvalidMessage, ...).
    """
    major, minor = (tuple(msg.version) + (None, None))[:2]
    if major != spec.PROTOCOL_VERSION[0] or type(minor) is not int:
        raise MalformedHeader(
            f"cannot encode version {msg.version!r}; this peer speaks "
            f"{spec.PROTOCOL_VERSION[0]}.{spec.PROTOCOL_VERSION[1]}"
        )
    check_uint(minor, "minor version", spec.UINT16_MAX)
    check_text(msg.run_id, "run", spec.MAX_RUN_ID_BYTES)
    check_uint(msg.src, "src", spec.UINT16_MAX)
    check_uint(msg.dst, "dst", spec.UINT16_MAX)
    for what, maximum in (("step", spec.UINT64_MAX), ("micro", spec.UINT32_MAX)):
        check_uint(getattr(msg, what), what, maximum)
    for what in ("seq", "pver", "cver", "epoch"):
        check_uint(getattr(msg, what), what, spec.UINT64_MAX)
    if not isinstance(msg.meta, dict):
        raise MalformedHeader(f"meta must be a dict, got {type(msg.meta).__name__}")
    meta = canonical_meta(msg.meta)
    if len(msg.tensors) > spec.MAX_TENSORS:
        raise MalformedHeader(f"{len(msg.tensors)} tensors exceed the limit of {spec.MAX_TENSORS}")
    check_type_rules(msg.type, meta, [(n, t.dtype) for n, t in msg.tensors.items()])

    descriptors: list[Descriptor] = []
    frames: list[Frame] = []
    for name, t in msg.tensors.items():
        check_text(name, "tensor name", spec.MAX_NAME_BYTES)
        if len(t.shape) > spec.MAX_NDIM:
            raise BadShape(f"tensor {name!r}: {len(t.shape)} dimensions exceed {spec.MAX_NDIM}")
        if isinstance(compress, str):
            codec = compress
        elif compress is not None and name in compress:
            codec = compress[name]
        else:
            codec = default_codec(t.dtype)
        if codec not in spec.CODECS:
            raise BadCodec(f"tensor {name!r}: unknown codec {codec!r}")
        arr = t.wire_array()
        if arr.nbytes > max_frame_bytes:
            raise FrameTooLarge(
                f"tensor {name!r}: {arr.nbytes} bytes exceed the limit of {max_frame_bytes}"
            )
        payload = _byte_view(arr)
        if codec == "lz4":
            packed = lz4.block.compress(payload, store_size=False) if arr.nbytes else b""
            if 0 < len(packed) < arr.nbytes:
                payload = packed
            else:
                codec = "raw"
        descriptors.append(
            Descriptor(
                name=name,
                dtype=t.dtype,
                shape=t.shape,
                codec=codec,
                nbytes=len(payload),
                rawbytes=arr.nbytes,
                crc=zlib.crc32(payload),
            )
        )
        frames.append(payload)

    header = Header(
        version=(major, minor),
        type=msg.type,
        run=msg.run_id,
        src=msg.src,
        dst=msg.dst,
        step=msg.step,
        micro=msg.micro,
        seq=msg.seq,
        pver=msg.pver,
        cver=msg.cver,
        meta=meta,
        tensors=tuple(descriptors),
        epoch=msg.epoch,
    )
    head = pack_header(header)
    if len(head) > max_header_bytes:
        raise FrameTooLarge(f"header of {len(head)} bytes exceeds the limit of {max_header_bytes}")
    return [head, *frames]


def _as_buffer(frame: Any) -> memoryview:
    obj = getattr(frame, "buffer", frame)  # zmq.Frame exposes its memory as .buffer
    mv = memoryview(obj)
    if mv.ndim != 1 or mv.itemsize != 1:
        mv = mv.cast("B")
    return mv


def _limits(limits: DecodeLimits | None) -> DecodeLimits:
    if limits is None:
        return DecodeLimits()
    if not isinstance(limits, DecodeLimits):
        raise TypeError(f"limits must be a DecodeLimits, got {type(limits).__name__}")
    return limits


def decode_header(frames: Iterable[Any], limits: DecodeLimits | None = None) -> tuple[Header, tuple[Any, ...]]:
    """Phase 1: parse and check the header of ``frames``; no tensor frame is read.

    Checks header size, msgpack, version, header fields and type (in that order; SPEC §6). Returns
    the :class:`Header` and its raw descriptor maps (unchecked: phase 2 checks them). Raises only
    :class:`WireError` subclasses; callers check run, sender and session on the header before
    calling :func:`decode_tensors`.
    """
    limits = _limits(limits)
    bufs = [_as_buffer(f) for f in frames]
    if not bufs:
        raise FrameCountMismatch("empty message: no header frame")
    h = parse_header(bufs[0], max_header_bytes=limits.max_header_bytes)
    return h, h.tensors


def decode_tensors(header: Header, frames: Iterable[Any], limits: DecodeLimits | None = None) -> Message:
    """Phase 2: the :class:`Message` of ``frames`` whose header :func:`decode_header` returned.

    Descriptors are checked against ``limits`` on their declared sizes before anything is
    allocated; an ``lz4`` frame is inflated into a buffer of exactly ``rawbytes`` bytes.
    """
    limits = _limits(limits)
    bufs = [_as_buffer(f) for f in frames]
    h = header
    descriptors = parse_descriptors(h.tensors, max_frame_bytes=limits.max_frame_bytes,
                                    rawbytes_limit=limits.rawbytes_limit)
    if len(bufs) != 1 + len(descriptors):
        raise FrameCountMismatch(
            f"{len(bufs)} frames for {len(descriptors)} tensors (expected {1 + len(descriptors)})"
        )
    check_type_rules(h.type, h.meta, [(d.name, d.dtype) for d in descriptors])

    tensors: dict[str, WireTensor] = {}
    for d, buf in zip(descriptors, bufs[1:]):
        if buf.nbytes != d.nbytes:
            raise LengthMismatch(f"tensor {d.name!r}: frame of {buf.nbytes} bytes, header says {d.nbytes}")
        if zlib.crc32(buf) != d.crc:
            raise ChecksumMismatch(f"tensor {d.name!r}: CRC-32 mismatch")
        data: Any = buf
        if d.codec == "lz4":
            try:  # a destination of exactly rawbytes: a block that would write more fails
                data = lz4.block.decompress(buf, uncompressed_size=d.rawbytes)
            except Exception as e:  # LZ4BlockError, ValueError on size 0, MemoryError...
                raise DecompressionFailed(
                    f"tensor {d.name!r}: not an LZ4 block decompressing within {d.rawbytes} bytes: {e}"[:200]
                ) from None
            if len(data) != d.rawbytes:
                raise LengthMismatch(
                    f"tensor {d.name!r}: decompressed to {len(data)} bytes, header says {d.rawbytes}"
                )
        arr = np.frombuffer(data, dtype=spec.DTYPES[d.dtype].numpy).reshape(d.shape)
        arr.flags.writeable = False  # the memory belongs to the received frame
        tensors[d.name] = WireTensor(d.dtype, arr)

    return Message(
        type=h.type,
        run_id=h.run,
        src=h.src,
        dst=h.dst,
        step=h.step,
        micro=h.micro,
        seq=h.seq,
        pver=h.pver,
        cver=h.cver,
        epoch=h.epoch,
        meta=h.meta,
        tensors=tensors,
        version=h.version,
    )


def decode(
    frames: Iterable[Any],
    limits: DecodeLimits | None = None,
    *,
    max_header_bytes: int = spec.DEFAULT_MAX_HEADER_BYTES,
    max_frame_bytes: int = spec.DEFAULT_MAX_FRAME_BYTES,
) -> Message:
    """Decode ZeroMQ frames into a :class:`Message`, checking everything SPEC §6 lists.

    :func:`decode_header` then :func:`decode_tensors`. ``limits`` (when given) replaces
    ``max_header_bytes`` / ``max_frame_bytes``. Unknown header and descriptor keys (newer minor
    version) are ignored; ``Message.version`` is the sender's version. Limits apply to declared
    sizes before anything is allocated; bound the total message size at the socket
    (``zmq.MAXMSGSIZE``) as well.
    """
    if limits is None:
        limits = DecodeLimits(max_header_bytes=max_header_bytes, max_frame_bytes=max_frame_bytes)
    frames = list(frames)
    header, _ = decode_header(frames, limits)
    return decode_tensors(header, frames, limits)
