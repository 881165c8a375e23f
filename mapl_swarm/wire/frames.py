"""Messages <-> ZeroMQ multipart frames (SPEC §1, §4, §6, §7).

:func:`encode` returns ``[header, *tensor_frames]``; an uncompressed tensor frame is a
``memoryview`` of the source array's memory (no copy), so it must stay unchanged until the send
has completed (pyzmq ``copy=False``). :func:`decode` accepts ``bytes``, ``memoryview`` or any
buffer (``zmq.Frame`` via its ``.buffer``) and raises only :class:`WireError` subclasses for any
bytes it is given; ``raw`` tensors come back as read-only numpy views of the received frames.
"""

from __future__ import annotations

import hashlib
import hmac
import struct
import zlib
from typing import Any, Iterable, Mapping, Sequence

import lz4.block
import numpy as np

from . import spec
from .errors import (
    AuthFailed,
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

__all__ = ["encode", "decode", "default_codec", "compute_tag", "Frame"]

Frame = bytes | memoryview
"""What :func:`encode` returns per frame."""

_ZERO_TAG = bytes(spec.AUTH_TAG_BYTES)


def default_codec(dtype: str) -> str:
    """Codec the encoder picks for a tag: ``lz4`` for integers (ids, codes), ``raw`` for floats."""
    return "raw" if dtype in spec.FLOAT_DTYPES else "lz4"


def _check_secret(secret: Any) -> bytes | None:
    if secret is None:
        return None
    if not isinstance(secret, (bytes, bytearray, memoryview)):
        raise TypeError(f"secret must be bytes, got {type(secret).__name__}")
    secret = bytes(secret)
    if not secret:
        raise ValueError("secret must not be empty (use None for no authentication)")
    return secret


def compute_tag(secret: bytes, head: Any, tensor_frames: Sequence[Any]) -> bytes:
    """HMAC-SHA256 tag of SPEC §7; ``head`` is the header frame without its last 32 bytes."""
    mac = hmac.new(secret, digestmod=hashlib.sha256)
    mac.update(spec.MAC_DOMAIN)
    mac.update(struct.pack("<I", 1 + len(tensor_frames)))
    for f in (head, *tensor_frames):
        mac.update(struct.pack("<Q", memoryview(f).nbytes))
        mac.update(f)
    return mac.digest()


def _byte_view(arr: np.ndarray) -> Frame:
    """Bytes of a C-contiguous array as a flat uint8 memoryview sharing its memory."""
    if arr.size == 0:
        return b""
    return memoryview(arr.reshape(-1).view(np.uint8))


def encode(
    msg: Message,
    *,
    secret: bytes | None = None,
    compress: str | Mapping[str, str] | None = None,
    max_header_bytes: int = spec.DEFAULT_MAX_HEADER_BYTES,
    max_frame_bytes: int = spec.DEFAULT_MAX_FRAME_BYTES,
) -> list[Frame]:
    """Encode ``msg`` into ZeroMQ frames ``[header, *tensor_frames]``.

    ``compress`` chooses codecs: a codec name for every tensor, or a map from tensor name to codec
    (tensors not named use :func:`default_codec`). ``lz4`` falls back to ``raw`` when it would not
    shrink the frame. ``secret`` (bytes) adds the HMAC tag. Invalid messages raise the WireError
    the receiver would raise (MalformedHeader, BadDtype, BadShape, InvalidMessage, ...).
    """
    secret = _check_secret(secret)
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
    for what in ("seq", "pver", "cver"):
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
        auth=_ZERO_TAG if secret is not None else None,
    )
    head = pack_header(header)
    if len(head) > max_header_bytes:
        raise FrameTooLarge(f"header of {len(head)} bytes exceeds the limit of {max_header_bytes}")
    if secret is not None:
        body = head[: -spec.AUTH_TAG_BYTES]
        head = body + compute_tag(secret, body, frames)
    return [head, *frames]


def _as_buffer(frame: Any) -> memoryview:
    obj = getattr(frame, "buffer", frame)  # zmq.Frame exposes its memory as .buffer
    mv = memoryview(obj)
    if mv.ndim != 1 or mv.itemsize != 1:
        mv = mv.cast("B")
    return mv


def _authenticate(h: Header, bufs: list[memoryview], secret: bytes | None) -> None:
    if secret is None:
        if h.auth is not None:
            raise AuthFailed("message carries an auth tag but this peer has no secret")
        return
    if h.auth is None:
        raise AuthFailed("message has no auth tag but this run has a secret")
    if len(h.auth) != spec.AUTH_TAG_BYTES or bufs[0][-spec.AUTH_TAG_BYTES :] != h.auth:
        raise AuthFailed("auth must be the last header key, a 32-byte bin")
    expected = compute_tag(secret, bufs[0][: -spec.AUTH_TAG_BYTES], bufs[1:])
    if not hmac.compare_digest(expected, h.auth):
        raise AuthFailed("auth tag mismatch: wrong secret or altered message")


def decode(
    frames: Iterable[Any],
    *,
    secret: bytes | None = None,
    max_header_bytes: int = spec.DEFAULT_MAX_HEADER_BYTES,
    max_frame_bytes: int = spec.DEFAULT_MAX_FRAME_BYTES,
) -> Message:
    """Decode ZeroMQ frames into a :class:`Message`, checking everything SPEC §6 lists.

    Unknown header and descriptor keys (newer minor version) are ignored; ``Message.version``
    is the sender's version. Limits apply to declared sizes before anything is allocated; bound
    the total message size at the socket (``zmq.MAXMSGSIZE``) as well.
    """
    secret = _check_secret(secret)
    bufs = [_as_buffer(f) for f in frames]
    if not bufs:
        raise FrameCountMismatch("empty message: no header frame")
    h = parse_header(bufs[0], max_header_bytes=max_header_bytes)
    _authenticate(h, bufs, secret)
    descriptors = parse_descriptors(h.tensors, max_frame_bytes=max_frame_bytes)
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
            try:
                data = lz4.block.decompress(buf, uncompressed_size=d.rawbytes)
            except Exception as e:  # LZ4BlockError, ValueError on size 0, MemoryError...
                raise DecompressionFailed(f"tensor {d.name!r}: {e}"[:200]) from None
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
        meta=h.meta,
        tensors=tensors,
        version=h.version,
    )
