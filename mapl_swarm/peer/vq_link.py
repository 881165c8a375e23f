"""One link's side of the MAPL+VQ codebook streams (SPEC §5.1): slices, RESYNC, retransmission.

Each :class:`~.link.PeerLink` of a mapl_vq peer owns a :class:`CodebookLink`: the link sends one
stream (``act`` downstream, ``grad`` upstream) and receives the other. The stage runtime queues
:class:`~mapl_swarm.compress.codebook_sync.CodebookSlice` s on each encode;
:meth:`CodebookLink.send_slices` sends them as CODEBOOK_SLICE messages on the link, right before
the ACT or GRAD they belong to. With codebooks learned per step (``compression.vq.update = step``,
several replicas per stage) nothing is queued: each link sends a full slice of the sender's
version before its first payload at a version it has not carried
(:attr:`CodebookLink.sent_version`). Incoming slices go through the mailbox like ACT/GRAD, so the
serving loop applies them in arrival order, between computations (never while the worker thread decodes).
A rejected slice is counted and logged and leaves the codebooks untouched; a gap
(``future_slice``), codes at another version, or a neighbour that handshakes again (a
reconnection) make this link send RESYNC for the stream it receives; a RESYNC received makes the
next encode send a full slice.

Retransmission (SPEC §5.1, 1.2): codes that fail the version check are not fatal when the sender
advertised ``vq_retransmit``: :meth:`CodebookLink.guard` sends a RESYNC naming the message
(``retransmit``) and raises :class:`Retransmitting`, on which the serving loop drops the message
and waits for its copy. The link remembers each ACT/GRAD it sent (:meth:`CodebookLink.remember`)
and answers with a full slice and the same message re-encoded, under the compute thread's encode
lock so no other encode of the stream comes between them.

Threads: taking the queued slices (brought to host memory), reading and applying a received slice
and re-encoding run on the compute thread (:class:`~.host.HostRuntime`); the loop only reads
versions and flags.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from mapl_swarm.errors import MaplError
from mapl_swarm.peer.host import HostRuntime
from mapl_swarm.pipeline.payload import PayloadKey, Stream
from mapl_swarm.wire import Message, MessageType
from mapl_swarm.wire.codebook import (
    INDEXED_SLICES_CAPABILITY,
    RETRANSMIT_CAPABILITY,
    CodebookError,
    CodebookVersionMismatch,
    FutureSlice,
    resync_meta,
    slice_parts,
)

if TYPE_CHECKING:
    from mapl_swarm.peer.compute import ComputeThread
    from mapl_swarm.pipeline.stage import StageRuntime

log = logging.getLogger(__name__)

__all__ = ["CodebookLink", "Retransmitting", "LinkEnd", "codebook_summary"]

MT = MessageType


RESYNC_SLACK = 2
"""RESYNCs a step may bring beyond one per payload sent: a reconnection's and a lost slice's."""


class Retransmitting(Exception):
    """The codes of a received ACT/GRAD could not be decoded; its retransmission was requested."""


class LinkEnd(Protocol):
    """What a :class:`CodebookLink` uses of the link that owns it (:class:`~.link.PeerLink`)."""

    stage: int
    tx_stream: Stream
    rx_stream: Stream
    capabilities: frozenset[str]

    @property
    def local_name(self) -> str: ...

    @property
    def local_stage(self) -> int: ...

    async def send(self, mtype: MessageType, **kw: Any) -> None: ...

    async def send_act(self, step: int, micro: int, payload: Mapping[str, Any], *, eval_mode: bool,
                       pver: int) -> None: ...

    async def send_grad(self, step: int, micro: int, payload: Mapping[str, Any], *, pver: int) -> None: ...


@dataclass
class _Sent:
    step: int
    payload: Mapping[str, Any]
    pver: int


def _new_stats() -> dict[str, Any]:
    return {"applied": 0, "ignored": 0, "rejected": defaultdict(int), "resyncs_sent": 0, "resyncs_received": 0,
            "reconnects": 0, "retransmits_requested": 0, "retransmitted": 0}


class CodebookLink:
    """Codebook slices, RESYNC, retransmission and their counters on one link (mapl_vq only)."""

    def __init__(self, link: LinkEnd, runtime: StageRuntime, compute: ComputeThread, *,
                 spawn: Callable[[Awaitable[Any]], None], on_bad_frame: Callable[[str, str], None],
                 strike: Callable[[str, str, str], None] = lambda member, code, text: None) -> None:
        self.link = link
        self._strike = strike
        """Counts a rejected slice against the member that sent it (:mod:`~.strikes`)."""
        self.rt = runtime
        self.host = HostRuntime(runtime)
        """The runtime's tensor calls, made on the compute thread."""
        self.compute = compute
        self._spawn = spawn
        self._on_bad_frame = on_bad_frame
        self.stats: dict[str, Any] = _new_stats()
        self._handshakes = 0
        self._sent: dict[tuple[str, int], _Sent] = {}
        """(mode, micro) -> the last ACT/GRAD sent on the link, for retransmission."""
        self.awaiting: set[tuple[int, int, str]] = set()
        """(step, micro, mode) asked to be retransmitted, not yet decoded (SPEC §9.5, 1.7)."""
        self._resyncs: tuple[int, int] = (-1, 0)
        """(step of the newest payload sent, RESYNCs received since; SPEC §5.1, 1.7)."""
        self.sent_version = -1
        """Version of the last slice this link sent of its stream (-1: none yet, or a RESYNC asked
        for a full one): with ``compression.vq.update = step`` a full slice goes before the next
        payload when the sender's version is newer (every replica downstream gets its own)."""

    @property
    def tx(self) -> Stream:
        """The stream this link sends."""
        return self.link.tx_stream

    @property
    def rx(self) -> Stream:
        """The stream this link receives."""
        return self.link.rx_stream

    def tx_version(self) -> int:
        """``cver`` of the last payload encoded on the stream this link sends."""
        return self.rt.codebook_version(self.tx)

    async def send_slices(self, step: int, micro: int) -> None:
        """Send the slices due on this link before its next payload: the runtime's queued ones, or
        (``update = step``) a full slice when this link has not carried the current version."""
        stream = self.tx
        kind = stream.slice_kind
        for sl in await self.compute.run(self.host.slices_for, stream, self.sent_version):  # host memory
            p = slice_parts(stream=sl.stream, version=sl.version, start=sl.start, full=sl.full, codes=sl.codes,
                            index=sl.index)  # the one CODEBOOK_SLICE encoder (shared with the golden vectors)
            await self.link.send(MT.CODEBOOK_SLICE, step=step, micro=micro, meta=p.meta, cver=p.cver,
                                 tensors=p.tensors, kinds={name: kind for name in p.tensors})
            self.sent_version = sl.version

    async def on_slice(self, msg: Message) -> None:
        """Apply a received slice; rejections are counted and logged, a gap asks for a RESYNC unless
        one is awaited already (a spray of far slices would otherwise send one each, beyond what the
        sender answers in a step, and its answer to a retransmission request could be the one dropped)."""
        try:
            outcome = await self.compute.run(self.host.apply_slice, msg)
        except CodebookError as exc:
            self.stats["rejected"][exc.code] += 1
            log.warning("%s: rejected a codebook slice from stage %d: %s: %s", self.link.local_name, msg.src,
                        type(exc).__name__, exc)
            full = msg.meta.get("full") is True
            self._strike(self.link.name, "future_full_slice" if isinstance(exc, FutureSlice) and full else exc.code,
                         str(exc))
            if isinstance(exc, FutureSlice) and not self.rt.vq.rx[self.rx].awaiting_resync:
                await self.request_resync(exc.code)
            return
        self.stats["applied" if outcome == "apply" else "ignored"] += 1

    async def request_resync(self, reason: str, retransmit: tuple[int, int, str] | None = None) -> None:
        """Ask the neighbour for a full slice of the stream it sends us; with ``retransmit`` =
        (step, micro, mode) also for that message re-encoded."""
        stream = self.rx
        have = self.rt.vq.request_resync(stream)
        self.stats["resyncs_sent"] += 1
        log.info("%s: asking stage %d for a codebook resync of %s (have v%d): %s%s", self.link.local_name,
                 self.link.stage, stream, have, reason, "" if retransmit is None else
                 " and for %s step %d micro-batch %d again" % (retransmit[2], *retransmit[:2]))
        step, micro = retransmit[:2] if retransmit is not None else (0, 0)
        await self.link.send(MT.RESYNC, step=step, micro=micro,
                             meta=resync_meta(stream.value, have, reason, retransmit))

    def on_resync(self, msg: Message) -> str | None:
        """The neighbour asked for a full slice of the stream this link sends (and maybe for a
        message again): handled on a background task, serialised with the peer's encodes. Returns
        why it is implausible (more RESYNCs in a step than it had payloads to fail on), or None."""
        stream = msg.meta.get("stream")
        if stream not in self.rt.vq.tx or stream != self.tx:
            self._on_bad_frame(f"stage{msg.src}", f"RESYNC for stream {stream!r} this peer does not send it")
            return None
        step = max((sent.step for sent in self._sent.values()), default=0)
        count = self._resyncs[1] + 1 if self._resyncs[0] == step else 1
        most = sum(sent.step == step for sent in self._sent.values()) + RESYNC_SLACK
        if count > most:
            return f"RESYNC number {count} since this peer sent step {step}'s payloads (at most {most})"
        self._resyncs = (step, count)
        self.stats["resyncs_received"] += 1
        log.info("%s: stage %d asked for a codebook resync of %s (it has v%s)%s", self.link.local_name, msg.src,
                 stream, msg.meta.get("have"), " and a retransmission" if msg.meta.get("retransmit") else "")
        self._spawn(self._answer_resync(msg))
        return None

    async def _answer_resync(self, msg: Message) -> None:
        stream = self.tx
        async with self.compute.encode_lock:  # the full slice, then the re-encoded message: nothing between
            self.sent_version = -1  # update = step: the next payload on this link brings the full slice
            if not msg.meta.get("retransmit"):
                await self.compute.run(self.rt.vq.resync_requested, stream)
                return
            mode = msg.meta.get("mode", "train")
            sent = self._sent.get((mode, msg.micro))
            codes = None
            if sent is not None and sent.step == msg.step:
                key = msg.micro if mode == "train" else -1 - msg.micro
                codes = await self.compute.run(self.host.reencode, stream, key)
            if codes is None:
                why = (f"stage {self.link.local_stage} no longer holds {stream} {mode} step {msg.step} "
                       f"micro-batch {msg.micro} (it holds step {sent.step if sent else None})")
                log.error("%s: cannot retransmit: %s", self.link.local_name, why)
                await self.link.send(MT.ERROR, meta={"code": "retransmit_unavailable", "message": why})
                return
            payload = {**sent.payload, PayloadKey.CODES: codes}
            if stream == Stream.ACT:
                await self.link.send_act(msg.step, msg.micro, payload, eval_mode=mode == "eval", pver=sent.pver)
            else:
                await self.link.send_grad(msg.step, msg.micro, payload, pver=sent.pver)
            self.stats["retransmitted"] += 1

    def remember(self, mode: str, step: int, micro: int, payload: Mapping[str, Any], pver: int) -> None:
        """Note an ACT/GRAD payload as sent (the last one per mode and micro-batch is kept)."""
        self._sent[(mode, micro)] = _Sent(step, payload, pver)

    def check_capabilities(self) -> None:
        """Refuse a neighbour that cannot take this link's slices (indexed: capability 1.2)."""
        if self.rt.vq.s.slice_order == "priority" and INDEXED_SLICES_CAPABILITY not in self.link.capabilities:
            raise MaplError(f"{self.link.local_name}: stage {self.link.stage} does not accept indexed codebook "
                            f"slices (capability {INDEXED_SLICES_CAPABILITY!r}), which compression.vq.slice_order = "
                            f"'priority' sends")

    async def on_handshake(self) -> None:
        """After answering a HELLO: a second handshake is a reconnection -> RESYNC."""
        if self._handshakes:
            self.stats["reconnects"] += 1
            await self.request_resync("reconnected")
        self._handshakes += 1

    async def guard(self, work: Awaitable, message: tuple[int, int, str] | None = None):
        """Await a forward/backward that decodes codes from the neighbour sent as ``message`` =
        (step, micro, mode). On a version mismatch ask for a RESYNC; if the neighbour retransmits,
        also for the message, and raise :class:`Retransmitting` (drop it, its copy follows), else
        re-raise."""
        try:
            result = await work
        except CodebookVersionMismatch as exc:
            retransmit = message if RETRANSMIT_CAPABILITY in self.link.capabilities else None
            if retransmit is not None:
                self.awaiting.add(retransmit)  # before the request: its answer may come at once
            await self.request_resync(exc.code, retransmit)
            if retransmit is None:
                raise
            self.stats["retransmits_requested"] += 1
            raise Retransmitting(str(exc)) from None
        self.awaiting.discard(message)  # decoded: a retransmission asked for it has come
        return result


def codebook_summary(vq: Any, links: Iterable[CodebookLink]) -> dict[str, Any]:
    """A peer's codebook figures: every link's counters summed, the runtime's versions and digests."""
    out = _new_stats()
    for link in links:
        for k, v in link.stats.items():
            if k == "rejected":
                for code, n in v.items():
                    out[k][code] += n
            else:
                out[k] += v
    out["rejected"] = dict(out["rejected"])
    out["versions"] = {f"tx_{k}": t.version for k, t in vq.tx.items()}
    out["versions"].update({f"rx_{k}": r.version for k, r in vq.rx.items()})
    out["digests"] = {f"tx_{k}": t.digest() for k, t in vq.tx.items()}
    out["digests"].update({f"rx_{k}": r.digest() for k, r in vq.rx.items()})
    return out
