"""A peer's side of the MAPL+VQ codebook streams (SPEC §5.1) and the payload <-> tensor names.

The stage runtime queues :class:`~mapl_swarm.compress.codebook_sync.CodebookSlice` s on each
encode; :meth:`CodebookLink.send_slices` sends them as CODEBOOK_SLICE messages on the link, right
before the ACT (``act`` stream, downstream) or GRAD (``grad`` stream, upstream) they belong to.
Incoming slices go through the mailbox like ACT/GRAD, so the serving loop applies them in arrival
order, between computations (never while the worker thread decodes). A rejected slice is counted
and logged and leaves the codebooks untouched; a gap (``future_slice``), codes at another version,
or a neighbour that handshakes again (a reconnection) make this peer send RESYNC for the stream it
receives from that neighbour; a RESYNC received makes the next encode send a full slice.

Retransmission (SPEC §5.1, 1.2): codes that fail the version check are not fatal when the sender
advertised ``vq_retransmit``: :meth:`CodebookLink.guard` sends a RESYNC naming the message
(``retransmit``) and raises :class:`Retransmitting`, on which the serving loop drops the message
and waits for its copy. The sender remembers each ACT/GRAD it sent (:meth:`CodebookLink.remember`)
and answers with a full slice and the same message re-encoded, under the peer's encode lock so no
other encode of the stream comes between them.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from typing import TYPE_CHECKING, Any, Awaitable

from mapl_swarm.compress.codebook_sync import CodebookSlice
from mapl_swarm.peer.tensors import from_wire
from mapl_swarm.wire import Message, MessageType
from mapl_swarm.errors import MaplError
from mapl_swarm.wire.codebook import (
    INDEXED_SLICES_CAPABILITY,
    RETRANSMIT_CAPABILITY,
    CodebookError,
    CodebookVersionMismatch,
    FutureSlice,
    resync_meta,
)

if TYPE_CHECKING:
    from mapl_swarm.peer.runtime import Peer

log = logging.getLogger(__name__)

__all__ = ["CodebookLink", "Retransmitting", "act_tensors", "grad_tensors", "act_payload", "grad_payload"]

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


class Retransmitting(Exception):
    """The codes of a received ACT/GRAD could not be decoded; its retransmission was requested."""


class CodebookLink:
    """Codebook slices, RESYNC and their counters for one peer (only with the mapl_vq codec)."""

    def __init__(self, peer: "Peer") -> None:
        self.peer = peer
        self.stats: dict[str, Any] = {"applied": 0, "ignored": 0, "rejected": defaultdict(int),
                                      "resyncs_sent": 0, "resyncs_received": 0, "reconnects": 0,
                                      "retransmits_requested": 0, "retransmitted": 0}
        self._handshaken: set[int] = set()
        self._sent: dict[tuple[str, str, int], tuple[int, dict]] = {}
        """(stream, mode, micro) -> (step, payload) of the last ACT/GRAD sent, for retransmission."""

    def stream_from(self, neighbour: int) -> str:
        """The stream ``neighbour`` sends to this peer: ``act`` from upstream, ``grad`` from downstream."""
        return "act" if neighbour == self.peer.up else "grad"

    async def send_slices(self, dst: int, stream: str, step: int, micro: int) -> None:
        """Send the runtime's queued ``stream`` slices to ``dst`` (before the payload they precede)."""
        for sl in self.peer.rt.take_slices(stream):
            meta = {"stream": sl.stream, "start": sl.start, **({"full": True} if sl.full else {})}
            kind = "codebook" if stream == "act" else "grad_codebook"
            tensors = {"codes": sl.codes, **({} if sl.index is None else {"index": sl.index})}
            await self.peer._send(dst, MT.CODEBOOK_SLICE, step=step, micro=micro, meta=meta, cver=sl.version,
                                  tensors=tensors, payload_kinds={name: kind for name in tensors})

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

    async def request_resync(self, src: int, reason: str,
                             retransmit: tuple[int, int, str] | None = None) -> None:
        """Ask neighbour ``src`` for a full slice of the stream it sends us; with ``retransmit`` =
        (step, micro, mode) also for that message re-encoded."""
        stream = self.stream_from(src)
        have = self.peer.rt.vq.request_resync(stream)
        self.stats["resyncs_sent"] += 1
        log.info("%s: asking stage %d for a codebook resync of %s (have v%d): %s%s", self.peer.name, src,
                 stream, have, reason, "" if retransmit is None else
                 " and for %s step %d micro-batch %d again" % (retransmit[2], *retransmit[:2]))
        step, micro = retransmit[:2] if retransmit is not None else (0, 0)
        await self.peer._send(src, MT.RESYNC, step=step, micro=micro,
                              meta=resync_meta(stream, have, reason, retransmit))

    def on_resync(self, msg: Message) -> None:
        """A receiver asked for a full slice of the stream this peer sends it (and maybe for a
        message again): handled on a task, serialised with the peer's encodes."""
        stream = msg.meta.get("stream")
        vq = self.peer.rt.vq
        if stream not in vq.tx or self.stream_from(msg.src) == stream:
            self.peer._bad_frame(f"stage{msg.src}", f"RESYNC for stream {stream!r} this peer does not send it")
            return
        self.stats["resyncs_received"] += 1
        log.info("%s: stage %d asked for a codebook resync of %s (it has v%s)%s", self.peer.name, msg.src,
                 stream, msg.meta.get("have"), " and a retransmission" if msg.meta.get("retransmit") else "")
        self.peer.spawn(self._answer_resync(msg, stream))

    async def _answer_resync(self, msg: Message, stream: str) -> None:
        peer = self.peer
        async with peer.encode_lock:  # the full slice, then the re-encoded message: nothing between
            if not msg.meta.get("retransmit"):
                await peer._compute(peer.rt.vq.resync_requested, stream)
                return
            mode = msg.meta.get("mode", "train")
            sent = self._sent.get((stream, mode, msg.micro))
            codes = None
            if sent is not None and sent[0] == msg.step:
                codes = await peer._compute(peer.rt.reencode, stream, msg.micro if mode == "train" else -1 - msg.micro)
            if codes is None:
                why = (f"stage {peer.stage} no longer holds {stream} {mode} step {msg.step} micro-batch {msg.micro} "
                       f"(it holds step {sent[0] if sent else None})")
                log.error("%s: cannot retransmit: %s", peer.name, why)
                await peer._send(msg.src, MT.ERROR, meta={"code": "retransmit_unavailable", "message": why})
                return
            payload = {**sent[1], "codes": codes}
            if stream == "act":
                await peer._send_act(msg.step, msg.micro, payload, eval_mode=mode == "eval")
            else:
                await peer._send_grad(msg.step, msg.micro, payload)
            self.stats["retransmitted"] += 1

    def remember(self, stream: str, mode: str, step: int, micro: int, payload: dict) -> None:
        """Note an ACT/GRAD payload as sent (the last one per stream, mode and micro is kept)."""
        self._sent[(stream, mode, micro)] = (step, payload)

    def check_neighbour(self, neighbour: int) -> None:
        """Refuse a link whose receiver cannot take this peer's slices (indexed: capability 1.2)."""
        if self.peer.rt.vq.s.slice_order == "priority" and \
                INDEXED_SLICES_CAPABILITY not in self.peer.neighbour_caps.get(neighbour, ()):
            raise MaplError(f"{self.peer.name}: stage {neighbour} does not accept indexed codebook slices "
                            f"(capability {INDEXED_SLICES_CAPABILITY!r}), which "
                            f"compression.vq.slice_order = 'priority' sends")

    async def on_handshake(self, src: int) -> None:
        """After answering a HELLO: a second handshake with ``src`` is a reconnection -> RESYNC."""
        if src in self._handshaken:
            self.stats["reconnects"] += 1
            await self.request_resync(src, "reconnected")
        self._handshaken.add(src)

    async def guard(self, work: Awaitable, src: int, message: tuple[int, int, str] | None = None):
        """Await a forward/backward that decodes codes from ``src`` sent as ``message`` = (step,
        micro, mode). On a version mismatch ask for a RESYNC; if ``src`` retransmits, also for the
        message, and raise :class:`Retransmitting` (drop it, its copy follows), else re-raise."""
        try:
            return await work
        except CodebookVersionMismatch as exc:
            retransmit = message if RETRANSMIT_CAPABILITY in self.peer.neighbour_caps.get(src, ()) else None
            await self.request_resync(src, exc.code, retransmit)
            if retransmit is None:
                raise
            self.stats["retransmits_requested"] += 1
            raise Retransmitting(str(exc)) from None

    def summary(self) -> dict[str, Any]:
        vq = self.peer.rt.vq
        out = {k: (dict(v) if isinstance(v, defaultdict) else v) for k, v in self.stats.items()}
        out["versions"] = {f"tx_{k}": t.version for k, t in vq.tx.items()}
        out["versions"].update({f"rx_{k}": r.version for k, r in vq.rx.items()})
        out["digests"] = {f"tx_{k}": t.digest() for k, t in vq.tx.items()}
        out["digests"].update({f"rx_{k}": r.digest() for k, r in vq.rx.items()})
        return out
