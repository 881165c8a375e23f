"""A peer's link to one neighbour: handshake state, framing, counting and sending of its messages.

:class:`PeerLink` is everything this peer knows and does about one neighbour: where it is
(``endpoint``), whether it welcomed us and what it advertised (``capabilities``), the link's
outbound sequence numbers, how stage payloads map to wire tensors and back (names from
:mod:`mapl_swarm.pipeline.payload`; the compute thread does every torch <-> host conversion, the
link only wraps host memory), the payload byte counter, the send through the transport and,
with mapl_vq, the link's side of the codebook streams (:class:`~.vq_link.CodebookLink`).

Sessions (SPEC §9): the link's outbound direction is open once the neighbour answered
this peer's HELLO with WELCOME (``welcomed``); nothing but HELLO goes out before (heartbeats
included). Its inbound direction is the neighbour's connection bound when this peer welcomed the
neighbour's HELLO (``rx``, an :class:`~.admission.RxSession`: routing id, sequence). WELCOME
and REJECT carry ``seq`` 0 and go back on the HELLO's own connection (``reply``); every other
message takes the next ``seq`` of the link's outbound connection (HELLO has 0).

The schedule talks to the links of a neighbour stage (:class:`Links`: a set of links per
neighbour stage and the route to one) in payload terms (``send_act``, ``send_grad``,
``decoded``...), never to the transport, so several peers of a neighbour stage or re-routing can change what a link is without touching the schedule.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import re
import time
from collections import deque
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

from mapl_swarm.net.emulator import LinkConfig
from mapl_swarm.peer.session import RxSession
from mapl_swarm.pipeline.tensors import to_wire
from mapl_swarm.peer.vq_link import CodebookLink
from mapl_swarm.pipeline.payload import (
    ACT_WIRE,
    GRAD_WIRE,
    LinkCounter,
    LinkKind,
    Stream,
    WireName,
    act_kind,
)
from mapl_swarm.net.identity import CertificateError
from mapl_swarm.wire import Message, MessageType, encode, new_nonce
from mapl_swarm.wire.message import payload_digest
from mapl_swarm.wire.spec import NONCE_BYTES, REPLICAS_CAPABILITY

if TYPE_CHECKING:
    import torch

    from mapl_swarm.net.identity import CertificateBody, PeerIdentity
    from mapl_swarm.net.transport import Transport
    from mapl_swarm.peer.compute import ComputeThread
    from mapl_swarm.pipeline.stage import StageRuntime

log = logging.getLogger(__name__)

__all__ = ["LinkSettings", "PeerLink", "Links", "Reply", "stage_name", "replica_name", "stage_of", "config_differences"]

MT = MessageType
T = TypeVar("T")

Reply = Callable[[Sequence[Any], str], Awaitable[None]]
"""Sends ``(frames, kind)`` back on the connection a received message came in on."""

CONFIG_REFUSALS = frozenset({"fingerprint_mismatch", "stage_mismatch"})
"""REJECT codes that say the two peers' configurations differ (SPEC §9.2 step 2.3-2.4)."""


_OLDER_HELLOS = 256
"""HELLOs of a link remembered as superseded: a neighbour that was stalled answers every HELLO it
missed at once (one per ``net.hello_retry_s`` of a rejoin wait), and those answers are no fault."""


def _anchor(anchored: bool) -> dict[str, bool]:
    """The ``anchored`` field of HELLO/WELCOME/REJECT/HEARTBEAT (1.6): written only when true."""
    return {"anchored": True} if anchored else {}


_ROUTING_ID = re.compile(r"stage(0|[1-9][0-9]{0,4})\.[0-9a-f]{8}")


def stage_name(stage: int) -> str:
    """A stage's transport name (the name part of its routing id, and the name of links to it)."""
    return f"stage{stage}"


def replica_name(stage: int, contact: str) -> str:
    """The name of the link to the replica of ``stage`` at ``contact`` (SPEC §9.10): the stage's
    name and 8 hex digits of the contact's SHA-256, e.g. ``stage1@3fa2c9d1``."""
    return f"{stage_name(stage)}@{hashlib.sha256(contact.encode()).hexdigest()[:8]}"


def stage_of(routing_id: str) -> int | None:
    """The stage of a routing id ``stage<k>.<8 hex>`` (SPEC §1.2); None for anything else."""
    m = _ROUTING_ID.fullmatch(routing_id)
    return int(m.group(1)) if m else None


