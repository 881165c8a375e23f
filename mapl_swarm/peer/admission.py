"""What a peer lets in: who may say what, sessions and sequence numbers, bounded decoding, content.

Every received message passes these checks, in this order, before anything of it reaches the
schedule, the stage runtime, its optimizer or its codebooks (issue 12; SPEC §6, §9). The first that
fails drops the message with a stable code (:class:`Rejected`), counted by code in the peer's
result (``rejects``) and logged (:class:`RejectCounter`); the peer keeps serving.

1. **sender**: the routing id names a neighbour stage (:func:`~.link.stage_of`), else ``not_allowed``;
2. **header**, on the event loop, before any tensor frame is looked at: size, msgpack, version,
   fields, type and authentication with the key of the sender's session (the wire's codes);
3. **run and stages**: ``run_mismatch``, ``stage_mismatch`` (``dst`` is not this stage), and
   ``wrong_session`` when ``src`` is not the stage of the connection it came in on;
4. **session**: a HELLO opens one (:meth:`Admission.check_hello`; a refusal is a REJECT to the
   HELLO's own connection, :class:`HelloRefused`, never to the bound neighbour); WELCOME and REJECT
   count only as the answer to this peer's pending HELLO; every other message only from the routing
   id bound at the handshake (``not_allowed`` before one, ``wrong_session`` from another) with a
   sequence number above the last accepted (``replay``; a gap is logged as lost messages);
5. **who may say what** (:func:`allowed_from`): per type, the neighbour direction, else ``not_allowed``;
6. **tensors**, decoded and inflated off the event loop (the decode thread), within limits;
7. **content** against the run's shapes and the schedule's window (``content_check``), also off
   the loop;
8. the mailbox's per-neighbour bound (``queue_full``, :class:`~.mailbox.Mailbox`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from mapl_swarm.peer._pre14 import DecodeLimits, decode_header, decode_tensors
from mapl_swarm.peer.link import stage_of
from mapl_swarm.peer.session import HelloRefused, Rejected, RxSession
from mapl_swarm.wire import Message, MessageType, VersionMismatch, WireError

if TYPE_CHECKING:
    from mapl_swarm.config import TrainConfig
    from mapl_swarm.peer.compute import WorkerThread
    from mapl_swarm.peer.link import LinkSettings, Links, PeerLink
    from mapl_swarm.wire.header import Header

log = logging.getLogger(__name__)

__all__ = ["Rejected", "HelloRefused", "RejectCounter", "RxSession", "Arrival", "Admitted", "Admission",
           "allowed_from", "mailbox_bound", "FROM_UPSTREAM", "FROM_DOWNSTREAM", "FROM_EITHER"]

MT = MessageType

FROM_UPSTREAM = frozenset({MT.ACT, MT.PROJ, MT.BYE})
"""Accepted only from the upstream neighbour (BYE: stage 0 ends the run down the pipeline)."""
FROM_DOWNSTREAM = frozenset({MT.GRAD, MT.PROJ_GRAD, MT.REPORT})
"""Accepted only from the downstream neighbour."""
FROM_EITHER = frozenset({MT.HELLO, MT.WELCOME, MT.REJECT, MT.HEARTBEAT, MT.ERROR})
"""Accepted from either neighbour (all but HELLO only within its handshake or session)."""


def allowed_from(mtype: MessageType, meta: Mapping[str, Any], *, upstream: bool) -> bool:
    """Whether a message of ``mtype`` may come from the upstream (``upstream``) or downstream
    neighbour. CODEBOOK_SLICE follows its stream (``act`` down, ``grad`` up), RESYNC goes against
    it (the receiver of a stream asks its sender), CHECKPOINT by phase (``saved``/``offer`` up,
    ``complete``/``resume`` down; SPEC §5.2)."""
    if mtype in FROM_EITHER:
        return True
    if mtype in FROM_UPSTREAM:
        return upstream
    if mtype in FROM_DOWNSTREAM:
        return not upstream
    flowing = "act" if upstream else "grad"  # the stream this neighbour sends us
    if mtype is MT.CODEBOOK_SLICE:
        return meta.get("stream", flowing) == flowing
    if mtype is MT.RESYNC:
        asked = "grad" if upstream else "act"  # the stream we send it
        return meta.get("stream", asked) == asked
    if mtype is MT.CHECKPOINT:
        return (meta.get("phase") in ("complete", "resume")) == upstream
    return False


def mailbox_bound(cfg: TrainConfig) -> int:
    """Pipeline messages queued per neighbour at most: a step's ACTs (or GRADs) and their codebook
    slices, or a validation's eval ACTs, plus a few (PROJ, PROJ_GRAD, BYE, a retransmission)."""
    return 2 * max(cfg.pipeline.num_micro_batches, cfg.eval.batches) + 8


