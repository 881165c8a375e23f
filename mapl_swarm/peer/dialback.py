"""Dial-back (SPEC §9.11): on a member's request a live peer dials the contact that member will
serve at, so that the member learns whether the swarm can reach it (``mapl-swarm doctor``).

A request is a DIALBACK on this peer's ROUTER from a connection that is no neighbour's: the
requester's certificate (``cert``: this run's, for the stage in the header's ``src``, not revoked,
naming the CURVE key its connection proved), the contact to dial (``contact``:
``tcp://host:port#<hex key>``, the key the certificate's own: a member can have this peer dial
only an address that claims to be itself) and a ``nonce``. This peer then opens one connection to
that contact, pinned to that key, sends a DIALBACK echoing the nonce and closes it; the same
DIALBACK goes back first on the request's own connection, so that the requester knows it was
heard (only the one on its listening socket proves that the swarm reaches it). A stranger's
request (an insecure run, a certificate of another authority), a second request of the same
certificate within :data:`PER_MEMBER_S`, and requests beyond :data:`MAX_IN_FLIGHT` dials at once
are dropped and counted (``not_certified``, ``queue_full``).
"""

from __future__ import annotations

import itertools
import logging
import secrets
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from mapl_swarm.errors import MaplError

from mapl_swarm.net.errors import NetError
from mapl_swarm.net.identity import CertificateError
from mapl_swarm.net.transport import Transport, TransportConfig, is_dial_out, run, split_contact
from mapl_swarm.wire import Message, MessageType, WireError, decode, encode

__all__ = ["DialBacks", "PER_MEMBER_S", "MAX_IN_FLIGHT", "DIAL_S", "Reachability", "ask_dial_back", "reachability"]

log = logging.getLogger(__name__)

PER_MEMBER_S = 10.0
"""One dial-back per certificate within this many seconds."""
MAX_IN_FLIGHT = 4
"""Dials on their way at once at most."""
DIAL_S = 5.0
"""How long a dial may take to deliver its DIALBACK before the connection is closed."""
_REMEMBERED = 256


class Refused(Exception):
    """A request dropped: ``code`` (SPEC §6) and why."""

    def __init__(self, code: str, text: str) -> None:
        super().__init__(text)
        self.code, self.text = code, text