@dataclass(frozen=True, kw_only=True)
class LinkSettings:
    """What every link of one peer shares: who this peer is and how it frames its messages."""

    run_id: str
    """Run id in every header; messages of other runs are dropped."""
    stage: int
    """This peer's stage."""
    num_stages: int
    """Stages in the pipeline (checked at the handshake)."""
    fingerprint: str
    """Config fingerprint (model, codec, tokenizer); a neighbour with another one is refused."""
    capabilities: tuple[str, ...]
    """Advertised in HELLO/WELCOME."""
    num_micro_batches: int = 1
    """M, micro-batches per step: not in the fingerprint, so checked at the handshake (1.4)."""
    micro_batch_size: int = 1
    """B, sequences per micro-batch (checked at the handshake)."""
    eval_batches: int = 0
    """E, eval micro-batches per validation (checked at the handshake)."""
    max_in_flight: int = 0
    """Micro-batches stage 0 keeps in flight, from which every stage's 1F1B warm-up follows, so all
    must share it (checked at the handshake when both send it, 1.6); 0: not sent."""
    identity: PeerIdentity | None = None
    """A certified peer's identity (SPEC §7.2): its certificate goes in its HELLO, others' are checked."""
    sign_work: bool = False
    """Replicas check each other's work (``replicas.check_fraction``, SPEC §9.10 item 15): a certified
    peer signs every train ACT and GRAD it sends, and takes only signed ones."""
    compress_ids: bool = True
    """lz4 on integer tensors (ids, codes) when it helps; False sends every tensor raw."""
    max_frame_bytes: int
    """Largest tensor frame accepted or sent."""
    config: Mapping[str, Any] = field(default_factory=dict)
    """Every setting the neighbours must share, by TOML name (``config.config_summary``): sent in
    HELLO/WELCOME (1.6) so that a refusal names what differs."""
    replicas: bool = False
    """The run has several peers per stage (SPEC §9.10): a neighbour must advertise ``replicas`` too
    and name its ``contact``."""
    stage_replicas: int = 0
    """With replicas, a session that re-forms the swarm (SPEC §9.10 item 10): the replicas of this
    peer's stage that start it (those live at the pause), sent as HELLO/WELCOME ``stage_replicas``;
    0: not sent."""
    lost: int | None = None
    """In such a session: the stage that lost its last replica (HELLO/WELCOME ``lost``), when known."""

    @property
    def name(self) -> str:
        return stage_name(self.stage)

    def hello_meta(self, contact: str | None = None) -> dict[str, Any]:
        """HELLO/WELCOME meta without the nonces: fingerprint, stage count, the pipeline's M, B and E,
        capabilities, transport name, this peer's ``contact`` once it has one (2.1: the receiver binds
        the HELLO to the link of that contact, SPEC §9.2)."""
        return {"fingerprint": self.fingerprint, "num_stages": self.num_stages,
                **({"contact": contact} if contact is not None else {}),
                "num_micro_batches": self.num_micro_batches, "micro_batch_size": self.micro_batch_size,
                "eval_batches": self.eval_batches, "capabilities": list(self.capabilities), "peer": self.name,
                **({"config": dict(self.config)} if self.config else {}),
                **({"cert": self.identity.encoded_cert} if self.identity is not None else {}),
                **({"max_in_flight": self.max_in_flight} if self.max_in_flight else {}),
                **({"stage_replicas": self.stage_replicas} if self.stage_replicas else {}),
                **({"lost": self.lost} if self.stage_replicas and self.lost is not None else {})}

    def mismatch(self, meta: Mapping[str, Any], peer: int) -> tuple[str, str] | None:
        """(REJECT code, reason naming the values of both stages) when a HELLO/WELCOME's ``meta``
        from stage ``peer`` is of another run configuration (SPEC §9.2 steps 3-4, after run and
        stages); None when it fits. With the neighbour's ``config`` (1.6) the reason names every
        setting that differs, else the field or the two fingerprints."""
        pipeline = ("num_micro_batches", "micro_batch_size", "eval_batches",
                    *(("max_in_flight",) if self.max_in_flight and "max_in_flight" in meta else ()))
        theirs_replicas = REPLICAS_CAPABILITY in meta.get("capabilities", ())
        if meta.get("num_stages") != self.num_stages:
            code = "stage_mismatch"
        elif meta.get("fingerprint") != self.fingerprint or any(meta.get(k) != getattr(self, k) for k in pipeline):
            code = "fingerprint_mismatch"
        elif theirs_replicas != self.replicas or (self.replicas and not isinstance(meta.get("contact"), str)):
            code = "fingerprint_mismatch"  # SPEC §9.10: replicas only with replicas, each naming its contact
        else:
            return None
        theirs = meta.get("config")
        differ = config_differences(self.config, theirs, peer, self.stage) if isinstance(theirs, dict) else []
        if differ:
            return code, "config differs: " + ", ".join(differ)
        for key in ("num_stages", *pipeline):
            if meta.get(key) != getattr(self, key):
                return code, f"{key} mismatch: stage {peer} has {_shown(meta.get(key))}, stage {self.stage} " \
                             f"{getattr(self, key)}"
        if theirs_replicas != self.replicas:
            return code, (f"replicas.enabled mismatch: stage {peer} has {str(theirs_replicas).lower()}, stage "
                          f"{self.stage} {str(self.replicas).lower()}")
        if self.replicas and not isinstance(meta.get("contact"), str):
            return code, f"stage {peer} runs with replicas but names no contact"
        return code, (f"config fingerprint mismatch: stage {peer} has {_shown(meta.get('fingerprint'))}, stage "
                      f"{self.stage} {self.fingerprint}")


