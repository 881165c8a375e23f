"""Codebook streaming messages (SPEC §5.1): CODEBOOK_SLICE / RESYNC builders and readers.

The receiver's rules themselves live in :mod:`mapl_swarm.wire.codebook_rules` (pure Python, shared with
the torch codec state); this module re-exports them and adds what needs wire messages:

* :func:`slice_parts` — THE CODEBOOK_SLICE encoder: header ``cver``, ``meta`` and tensors by wire
  name, for any array type (peers pass torch tensors, :func:`slice_message` numpy arrays);
* :func:`slice_fields` — its inverse, reading a decoded slice;
* :func:`receiver_outcome` — what a receiver does with a decoded message (the golden vectors);
* :func:`slice_message`, :func:`resync_message`, :func:`resync_meta` — message builders.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import numpy as np

from .codebook_rules import (
    APPLY,
    CODEBOOK_ERRORS_BY_CODE,
    IGNORE,
    INDEXED_SLICES_CAPABILITY,
    RETRANSMIT_CAPABILITY,
    SLICE_VALUE_BOUND,
    VQ_CAPABILITY,
    BadCodes,
    CodebookError,
    CodebookLayout,
    CodebookVersionMismatch,
    FutureSlice,
    SliceIndexOutOfRange,
    SliceMalformed,
    SliceIndex,
    SliceShapeMismatch,
    StaleSlice,
    check_codes,
    check_slice,
    code_dtype,
)

from . import spec
from .message import Message, WireTensor
from .spec import MessageType

__all__ = [
    "CodebookError",
    "SliceMalformed",
    "SliceShapeMismatch",
    "SliceIndexOutOfRange",
    "StaleSlice",
    "FutureSlice",
    "CodebookVersionMismatch",
    "BadCodes",
    "CODEBOOK_ERRORS_BY_CODE",
    "CodebookLayout",
    "SliceFields",
    "SliceParts",
    "APPLY",
    "IGNORE",
    "VQ_CAPABILITY",
    "RETRANSMIT_CAPABILITY",
    "INDEXED_SLICES_CAPABILITY",
    "SliceIndex",
    "code_dtype",
    "slice_parts",
    "slice_fields",
    "check_slice",
    "check_codes",
    "receiver_outcome",
    "slice_message",
    "resync_message",
    "resync_meta",
]


ArrayT = TypeVar("ArrayT")


@dataclass(frozen=True)
class SliceParts(Generic[ArrayT]):
    """What a CODEBOOK_SLICE carries besides its routing header (run, src, dst, step, micro, seq)."""

    cver: int
    """Header ``cver``: the stream's version after the slice."""
    meta: dict[str, Any]
    """``stream``, ``start``, and ``full: True`` for a full slice (absent otherwise)."""
    tensors: dict[str, ArrayT]
    """``codes`` (fp32 (R, r/G, n, G)), then ``index`` (uint8/uint16 (R, r/G, n)) for an indexed slice."""


def slice_parts(*, stream: str, version: int, start: int, full: bool, codes: ArrayT,
                index: ArrayT | None = None) -> SliceParts[ArrayT]:
    """The CODEBOOK_SLICE encoder (SPEC §5.1), used by peers, :func:`slice_message` and the golden
    vectors; :func:`slice_fields` reads what it writes.

    The arrays pass through unchanged (numpy arrays or torch tensors: whoever builds the
    :class:`Message` converts them). It enforces none of the receiver's rules, so tests and the
    golden vectors can build slices a receiver must refuse.
    """
    meta: dict[str, Any] = {"stream": stream, "start": int(start)}
    if full:
        meta["full"] = True
    tensors = {"codes": codes} if index is None else {"codes": codes, "index": index}
    return SliceParts(cver=int(version), meta=meta, tensors=tensors)


@dataclass(frozen=True)
class SliceFields:
    """What a CODEBOOK_SLICE says (meta and tensor checked, layout not yet)."""

    stream: str
    version: int
    """Header ``cver``: the stream's version after the slice."""
    start: int
    full: bool
    codes: np.ndarray
    """fp32 array (R, r/G, n, G) (read-only view of the frame when decoded)."""
    index: np.ndarray | None = None
    """Indexed slice: uint8/uint16 array (R, r/G, n) of the codes' positions."""
    index_dtype: str | None = None


def slice_fields(msg: Message) -> SliceFields:
    """Read a CODEBOOK_SLICE's fields (the inverse of :func:`slice_parts`); :class:`SliceMalformed`
    when meta or tensors are wrong."""
    if msg.type is not MessageType.CODEBOOK_SLICE:
        raise SliceMalformed(f"expected CODEBOOK_SLICE, got {msg.type.name}")
    meta = msg.meta
    stream, start, full = meta.get("stream"), meta.get("start"), meta.get("full", False)
    if stream not in spec.STREAMS:
        raise SliceMalformed(f"slice meta.stream must be one of {spec.STREAMS}, got {stream!r:.40}")
    if type(start) is not int or start < 0:
        raise SliceMalformed(f"slice meta.start must be a non-negative integer, got {start!r:.40}")
    if type(full) is not bool:
        raise SliceMalformed(f"slice meta.full must be a bool, got {full!r:.40}")
    if list(msg.tensors) not in (["codes"], ["codes", "index"]):
        raise SliceMalformed(f"a slice carries the tensor 'codes', then optionally 'index', got {list(msg.tensors)}")
    t = msg.tensors["codes"]
    if t.dtype != "fp32":
        raise SliceMalformed(f"slice codes must be fp32, got {t.dtype}")
    index = msg.tensors.get("index")
    return SliceFields(stream=stream, version=msg.cver, start=start, full=full, codes=t.wire_array(),
                       index=None if index is None else index.wire_array(),
                       index_dtype=None if index is None else index.dtype)


