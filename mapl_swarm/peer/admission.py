"""What a peer lets in: who may say what, sessions and sequence numbers, bounded decoding, content.

Every received message passes these checks, in the order of SPEC §6.1, before anything of it
reaches the schedule, the stage runtime, its optimizer or its codebooks. The first that
fails drops the message with a stable code (:class:`~.session.Rejected`, or the wire's
``ContentError`` / ``WireError``), counted by code in the peer's result (``rejects``) and logged
(:class:`RejectCounter`); the peer keeps serving.

1. **sender**: the routing id is ``stage<k>.<8 hex>`` of a neighbour (:func:`~.link.stage_of`),
   else ``not_allowed``, unread;
2. **header**, on the event loop, before any tensor frame is looked at: size, msgpack, version,
   fields and type (the wire's codes; a certified peer's connection has already proved its key);
3. **handshake**: a HELLO opens a session (:meth:`Admission.check_hello`: of a certified peer only
   with a certificate for the sender's stage and its connection's key; a refusal is a REJECT to
   the HELLO's own connection, :class:`~.session.HelloRefused`, never to the bound neighbour);
   WELCOME and REJECT count only as the answer to this peer's pending HELLO, echoing its nonce;
   all three only with ``seq`` 0;
4. **who may say what** (``not_allowed``): run, ``dst``, ``src`` equal to the routing id's stage,
   the type's direction (``wire.content.check_sender``, SPEC §9.4);
5. **session**: only from the routing id bound at the handshake (``wrong_session``), of the swarm's
   run epoch or later once training runs (``stale_epoch``, SPEC "Rejoin"), with a sequence number
   above the last accepted (``replay``; a gap is logged as lost messages); a pipeline message
   (:data:`HELD_UNTIL_START`) that comes before this peer's training started is then held
   (:class:`~.session.Early`): the peer admits it with the checks from here on once training
   starts (SPEC §6.1 "Before training starts");
6. **window** and **sizes** on the header (``out_of_window``, ``stale_projector``,
   ``size_mismatch``: ``wire.content.check_header`` / ``check_declared`` against the run's
   :class:`~mapl_swarm.wire.RunShapes` and the link's :class:`~mapl_swarm.wire.Window`);
7. **tensors** decoded and inflated off the event loop (the decode thread) within the run's limits,
   then their **content** (shapes, dtypes, id and code ranges, finite values:
   ``wire.content.check_content``), also off the loop;
8. the mailbox's per-neighbour bound (``queue_full``, :class:`~.mailbox.Mailbox`).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from mapl_swarm.config.catalog import codec_info
from mapl_swarm.net.identity import CertificateError
from mapl_swarm.peer.link import stage_of
from mapl_swarm.peer.session import Early, HelloRefused, Rejected, RxSession, Superseded, Unbound, Unlinked
from mapl_swarm.wire import (ContentError, DecodeLimits, Message, MessageType, RunShapes, VersionMismatch, Window,
                             WireError, check_content, check_declared, check_epoch, check_header, check_sender,
                             decode_header, decode_tensors)
from mapl_swarm.wire.spec import HANDSHAKE_TYPES, REJOIN_CAPABILITY, WINDOW_TYPES

if TYPE_CHECKING:
    from mapl_swarm.config import TrainConfig
    from mapl_swarm.peer.compute import WorkerThread
    from mapl_swarm.peer.link import LinkSettings, Links, PeerLink
    from mapl_swarm.step.window import StepWindow
    from mapl_swarm.wire.header import Header

log = logging.getLogger(__name__)

__all__ = ["Rejected", "HelloRefused", "Early", "HELD_UNTIL_START", "RejectCounter", "RxSession", "Arrival",
           "Admitted", "Admission", "run_shapes", "mailbox_bound"]

MT = MessageType

HELD_UNTIL_START: frozenset[MessageType] = WINDOW_TYPES | {MT.RESYNC}
"""The pipeline's messages: their checks need the run epoch, step window and projector version
that this peer has only once its training starts, so those that come earlier are held (a
neighbour that got the resume decision first may already send step N's PROJ and ACTs)."""


def _shown_contact(contact: str) -> str:
    """A contact received from the network, as a log line may show it (bounded)."""
    return repr(contact if len(contact) <= 80 else contact[:77] + "...")


def run_shapes(cfg: TrainConfig, stage: int) -> RunShapes:
    """The run as stage ``stage`` sees it (:class:`~mapl_swarm.wire.RunShapes`): what every tensor it
    receives must look like, from the config alone."""
    m, c, p = cfg.model, cfg.compression, cfg.pipeline
    info = codec_info(c.codec)
    vq = c.vq if info.quantized else None
    return RunShapes(micro_batch_size=p.micro_batch_size, context_length=m.context_length, hidden_size=m.hidden_size,
                     width=c.rank if info.projected else m.hidden_size, vocab_size=m.vocab_size,
                     wire_dtype=c.wire_dtype, id_dtype="uint16" if m.vocab_size <= 1 << 16 else "uint32",
                     vq_rounds=vq.rounds if vq else 0, vq_group_size=vq.group_size if vq else 0,
                     vq_codebook_size=vq.codebook_size if vq else 0, num_micro_batches=p.num_micro_batches,
                     eval_batches=cfg.eval.batches, num_stages=p.num_stages, stage=stage,
                     trainable_projector=info.trainable_projector,
                     orthonormal_projector=not info.unconstrained_projector)


def mailbox_bound(cfg: TrainConfig) -> int:
    """Pipeline messages queued per neighbour stage at most: a step's ACTs (or GRADs) and their
    codebook slices, or a validation's eval ACTs, plus a few (PROJ, PROJ_GRAD, BYE, a
    retransmission; with replicas, each replica's PROJ and ROUTEs)."""
    replicas = max(cfg.replicas.initial, default=1)  # each sends its PROJ and ROUTE end of a step (SPEC §9.10)
    return 2 * max(cfg.pipeline.num_micro_batches, cfg.eval.batches) + 8 + 4 * (replicas - 1)


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

    def __call__(self, code: str, sender: str, text: str, *, quiet: bool = False) -> None:
        """Count one drop; ``quiet``: an expected one (logged at debug)."""
        n = self.counts[code] = self.counts.get(code, 0) + 1
        if quiet:
            log.debug("%s: dropped a message from %r: %s (%s, %d so far)", self.name, sender, text, code, n)
        elif n <= self.log_first or n & (n - 1) == 0:
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
    held: bool = False
    """It came before this peer's training started and was held (:class:`~.session.Early`): its
    ``seq`` was accepted then, in arrival order; the checks after the sequence remain."""
    peer_key: bytes | None = None
    """The CURVE key its connection proved (a certified peer's transport, ``Transport.peer_key``)."""


@dataclass(frozen=True)
class Admitted:
    """A message that passed every check, and the link of the neighbour it came from."""

    msg: Message
    link: PeerLink
    sender: str


class Admission:
    """The checks of the module docstring for one peer (see there). ``shapes`` is the run as this
    stage sees it (:func:`run_shapes`); ``window`` the step core's :class:`~mapl_swarm.step.window.StepWindow`, asked
    on the loop when a message arrives (the link's window, the lowest run epoch)."""

    def __init__(self, settings: LinkSettings, links: Links, *, shapes: RunShapes, window: StepWindow,
                 rejects: RejectCounter, decoder: WorkerThread, deadline: Callable[[str], float],
                 clock: Callable[[], float], replies_on_link: bool, started: Callable[[], bool] = lambda: True,
                 unknown_replica: Callable[[int], None] = lambda stage: None,
                 strike: Callable[[str, str, str], None] = lambda member, code, text: None) -> None:
        self.s = settings
        self.links = links
        self.shapes = shapes
        self.window = window
        self.rejects = rejects
        self.limits: DecodeLimits = shapes.decode_limits()
        """Per tensor name the largest size the run allows, checked before any inflate (SPEC §8)."""
        self.decoder = decoder
        self.deadline = deadline
        """``deadline(link name)``: how long that neighbour's session stays live unheard before training."""
        self.clock = clock
        self.replies_on_link = replies_on_link
        """WELCOME/REJECT come back on this peer's own connection (``Arrival.reply_link``); False
        with a transport that cannot receive there (they then come on the neighbour's connection,
        recognised by the HELLO nonce they echo)."""
        self.started = started
        """This peer's training runs: before, pipeline messages are held (:class:`~.session.Early`)."""
        self.unknown_replica = unknown_replica
        """Told the stage of a HELLO from a replica this peer has no link to (it may be joining)."""
        self.strike = strike
        """``strike(link name, code, text)``: a message of a neighbour in session failed a content
        check (:mod:`~.strikes`)."""

    # ------------------------------------------------------------------ the way in
    async def admit(self, arrival: Arrival) -> Admitted | None:
        """The admitted message, or None when dropped (counted and logged). A refused HELLO raises
        :class:`HelloRefused` (the caller answers with REJECT), a version mismatch re-raises
        :class:`~mapl_swarm.wire.VersionMismatch` (likewise), a pipeline message before training
        :class:`~.session.Early` (the caller holds it and admits it again once training starts)."""
        sender = arrival.sender
        in_session = False
        try:
            link = self._link_of(arrival)
            header = self._header(arrival, link)
            if arrival.reply_link is None:
                link = self._bound_link(arrival, header, link)
            if header.type in HANDSHAKE_TYPES and header.seq != 0:
                raise Rejected("not_allowed", f"{header.type.name} with seq {header.seq} (the handshake's is 0)")
            if header.type is MT.HELLO:
                if arrival.reply_link is not None:
                    raise Rejected("not_allowed", "HELLO on this peer's own connection")
                self.check_hello(header, link, sender, arrival.peer_key)
                return Admitted(decode_tensors(header, arrival.frames, self.limits), link, sender)
            self._check_message(header, link, arrival)
            in_session = True  # a member in session: what fails now is its own doing
            msg = await self._tensors(header, arrival.frames, link)
        except (HelloRefused, VersionMismatch, Early):
            raise
        except (Superseded, Unlinked) as exc:
            log.debug("stage %d: a message from %r not used: %s", self.s.stage, sender, exc.text)
            return None
        except Unbound as exc:
            self.rejects(exc.code, sender, exc.text, quiet=True)
            return None
        except (Rejected, ContentError) as exc:
            self.rejects(exc.code, sender, exc.text)
            if in_session and isinstance(exc, ContentError):
                self.strike(link.name, exc.code, exc.text)
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
            link = None if stage is None else self.links.route(stage)
        if link is None:
            raise Rejected("not_allowed", f"{arrival.sender!r} is not a neighbour of stage {self.s.stage}")
        return link

    def _bound_link(self, arrival: Arrival, header: Header, link: PeerLink) -> PeerLink:
        """The link a message belongs to (SPEC §9.2 step 1, §9.10 item 1); a neighbour stage has a
        link per peer's contact. A message comes on the link its connection's session is bound to;
        anything but a HELLO else keeps ``link``, whose session check drops it (``wrong_session``).
        A HELLO goes to the link of the contact it names. Naming none (a 2.0 chain peer's), to the
        stage's link that welcomed this peer; while several were dialed and none did, it is dropped
        (binding it would be a guess). Naming a contact this peer has no link to: in a chain whose
        peer of that stage is in session with this one, to that peer's link (:meth:`check_hello`
        refuses it ``stage_taken`` unless it re-forms the swarm); otherwise this peer reads the
        stage's records and drops it (a bad message only when its sender holds no certificate for
        that stage)."""
        bound = self.links.by_session(arrival.sender)
        if bound is not None and bound.stage == link.stage:
            return bound
        if header.type is not MT.HELLO:
            return link
        contact = header.meta.get("contact")
        if not isinstance(contact, str):  # a 2.0 chain peer's: the stage's link, once it is clear which
            dialed = self.links.of_stage(link.stage)
            if not self.s.replicas and len(dialed) > 1 and not any(other.welcomed for other in dialed):
                raise Unlinked("not_allowed", f"HELLO of stage {link.stage} naming no contact while none of its "
                                              f"records this peer dialed welcomed it yet (it says HELLO again)")
            return link
        found = self.links.by_contact(link.stage, contact)
        if found is not None:
            return found
        if not self.s.replicas:  # a chain: the link of the stage's peer, if any, refuses it (check_hello)
            taken = next((other for other in self.links.of_stage(link.stage)
                          if other.welcomed or self._live(other, arrival.sender)), None)
            if taken is not None:
                return taken
        self.unknown_replica(link.stage)
        why = f"HELLO from a peer of stage {link.stage} this peer does not know ({_shown_contact(contact)})"
        if self.s.identity is not None:
            try:
                self.s.identity.verify_peer(header.meta.get("cert"), stage=link.stage, curve_key=arrival.peer_key)
            except CertificateError:
                raise Rejected("not_allowed", why) from None
        raise Unlinked("not_allowed", f"{why}: it announced itself since this peer read the records")

    def _live(self, link: PeerLink, sender: str) -> bool:
        """``link``'s inbound session is another connection's than ``sender``'s and still alive:
        while training until this peer finds the neighbour lost, before it while heard within the
        neighbour's session deadline."""
        bound = link.rx
        unheard = math.inf if self.started() else self.deadline(link.name)
        return bound is not None and bound.routing_id != sender and bound.alive(self.clock(), unheard)

    def _header(self, arrival: Arrival, link: PeerLink) -> Header:
        """Phase 1 on the loop: the header only; no tensor frame is looked at."""
        header, _ = decode_header(arrival.frames, self.limits)
        return header

    # ------------------------------------------------------------------ handshake and session
    def check_hello(self, h: Header, link: PeerLink, sender: str, peer_key: bytes | None = None) -> None:
        """SPEC §9.2 step 2 in order (version and authentication are the decoder's): a certified
        peer's certificate for the sender's stage and the key its connection proved (``peer_key``),
        run, stages, configuration, then the stage's live session (a HELLO from the bound
        connection itself is a reconnection that replaces it)."""
        s, nonce = self.s, h.meta.get("nonce")
        certificate = None
        if s.identity is not None:
            try:
                certificate = s.identity.verify_peer(h.meta.get("cert"), stage=link.stage, curve_key=peer_key)
            except CertificateError as exc:
                raise HelloRefused("not_certified", f"HELLO of stage {link.stage} refused: {exc} ({exc.code})",
                                   nonce) from None
        pinned = link.server_key if certificate is not None else None
        if pinned is not None and certificate.curve_key != pinned:  # both directions one identity (§7.2 item 7)
            raise HelloRefused("stage_taken", f"stage {link.stage}'s HELLO comes from {certificate.name!r}, another "
                                              f"identity than the one this peer dials at {link.endpoint}", nonce)
        if h.run != s.run_id:
            raise HelloRefused("run_mismatch", f"run mismatch: peer {h.run!r}, this peer {s.run_id!r}", nonce)
        if h.dst != s.stage or h.src != link.stage:
            raise HelloRefused("stage_mismatch", f"stage mismatch: HELLO from stage {h.src} for stage {h.dst} on "
                                                 f"a connection of stage {link.stage}; this peer is stage {s.stage}",
                               nonce)
        refused = s.mismatch(h.meta, link.stage)
        if refused is not None:
            raise HelloRefused(*refused, nonce)
        reforms = (self.started() and h.epoch > self.window.epoch and REJOIN_CAPABILITY in s.capabilities
                   and REJOIN_CAPABILITY in h.meta.get("capabilities", ()))
        if certificate is not None and getattr(link.peer_certificate, "curve_key", None) != certificate.curve_key:
            reforms = False  # only the bound neighbour re-forms, on a new connection (SPEC §7.2 item 7)
        contact = h.meta.get("contact")  # another contact than the link's: a chain's stage has one peer
        other = isinstance(contact, str) and link.contact is not None and contact != link.contact
        if (other or self._live(link, sender)) and not reforms:  # one re-forming comes on a new connection (§9.6)
            raise HelloRefused("stage_taken", f"stage {link.stage} is taken: " + (
                f"this peer is in session with its peer at {link.contact}" if other else
                f"its session is alive (heard {self.clock() - link.rx.heard_at:.0f} s ago)"), nonce)
        link.peer_certificate = certificate
        link.peer_cert = h.meta.get("cert") if certificate is not None else None

    def _check_message(self, h: Header, link: PeerLink, arrival: Arrival) -> None:
        """SPEC §6.1 rules 1-6 on the authenticated header of anything but HELLO."""
        s = self.s
        if h.run != s.run_id:
            raise Rejected("not_allowed", f"run {h.run!r}, this peer's is {s.run_id!r}")
        if h.src != link.stage:
            raise Rejected("not_allowed", f"src {h.src} on a connection of stage {link.stage}")
        if h.type in (MT.WELCOME, MT.REJECT):
            check_sender(h, self.shapes)
            self._check_answer(h, link, arrival)
            return
        if arrival.reply_link is not None:
            raise Rejected("not_allowed", f"{h.type.name} on this peer's own connection (only WELCOME/REJECT)")
        check_sender(h, self.shapes)  # dst, the type's direction, the codec's types
        if h.type is MT.ROUTE and not s.replicas:  # a capability-gated type (SPEC §9.10): a chain's is implied
            raise Rejected("not_allowed", "ROUTE in a run without replicas")
        session = link.rx
        if session is None or session.routing_id != arrival.sender:
            refused = Unbound if h.type is MT.HEARTBEAT else Rejected  # an ended session's queued heartbeats
            raise refused("wrong_session", f"{h.type.name} from {arrival.sender!r}; stage {link.stage}'s "
                                            f"session is {session.routing_id if session else None!r}")
        check_epoch(h, self.window.epoch)  # before the sequence: a stale message does not move it
        if not arrival.held:
            gap = session.accept(h.seq, self.clock())
            if gap:
                log.warning("%s: %d message(s) from stage %d lost before seq %d (%d lost on the session)", s.name,
                            gap, link.stage, h.seq, session.lost)
            if h.type in HELD_UNTIL_START and not self.started():
                raise Early(link.name, f"{h.type.name} of step {h.step} before this peer's training started")
        check_header(h, self.shapes, self.window.of(link.stage))  # step window, projector version
        check_declared(h, self.shapes)  # declared sizes, before anything is inflated

    def _check_answer(self, h: Header, link: PeerLink, arrival: Arrival) -> None:
        """WELCOME/REJECT count only as the answer to this peer's pending HELLO (SPEC §9.2 step 3)."""
        if self.replies_on_link and arrival.reply_link is None:
            raise Rejected("not_allowed", f"{h.type.name} not on this peer's connection to stage {link.stage}")
        if not link.awaiting_answer:
            raise Rejected("not_allowed", f"{h.type.name} but no HELLO to stage {link.stage} awaits an answer")
        if not link.answers_hello(h.type, h.meta):
            if link.answers_older_hello(h.meta):
                raise Superseded("not_allowed", f"{h.type.name} to an earlier HELLO, which a newer one replaced")
            raise Rejected("not_allowed", f"{h.type.name} for another HELLO (hello_nonce)")
        if h.type is MT.WELCOME and self.s.identity is not None:  # the pinned server's own certificate
            try:
                self.s.identity.verify_peer(h.meta.get("cert"), stage=link.stage, curve_key=link.server_key)
            except CertificateError as exc:
                raise Rejected("not_certified", f"WELCOME of stage {link.stage}: {exc} ({exc.code})") from None

    # ------------------------------------------------------------------ tensors and content
    async def _tensors(self, header: Header, frames: Sequence[Any], link: PeerLink) -> Message:
        if header.type in (MT.WELCOME, MT.REJECT):
            return decode_tensors(header, frames, self.limits)
        window = self.window.of(link.stage)  # a snapshot, taken on the loop
        if not header.tensors:  # nothing to inflate: the content rules (a REPORT's numbers) on the loop
            return self._decode(header, frames, window)
        return await self.decoder.run(self._decode, header, frames, window)

    def _decode(self, header: Header, frames: Sequence[Any], window: Window) -> Message:
        """Descriptors within limits, CRC, inflate, then the content rules (the decode thread for tensors)."""
        msg = decode_tensors(header, frames, self.limits)
        check_content(msg, self.shapes, window)
        return msg
