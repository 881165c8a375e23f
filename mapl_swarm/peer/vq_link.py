"""A peer's side of the MAPL+VQ codebook streams (SPEC §5.1) and the payload <-> tensor names.

The stage runtime queues :class:`~mapl_swarm.compress.codebook_sync.CodebookSlice` s on each
encode; :meth:`CodebookLink.send_slices` sends them as CODEBOOK_SLICE messages on the link, right
before the ACT (``act`` stream, downstream) or GRAD (``grad`` stream, upstream) they belong to.
Incoming slices go through the mailbox like ACT/GRAD, so the serving loop applies them in arrival
order, between computations (never while the worker thread decodes). A rejected slice is counted
and logged and leaves the codebooks untouched; a gap (``future_slice``), codes at another version,
or a neighbour that handshakes again (a reconnection) make this peer send RESYNC for the stream it
receives from that neighbour; a RESYNC received makes the next encode send a full slice.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from typing import TYPE_CHECKING, Any, Awaitable

from mapl_swarm.compress.codebook_sync import CodebookSlice
from mapl_swarm.peer.tensors import from_wire
from mapl_swarm.wire import Message, MessageType
from mapl_swarm.wire.codebook import CodebookError, CodebookVersionMismatch, FutureSlice

if TYPE_CHECKING:
    from mapl_swarm.peer.runtime import Peer

log = logging.getLogger(__name__)

__all__ = ["CodebookLink", "act_tensors", "grad_tensors", "act_payload", "grad_payload"]

MT = MessageType
_ACT_WIRE = {"act": "z", "codes": "codes", "ids": "ids"}
_GRAD_WIRE = {"grad": "dz", "codes": "codes"}


def act_tensors(payload: dict, *, eval_mode: bool = False) -> tuple[dict, dict[str, str]]:
    """ACT tensors by wire name (``z`` or ``codes``, ``ids``) and their link-counter kinds."""
    tensors = {_ACT_WIRE[k]: v for k, v in payload.items()}
    kinds = {name: ("eval_" if eval_mode else "") + ("ids" if name == "ids" else "act") for name in tensors}
    return tensors, kinds


def grad_tensors(payload: dict) -> tuple[dict, dict[str, str]]:
    """GRAD tensors by wire name (``dz`` or ``codes``) and their link-counter kinds."""
    tensors = {_GRAD_WIRE[k]: v for k, v in payload.items()}
    return tensors, {name: "grad" for name in tensors}


def act_payload(msg: Message) -> dict:
    """The stage payload of a received ACT (``act`` or ``codes``, and ``ids``)."""
    return {k: from_wire(msg.tensors[w]) for k, w in _ACT_WIRE.items() if w in msg.tensors}


def grad_payload(msg: Message) -> dict:
    """The stage payload of a received GRAD (``grad`` or ``codes``)."""
    return {k: from_wire(msg.tensors[w]) for k, w in _GRAD_WIRE.items() if w in msg.tensors}


class CodebookLink:
    """Codebook slices, RESYNC and their counters for one peer (only with the mapl_vq codec)."""

    def __init__(self, peer: "Peer") -> None:
        self.peer = peer
        self.stats: dict[str, Any] = {"applied": 0, "ignored": 0, "rejected": defaultdict(int),
                                      "resyncs_sent": 0, "resyncs_received": 0, "reconnects": 0}
        self._handshaken: set[int] = set()

    def stream_from(self, neighbour: int) -> str:
        """The stream ``neighbour`` sends to this peer: ``act`` from upstream, ``grad`` from downstream."""
        return "act" if neighbour == self.peer.up else "grad"

    async def send_slices(self, dst: int, stream: str, step: int, micro: int) -> None:
        """Send the runtime's queued ``stream`` slices to ``dst`` (before the payload they precede)."""
        for sl in self.peer.rt.take_slices(stream):
            meta = {"stream": sl.stream, "start": sl.start, **({"full": True} if sl.full else {})}
            kind = "codebook" if stream == "act" else "grad_codebook"
            await self.peer._send(dst, MT.CODEBOOK_SLICE, step=step, micro=micro, meta=meta, cver=sl.version,
                                  tensors={"codes": sl.codes}, payload_kinds={"codes": kind})

    async def on_slice(self, msg: Message) -> None:
        """Apply a received slice; rejections are counted and logged, a gap asks for a RESYNC."""
        try:
            outcome = self.peer.rt.apply_slice(CodebookSlice.from_message(msg))
        except CodebookError as exc:
            self.stats["rejected"][exc.code] += 1
            log.warning("%s: rejected a codebook slice from stage %d: %s: %s", self.peer.name, msg.src,
                        type(exc).__name__, exc)
            if isinstance(exc, FutureSlice):
                await self.request_resync(msg.src, exc.code)
            return
        self.stats["applied" if outcome == "apply" else "ignored"] += 1

    async def request_resync(self, src: int, reason: str) -> None:
        """Ask neighbour ``src`` for a full slice of the stream it sends us."""
        stream = self.stream_from(src)
        have = self.peer.rt.vq.request_resync(stream)
        self.stats["resyncs_sent"] += 1
        log.info("%s: asking stage %d for a codebook resync of %s (have v%d): %s", self.peer.name, src,
                 stream, have, reason)
        await self.peer._send(src, MT.RESYNC, meta={"stream": stream, "have": have, "reason": reason})

    def on_resync(self, msg: Message) -> None:
        """A receiver asked for a full slice of the stream this peer sends it."""
        stream = msg.meta.get("stream")
        vq = self.peer.rt.vq
        if stream not in vq.tx or self.stream_from(msg.src) == stream:
            self.peer._bad_frame(f"stage{msg.src}", f"RESYNC for stream {stream!r} this peer does not send it")
            return
        self.stats["resyncs_received"] += 1
        vq.resync_requested(stream)
        log.info("%s: stage %d asked for a codebook resync of %s (it has v%s)", self.peer.name, msg.src,
                 stream, msg.meta.get("have"))

    async def on_handshake(self, src: int) -> None:
        """After answering a HELLO: a second handshake with ``src`` is a reconnection -> RESYNC."""
        if src in self._handshaken:
            self.stats["reconnects"] += 1
            await self.request_resync(src, "reconnected")
        self._handshaken.add(src)

    async def guard(self, work: Awaitable, src: int):
        """Await a forward/backward that decodes codes from ``src``; on a version mismatch ask for a
        RESYNC before the error propagates (without retransmission the micro-batch is lost)."""
        try:
            return await work
        except CodebookVersionMismatch:
            await self.request_resync(src, "codebook_version_mismatch")
            raise

    def summary(self) -> dict[str, Any]:
        vq = self.peer.rt.vq
        out = {k: (dict(v) if isinstance(v, defaultdict) else v) for k, v in self.stats.items()}
        out["versions"] = {f"tx_{k}": t.version for k, t in vq.tx.items()}
        out["versions"].update({f"rx_{k}": r.version for k, r in vq.rx.items()})
        out["digests"] = {f"tx_{k}": t.digest() for k, t in vq.tx.items()}
        out["digests"].update({f"rx_{k}": r.digest() for k, r in vq.rx.items()})
        return out
