"""Codebook streaming rules of SPEC §5.1: named errors, codebook layout, the receiver's checks.

Pure Python (no torch, numpy, msgpack or lz4; the wire package imports lazily, so importing this
module loads none of them), so the torch codec state (:mod:`mapl_swarm.compress.codebook_sync`,
:mod:`mapl_swarm.compress.vq`) and the wire side (:mod:`mapl_swarm.wire.codebook`, the golden
vectors) apply the very same rules, in the same order:

1. meta and tensor (:class:`SliceMalformed`), 2. shape (:class:`SliceShapeMismatch`),
3. index range (:class:`SliceIndexOutOfRange`; an indexed slice's rows strictly increasing:
:class:`SliceMalformed`), 4. finite values (:class:`SliceMalformed`), 5. version
(:class:`StaleSlice`, :class:`FutureSlice`).

These errors belong to the codebook receiver, not to the frame decoder (the messages are valid
frames), so they are :class:`CodebookError` s and not wire errors.
"""

from __future__ import annotations

from dataclasses import dataclass

from mapl_swarm.errors import MaplError

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
    "APPLY",
    "IGNORE",
    "VQ_CAPABILITY",
    "RETRANSMIT_CAPABILITY",
    "INDEXED_SLICES_CAPABILITY",
    "SliceIndex",
    "STREAMS",
    "code_dtype",
    "check_slice",
    "check_codes",
]

STREAMS = ("act", "grad")
"""Codebook streams: forward Z (``act``) and backward dL/dZ (``grad``)."""

APPLY = "apply"
"""Outcome of :func:`check_slice`: the receiver applies the slice."""
IGNORE = "ignore"
"""Outcome of :func:`check_slice`: a partial slice while awaiting a resync (counted, no error)."""
VQ_CAPABILITY = "vq_stream"
"""HELLO/WELCOME capability of peers that follow SPEC §5.1."""
RETRANSMIT_CAPABILITY = "vq_retransmit"
"""HELLO/WELCOME capability of peers that answer RESYNC ``retransmit`` requests (SPEC §5.1)."""
INDEXED_SLICES_CAPABILITY = "vq_indexed_slices"
"""HELLO/WELCOME capability of peers that accept indexed CODEBOOK_SLICEs (SPEC §5.1)."""


SLICE_VALUE_BOUND = 65504.0
"""A slice's codes lie within ±this (the fp16 range): codebooks are centroids of projected
activations or of their gradients, which no honest sender has beyond it, while a finite absurd
value (1e30) would overflow every reconstruction it enters. Beyond it: ``SliceMalformed``."""

MAX_SLICE_SKIP = 4096
"""How far a full slice's version may lie beyond the receiver's: a sender emits at most one
slice per micro-batch it encodes and cannot run more than its step window ahead of the receiver,
so an honest full slice (after lost ones, or answering a RESYNC) skips far fewer; one beyond it
(version 10^6) is ``FutureSlice``, and the receiver asks for a RESYNC."""


class CodebookError(MaplError):
    """A slice or a VQ code tensor the codebook receiver refuses; ``code`` names it."""

    code = "codebook_error"


class SliceMalformed(CodebookError):
    """Missing/wrong ``stream`` or ``start``, not exactly one tensor ``codes``, ``full`` with
    start != 0, or a non-finite value."""

    code = "slice_malformed"


class SliceShapeMismatch(CodebookError):
    """``codes`` is not (R, r/G, n, G) for this receiver's R, r/G, G; n = 0; full with n != K."""

    code = "slice_shape_mismatch"


class SliceIndexOutOfRange(CodebookError):
    """``start + n > K``."""

    code = "slice_index_out_of_range"


class StaleSlice(CodebookError):
    """The slice's version is not newer than the receiver's (replay or old slice)."""

    code = "stale_slice"


class FutureSlice(CodebookError):
    """A partial slice skipping versions (slices were lost): the receiver asks for a RESYNC."""

    code = "future_slice"


class CodebookVersionMismatch(CodebookError):
    """VQ codes encoded with another codebook version than the receiver holds."""

    code = "codebook_version_mismatch"


class BadCodes(CodebookError):
    """VQ codes missing, of the wrong dtype or shape (not (B, T, R, r/G)), or a code >= K."""

    code = "bad_codes"


CODEBOOK_ERRORS_BY_CODE: dict[str, type[CodebookError]] = {
    cls.code: cls
    for cls in (SliceMalformed, SliceShapeMismatch, SliceIndexOutOfRange, StaleSlice, FutureSlice,
                CodebookVersionMismatch, BadCodes)
}
"""Codebook error class for each stable code."""


@dataclass(frozen=True)
class CodebookLayout:
    """Shape of one stream's codebooks: (rounds, groups, codebook_size, group_size)."""

    rounds: int
    """Residual rounds R."""
    groups: int
    """Groups r/G."""
    codebook_size: int
    """Codes per codebook K."""
    group_size: int
    """Coordinates per group G."""

    @property
    def shape(self) -> tuple[int, int, int, int]:
        """(R, r/G, K, G)."""
        return (self.rounds, self.groups, self.codebook_size, self.group_size)


