"""Canonical msgpack header (SPEC §2–§4): packing, strict parsing and field checks.

:func:`pack_header` writes a :class:`Header` canonically (fixed key order, ``epoch`` only when not
0, sorted ``meta`` keys, smallest integer widths, float64); :func:`parse_header` reads any
well-formed header, checks the version and every required field (and ``epoch`` when present), and
leaves the tensor descriptors raw so that the caller can check run, sender and session on the
header before looking at them (:func:`parse_descriptors`). Keys this version does not know are
ignored (SPEC §2).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

import msgpack
import numpy as np

from . import spec
from .errors import (
    BadCodec,
    BadDtype,
    BadShape,
    FrameTooLarge,
    LengthMismatch,
    MalformedHeader,
    UnknownMessageType,
    VersionMismatch,
)

__all__ = [
    "Descriptor",
    "Header",
    "pack_header",
    "parse_header",
    "parse_descriptors",
    "canonical_meta",
    "check_uint",
    "check_text",
]


@dataclass(frozen=True)
class Descriptor:
    """One tensor descriptor (SPEC §4), checked."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    codec: str
    nbytes: int
    rawbytes: int
    crc: int

    def to_map(self) -> dict[str, Any]:
        """Descriptor as a map in canonical key order."""
        return {
            "name": self.name,
            "dtype": self.dtype,
            "shape": list(self.shape),
            "codec": self.codec,
            "nbytes": self.nbytes,
            "rawbytes": self.rawbytes,
            "crc": self.crc,
        }


@dataclass(frozen=True)
class Header:
    """Decoded header fields. ``tensors`` holds :class:`Descriptor` (encode) or raw maps (parse)."""

    version: tuple[int, int]
    type: spec.MessageType
    run: str
    src: int
    dst: int
    step: int
    micro: int
    seq: int
    pver: int
    cver: int
    meta: dict[str, Any]
    tensors: tuple[Any, ...]
    epoch: int = 0
    """The sender's run epoch (header ``epoch``, SPEC §9.6): 0 when the key is absent."""


def check_uint(value: Any, what: str, maximum: int, exc: type[Exception] = MalformedHeader) -> int:
    """Return ``value`` if it is an int (not a bool) in ``0..maximum``, else raise ``exc``."""
    if type(value) is not int or not 0 <= value <= maximum:
        raise exc(f"{what} must be an integer in 0..{maximum}, got {value!r:.80}")
    return value


def check_text(value: Any, what: str, max_bytes: int, exc: type[Exception] = MalformedHeader) -> str:
    """Return ``value`` if it is a str of 1..max_bytes UTF-8 bytes, else raise ``exc``."""
    if not isinstance(value, str):
        raise exc(f"{what} must be a string, got {type(value).__name__}")
    try:
        n = len(value.encode("utf-8"))
    except UnicodeEncodeError as e:
        raise exc(f"{what} is not valid UTF-8") from e
    if not 1 <= n <= max_bytes:
        raise exc(f"{what} must have 1..{max_bytes} UTF-8 bytes, got {n}")
    return value


