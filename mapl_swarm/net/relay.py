"""A relay between two dial-out peers (SPEC §9.12): two outbound TCP connections spliced end to end.

Two neighbours that both accept no connection (:mod:`~.transport` "dial-out peers") meet at a
relay, a process on a reachable host (``mapl-swarm relay``). Each opens a TCP connection to it and
says, in one signed **relay request**, who it is (its certificate), whom it wants (the other's CURVE
key) and its **role**: the peer whose CURVE key is the smaller of the two ``dial`` s (its DEALER's
connection), the other ``serve`` s (its ROUTER takes that connection). The relay pairs a ``dial``
of A for B with a ``serve`` of B for A, answers both ``ok`` and from then on copies bytes both
ways, unread: the ZeroMQ connection that runs through it is CURVE-encrypted and pinned end to end,
so the relay sees ciphertext, sizes and timing, and can neither read nor forge. It serves certified
members of its run only (the certificate of its run's authority, valid, not revoked, and a
signature of the request's nonce by the certificate's key), and holds at most
:data:`MAX_WAITING_PER_PEER` unpaired connections per member, for at most :data:`PAIR_TIMEOUT_S`,
:data:`MAX_PAIRS_PER_PEER` pairs per member and :data:`MAX_UNREAD` connections not yet read
(:data:`MAX_UNREAD_PER_ADDRESS` per address); it logs refusals sparingly (:data:`REFUSALS_LOGGED_S`)
and answers every one a stranger can cause with the same code.

Framing before the splice: each control message is a 4-byte big-endian length and a msgpack map
(:func:`read_frame`, at most :data:`MAX_CONTROL_BYTES`). The relay speaks first
(``{"relay": 1, "nonce": bin 16}``), the member answers with its request (``run``, ``cert``,
``role``, ``peer``: bin 32, ``sig``: its signing key's signature of :func:`relay_statement`)
**sealed** to the relay's own CURVE key (:func:`seal`: the run id and the certificate never cross in
clear; members know the relay by ``net.relay = "HOST:PORT#<hex key>"``), and the relay answers
``{"ok": true}`` once paired or ``{"ok": false, "code"}`` and closes (the reason stays in its log).

On a member's side (:class:`RelayClient`) ZeroMQ keeps dialing local TCP endpoints: a ``dial``
link's DEALER connects to a local listener whose every connection the client carries to the relay
(:meth:`RelayClient.dial_endpoint`); a ``serve`` link keeps one request waiting at the relay and
carries each pairing into its own ROUTER (:meth:`RelayClient.serve`).
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import secrets
import signal
import socket
import struct
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Callable

import msgpack
from zmq.utils import z85
from cryptography.exceptions import InvalidSignature, InvalidTag
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from mapl_swarm.aio import within
from mapl_swarm.net.errors import NetError
from mapl_swarm.net.identity import REVOCATION_POLL_S, CertificateError, RevocationWatch, Signed, verify_certificate

log = logging.getLogger(__name__)

__all__ = ["Relay", "RelayClient", "RelayStats", "relay_statement", "role_of", "read_frame", "write_frame"]

MAX_CONTROL_BYTES = 16 * 1024
"""Largest relay control message (a request carries a certificate of at most 4 KiB)."""
NONCE_BYTES = 16
PAIR_TIMEOUT_S = 120.0
"""How long a relay holds a request unpaired (a neighbour that is slow to start), then closes it."""
HELLO_TIMEOUT_S = 10.0
"""How long a connection may take to send its request."""
MAX_WAITING_PER_PEER = 8
"""Unpaired requests a relay holds per member (beyond, the member's oldest is closed)."""
MAX_PAIRS_PER_PEER = 32
"""Spliced pairs a relay carries per member (beyond, the member's oldest is cut): a member has a
link per neighbouring peer, a few dozen at most."""
MAX_UNREAD = 256
"""Connections a relay holds before their request is read and checked (beyond, a new one is closed
at once): strangers cannot take every descriptor with idle connections."""
MAX_UNREAD_PER_ADDRESS = 16
"""Of those, from one IP address."""
REFUSALS_LOGGED_S = 10.0
"""A relay logs one refusal of each code per this many seconds (the rest are counted): a stranger's
flood of bad requests cannot fill its disk."""
_CHUNK = 256 * 1024
ROLES = ("dial", "serve")


def relay_statement(run_id: str, nonce: bytes, role: str, peer: bytes) -> bytes:
    """What a member signs to be relayed: the relay's nonce, its role and the key it wants."""
    return b"mapl-relay v1\x00" + run_id.encode() + b"\x00" + nonce + role.encode() + b"\x00" + peer


def _box(shared: bytes, nonce: bytes) -> ChaCha20Poly1305:
    key = HKDF(algorithm=hashes.SHA256(), length=32, salt=None, info=b"mapl-relay seal v1" + nonce).derive(shared)
    return ChaCha20Poly1305(key)


def seal(relay_key: bytes, nonce: bytes, data: bytes) -> bytes:
    """``data`` for the holder of the CURVE (X25519) key ``relay_key`` only: a fresh X25519 key's
    public half, then ChaCha20-Poly1305 under HKDF-SHA256(their shared secret, ``nonce``)."""
    ephemeral = X25519PrivateKey.generate()
    shared = ephemeral.exchange(X25519PublicKey.from_public_bytes(relay_key))
    public = ephemeral.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return public + _box(shared, nonce).encrypt(bytes(12), data, None)  # a key per message: a zero nonce


def unseal(secret: bytes, nonce: bytes, sealed: bytes) -> bytes:
    """What :func:`seal` sealed to the public half of the X25519 ``secret`` (32 raw bytes); NetError else."""
    try:
        shared = X25519PrivateKey.from_private_bytes(secret).exchange(X25519PublicKey.from_public_bytes(sealed[:32]))
        return _box(shared, nonce).decrypt(bytes(12), sealed[32:], None)
    except (InvalidTag, ValueError):
        raise NetError("a relay request not sealed to this relay's key") from None


def role_of(own_key: bytes, peer_key: bytes) -> str:
    """``dial`` for the neighbour whose CURVE key is the smaller, ``serve`` for the other."""
    return "dial" if own_key < peer_key else "serve"


async def read_frame(reader: asyncio.StreamReader) -> dict[str, Any]:
    """One length-prefixed msgpack map; :class:`NetError` when it is not one."""
    try:
        size = struct.unpack(">I", await reader.readexactly(4))[0]
        if size > MAX_CONTROL_BYTES:
            raise NetError(f"a relay control message of {size} bytes (at most {MAX_CONTROL_BYTES})")
        data = msgpack.unpackb(await reader.readexactly(size), raw=False)
    except (asyncio.IncompleteReadError, ConnectionError) as exc:
        raise NetError(f"the relay connection ended: {exc}") from None
    except (ValueError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError) as exc:
        raise NetError(f"an unreadable relay control message: {exc}") from None
    if not isinstance(data, dict):
        raise NetError("a relay control message that is not a map")
    return data


def write_frame(writer: asyncio.StreamWriter, data: dict[str, Any]) -> None:
    body = msgpack.packb(data, use_bin_type=True)
    writer.write(struct.pack(">I", len(body)) + body)


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, count: Callable[[int], None]) -> None:
    """Copy ``reader`` to ``writer`` until end of stream, then end ``writer``'s side."""
    try:
        while data := await reader.read(_CHUNK):
            count(len(data))
            writer.write(data)
            await writer.drain()
        if writer.can_write_eof():
            writer.write_eof()
    except (ConnectionError, OSError, RuntimeError):  # the other side went first (RuntimeError: closed under us)
        pass


