"""Wire protocol 2.2: messages <-> ZeroMQ multipart frames (normative text: protocol/SPEC.md).

Imports no torch; tensors are numpy arrays (bf16 as its raw ``uint16`` bit patterns). Messages carry
no authentication tag: CURVE with per-peer keys authenticates every connection (SPEC §7).

API
---
``Message(*, type, run_id, src, dst, step=0, micro=0, seq=0, pver=0, cver=0, epoch=0, meta={},
tensors={}, version=PROTOCOL_VERSION)``
    One message. ``type`` is a :class:`MessageType`; ``tensors`` maps names (frame order) to
    :class:`WireTensor` (a plain numpy array is wrapped with its inferred tag). ``epoch`` is the
    sender's run epoch, header key ``epoch``, written only when not 0 (SPEC §9.6 rejoin).
``WireTensor(dtype, data)`` / ``WireTensor.from_array(array, dtype=None)``
    Dtype tag (``bf16 fp16 fp32 fp64 uint8 uint16 uint32 int32 int64``) plus numpy elements.
``encode(msg, *, compress=None, max_header_bytes=64 KiB, max_frame_bytes=256 MiB)
-> list[bytes | memoryview]``
    Canonical header frame, then one frame per tensor. ``raw`` tensor frames are memoryviews of
    the arrays (zero copy: keep them unchanged until sent). ``compress``: one codec for all
    tensors or ``{name: "raw" | "lz4"}``; default ``lz4`` for integer tags, ``raw`` for floats;
    ``lz4`` falls back to ``raw`` when it does not shrink.
``decode(frames, limits=None, *, max_header_bytes=64 KiB, max_frame_bytes=256 MiB) -> Message``
    Raises only :class:`WireError` subclasses on bad input; unknown header/descriptor keys of the
    same major are ignored; ``raw`` tensors are read-only views of the frames. It is
``decode_header(frames, limits=None) -> (Header, raw descriptors)`` (size, msgpack, version,
fields, type: check run, sender and session here) followed by
``decode_tensors(header, frames, limits=None) -> Message`` (descriptors against
:class:`DecodeLimits` on declared sizes, frame count, per-type rules, frames; LZ4 inflates into
exactly ``rawbytes``).
``DecodeLimits(max_header_bytes, max_frame_bytes, max_rawbytes={name: bytes} | None)``.
``new_nonce()`` (the handshake nonces, SPEC §9.2): :mod:`mapl_swarm.wire.session`.
``default_codec(dtype) -> str``; ``MessageType``; ``PROTOCOL_VERSION``; ``META_SCHEMA``.

Errors (``.code``): MalformedHeader, UnknownMessageType, VersionMismatch (``peer speaks 1.9,
this peer speaks 2.0``; ``.peer_version``, ``.local_version``), FrameCountMismatch,
LengthMismatch, ChecksumMismatch, FrameTooLarge, BadDtype, BadShape, BadCodec,
DecompressionFailed, InvalidMessage — all subclasses of :class:`WireError`
(itself a ``mapl_swarm.errors.MaplError``); ``ERRORS_BY_CODE`` maps codes to classes.

``meta`` per type (required; optional): HELLO/WELCOME ``fingerprint`` str, ``num_stages`` uint,
``capabilities`` [str], ``nonce`` (16-byte bin), ``num_micro_batches``, ``micro_batch_size``
(uint >= 1), ``eval_batches`` (uint) and for WELCOME ``hello_nonce``; ``components`` map, ``peer``
str, ``config`` map, ``anchored`` bool, ``max_in_flight`` uint >= 1, ``cert`` bin. REJECT ``code``,
``reason`` str; ``local``, ``remote``, ``hello_nonce``, ``anchored`` bool. ACT ``mode``
"train"|"eval". PROJ_GRAD —; ``micro_batches`` uint. REPORT ``loss`` float, ``tokens`` uint;
``mode``, ``metrics`` {str: number}. HEARTBEAT —; ``sent_ns``, ``echo_ns``, ``held_ns`` uint
(round trips, SPEC §9.5), ``anchored`` bool. BYE —; ``reason`` str, ``lost`` uint. ERROR ``code``,
``message`` str; ``ref_seq`` uint. CODEBOOK_SLICE —; ``stream`` "act"|"grad", ``start`` uint,
``full`` bool. RESYNC —; ``stream``, ``have`` uint, ``reason`` str, ``retransmit`` bool, ``mode``.
CHECKPOINT ``phase`` "saved"|"complete"|"offer"|"resume"|"drain_request"|"drain"|"unsaved"|
"abandoned" (step and reason required for the last two); ``step`` uint|nil, ``steps`` [uint],
``have`` {str: [uint]}, ``reason`` str, ``epoch`` uint (offer, resume) (per-phase rules of SPEC
§5.2). GRAD, PROJ: none. PROJ, PROJ_GRAD and CODEBOOK_SLICE tensors must be fp32 (BadDtype; a
CODEBOOK_SLICE ``index`` is uint8/uint16); HELLO, WELCOME, REJECT, REPORT, RESYNC, HEARTBEAT, BYE,
ERROR, CHECKPOINT carry none.

Content checks (SPEC §6.1): :mod:`mapl_swarm.wire.content` — ``RunShapes``, ``Window``,
``ContentError(code, text)``, ``check_sender``, ``check_epoch`` (``stale_epoch`` against the
receiver's run epoch), ``check_header``, ``check_declared``, ``check_content`` (a PROJ more than
``spec.PROJ_ORTHONORMAL_TOL`` off orthonormal is ``not_orthonormal``), ``CONTENT_CODES``.

Rejoin (SPEC §9.6): ``REJOIN_CAPABILITY`` (HELLO/WELCOME capability ``"rejoin"``) and
``REJOIN_REASON`` (BYE ``reason`` ``"rejoin"``, with ``lost`` the departed stage).

Codebook streaming (SPEC §5.1): slice/RESYNC messages in :mod:`mapl_swarm.wire.codebook`, the
receiver's checks in :mod:`mapl_swarm.wire.codebook_rules` (pure Python, shared with the torch codec
state in :mod:`mapl_swarm.compress`).

Golden vectors (tooling, not imported by the runtime modules): :mod:`mapl_swarm.wire.golden`;
``python -m mapl_swarm.wire.golden --out protocol/vectors/v2`` (regenerate),
``python -m mapl_swarm.wire.golden --check protocol/vectors/v2`` (verify).

The package imports lazily (the names above load their module on first use), so that
:mod:`mapl_swarm.wire.codebook_rules` can be imported by the in-process stack without msgpack,
lz4 or numpy.
"""