_SHOWN_DIFFERENCES = 6


def _shown(value: Any) -> str:
    """A setting received from the network, as a log line may show it (bounded, scalars only)."""
    if value is None or isinstance(value, (bool, int, float, str)):
        text = repr(value)
        return text if len(text) <= 40 else text[:37] + "..."
    return f"<{type(value).__name__}>"


def config_differences(mine: Mapping[str, Any], theirs: Mapping[Any, Any], peer: int, stage: int) -> list[str]:
    """``"name (stage P has X, stage S Y)"`` for each setting of ``mine`` (stage ``stage``'s) that
    ``theirs`` (stage ``peer``'s HELLO/WELCOME ``config``) holds otherwise or lacks: sorted, at most
    a few, then a count."""
    differ = sorted(k for k in mine if theirs.get(k, _MISSING) != mine[k])
    shown = [f"{k} (stage {peer} has {_shown(theirs[k]) if k in theirs else 'none'}, stage {stage} {_shown(mine[k])})"
             for k in differ[:_SHOWN_DIFFERENCES]]
    if len(differ) > _SHOWN_DIFFERENCES:
        shown.append(f"and {len(differ) - _SHOWN_DIFFERENCES} more")
    return shown


_MISSING = object()


class PeerLink:
    """This peer's link to neighbour ``stage`` (see the module docstring)."""

    def __init__(self, settings: LinkSettings, stage: int, *,
                 on_bad_frame: Callable[[str, str], None], contact: str | None = None) -> None:
        self.settings = settings
        self.stage = stage
        """The neighbour's stage."""
        self.contact = contact
        """The contact (DHT record value) of the one peer of the stage this link joins (SPEC §9.1);
        None only for a link built without one (tests)."""
        self.name = stage_name(stage) if contact is None else replica_name(stage, contact)
        """The neighbour's transport name (the outbound link's name)."""
        self.is_upstream = stage < settings.stage
        self.tx_stream = Stream.GRAD if self.is_upstream else Stream.ACT
        """The payload stream this peer sends on the link (gradients go upstream)."""
        self.rx_stream = Stream.ACT if self.is_upstream else Stream.GRAD
        """The payload stream this peer receives on the link."""
        self.endpoint: str | None = None
        """Where the neighbour listens, once found."""
        self.welcomed = False
        """The neighbour answered our HELLO with WELCOME."""
        self.capabilities: frozenset[str] = frozenset()
        """What the neighbour advertised in its HELLO/WELCOME."""
        self.counter = LinkCounter()
        """Payload bytes sent on this link, by kind."""
        self.codebooks: CodebookLink | None = None
        """mapl_vq: this link's side of the codebook streams (:meth:`use_codebooks`)."""
        self.rx: RxSession | None = None
        """The neighbour's connection bound when this peer welcomed its HELLO (None before)."""
        self.hello_sent = False
        """This peer sent HELLO on the link; until WELCOME or REJECT answers it, ``awaiting_answer``."""
        self.rejected = False
        """The neighbour answered this peer's HELLO with REJECT."""
        self.epoch = 0
        """The run epoch this peer's messages on the link carry (SPEC "Rejoin"; :meth:`Links.set_epoch`)."""
        self.hello_at: float | None = None
        """When (``time.monotonic()``) the newest HELLO went out (None: none yet)."""
        self.retry = False
        """The neighbour refused the newest HELLO in a way that may pass: ``stage_taken`` (its old
        session may not have timed out yet, SPEC "Rejoin"), or a configuration refusal by a peer
        that is not anchored (either side may be the misconfigured one, SPEC §9.2): HELLO again."""
        self.peer_anchored = False
        """The neighbour said it is anchored (SPEC §9.2, 1.6): it holds stage 0's configuration."""
        self.peer_certificate: CertificateBody | None = None
        self.peer_cert: bytes | None = None
        """The neighbour's certificate as its HELLO carried it (what proves its signatures to a third party)."""
        """The certificate of the neighbour whose HELLO passed last (SPEC §7.2: its key and roles)."""
        self._hello_nonce: bytes | None = None
        self._older_nonces: deque[bytes] = deque(maxlen=_OLDER_HELLOS)
        """The nonces of this link's last HELLOs before the current one (their answers are superseded)."""
        self.refused_hello: str | None = None
        """Why this peer last refused a HELLO of this neighbour (code: reason), if it did."""
        self.reform_replicas: int | None = None
        """The neighbour's WELCOME ``stage_replicas``: its stage starts the re-formed swarm with this
        many replicas (SPEC §9.10 item 10); None: it did not say (not a re-form)."""
        self.reform_lost: int | None = None
        """The neighbour's WELCOME ``lost``: the stage the re-formed swarm waits one replacement for."""
        self.refused_by: str | None = None
        """The reason of the neighbour's last configuration refusal that is retried (logged once)."""
        self.refusal: str | None = None
        """Why the peer at this link's contact refused this peer with a final REJECT (this session):
        the link's HELLOs end (:mod:`~.linker`)."""
        self.local_name, self.local_stage = settings.name, settings.stage
        """This peer's transport name and stage."""
        self.local_contact: str | None = None
        """This peer's own contact, named in its HELLO/WELCOME (set once it is bound)."""
        self._on_bad_frame = on_bad_frame
        self._seq = 0
        self._send_lock = asyncio.Lock()
        self._transport: Transport | None = None

    def use_codebooks(self, runtime: StageRuntime, compute: ComputeThread, *,
                      spawn: Callable[[Awaitable[Any]], None],
                      strike: Callable[[str, str, str], None] = lambda member, code, text: None) -> None:
        """Stream the runtime's VQ codebooks on this link (mapl_vq); ``strike`` counts a rejected
        slice against the member that sent it."""
        self.codebooks = CodebookLink(self, runtime, compute, spawn=spawn, on_bad_frame=self._on_bad_frame,
                                      strike=strike)

    # ------------------------------------------------------------------ transport
    def connect(self, transport: Transport, endpoint: str, config: LinkConfig) -> None:
        """Open the outbound link to the neighbour at ``endpoint`` (shaped by ``config``); the
        transport's connection to the stage is kept when it already goes there (an earlier session
        of this process). A connection elsewhere must be closed first (:meth:`Peer._connect`)."""
        if transport.endpoint_of(self.name) != endpoint:
            transport.connect(self.name, endpoint, config)
        self._transport = transport
        self.endpoint = endpoint

    @property
    def server_key(self) -> bytes | None:
        """The CURVE key this peer's connection to the neighbour is pinned to (certified peers)."""
        return None if self._transport is None else self._transport.server_key(self.name)

    def frames(self, msg: Message) -> list:
        """``msg`` encoded for this link: its compression and frame limit."""
        s = self.settings
        return encode(msg, compress=None if s.compress_ids else "raw", max_frame_bytes=s.max_frame_bytes)

    def _answer(self, mtype: MessageType, meta: dict) -> list:
        """WELCOME/REJECT frames: ``seq`` 0, outside the link's outbound sequence (SPEC §9.2)."""
        return self.frames(Message(type=mtype, run_id=self.settings.run_id, src=self.settings.stage,
                                   dst=self.stage, seq=0, epoch=self.epoch, meta=meta))

    async def send_heartbeat(self, meta: Callable[[], dict] | None = None, *, anchored: bool = False) -> None:
        """HEARTBEAT with the next ``seq``; only once the neighbour welcomed this peer (SPEC §9.3).
        ``meta()`` gives its timestamps (SPEC §9.5), read when its turn to be framed comes;
        ``anchored``: this peer holds stage 0's configuration (SPEC §9.2)."""
        if self.welcomed:
            await self.send(MT.HEARTBEAT, meta=lambda: {**(meta() if meta is not None else {}), **_anchor(anchored)})

    async def send(self, mtype: MessageType, *, step: int = 0, micro: int = 0,
                   meta: dict | Callable[[], dict] | None = None,
                   tensors: Mapping[str, torch.Tensor] | None = None, kinds: Mapping[str, LinkKind] | None = None,
                   pver: int = 0, cver: int = 0, epoch: int | None = None) -> None:
        """Send one message to the neighbour: next sequence number, torch -> wire tensors, payload
        bytes counted under ``kinds[name]`` per tensor (``kinds`` is required with ``tensors``).
        ``tensors`` are host tensors, contiguous: what :class:`~.host.HostRuntime` returns (the
        frames view their memory until sent, see :func:`~.tensors.to_wire`). ``meta`` may be a
        callable, called when the message is framed. ``epoch``: the run epoch in its header (None:
        the link's, :meth:`Links.set_epoch`).

        Sends on one link are serialised (a FIFO lock from the sequence number to the transport's
        queue), so the neighbour gets them in ``seq`` order even when several tasks send at once
        (the schedule, relayed REPORTs, heartbeats) and the link's send buffer is full."""
        if self._transport is None:
            raise RuntimeError(f"{self.local_name}: link to {self.name} used before connect()")
        async with self._send_lock:
            seq, self._seq = self._seq, self._seq + 1
            wire_tensors = {str(k): to_wire(v) for k, v in (tensors or {}).items()}
            msg = Message(type=mtype, run_id=self.settings.run_id, src=self.settings.stage, dst=self.stage,
                          step=step, micro=micro, seq=seq, pver=pver, cver=cver,
                          epoch=self.epoch if epoch is None else epoch,
                          meta=(meta() if callable(meta) else meta) or {}, tensors=wire_tensors)
            frames = self.frames(msg)
            for name, t in (tensors or {}).items():
                self.counter.add(kinds[name], t)  # every tensor sent is counted under its kind
            await self._transport.send(self.name, frames, kind=mtype.name)

    # ------------------------------------------------------------------ handshake
    async def send_hello(self, *, anchored: bool = False) -> None:
        """HELLO with ``seq`` 0 and a fresh nonce, opening the link's outbound session; ``anchored``:
        this peer holds stage 0's configuration (:attr:`Links.anchored`)."""
        if self._hello_nonce is not None:
            self._older_nonces.append(self._hello_nonce)
        self._hello_nonce = new_nonce()
        self.hello_sent, self.welcomed, self.rejected, self.retry = True, False, False, False
        self.hello_at = time.monotonic()
        self._seq = 0
        await self.send(MT.HELLO, meta={**self.settings.hello_meta(self.local_contact), "nonce": self._hello_nonce,
                                        **_anchor(anchored)})

    @property
    def awaiting_answer(self) -> bool:
        """This peer's HELLO is not answered yet (only then WELCOME or REJECT is accepted)."""
        return self.hello_sent and not self.welcomed and not self.rejected

    def answers_hello(self, mtype: MessageType, meta: Mapping[str, Any]) -> bool:
        """A WELCOME echoes this peer's HELLO nonce; a REJECT does when it carries one (SPEC §9.2)."""
        echo = meta.get("hello_nonce")
        if echo is None and mtype is MT.REJECT:
            return True
        return echo == self._hello_nonce

    def answers_older_hello(self, meta: Mapping[str, Any]) -> bool:
        """The answer echoes the nonce of one of this link's earlier HELLOs (a newer one replaced it)."""
        return meta.get("hello_nonce") in self._older_nonces

    async def on_hello(self, msg: Message, sender: str, reply: Reply, *, now: float, anchored: bool = False) -> None:
        """Welcome the neighbour's HELLO (already checked, :meth:`~.admission.Admission.check_hello`):
        bind its connection ``sender`` as the link's inbound session and answer WELCOME on it. A later HELLO is a reconnection (mapl_vq: ask for a
        codebook resync)."""
        s = self.settings
        self.capabilities = frozenset(msg.meta.get("capabilities", []))
        self.peer_anchored = self.peer_anchored or msg.meta.get("anchored") is True
        self.rx = RxSession(routing_id=sender, heard_at=now, last_seq=msg.seq)
        if self._transport is not None and self._transport.is_reverse(self.name):
            self._transport.bind_reverse(self.name, sender)  # a dial-out neighbour: its connection carries ours too
        await reply(self._answer(MT.WELCOME, {**s.hello_meta(self.local_contact), "nonce": new_nonce(),
                                              "hello_nonce": msg.meta["nonce"], **_anchor(anchored)}), MT.WELCOME.name)
        if self.codebooks is not None:
            await self.codebooks.on_handshake()

    async def refuse(self, code: str, reason: str, reply: Reply, *, hello_nonce: Any = None,
                     anchored: bool = False) -> None:
        """REJECT a HELLO on its own connection (``reply``), never on the bound session; with the
        HELLO's nonce when it was readable, and whether this peer is anchored (1.6: a configuration
        refusal by an anchored peer is final, SPEC §9.2)."""
        meta = {"code": code, "reason": reason, "anchored": anchored}  # always: absent is a 1.5 refusal
        if isinstance(hello_nonce, bytes) and len(hello_nonce) == NONCE_BYTES:
            meta["hello_nonce"] = hello_nonce
        await reply(self._answer(MT.REJECT, meta), MT.REJECT.name)

    def on_welcome(self, msg: Message) -> None:
        """The neighbour welcomed this peer's HELLO: the outbound session is open."""
        self.welcomed = True
        self.capabilities = frozenset(msg.meta.get("capabilities", []))
        self.peer_anchored = self.peer_anchored or msg.meta.get("anchored") is True
        self.reform_replicas, self.reform_lost = msg.meta.get("stage_replicas"), msg.meta.get("lost")

    def end_sessions(self) -> None:
        """The neighbour left before training (SPEC §9.5): its stage is free, this peer HELLOs again."""
        self.rx, self.welcomed = None, False

    def on_reject(self, msg: Message) -> None:
        """REJECT of this peer's newest HELLO; ``stage_taken`` and a configuration refusal of a peer
        that is not anchored are retried (:attr:`retry`)."""
        self.rejected = True
        code = msg.meta.get("code")
        self.retry = code == "stage_taken" or (code in CONFIG_REFUSALS and msg.meta.get("anchored") is False)

    # ------------------------------------------------------------------ payloads out
    async def send_act(self, step: int, micro: int, payload: Mapping[str, torch.Tensor], *, eval_mode: bool,
                       pver: int) -> None:
        """ACT (a forward payload) downstream, after the codebook slices it needs (mapl_vq)."""
        mode = "eval" if eval_mode else "train"
        cver = 0
        if self.codebooks is not None:
            await self.codebooks.send_slices(step, micro)
            self.codebooks.remember(mode, step, micro, payload, pver)
            cver = self.codebooks.tx_version()
        tensors = {ACT_WIRE[k]: v for k, v in payload.items()}
        kinds = {ACT_WIRE[k]: act_kind(k, eval_mode=eval_mode) for k in payload}
        await self.send(MT.ACT, step=step, micro=micro, pver=pver, meta={"mode": mode, **(
            self._signed("ACT", step, micro, tensors) if not eval_mode else {})}, tensors=tensors, kinds=kinds,
                        cver=cver)

    async def send_grad(self, step: int, micro: int, payload: Mapping[str, torch.Tensor], *, pver: int) -> None:
        """GRAD (a backward payload) upstream, after the codebook slices it needs (mapl_vq); ``pver``
        is the projector version its ACT was made with."""
        cver = 0
        if self.codebooks is not None:
            await self.codebooks.send_slices(step, micro)
            self.codebooks.remember("train", step, micro, payload, pver)
            cver = self.codebooks.tx_version()
        tensors = {GRAD_WIRE[k]: v for k, v in payload.items()}
        await self.send(MT.GRAD, step=step, micro=micro, pver=pver, tensors=tensors, meta=self._signed(
            "GRAD", step, micro, tensors), kinds={name: LinkKind.GRAD for name in tensors}, cver=cver)

    def _signed(self, kind: str, step: int, micro: int, tensors: Mapping[str, torch.Tensor]) -> dict[str, bytes]:
        """``sig`` of a train ACT or GRAD (SPEC §9.10 item 15), when this peer signs its work."""
        identity = self.settings.identity
        if not self.settings.sign_work or identity is None:
            return {}
        digest = payload_digest({name: to_wire(t.contiguous()) for name, t in tensors.items()})
        return {"sig": identity.sign_work(kind, step, micro, digest)}

    def proof_of(self, msg: Message) -> dict[str, bytes] | None:
        """What shows that this link's peer sent ``msg`` (its ``sig`` and the certificate its HELLO
        carried), kept with a train ACT's or GRAD's inputs for the replicas that check this one's
        work; None when ``msg`` carries no signature or the peer no certificate."""
        sig = msg.meta.get("sig")
        return {"cert": self.peer_cert, "sig": sig} if isinstance(sig, bytes) and self.peer_cert is not None else None

    def signed_work(self, msg: Message) -> bool:
        """``msg``, a train ACT or GRAD, carries its sender's signature of its micro-batch and bytes
        (SPEC §9.10 item 15); True too when this peer checks none (insecure, or no checking)."""
        identity = self.settings.identity
        if not self.settings.sign_work or identity is None:
            return True
        proof = self.proof_of(msg)
        try:
            identity.verify_work(proof or {}, kind=msg.type.name, step=msg.step, micro=msg.micro,
                                 digest=payload_digest(msg.tensors), stage=self.stage)
        except CertificateError:
            return False
        return True

    async def send_projector(self, step: int, projector: torch.Tensor, pver: int) -> None:
        """PROJ of ``step`` (the step whose ACTs it precedes) downstream, at projector version ``pver``."""
        await self.send(MT.PROJ, step=step, pver=pver, tensors={WireName.PROJ: projector},
                        kinds={WireName.PROJ: LinkKind.PROJ})

    async def send_projector_grad(self, step: int, grad: torch.Tensor, *, micro_batches: int, pver: int) -> None:
        """PROJ_GRAD of ``step`` upstream; ``pver``: the projector version it was computed at."""
        await self.send(MT.PROJ_GRAD, step=step, pver=pver, meta={"micro_batches": micro_batches},
                        tensors={WireName.PROJ_GRAD: grad}, kinds={WireName.PROJ_GRAD: LinkKind.PROJ_GRAD})

    async def send_route(self, step: int, phase: str, *, acts: int | None = None, gone: list[str] | None = None,
                         epoch: int | None = None, held: list[int] | None = None,
                         proof: tuple[bytes, bytes] | None = None) -> None:
        """ROUTE (SPEC §9.10): ``ready`` upstream (this peer takes the link's train ACTs of ``step``),
        ``end`` downstream (``acts``: the train ACTs of ``step`` the link carried; no more),
        ``commit`` downstream (every stage may take ``step``), ``reopen`` downstream (more train ACTs
        of ``step`` come after the link's end), ``gone`` and ``redo`` either way (``gone``: contacts
        of replicas that left, ``held``: with ``gone`` upstream, the micro-batches this peer took
        from them; ``redo`` runs ``step`` again in run epoch ``epoch``, with its maker's proof: a
        relayed one's ``proof``, else, certified, this peer's own signature of the decision)."""
        epoch = self.epoch if epoch is None else epoch
        meta: dict = {"phase": phase}
        if acts is not None:
            meta["acts"] = acts
        if gone is not None:
            meta["gone"] = gone
        if held is not None:
            meta["held"] = held
        if phase == "redo" and proof is not None:
            meta["cert"], meta["sig"] = proof
        elif phase == "redo" and self.settings.identity is not None:
            meta.update(self.settings.identity.sign_redo(epoch, step))
        await self.send(MT.ROUTE, step=step, meta=meta, epoch=epoch)

    async def send_report(self, step: int, meta: dict) -> None:
        await self.send(MT.REPORT, step=step, meta=meta)

    async def send_bye(self, meta: dict, *, step: int = 0) -> None:
        """BYE: this peer sends nothing more on the link (``step``: the steps it completed)."""
        await self.send(MT.BYE, step=step, meta=meta)

    # ------------------------------------------------------------------ payloads in
    async def decoded(self, work: Awaitable[T], msg: Message) -> T:
        """Await ``work`` (a compute that decodes ``msg`` from this neighbour). mapl_vq: codes at
        another codebook version ask for a RESYNC and a retransmission, raising
        :class:`~.vq_link.Retransmitting` (drop ``msg``, its copy follows)."""
        if self.codebooks is None:
            return await work
        return await self.codebooks.guard(work, (msg.step, msg.micro, msg.meta.get("mode", "train")))

    async def on_codebook_slice(self, msg: Message) -> None:
        if self.codebooks is None:
            self._on_bad_frame(self.name, "CODEBOOK_SLICE but the codec has no codebooks")
        else:
            await self.codebooks.on_slice(msg)