class RejectCounter:
    """Counts dropped messages by code into ``counts`` (the peer result's ``rejects``) and logs them:
    every one of the first ``log_first`` of a code, then at powers of two (a flood stays readable)."""

    def __init__(self, name: str, counts: dict[str, int], *, log_first: int = 20) -> None:
        self.name = name
        self.counts = counts
        self.log_first = log_first

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def __call__(self, code: str, sender: str, text: str) -> None:
        n = self.counts[code] = self.counts.get(code, 0) + 1
        if n <= self.log_first or n & (n - 1) == 0:
            log.warning("%s: dropped a message from %r: %s (%s, %d so far)", self.name, sender, text, code, n)


@dataclass(frozen=True)
class Arrival:
    """A received message, before admission."""

    sender: str
    """The routing id it came from on this peer's ROUTER, or the link name for a reply."""
    frames: Sequence[Any]
    reply_link: str | None = None
    """Set when it came in on this peer's own connection to that neighbour: an answer to what this
    peer sent there (WELCOME or REJECT to its HELLO)."""


@dataclass(frozen=True)
class Admitted:
    """A message that passed every check, and the link of the neighbour it came from."""

    msg: Message
    link: PeerLink
    sender: str


ContentCheck = Callable[[Message], None]
"""Checks one decoded message against the run and a window snapshot (raises :class:`Rejected`)."""