def receiver_outcome(msg: Message, *, stream: str, layout: CodebookLayout, have: int,
                     awaiting_resync: bool = False, holds_slice: bool = False) -> str:
    """What a ``stream`` receiver at version ``have`` does with a decoded message: a
    CODEBOOK_SLICE gives :data:`APPLY` or :data:`IGNORE`, ACT/GRAD codes :data:`APPLY` (decodable);
    otherwise the :class:`CodebookError` is raised. ``holds_slice``: the receiver's codebooks equal
    the slice's codes (SPEC §9.10 item 12). Used by the golden vectors."""
    if msg.type is MessageType.CODEBOOK_SLICE:
        f = slice_fields(msg)
        shape = f.codes.shape
        finite = bool((np.abs(f.codes) <= SLICE_VALUE_BOUND).all())  # NaN fails the comparison
        index = None if f.index is None else SliceIndex.of(f.index_dtype, f.index.shape, f.index.ravel().tolist())
        return check_slice(stream=f.stream, version=f.version, start=f.start, full=f.full, shape=shape,
                           finite=finite, expect_stream=stream, layout=layout, have=have,
                           awaiting_resync=awaiting_resync, index=index, same=holds_slice)
    if msg.type in (MessageType.ACT, MessageType.GRAD):
        t = msg.tensors.get("codes")
        if t is None:
            raise BadCodes(f"{msg.type.name} carries no 'codes' tensor")
        a = t.wire_array()
        check_codes(cver=msg.cver, have=have, dtype=t.dtype, shape=t.shape,
                    max_code=int(a.max()) if a.size else None, layout=layout)
        return APPLY
    raise CodebookError(f"{msg.type.name} is not a codebook message")


_SLICE_WIRE = {
    "codes": lambda a: WireTensor("fp32", np.ascontiguousarray(a, dtype="<f4")),
    "index": lambda a: WireTensor.from_array(np.ascontiguousarray(a)),
}
"""numpy array -> WireTensor for each slice tensor name."""


def slice_message(*, run_id: str, src: int, dst: int, stream: str, version: int, start: int,
                  full: bool, codes: np.ndarray, step: int = 0, micro: int = 0, seq: int = 0,
                  pver: int = 0, index: np.ndarray | None = None,
                  version_tuple: tuple[int, int] = spec.PROTOCOL_VERSION, epoch: int = 0) -> Message:
    """A CODEBOOK_SLICE message from :func:`slice_parts` (``codes``: float32 array (R, r/G, n, G);
    ``index``: an indexed slice's uint8/uint16 array (R, r/G, n))."""
    p = slice_parts(stream=stream, version=version, start=start, full=full, codes=codes, index=index)
    tensors = {name: _SLICE_WIRE[name](a) for name, a in p.tensors.items()}
    return Message(type=MessageType.CODEBOOK_SLICE, run_id=run_id, src=src, dst=dst, step=step,
                   micro=micro, seq=seq, pver=pver, cver=p.cver, epoch=epoch, meta=p.meta, tensors=tensors,
                   version=version_tuple)


def resync_message(*, run_id: str, src: int, dst: int, stream: str, have: int, reason: str = "",
                   retransmit: tuple[int, int, str] | None = None,
                   version_tuple: tuple[int, int] = spec.PROTOCOL_VERSION, epoch: int = 0) -> Message:
    """A RESYNC message asking the ``stream`` sender ``dst`` for a full slice; with ``retransmit``
    = (step, micro, mode) also for that ACT/GRAD re-encoded against the new mirror."""
    meta: dict[str, Any] = resync_meta(stream, have, reason, retransmit)
    step, micro = retransmit[:2] if retransmit is not None else (0, 0)
    return Message(type=MessageType.RESYNC, run_id=run_id, src=src, dst=dst, step=step, micro=micro,
                   epoch=epoch, meta=meta, version=version_tuple)


def resync_meta(stream: str, have: int, reason: str = "",
                retransmit: tuple[int, int, str] | None = None) -> dict[str, Any]:
    """RESYNC ``meta``: ``stream``, ``have``, ``reason`` if any; ``retransmit`` and ``mode`` when
    asking for a retransmission (its step and micro go in the header)."""
    meta: dict[str, Any] = {"stream": stream, "have": int(have)}
    if reason:
        meta["reason"] = reason
    if retransmit is not None:
        meta["retransmit"] = True
        meta["mode"] = retransmit[2]
    return meta