def code_dtype(codebook_size: int) -> str:
    """Wire dtype of VQ codes: ``uint8`` when K <= 256, else ``uint16`` (K <= 65536)."""
    if not 1 <= codebook_size <= 1 << 16:
        raise ValueError(f"codebook size must be in 1..65536, got {codebook_size}")
    return "uint8" if codebook_size <= 256 else "uint16"


@dataclass(frozen=True)
class SliceIndex:
    """What the rules need to know of an indexed slice's ``index`` tensor (SPEC §5.1)."""

    dtype: str
    shape: tuple[int, ...]
    max_index: int
    """Largest index (0 for an empty tensor)."""
    increasing: bool
    """Every row ``index[k, g, :]`` strictly increasing."""

    @classmethod
    def of(cls, dtype: str, shape: tuple[int, ...], values: list[int]) -> "SliceIndex":
        """Summary of an ``index`` tensor of wire ``dtype`` and ``shape`` from its row-major values."""
        n = shape[-1] if shape else 1
        rows = [values[i:i + n] for i in range(0, len(values), n)] if n else []
        increasing = all(a < b for row in rows for a, b in zip(row, row[1:]))
        return cls(dtype=dtype, shape=tuple(shape), max_index=max(values, default=0), increasing=increasing)


def check_slice(*, stream: str, version: int, start: int, full: bool, shape: tuple[int, ...],
                finite: bool | None, expect_stream: str, layout: CodebookLayout, have: int,
                awaiting_resync: bool = False, index: SliceIndex | None = None, same: bool = False) -> str:
    """Apply SPEC §5.1's receiver rules; returns :data:`APPLY` or :data:`IGNORE`, or raises.

    ``shape`` and ``finite`` describe the slice's codes (``finite=None`` skips that check, for
    callers that test it themselves); ``index`` its ``index`` tensor if any; ``have`` is the
    receiver's version; ``same``: the slice's codes equal the receiver's codebooks (a full slice
    at the receiver's own version is then another replica's copy of it, SPEC §9.10: ignored).
    """
    if stream != expect_stream:
        raise SliceMalformed(f"slice of stream {stream!r} sent to the {expect_stream!r} receiver")
    if full and start != 0:
        raise SliceMalformed(f"a full slice starts at 0, got start {start}")
    R, NG, K, G = layout.shape
    if index is not None:
        if full:
            raise SliceMalformed("a full slice carries no index")
        if start != 0:
            raise SliceMalformed(f"an indexed slice has start 0, got start {start}")
        if index.dtype != code_dtype(K):
            raise SliceMalformed(f"slice index must be {code_dtype(K)} for K={K}, got {index.dtype}")
    shape = tuple(shape)
    if len(shape) != 4 or (shape[0], shape[1], shape[3]) != (R, NG, G) or shape[2] == 0:
        raise SliceShapeMismatch(f"slice codes shape {shape}, expected ({R}, {NG}, n >= 1, {G})")
    n = shape[2]
    if full and n != K:
        raise SliceShapeMismatch(f"full slice of {n} codes, the codebooks hold {K}")
    if index is not None and tuple(index.shape) != (R, NG, n):
        raise SliceShapeMismatch(f"slice index shape {tuple(index.shape)}, expected ({R}, {NG}, {n})")
    if start + n > K:
        raise SliceIndexOutOfRange(f"slice codes {start}..{start + n - 1} outside 0..{K - 1}")
    if index is not None:
        if index.max_index >= K:
            raise SliceIndexOutOfRange(f"slice index {index.max_index} outside 0..{K - 1}")
        if not index.increasing:
            raise SliceMalformed("slice index rows must be strictly increasing")
    if finite is False:
        raise SliceMalformed(f"slice codes contain non-finite values or values beyond ±{SLICE_VALUE_BOUND:g}")
    if full and version > have + MAX_SLICE_SKIP:
        raise FutureSlice(f"full slice version {version} lies more than {MAX_SLICE_SKIP} beyond the receiver's "
                          f"{have}")
    if awaiting_resync:
        return APPLY if full else IGNORE
    if full and same and version == have:
        return IGNORE
    if version <= have:
        raise StaleSlice(f"slice version {version} is not newer than the receiver's {have}")
    if not full and version != have + 1:
        raise FutureSlice(f"slice version {version} skips from {have}: slices were lost")
    return APPLY


def check_codes(*, cver: int, have: int, dtype: str, shape: tuple[int, ...], max_code: int | None,
                layout: CodebookLayout) -> None:
    """SPEC §5.1 checks of an ACT/GRAD ``codes`` tensor: version first, then dtype, shape, range.

    ``max_code`` is the largest code (None for an empty tensor or to skip the range check).
    """
    if cver != have:
        raise CodebookVersionMismatch(f"codes encoded with codebook version {cver}, the receiver "
                                      f"holds version {have}")
    want = code_dtype(layout.codebook_size)
    if dtype != want:
        raise BadCodes(f"codes must be {want} for K={layout.codebook_size}, got {dtype}")
    shape = tuple(shape)
    if len(shape) != 4 or shape[2:] != (layout.rounds, layout.groups):
        raise BadCodes(f"codes shape {shape}, expected (B, T, {layout.rounds}, {layout.groups})")
    if max_code is not None and max_code >= layout.codebook_size:
        raise BadCodes(f"code {max_code} outside 0..{layout.codebook_size - 1}")