async def splice(a: tuple[asyncio.StreamReader, asyncio.StreamWriter],
                 b: tuple[asyncio.StreamReader, asyncio.StreamWriter],
                 count: Callable[[str, int], None] = lambda direction, n: None) -> None:
    """Copy both ways until either side ends, then close both; ``count(direction, bytes)``."""
    try:
        done, pending = await asyncio.wait(
            [asyncio.ensure_future(_pipe(a[0], b[1], lambda n: count("a->b", n))),
             asyncio.ensure_future(_pipe(b[0], a[1], lambda n: count("b->a", n)))],
            return_when=asyncio.FIRST_COMPLETED)
        for task in pending:  # one side ended: the ZeroMQ connection through it is over
            task.cancel()
        await asyncio.gather(*done, *pending, return_exceptions=True)
    finally:
        for _, writer in (a, b):
            writer.close()


@dataclass
class RelayStats:
    """What a relay did: pairings, refusals by code, bytes carried."""

    paired: int = 0
    refused: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    bytes: int = 0


@dataclass(eq=False)  # each request is its own (a key of the relay's pairs)
class _Waiting:
    key: bytes
    role: str
    peer: bytes
    name: str
    serial: int
    not_after: float
    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter
    timer: asyncio.TimerHandle | None = None


class Relay:
    """The relay's side (module docstring): ``trust`` is the run and authority it serves
    (``run_id``, ``authority``, ``revoked``: a :class:`~.discovery.TrustedAuthority`), ``key`` its
    own :class:`~.identity.PeerKey` (requests are sealed to its CURVE key, :attr:`public`).
    ``revocations``: the authority's revocation list file, read again when it changes (at each
    request, and by :meth:`enforce_revocations`): a revoked member is refused, and the pairs it
    is in are cut."""

    def __init__(self, trust: Any, key: Any, *, pair_timeout_s: float = PAIR_TIMEOUT_S,
                 revocations: str | os.PathLike[str] | None = None) -> None:
        self.run_id, self.authority = trust.run_id, trust.authority
        self.revoked: set[int] = set(trust.revoked)
        """The serials refused: the trust's, and those of the revocation list (:class:`~.identity.RevocationWatch`)."""
        self._watch = RevocationWatch(revocations) if revocations is not None else None
        self._pairs: dict[tuple[_Waiting, _Waiting], asyncio.Task] = {}
        self.public = key.curve_public
        self._secret = z85.decode(key.curve_secret)
        self.pair_timeout_s = pair_timeout_s
        self.stats = RelayStats()
        self._waiting: list[_Waiting] = []
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task] = set()
        self._unread: dict[str, int] = defaultdict(int)
        """Connections whose request is not read yet, by IP address."""
        self._logged: dict[str, float] = {}
        """When a refusal of each code was last logged."""

    async def start(self, host: str, port: int) -> int:
        """Listen on ``host:port`` (0: a free port); returns the port."""
        self._server = await asyncio.start_server(self._serve, host, port)
        return self._server.sockets[0].getsockname()[1]

    async def aclose(self) -> None:
        if self._server is not None:
            self._server.close()
        for waiting in self._waiting:  # unpaired requests end with the relay
            waiting.writer.close()
        self._waiting.clear()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._server is not None:
            await self._server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        address = str(writer.get_extra_info("peername")[0])
        if sum(self._unread.values()) >= MAX_UNREAD or self._unread[address] >= MAX_UNREAD_PER_ADDRESS:
            self.stats.refused["busy"] += 1
            writer.close()  # nothing read, nothing said: a flood of idle connections costs no more
            return
        task = asyncio.current_task()
        self._tasks.add(task)
        try:
            await self._one(reader, writer, address)
        except asyncio.CancelledError:
            writer.close()  # the relay stops (aclose); asyncio would log a handler that ends cancelled
        finally:
            self._tasks.discard(task)

    def _refuse(self, writer: asyncio.StreamWriter, code: str, reason: str, who: str) -> None:
        self.stats.refused[code] += 1
        now = time.monotonic()
        if now - self._logged.get(code, -math.inf) >= REFUSALS_LOGGED_S:
            self._logged[code] = now
            log.warning("relay: refused %s: %s (%s; %d refused so far, at most one logged per %g s)", who,
                        reason[:200], code, self.stats.refused[code], REFUSALS_LOGGED_S)
        write_frame(writer, {"ok": False, "code": code})  # the reason may name the run: it stays here
        writer.close()

    async def _one(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, address: str) -> None:
        who = "{}:{}".format(*writer.get_extra_info("peername")[:2])
        nonce = secrets.token_bytes(NONCE_BYTES)
        self._unread[address] += 1
        try:
            write_frame(writer, {"relay": 1, "nonce": nonce})
            sealed = (await within(read_frame(reader), HELLO_TIMEOUT_S)).get("sealed")
            if not isinstance(sealed, bytes):
                raise NetError("no sealed request")
            request = msgpack.unpackb(unseal(self._secret, nonce, sealed), raw=False)
            if not isinstance(request, dict):
                raise NetError("a sealed request that is not a map")
        except (NetError, TimeoutError, ValueError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError) as exc:
            self._refuse(writer, "malformed", f"no readable relay request: {exc}", who)
            return
        finally:
            self._unread[address] -= 1
            if not self._unread[address]:
                del self._unread[address]
        try:
            body, role, peer = self._check(request, nonce)
        except _Refused as exc:
            self._refuse(writer, exc.code, exc.reason, who)
            return
        me = _Waiting(body.curve_key, role, peer, body.name, body.serial, body.not_after, reader, writer)
        # a request waits in the list until paired (then taken out) or expired; the keys fix the roles.
        # A partner whose connection already ended is dropped rather than paired.
        for gone in [w for w in self._waiting if w.reader.at_eof() or w.writer.is_closing()]:
            self._drop(gone)
        partner = next((w for w in self._waiting if w.key == peer and w.peer == me.key and w.role != me.role), None)
        if partner is None:
            self._wait(me, who)
            return
        self._drop(partner, close=False)
        await self._carry(partner, me)

    def _drop(self, waiting: _Waiting, *, close: bool = True) -> None:
        """Take a request out of the waiting list (closing its connection unless it is paired)."""
        self._waiting.remove(waiting)
        if waiting.timer is not None:
            waiting.timer.cancel()
        if close:
            waiting.writer.close()

    def enforce_revocations(self) -> None:
        """Read the revocation list again if it changed, and cut every pair holding a member whose
        certificate was revoked or expired since it was paired (and every waiting request of one)."""
        if self._watch is not None:
            self._watch.poll(self)
        now = time.time()

        def invalid(w: _Waiting) -> bool:
            return w.serial in self.revoked or now >= w.not_after

        for w in [w for w in self._waiting if invalid(w)]:
            self._drop(w)
        for (a, b), task in list(self._pairs.items()):
            if invalid(a) or invalid(b):
                log.warning("relay: cut %s and %s: a certificate was revoked or expired", a.name, b.name)
                task.cancel()

    def _check(self, request: dict[str, Any], nonce: bytes) -> tuple[Any, str, bytes]:
        self.enforce_revocations()
        role, peer, cert, sig = request.get("role"), request.get("peer"), request.get("cert"), request.get("sig")
        # whatever is wrong before the certificate and signature verify is one code: a stranger learns
        # nothing, not even whether it guessed the run
        if request.get("run") != self.run_id:
            raise _Refused("not_certified", "a request for another run")
        try:
            body = verify_certificate(Signed.decode("certificate", cert), authority=self.authority,
                                      run_id=self.run_id, revoked=self.revoked)
            if role not in ROLES or not isinstance(peer, bytes) or len(peer) != 32 or not isinstance(sig, bytes):
                raise ValueError("a request needs role (dial or serve), peer (32 bytes) and sig")
            statement = relay_statement(self.run_id, nonce, role, peer)
            Ed25519PublicKey.from_public_bytes(body.sign_key).verify(sig, statement)
        except CertificateError as exc:
            raise _Refused("not_certified", f"{exc} ({exc.code})") from None
        except (InvalidSignature, ValueError, TypeError) as exc:
            raise _Refused("not_certified", f"an unsigned or malformed request: {type(exc).__name__} {exc}") from None
        if peer == body.curve_key or role != role_of(body.curve_key, peer):
            raise _Refused("not_allowed", f"role {role!r} for peer {peer.hex()[:16]}: the peer with the smaller "
                                          f"CURVE key dials the other")
        return body, role, peer

    def _wait(self, me: _Waiting, who: str) -> None:
        mine = [w for w in self._waiting if w.key == me.key]
        if len(mine) >= MAX_WAITING_PER_PEER:  # a member's connections are bounded: its oldest goes
            self._drop(mine[0])
        self._waiting.append(me)
        log.debug("relay: %s (%s, %s) waits for its neighbour", me.name, who, me.role)
        me.timer = asyncio.get_running_loop().call_later(self.pair_timeout_s, self._drop, me)

    async def _carry(self, a: _Waiting, b: _Waiting) -> None:
        for w in (a, b):  # a member's pairs are bounded: its oldest is cut
            theirs = [task for pair, task in self._pairs.items() if w.key in (pair[0].key, pair[1].key)]
            if len(theirs) >= MAX_PAIRS_PER_PEER:
                theirs[0].cancel()
        self.stats.paired += 1
        for w in (a, b):
            write_frame(w.writer, {"ok": True})
        log.info("relay: %s (%s) and %s (%s) paired", a.name, a.role, b.name, b.role)
        carried = [0]

        def count(direction: str, n: int) -> None:
            carried[0] += n
            self.stats.bytes += n

        task = asyncio.ensure_future(splice((a.reader, a.writer), (b.reader, b.writer), count))
        self._pairs[a, b] = task
        try:
            await asyncio.gather(task, return_exceptions=True)
        finally:
            del self._pairs[a, b]
            for w in (a, b):
                w.writer.close()
        log.info("relay: %s and %s parted after %d bytes", a.name, b.name, carried[0])


