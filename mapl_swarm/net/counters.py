"""Byte accounting for multipart messages: payload size, ZMTP wire-size estimate, traffic counters.

Sizes used everywhere in :mod:`mapl_swarm.net`:

- **payload bytes** — the sum of the frames' lengths (what the caller handed over).
- **wire bytes** — payload plus the ZMTP 3.x framing ZeroMQ adds per frame: a 1-byte flags
  field and a 1-byte length for frames of at most 255 bytes (:data:`ZMTP_SHORT_FRAME_OVERHEAD`
  = 2 bytes), or an 8-byte length otherwise (:data:`ZMTP_LONG_FRAME_OVERHEAD` = 9 bytes).
  TCP/IP headers (~3% of a full-size segment) and the one-off ZMTP handshake are *not*
  included; the ROUTER identity frame is local to the receiver and never travels.

The link emulator shapes on wire bytes; counters record both so benchmarks can report either.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Iterable, Sequence, Union

__all__ = [
    "Frame",
    "DIRECTIONS",
    "ZMTP_SHORT_FRAME_OVERHEAD",
    "ZMTP_LONG_FRAME_OVERHEAD",
    "frame_nbytes",
    "payload_bytes",
    "zmtp_wire_bytes",
    "Traffic",
    "TrafficCounters",
]

Frame = Union[bytes, bytearray, memoryview]
"""One frame of a multipart message; any contiguous buffer (memoryviews travel zero-copy)."""

DIRECTIONS = ("tx", "rx")
"""Counter directions: ``tx`` = sent by this peer, ``rx`` = received by this peer."""

ZMTP_SHORT_FRAME_OVERHEAD = 2
"""ZMTP 3.x bytes of framing for a frame of at most 255 bytes (flags + 1-byte size)."""

ZMTP_LONG_FRAME_OVERHEAD = 9
"""ZMTP 3.x bytes of framing for a frame longer than 255 bytes (flags + 8-byte size)."""


def frame_nbytes(frame: Frame) -> int:
    """Byte length of one frame (a memoryview's ``nbytes``, not its item count)."""
    return frame.nbytes if isinstance(frame, memoryview) else len(frame)


def payload_bytes(frames: Iterable[Frame]) -> int:
    """Sum of the frames' byte lengths."""
    return sum(frame_nbytes(f) for f in frames)


def zmtp_wire_bytes(frames: Iterable[Frame]) -> int:
    """Payload bytes plus the ZMTP per-frame framing overhead (see module docstring)."""
    total = 0
    for f in frames:
        n = frame_nbytes(f)
        total += n + (ZMTP_SHORT_FRAME_OVERHEAD if n <= 255 else ZMTP_LONG_FRAME_OVERHEAD)
    return total


@dataclass(frozen=True)
class Traffic:
    """Totals for one (link, direction, kind) cell, or a sum of cells."""

    messages: int = 0
    """Number of multipart messages."""
    payload_bytes: int = 0
    """Sum of frame lengths."""
    wire_bytes: int = 0
    """Payload plus ZMTP framing estimate."""

    def __add__(self, other: "Traffic") -> "Traffic":
        return Traffic(self.messages + other.messages, self.payload_bytes + other.payload_bytes,
                       self.wire_bytes + other.wire_bytes)


class TrafficCounters:
    """Message and byte counters keyed by ``(link, direction, kind)``.

    ``link`` is the neighbour's name, ``direction`` one of :data:`DIRECTIONS`, ``kind`` a caller
    label such as ``"ACT"``, ``"GRAD"``, ``"PROJ"`` or ``"control"``. Not thread-safe: update it
    from the event loop that owns the transport.
    """

    def __init__(self) -> None:
        self._cells: dict[tuple[str, str, str], list[int]] = defaultdict(lambda: [0, 0, 0])

    def add(self, link: str, direction: str, kind: str, frames: Sequence[Frame]) -> Traffic:
        """Count one message; returns its own :class:`Traffic` (1 message and its sizes)."""
        if direction not in DIRECTIONS:
            raise ValueError(f"direction must be one of {DIRECTIONS}, got {direction!r}")
        one = Traffic(1, payload_bytes(frames), zmtp_wire_bytes(frames))
        cell = self._cells[(link, direction, kind)]
        cell[0] += one.messages
        cell[1] += one.payload_bytes
        cell[2] += one.wire_bytes
        return one

    def get(self, link: str, direction: str, kind: str) -> Traffic:
        """Totals of one cell (zeros when nothing was counted)."""
        cell = self._cells.get((link, direction, kind))
        return Traffic(*cell) if cell else Traffic()

    def total(self, *, link: str | None = None, direction: str | None = None,
              kind: str | None = None) -> Traffic:
        """Sum over every cell matching the given filters (``None`` matches anything)."""
        out = Traffic()
        for (lk, d, k), cell in self._cells.items():
            if (link is None or lk == link) and (direction is None or d == direction) \
                    and (kind is None or k == kind):
                out = out + Traffic(*cell)
        return out

    def rows(self) -> list[dict[str, str | int]]:
        """One JSON-ready dict per cell, sorted by link, direction, kind (for metrics JSONL)."""
        return [
            {"link": lk, "direction": d, "kind": k, "messages": c[0], "payload_bytes": c[1],
             "wire_bytes": c[2]}
            for (lk, d, k), c in sorted(dict(self._cells).items())  # a copy: the metrics thread reads it too
        ]
