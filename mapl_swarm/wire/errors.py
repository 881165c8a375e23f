"""Named wire errors (SPEC §6).

Every rejection of a message raises a subclass of :class:`WireError` with a stable ``code``
string; decoding arbitrary bytes raises nothing else. Encoding an invalid :class:`Message`
raises the same classes, so a peer never sends what its neighbour would reject.
"""

from __future__ import annotations

from mapl_swarm.errors import MaplError

__all__ = [
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


class WireError(MaplError):
    """Base class of every wire rejection; ``code`` names it on the wire (ERROR, logs, vectors)."""

    code = "wire_error"


class MalformedHeader(WireError):
    """Header frame is not msgpack, not a map, or has missing/mistyped/duplicate fields."""

    code = "malformed_header"


class UnknownMessageType(WireError):
    """The ``type`` code is not a message type of this major version."""

    code = "unknown_message_type"


class VersionMismatch(WireError):
    """The peer speaks another major version; the message names both versions."""

    code = "version_mismatch"

    def __init__(self, peer: tuple[int, int], local: tuple[int, int]) -> None:
        self.peer_version = tuple(peer)
        self.local_version = tuple(local)
        super().__init__(
            f"peer speaks {peer[0]}.{peer[1]}, this peer speaks {local[0]}.{local[1]}"
        )

    def __reduce__(self):  # keep picklable despite the custom __init__
        return (type(self), (self.peer_version, self.local_version))


class FrameCountMismatch(WireError):
    """Number of frames differs from 1 + number of tensor descriptors."""

    code = "frame_count_mismatch"


class LengthMismatch(WireError):
    """A frame or decoded buffer has another length than its descriptor says."""

    code = "length_mismatch"


class ChecksumMismatch(WireError):
    """CRC-32 of a tensor frame differs from its descriptor."""

    code = "checksum_mismatch"


class FrameTooLarge(WireError):
    """Header or tensor frame (on the wire or decoded) exceeds the configured limit."""

    code = "frame_too_large"


class BadDtype(WireError):
    """Unknown dtype tag, or a non-fp32 tensor where the spec requires fp32."""

    code = "bad_dtype"


class BadShape(WireError):
    """Shape is not a list of at most 8 non-negative integers."""

    code = "bad_shape"


class BadCodec(WireError):
    """Codec is neither ``raw`` nor ``lz4``."""

    code = "bad_codec"


class DecompressionFailed(WireError):
    """An ``lz4`` frame is not a valid LZ4 block."""

    code = "decompression_failed"


class InvalidMessage(WireError):
    """Per-type rule broken: required meta field missing or mistyped, tensors on a control type."""

    code = "invalid_message"


ERRORS_BY_CODE: dict[str, type[WireError]] = {
    cls.code: cls
    for cls in (
        MalformedHeader,
        UnknownMessageType,
        VersionMismatch,
        FrameCountMismatch,
        LengthMismatch,
        ChecksumMismatch,
        FrameTooLarge,
        BadDtype,
        BadShape,
        BadCodec,
        DecompressionFailed,
        InvalidMessage,
    )
}
"""Error class for each stable code."""