class Admission:
    """The checks of the module docstring for one peer (see there). ``content_check(link)`` gives
    the content check for a message from ``link``, taken on the loop (a snapshot of the schedule's
    window) and run on the decode thread; None checks nothing beyond the wire."""

    def __init__(self, settings: LinkSettings, links: Links, *, rejects: RejectCounter, limits: DecodeLimits,
                 decoder: WorkerThread, timeout_s: float, clock: Callable[[], float],
                 replies_on_link: bool, content_check: Callable[[PeerLink], ContentCheck | None] | None = None) -> None:
        self.s = settings
        self.links = links
        self.rejects = rejects
        self.limits = limits
        self.decoder = decoder
        self.timeout_s = timeout_s
        self.clock = clock
        self.replies_on_link = replies_on_link
        """WELCOME/REJECT come back on this peer's own connection (``Arrival.reply_link``); False
        with a transport that cannot reply on a connection (they then come on the neighbour's)."""
        self.content_check = content_check

    # ------------------------------------------------------------------ the way in
    async def admit(self, arrival: Arrival) -> Admitted | None:
        """The admitted message, or None when dropped (counted and logged). A refused HELLO raises
        :class:`HelloRefused` (the caller answers with REJECT), a version mismatch re-raises
        :class:`~mapl_swarm.wire.VersionMismatch` (likewise)."""
        sender = arrival.sender
        try:
            link = self._link_of(arrival)
            header = self._header(arrival, link)
            if header.type is MT.HELLO:
                if arrival.reply_link is not None:
                    raise Rejected("not_allowed", "HELLO on this peer's own connection")
                self.check_hello(header, link, sender)
            else:
                self._check_message(header, link, arrival)
            msg = await self._tensors(header, arrival.frames, link)
        except (HelloRefused, VersionMismatch):
            raise
        except Rejected as exc:
            self.rejects(exc.code, sender, exc.text)
            return None
        except WireError as exc:
            self.rejects(exc.code, sender, f"{type(exc).__name__}: {exc}")
            return None
        return Admitted(msg, link, sender)

    def _link_of(self, arrival: Arrival) -> PeerLink:
        if arrival.reply_link is not None:
            link = self.links.named(arrival.reply_link)
        else:
            stage = stage_of(arrival.sender)
            link = None if stage is None else self.links.by_stage(stage)
        if link is None:
            raise Rejected("not_allowed", f"{arrival.sender!r} is not a neighbour of stage {self.s.stage}")
        return link

    def _header(self, arrival: Arrival, link: PeerLink) -> Header:
        """Phase 1 on the loop: nothing is unpacked; the key is the session's (the run's for the handshake)."""
        session = link.rx if link.rx is not None and link.rx.routing_id == arrival.sender else None
        secret = link.rx_secret(session)
        header, _ = decode_header(arrival.frames, self.limits, secret=secret)
        return header

    # ------------------------------------------------------------------ handshake and session
    def check_hello(self, h: Header, link: PeerLink, sender: str) -> None:
        """SPEC §9.2 in order (version and authentication are the decoder's): run, stages,
        ``num_stages``, fingerprint; then the stage's bound session."""
        s, meta = self.s, h.meta
        if h.run != s.run_id:
            raise HelloRefused("run_mismatch", f"run mismatch: peer {h.run!r}, this peer {s.run_id!r}")
        if h.dst != s.stage or h.src != link.stage:
            raise HelloRefused("stage_mismatch", f"stage mismatch: HELLO from stage {h.src} for stage {h.dst} on "
                                                 f"a connection of stage {link.stage}; this peer is stage {s.stage}")
        if meta.get("num_stages") != s.num_stages:
            raise HelloRefused("stage_mismatch", f"num_stages mismatch: peer {meta.get('num_stages')}, "
                                                 f"this peer {s.num_stages}")
        if meta.get("fingerprint") != s.fingerprint:
            raise HelloRefused("fingerprint_mismatch", f"config fingerprint mismatch: peer stage {h.src} has "
                                                       f"{meta.get('fingerprint')}, stage {s.stage} has {s.fingerprint}")
        bound = link.rx
        if bound is not None and bound.routing_id == sender:
            raise Rejected("replay", "a second HELLO on a bound session")
        if bound is not None and bound.alive(self.clock(), self.timeout_s):
            raise HelloRefused("stage_taken", f"stage {link.stage} is taken: its session is alive "
                                              f"(heard {self.clock() - bound.heard_at:.0f} s ago)")

    def _check_message(self, h: Header, link: PeerLink, arrival: Arrival) -> None:
        s = self.s
        if h.run != s.run_id:
            raise Rejected("run_mismatch", f"run {h.run!r}, this peer's is {s.run_id!r}")
        if h.dst != s.stage:
            raise Rejected("stage_mismatch", f"dst {h.dst}, this peer is stage {s.stage}")
        if h.src != link.stage:
            raise Rejected("wrong_session", f"src {h.src} on a connection of stage {link.stage}")
        if h.type in (MT.WELCOME, MT.REJECT):
            self._check_answer(h, link, arrival)
            return
        if arrival.reply_link is not None:
            raise Rejected("not_allowed", f"{h.type.name} on this peer's own connection (only WELCOME/REJECT)")
        session = link.rx
        if session is None:
            raise Rejected("not_allowed", f"{h.type.name} before a handshake with stage {link.stage}")
        if session.routing_id != arrival.sender:
            raise Rejected("wrong_session", f"{h.type.name} from {arrival.sender!r}; stage {link.stage}'s "
                                            f"session is {session.routing_id!r}")
        gap = session.accept(h.seq, self.clock())
        if gap:
            log.warning("%s: %d message(s) from stage %d lost before seq %d (%d lost on the session)", s.name, gap,
                        link.stage, h.seq, session.lost)
        if not allowed_from(h.type, h.meta, upstream=link.is_upstream):
            side = "upstream" if link.is_upstream else "downstream"
            raise Rejected("not_allowed", f"{h.type.name} is not accepted from the {side} neighbour")

    def _check_answer(self, h: Header, link: PeerLink, arrival: Arrival) -> None:
        """WELCOME/REJECT count only as the answer to this peer's pending HELLO, on its connection."""
        if self.replies_on_link and arrival.reply_link is None:
            raise Rejected("not_allowed", f"{h.type.name} not on this peer's connection to stage {link.stage}")
        if not link.awaiting_answer:
            raise Rejected("not_allowed", f"{h.type.name} but no HELLO to stage {link.stage} awaits an answer")
        if not link.answers_hello(h.meta):
            raise Rejected("wrong_session", f"{h.type.name} for another HELLO (hello_nonce)")

    # ------------------------------------------------------------------ tensors and content
    async def _tensors(self, header: Header, frames: Sequence[Any], link: PeerLink) -> Message:
        check = self.content_check(link) if self.content_check is not None and header.tensors else None
        if not header.tensors:  # nothing to inflate: stays on the loop
            return decode_tensors(header, frames, self.limits)
        return await self.decoder.run(self._decode, header, frames, check)

    def _decode(self, header: Header, frames: Sequence[Any], check: ContentCheck | None) -> Message:
        """On the decode thread: descriptors within limits, CRC, inflate, then the content check."""
        msg = decode_tensors(header, frames, self.limits)
        if check is not None:
            check(msg)
        return msg