class DialBacks:
    """The dial-back service of one peer (``identity`` None: an insecure peer, which serves none)."""

    def __init__(self, name: str, stage: int, run_id: str, identity: Any,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.name, self.stage, self.run_id, self.identity, self.clock = name, stage, run_id, identity, clock
        self._last: OrderedDict[int, float] = OrderedDict()  # certificate serial -> when it was served
        self._in_flight = 0
        self._ids = itertools.count()
        self.served = 0
        """Dial-backs sent so far (queued on their connection: one to an unreachable contact never arrives)."""

    def request(self, msg: Message, sender: str, peer_key: bytes | None,
                transport: Any) -> Callable[[], Awaitable[None]]:
        """What answers a decoded DIALBACK request ``msg`` from connection ``sender``, which proved
        ``peer_key``, to run on a task of its own: the acknowledgement on that connection, then the
        dial; :class:`Refused` when it is not served."""
        if self.identity is None:
            raise Refused("not_certified", "a dial-back request to an insecure peer")
        if msg.run_id != self.run_id:
            raise Refused("run_mismatch", f"a dial-back request of run {msg.run_id!r}")
        contact, nonce = msg.meta.get("contact"), msg.meta["nonce"]
        try:
            body = self.identity.verify_peer(msg.meta.get("cert"), stage=msg.src, curve_key=peer_key)
        except CertificateError as exc:
            raise Refused("not_certified", f"a dial-back request refused: {exc} ({exc.code})") from None
        try:
            endpoint, key = split_contact(contact) if isinstance(contact, str) else ("", None)
        except NetError as exc:
            raise Refused("not_allowed", f"a dial-back request with a malformed contact: {exc}") from None
        if key != body.curve_key or not endpoint.startswith("tcp://"):
            raise Refused("not_allowed", f"{body.name!r} asked for a dial-back to a contact that is not its own "
                                         f"({contact!r:.80})")
        now = self.clock()
        if now - self._last.get(body.serial, -PER_MEMBER_S) < PER_MEMBER_S or self._in_flight >= MAX_IN_FLIGHT:
            raise Refused("queue_full", f"a dial-back request of {body.name!r} beyond the rate this peer serves")
        self._last[body.serial] = now
        self._last.move_to_end(body.serial)
        while len(self._last) > _REMEMBERED:
            self._last.popitem(last=False)
        self._in_flight += 1
        answer = Message(type=MessageType.DIALBACK, run_id=self.run_id, src=self.stage, dst=msg.src,
                         meta={"nonce": nonce})
        return lambda: self._dial(transport, sender, contact, encode(answer), body.name)

    async def _dial(self, transport: Any, sender: str, contact: str, frames: list[bytes], who: str) -> None:
        link = f"dialback.{next(self._ids)}"
        try:
            await transport.reply(sender, frames, kind="DIALBACK", timeout_s=DIAL_S)  # taken: the requester was asked
            transport.connect(link, contact)
            await transport.send(link, frames, kind="DIALBACK", timeout_s=DIAL_S)
            self.served += 1
            log.info("%s: a dial-back to %r at %s is on its way", self.name, who, split_contact(contact)[0])
        except (NetError, OSError) as exc:
            log.info("%s: could not dial back %r at %s: %s", self.name, who, split_contact(contact)[0], exc)
        finally:
            self._in_flight -= 1
            await transport.disconnect(link, linger_s=DIAL_S)


# ---------------------------------------------------------------------- the requester's side
@dataclass(frozen=True)
class Reachability:
    """What a dial-back found: ``ok`` True (a live peer dialed this host), False (none could: a NAT
    or firewall) or None (nobody could be asked), with what it found and, when False, the fix."""

    ok: bool | None
    detail: str
    fix: str = ""


async def ask_dial_back(cfg: Any, identity: Any, stage: int, contacts: Sequence[tuple[int, str]],
                        wait_s: float, connect_s: float = 3.0) -> Reachability:
    """Bind where this host's peer will listen, ask live peers (one after the other) to dial the
    contact it would advertise (SPEC §9.11), and wait ``wait_s`` for each one's DIALBACK. A live
    peer that does not acknowledge the request within ``connect_s`` (out of this host's reach, or
    refusing it) was not asked: with none asked the check is skipped, not failed."""
    config = TransportConfig(bind_host=cfg.net.bind_host, bind_port=cfg.net.port,
                             advertise_host=cfg.net.advertise_host or None, curve=identity.curve)
    asked: list[int] = []

    def echoes(frames: Any, nonce: bytes) -> bool:
        try:
            msg = decode(frames)
        except WireError:
            return False
        return msg.type is MessageType.DIALBACK and msg.meta.get("nonce") == nonce

    async def acknowledged(nonce: bytes) -> bool:
        """The asked peer's acknowledgement on the request's own connection."""
        try:
            while True:
                _, frames = await transport.recv_reply(timeout_s=connect_s)
                if echoes(frames, nonce):
                    return True
        except (OSError, MaplError):
            return False

    async with Transport("dialback", config) as transport:
        mine = transport.endpoint.partition("#")[0]
        for i, (their_stage, contact) in enumerate(contacts):
            link, nonce, start = f"ask{i}", secrets.token_bytes(16), time.monotonic()
            transport.connect(link, contact)
            await transport.send(link, encode(Message(
                type=MessageType.DIALBACK, run_id=cfg.run.run_id, src=stage, dst=their_stage,
                meta={"nonce": nonce, "cert": identity.encoded_cert, "contact": transport.endpoint})))
            if await acknowledged(nonce):  # else that peer is out of this host's reach, or refused: not asked
                asked.append(their_stage)
                while (left := start + wait_s - time.monotonic()) > 0:
                    try:
                        _, frames = await transport.recv(timeout_s=left)
                    except (OSError, MaplError):
                        break
                    if echoes(frames, nonce):
                        port = "" if cfg.net.port else " (net.port is 0: a free port was checked; a NAT or " \
                                                       "firewall that forwards one port needs a fixed net.port)"
                        return Reachability(True, f"a live peer of stage {their_stage} dialed {mine}{port}")
            await transport.disconnect(link)
    if not asked:
        return Reachability(None, f"not checked: no live peer acknowledged a dial-back request "
                                  f"({len(contacts)} tried: out of reach, refusing, or older than 2.1)")
    return Reachability(False, f"no live peer could dial {mine} within {wait_s:.0f} s (asked {len(asked)}): a NAT "
                               f"or firewall keeps the swarm out",
                        f"forward/open TCP port {mine.rsplit(':', 1)[1]} to this host and set net.advertise_host to "
                        "the address the others dial, or serve as a dial-out peer: net.reachable = \"no\"")


def reachability(cfg: Any, identity: Any, stage: int | None, staged: Sequence[tuple[int, Any]],
                 status_s: float, wait_s: float = 10.0) -> Reachability:
    """Whether live peers (of ``staged``: (stage, peer) pairs; dial-out peers cannot be asked) dial
    this host back: ``mapl-swarm doctor``'s check, and how a peer with ``net.reachable = "auto"``
    decides."""
    if identity is None:
        return Reachability(None, "a dial-back needs this host's --peer-key and --cert")
    contacts = [(s, p.contact) for s, p in staged
                if p.contact and not is_dial_out(p.contact) and not p.silent(status_s)][:2]
    if not contacts:
        return Reachability(None, "no live peer to dial back")
    own = stage if stage is not None else identity.body.stages[0] if identity.body.stages else 0
    try:
        return run(ask_dial_back(cfg, identity, own, contacts, wait_s))
    except MaplError as exc:  # the port taken, the host not this machine's: named by the port checks too
        return Reachability(None, f"not checked: {exc}")