from __future__ import annotations

from mapl_swarm.lazy import lazy_exports

_ERRORS = ("ERRORS_BY_CODE", "BadCodec", "BadDtype", "BadShape", "ChecksumMismatch",
           "DecompressionFailed", "FrameCountMismatch", "FrameTooLarge", "InvalidMessage", "LengthMismatch",
           "MalformedHeader", "UnknownMessageType", "VersionMismatch", "WireError")
_EXPORTS = {
    **{name: "mapl_swarm.wire.errors" for name in _ERRORS},
    **{name: "mapl_swarm.wire.frames" for name in ("decode", "decode_header", "decode_tensors", "DecodeLimits",
                                                   "default_codec", "encode")},
    "Header": "mapl_swarm.wire.header",
    "new_nonce": "mapl_swarm.wire.session",
    **{name: "mapl_swarm.wire.content" for name in ("CONTENT_CODES", "ContentError", "RunShapes", "Window",
                                                    "check_sender", "check_epoch", "check_header",
                                                    "check_declared", "check_content")},
    **{name: "mapl_swarm.wire.message" for name in ("META_SCHEMA", "Message", "WireTensor")},
    **{name: "mapl_swarm.wire.spec" for name in ("DTYPES", "PROTOCOL_VERSION", "MessageType", "REJOIN_CAPABILITY",
                                                 "REJOIN_REASON")},
}

__all__ = [
    "Message",
    "WireTensor",
    "MessageType",
    "PROTOCOL_VERSION",
    "REJOIN_CAPABILITY",
    "REJOIN_REASON",
    "DTYPES",
    "META_SCHEMA",
    "encode",
    "decode",
    "decode_header",
    "decode_tensors",
    "Header",
    "DecodeLimits",
    "default_codec",
    "new_nonce",
    "CONTENT_CODES",
    "ContentError",
    "RunShapes",
    "Window",
    "check_sender",
    "check_epoch",
    "check_header",
    "check_declared",
    "check_content",
    "WireError",
    "MalformedHeader",
    "UnknownMessageType",
    "VersionMismatch",
    "FrameCountMismatch",
    "LengthMismatch",
    "ChecksumMismatch",
    "FrameTooLarge",
    "BadDtype",
    "BadShape",
    "BadCodec",
    "DecompressionFailed",
    "InvalidMessage",
    "ERRORS_BY_CODE",
]


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