class Links:
    """A peer's links, by neighbour stage (``up``: None on stage 0; ``down``: None on the last
    stage). A neighbour stage is a set of links, one per peer that serves it, each to its contact
    (:meth:`add`, :mod:`~.linker`): one in a chain, one per replica with replicas (SPEC §9.10).
    :meth:`route` picks the link of a stage a message goes on where one is addressed (a chain's
    order, a CHECKPOINT), :meth:`of_stage` gives them all."""

    def __init__(self, up: int | None, down: int | None) -> None:
        self.up, self.down = up, down
        """The neighbour stages."""
        self.by_stage_links: dict[int, list[PeerLink]] = {stage: [] for stage in (up, down) if stage is not None}

    @property
    def stages_expected(self) -> list[int]:
        """The neighbour stages, whether linked yet or not."""
        return sorted(self.by_stage_links)

    def add(self, link: PeerLink) -> PeerLink:
        """A link to one more peer of a neighbour stage (one per DHT record's contact)."""
        if link.stage not in self.by_stage_links or self.named(link.name) is not None:
            raise ValueError(f"link {link.name}: not a neighbour stage, or linked already")
        self.by_stage_links[link.stage].append(link)
        return link

    def remove(self, link: PeerLink) -> None:
        """Drop ``link`` (a stale record's: its peer never welcomed this peer; a chain's second peer of a
        stage)."""
        self.by_stage_links[link.stage].remove(link)

    def of_stage(self, stage: int | None) -> list[PeerLink]:
        """The links to ``stage``'s peers (none for no such neighbour)."""
        return list(self.by_stage_links.get(stage, [])) if stage is not None else []

    def by_contact(self, stage: int, contact: str) -> PeerLink | None:
        """The link to the replica of ``stage`` at ``contact``."""
        return next((link for link in self.of_stage(stage) if link.contact == contact), None)

    def by_session(self, routing_id: str) -> PeerLink | None:
        """The link whose bound inbound session is ``routing_id``'s."""
        return next((link for link in self if link.rx is not None and link.rx.routing_id == routing_id), None)

    def route(self, stage: int | None) -> PeerLink | None:
        """The link a message to neighbour ``stage`` goes on (None: no such neighbour): of its links,
        the first that is welcomed, else the first."""
        links = self.by_stage_links.get(stage, []) if stage is not None else []
        return next((link for link in links if link.welcomed), links[0] if links else None)

    @property
    def upstream(self) -> PeerLink | None:
        return self.route(self.up)

    @property
    def downstream(self) -> PeerLink | None:
        return self.route(self.down)

    def __iter__(self) -> Iterator[PeerLink]:
        return iter([link for links in self.by_stage_links.values() for link in links])

    def named(self, name: str) -> PeerLink | None:
        """The link to the neighbour with transport name ``name``."""
        return next((link for link in self if link.name == name), None)

    @property
    def stages(self) -> list[int]:
        """The neighbour stages this peer has links to."""
        return sorted({link.stage for link in self})

    @property
    def all_welcomed(self) -> bool:
        return all(link.welcomed for link in self)

    @property
    def anchored(self) -> bool:
        """This peer holds the run's configuration for sure (SPEC §9.2, 1.6): it is stage 0, whose
        configuration is the run's, or its upstream neighbour is anchored and welcomed this peer
        (so their configurations match)."""
        up = self.upstream
        return up is None or (up.welcomed and up.peer_anchored)

    def set_epoch(self, epoch: int) -> None:
        """Every later message of this peer carries run epoch ``epoch`` (SPEC "Rejoin")."""
        for link in self:
            link.epoch = epoch