class _Refused(Exception):
    def __init__(self, code: str, reason: str) -> None:
        super().__init__(reason)
        self.code, self.reason = code, reason


class RelayClient:
    """A member's way through the relay at ``host:port`` (module docstring); ``identity`` is its
    :class:`~.identity.PeerIdentity`. Every byte it carries is counted in :attr:`bytes`."""

    def __init__(self, host: str, port: int, relay_key: bytes, identity: Any) -> None:
        self.host, self.port, self.relay_key, self.identity = host, port, relay_key, identity
        self.bytes = 0
        self._tasks: set[asyncio.Task] = set()

    async def open(self, role: str, peer: bytes) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        """A connection through the relay to the member holding CURVE key ``peer``, once paired."""
        try:
            reader, writer = await asyncio.open_connection(self.host, self.port)
        except OSError as exc:
            raise NetError(f"cannot reach the relay at {self.host}:{self.port}: {exc}") from None
        try:
            hello = await read_frame(reader)
            nonce = hello.get("nonce")
            if not isinstance(nonce, bytes) or len(nonce) != NONCE_BYTES:
                raise NetError(f"{self.host}:{self.port} is no relay (it sent no nonce)")
            me = self.identity
            request = {"run": me.run_id, "cert": me.encoded_cert, "role": role, "peer": peer,
                       "sig": me.key.sign(relay_statement(me.run_id, nonce, role, peer))}
            write_frame(writer, {"sealed": seal(self.relay_key, nonce, msgpack.packb(request, use_bin_type=True))})
            answer = await read_frame(reader)
        except BaseException:
            writer.close()
            raise
        if answer.get("ok") is not True:
            writer.close()
            raise NetError(f"the relay at {self.host}:{self.port} refused this peer ({answer.get('code')}; its log "
                           f"says why)")
        return reader, writer

    def _spawn(self, coro: Any) -> asyncio.Task:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def _count(self, direction: str, n: int) -> None:
        self.bytes += n

    def dial_endpoint(self, peer: bytes) -> tuple[str, Callable[[], None]]:
        """A local ``tcp://127.0.0.1:PORT`` whose every connection is carried to ``peer`` (role
        dial), and the call that stops it."""
        async def carry(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            try:
                far = await self.open("dial", peer)
            except (NetError, OSError) as exc:
                log.warning("relay: %s", exc)
                writer.close()  # ZeroMQ dials again later
                return
            await splice((reader, writer), far, self._count)

        listener = socket.socket()
        listener.bind(("127.0.0.1", 0))
        listener.listen(16)
        listener.setblocking(False)
        server: list[asyncio.Server] = []

        async def accept() -> None:
            server.append(await asyncio.start_server(lambda r, w: self._spawn(carry(r, w)), sock=listener))
            await asyncio.Event().wait()  # serving until stopped

        task = self._spawn(accept())

        def stop() -> None:
            task.cancel()
            for s in server:
                s.close()
            listener.close()

        return f"tcp://127.0.0.1:{listener.getsockname()[1]}", stop

    def serve(self, peer: bytes, local: tuple[str, int], retry_s: float = 1.0) -> Callable[[], None]:
        """Keep one request for ``peer`` waiting at the relay (role serve) and carry each pairing to
        this peer's own ROUTER at ``local``; returns the call that stops it."""
        async def keep() -> None:
            while True:
                try:
                    far = await self.open("serve", peer)
                except (NetError, OSError) as exc:
                    log.warning("relay: %s; asking again in %g s", exc, retry_s)
                    await asyncio.sleep(retry_s)
                    continue
                try:
                    near = await asyncio.open_connection(*local)
                except OSError as exc:
                    far[1].close()
                    log.error("relay: cannot reach this peer's own ROUTER at %s:%d: %s", *local, exc)
                    return
                self._spawn(splice(near, far, self._count))

        return self._spawn(keep()).cancel

    async def aclose(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)


def run_relay(trust: Any, key: Any, host: str, port: int, *, ready: Callable[[int, bytes], None] | None = None,
              report_s: float = 60.0, revocations: str | os.PathLike[str] | None = None) -> RelayStats:
    """Serve as the relay of ``trust``'s run with ``key`` on ``host:port`` until SIGINT or SIGTERM
    (taken by the event loop, so that no signal lands inside a transport's callback);
    ``ready(port, CURVE key)`` once listening. Reads ``revocations`` (the authority's list) again
    every :data:`~.identity.REVOCATION_POLL_S` when it changed, and cuts what holds a revoked or
    expired certificate. Logs what it carried every ``report_s`` and at the end; returns it."""
    relay = Relay(trust, key, revocations=revocations)

    def report() -> None:
        s = relay.stats
        log.info("relay: %d pairing(s), %d bytes carried, refused: %s", s.paired, s.bytes,
                 dict(s.refused) or "none")

    async def main() -> None:
        loop = asyncio.get_running_loop()
        stopped = asyncio.Event()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, lambda sig=sig: (log.info("relay stopped (%s)", sig.name), stopped.set()))
        bound = await relay.start(host, port)
        if ready is not None:
            ready(bound, relay.public)
        reported = loop.time()
        try:
            while not stopped.is_set():
                try:
                    await within(stopped.wait(), min(report_s, REVOCATION_POLL_S))
                except TimeoutError:
                    pass
                relay.enforce_revocations()
                if loop.time() - reported >= report_s:
                    reported = loop.time()
                    report()
        finally:
            await relay.aclose()

    try:
        asyncio.run(main())
    finally:
        report()
    return relay.stats