def canonical_meta(value: Any, depth: int = 1, path: str = "meta") -> Any:
    """Check a ``meta`` value and return its canonical form (sorted map keys, plain Python types).

    Numpy scalars become Python scalars and tuples become lists; anything msgpack cannot carry
    losslessly under SPEC §2 raises :class:`MalformedHeader`. ``depth`` counts containers (maps
    and arrays), the ``meta`` map itself being depth 1; a scalar is no level (SPEC §2).
    """
    if isinstance(value, np.generic):
        value = value.item()
    if value is None or isinstance(value, (bool, str, bytes, float)):
        if isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError as e:
                raise MalformedHeader(f"{path}: string is not valid UTF-8") from e
        return value
    if isinstance(value, int):
        if not spec.INT64_MIN <= value <= spec.UINT64_MAX:
            raise MalformedHeader(f"{path}: integer {value} outside int64/uint64")
        return int(value)
    if isinstance(value, (list, tuple, dict)) and depth > spec.MAX_META_DEPTH:
        raise MalformedHeader(f"{path}: containers nested deeper than {spec.MAX_META_DEPTH}")
    if isinstance(value, (list, tuple)):
        return [canonical_meta(v, depth + 1, f"{path}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, dict):
        for k in value:
            if not isinstance(k, str):
                raise MalformedHeader(f"{path}: map key {k!r:.40} is not a string")
            canonical_meta(k, depth, path)
        keys = sorted(value, key=lambda k: k.encode("utf-8"))
        return {k: canonical_meta(value[k], depth + 1, f"{path}.{k}") for k in keys}
    raise MalformedHeader(f"{path}: values of type {type(value).__name__} cannot be sent")


def pack_header(h: Header) -> bytes:
    """Encode ``h`` canonically; ``h.tensors`` must be :class:`Descriptor` objects."""
    m: dict[str, Any] = {
        "v": list(h.version),
        "type": int(h.type),
        "run": h.run,
        "src": h.src,
        "dst": h.dst,
        "step": h.step,
        "micro": h.micro,
        "seq": h.seq,
        "pver": h.pver,
        "cver": h.cver,
    }
    if h.epoch:  # optional: written only when not 0, right after cver
        m[spec.EPOCH_KEY] = h.epoch
    m |= {
        "meta": canonical_meta(h.meta),
        "tensors": [d.to_map() for d in h.tensors],
    }
    return msgpack.packb(m, use_bin_type=True)


def _pairs_hook(pairs: list[tuple[Any, Any]]) -> dict[str, Any]:
    d: dict[str, Any] = {}
    for k, v in pairs:
        if not isinstance(k, str):
            raise MalformedHeader(f"map key {k!r:.40} is not a string")
        if k in d:
            raise MalformedHeader(f"duplicate map key {k!r:.40}")
        d[k] = v
    return d


def _no_ext(code: int, data: bytes) -> Any:
    raise MalformedHeader(f"msgpack extension type {code} is not allowed")


def parse_header(buf: Any, *, max_header_bytes: int = spec.DEFAULT_MAX_HEADER_BYTES) -> Header:
    """Parse and check header frame ``buf``; descriptors in the result are unchecked raw maps.

    Raises FrameTooLarge, MalformedHeader, VersionMismatch or UnknownMessageType.
    """
    n = memoryview(buf).nbytes
    if n > max_header_bytes:
        raise FrameTooLarge(f"header of {n} bytes exceeds the limit of {max_header_bytes}")
    try:
        m = msgpack.unpackb(
            buf, raw=False, strict_map_key=True, object_pairs_hook=_pairs_hook, ext_hook=_no_ext
        )
    except MalformedHeader:
        raise
    except Exception as e:  # msgpack raises many types (ExtraData, FormatError, ValueError...)
        raise MalformedHeader(f"header is not valid msgpack: {type(e).__name__}: {e}"[:200]) from None
    if not isinstance(m, dict):
        raise MalformedHeader(f"header is a msgpack {type(m).__name__}, not a map")
    v = m.get("v")
    if (
        not isinstance(v, list)
        or len(v) != 2
        or any(type(x) is not int or not 0 <= x <= spec.UINT16_MAX for x in v)
    ):
        raise MalformedHeader(f"header key 'v' must be [major, minor] uint16s, got {v!r:.60}")
    if v[0] != spec.PROTOCOL_VERSION[0]:
        raise VersionMismatch((v[0], v[1]), spec.PROTOCOL_VERSION)
    missing = [k for k in spec.HEADER_KEYS if k not in m]
    if missing:
        raise MalformedHeader(f"header lacks required key(s) {', '.join(missing)}")
    type_code = check_uint(m["type"], "type", spec.UINT16_MAX)
    run = check_text(m["run"], "run", spec.MAX_RUN_ID_BYTES)
    src = check_uint(m["src"], "src", spec.UINT16_MAX)
    dst = check_uint(m["dst"], "dst", spec.UINT16_MAX)
    step = check_uint(m["step"], "step", spec.UINT64_MAX)
    micro = check_uint(m["micro"], "micro", spec.UINT32_MAX)
    seq = check_uint(m["seq"], "seq", spec.UINT64_MAX)
    pver = check_uint(m["pver"], "pver", spec.UINT64_MAX)
    cver = check_uint(m["cver"], "cver", spec.UINT64_MAX)
    epoch = check_uint(m.get(spec.EPOCH_KEY, 0), spec.EPOCH_KEY, spec.UINT64_MAX)
    meta = m["meta"]
    if not isinstance(meta, dict):
        raise MalformedHeader(f"header key 'meta' must be a map, got {type(meta).__name__}")
    canonical_meta(meta)  # checks value types and depth
    tensors = m["tensors"]
    if not isinstance(tensors, list):
        raise MalformedHeader(f"header key 'tensors' must be an array, got {type(tensors).__name__}")
    if len(tensors) > spec.MAX_TENSORS:
        raise MalformedHeader(f"{len(tensors)} tensors exceed the limit of {spec.MAX_TENSORS}")
    try:
        mtype = spec.MessageType(type_code)
    except ValueError:
        raise UnknownMessageType(f"unknown message type {type_code}") from None
    return Header(
        version=(v[0], v[1]),
        type=mtype,
        run=run,
        src=src,
        dst=dst,
        step=step,
        micro=micro,
        seq=seq,
        pver=pver,
        cver=cver,
        meta=meta,
        tensors=tuple(tensors),
        epoch=epoch,
    )


def _parse_descriptor(i: int, d: Any, max_frame_bytes: int,
                      rawbytes_limit: Callable[[str], int] | None = None) -> Descriptor:
    if not isinstance(d, dict):
        raise MalformedHeader(f"tensor descriptor {i} is not a map")
    missing = [k for k in spec.DESCRIPTOR_KEYS if k not in d]
    if missing:
        raise MalformedHeader(f"tensor descriptor {i} lacks key(s) {', '.join(missing)}")
    name = check_text(d["name"], f"tensor {i} name", spec.MAX_NAME_BYTES)
    dtype = d["dtype"]
    if not isinstance(dtype, str) or dtype not in spec.DTYPES:
        raise BadDtype(f"tensor {name!r}: unknown dtype {dtype!r:.40}")
    shape = d["shape"]
    if not isinstance(shape, list) or any(type(x) is not int or x < 0 for x in shape):
        raise BadShape(f"tensor {name!r}: shape must be non-negative integers, got {shape!r:.80}")
    if len(shape) > spec.MAX_NDIM:
        raise BadShape(f"tensor {name!r}: {len(shape)} dimensions exceed {spec.MAX_NDIM}")
    codec = d["codec"]
    if not isinstance(codec, str) or codec not in spec.CODECS:
        raise BadCodec(f"tensor {name!r}: unknown codec {codec!r:.40}")
    nbytes = check_uint(d["nbytes"], f"tensor {name!r} nbytes", spec.UINT64_MAX)
    rawbytes = check_uint(d["rawbytes"], f"tensor {name!r} rawbytes", spec.UINT64_MAX)
    crc = check_uint(d["crc"], f"tensor {name!r} crc", spec.UINT32_MAX)
    for what, size in (("on the wire", nbytes), ("decoded", rawbytes)):
        if size > max_frame_bytes:
            raise FrameTooLarge(
                f"tensor {name!r}: {size} bytes {what} exceed the limit of {max_frame_bytes}"
            )
    if rawbytes_limit is not None and rawbytes > (limit := rawbytes_limit(name)):
        raise FrameTooLarge(f"tensor {name!r}: {rawbytes} bytes decoded exceed this run's limit of {limit} "
                            f"for that name")
    expected = math.prod(shape) * spec.DTYPES[dtype].itemsize
    if rawbytes != expected:
        raise LengthMismatch(
            f"tensor {name!r}: rawbytes {rawbytes} != {expected} for shape {shape} {dtype}"
        )
    if codec == "raw" and nbytes != rawbytes:
        raise LengthMismatch(f"tensor {name!r}: raw codec with nbytes {nbytes} != rawbytes {rawbytes}")
    return Descriptor(name, dtype, tuple(shape), codec, nbytes, rawbytes, crc)


def parse_descriptors(
    raw: tuple[Any, ...], *, max_frame_bytes: int = spec.DEFAULT_MAX_FRAME_BYTES,
    rawbytes_limit: Callable[[str], int] | None = None,
) -> tuple[Descriptor, ...]:
    """Check raw descriptor maps (SPEC §4) and return them as :class:`Descriptor` objects.

    ``rawbytes_limit(name)``, when given, bounds each tensor's declared decoded size by name.
    """
    out = tuple(_parse_descriptor(i, d, max_frame_bytes, rawbytes_limit) for i, d in enumerate(raw))
    names = [d.name for d in out]
    if len(set(names)) != len(names):
        raise MalformedHeader(f"duplicate tensor names in {names}")
    return out
