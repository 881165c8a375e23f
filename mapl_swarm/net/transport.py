"""Asyncio ZeroMQ transport between pipeline peers, with per-link shaping and traffic counters.

Topology: every peer binds one ROUTER socket for everything it receives and connects one
DEALER per neighbour for what it sends. Each transport picks a routing id
``<name>.<8 hex digits>`` (:attr:`Transport.routing_id`, new per instance and on
:meth:`Transport.new_routing_id`, for a session that re-forms the swarm) that all its DEALERs
carry, so the ROUTER tells who sent each message (:meth:`Transport.recv` returns it, and
:meth:`Transport.name_of` its name part); :meth:`Transport.reply` answers on the ROUTER, on the
very connection a message came in on, and the dialer reads that answer on its DEALER
(:meth:`Transport.recv_reply`). Each outbound DEALER sits behind a
:class:`~mapl_swarm.net.emulator.LinkShaper`, so every direction of a link is shaped by its
sender. ``connect`` never waits for the other side: ZeroMQ queues messages (up to the send
high-water mark) until the neighbour is up, so peers may start in any order.

Members only (``TransportConfig.curve``, a certified peer's own keypair:
:class:`~mapl_swarm.net.identity.PeerIdentity`): the ROUTER is a ZeroMQ CURVE server with it and
every DEALER a CURVE client with it. Its advertised endpoint is a **contact**
``tcp://HOST:PORT#<64 hex digits of its CURVE public key>`` (:func:`contact`), and
:meth:`Transport.connect` takes a contact and pins that server key, so a connection completes only
with the holder of that key's secret (a relay or an impostor completes no handshake) and learns no
plaintext otherwise. A ZAP handler on the transport's context (pyzmq's thread authenticator,
started before the bind) admits every CURVE client, and every received message is attributed to
the key its connection proved (:meth:`Transport.peer_key`); who may speak is then the peer's
decision (its HELLO carries a certificate for that key). A routing id is bound to the first key
that used it: a message under that routing id from another key is dropped (``mismatched_keys``).
Without ``curve`` (``--insecure``) everything travels in the clear and anyone may connect.

Dial-out peers (``TransportConfig.dial_out``: a host behind NAT or a firewall that admits no inbound
connection; pinned transports only): such a transport advertises the contact ``dialout#<hex key>``
(:data:`DIAL_OUT`) and both directions of each of its links travel on the one connection it dials.
A reachable transport's :meth:`Transport.connect` to a dial-out contact opens a **reverse link**:
what it sends there goes out on its own ROUTER to the routing id the peer binds with
:meth:`Transport.bind_reverse` (once the dial-out peer's HELLO on that connection proved the key of
the contact), waiting for that binding and, when the connection is being made again, for it to
come back (held as a DEALER's queue holds them, so a flush does not wait for them; dropped once
the connection has been gone for ``send_timeout_s``). On the dial-out side the
neighbour's messages arrive on the DEALER, beside its answers (:meth:`Transport.recv_reply`):
:meth:`Transport.request_sender` names the connection as a routing id of the neighbour's stage for
the peer's admission, :meth:`Transport.peer_key` gives the link's pinned key for it, and
:meth:`Transport.reply` to it goes out on that DEALER. Which message is an answer is the wire's
business (WELCOME and REJECT, SPEC §1.2), so the peer sorts them, not the transport. Two dial-out
neighbours meet at a relay (``relay``, :mod:`~.relay`): the one with the smaller CURVE key dials the
other's ROUTER through it (a DEALER link to a local endpoint the relay client carries), the other
takes that connection into its ROUTER and treats the link as a reverse link.

No takeover: ``ROUTER_HANDOVER`` is off, so a second connection presenting a routing id that is in
use cannot take it over (the first one keeps it, and ZeroMQ never serves the second); ZeroMQ
heartbeats (``zmq_heartbeat_s``) drop a dead connection, freeing its routing id, and a DEALER
reconnects only after the ROUTER must have dropped its old connection. ``ROUTER_MANDATORY`` is on: replying to a
connection that is gone raises :class:`NetError`. ``max_message_bytes`` is the ROUTER's
``ZMQ_MAXMSGSIZE``: a connection sending a larger frame is dropped before the frame is buffered
(the sender's DEALER reconnects; other connections are not affected).

Frames are opaque (``list[bytes | memoryview]``; the wire format lives in :mod:`mapl_swarm.wire`).
They are sent with ``copy=False`` (pyzmq still copies frames under 64 KiB): do not mutate a
buffer after handing it to :meth:`Transport.send`. Received frames under 64 KiB come back as
``bytes``, larger ones as zero-copy ``memoryview`` s.

Counters (:class:`~mapl_swarm.net.counters.TrafficCounters`) are keyed by link name, direction
and a caller ``kind`` label; for received messages the kind comes from the optional ``rx_kind``
classifier (``"rx"`` without one), under the sender's transport name (not its routing id). Name
links after the neighbour's transport name so that the ``tx`` and ``rx`` rows of a link line up.

Create and use a transport inside one event loop (see :func:`new_event_loop`); when the peer
also uses hivemind's DHT, start the DHT first (see :mod:`mapl_swarm.net.discovery`).
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import math
import secrets
import socket
from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Coroutine, Sequence, TypeVar

import zmq
import zmq.asyncio
import zmq.utils.monitor
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils import z85

from mapl_swarm.aio import within
from mapl_swarm.errors import ConfigError
from mapl_swarm.net.counters import Frame, TrafficCounters
from mapl_swarm.net.emulator import LinkConfig, LinkShaper
from mapl_swarm.net.errors import LinkClosedError, NetError, NetTimeoutError, RelayNeeded
from mapl_swarm.net.limits import max_message_bytes
from mapl_swarm.net.identity import CurveKeys
from mapl_swarm.net.relay import RelayClient, role_of

if TYPE_CHECKING:
    from mapl_swarm.config import TrainConfig
    from mapl_swarm.net.identity import PeerIdentity as Membership

__all__ = [
    "DIAL_OUT",
    "CurveKeys",
    "TransportConfig",
    "Transport",
    "tcp_endpoint",
    "peer_transport",
    "contact",
    "split_contact",
    "is_dial_out",
    "new_event_loop",
    "run",
]

logger = logging.getLogger(__name__)

T = TypeVar("T")
_ZERO_COPY_MIN_BYTES = zmq.COPY_THRESHOLD
_WILDCARD_HOSTS = ("0.0.0.0", "::", "*", "")
REPLY_QUEUE_MESSAGES = 64
"""Replies (messages received on the DEALERs) waiting for :meth:`Transport.recv_reply` at most; a
neighbour's ROUTER answers a HELLO once, so more are dropped. A dial-out transport, which receives
everything on its DEALERs, drops nothing: its DEALERs wait for room."""
ZAP_DOMAIN = "mapl"
"""ZAP domain of every CURVE ROUTER (the authenticator admits clients in this domain only)."""
_HEARTBEAT_TIMEOUT_FACTOR = 3
_RECONNECT_FACTOR = 5
"""A DEALER's reconnect interval in heartbeat intervals: longer than the ROUTER needs to drop the
dead connection (up to one interval until its next PING, then the timeout)."""
_MAX_HEARTBEAT_TTL_MS = 6_553_500  # ZMQ_HEARTBEAT_TTL travels in deciseconds, 16 bits
_CURVE_FRAME_OVERHEAD = 33
"""Bytes CURVE adds to each frame (libzmq 4.3's MESSAGE command: name, nonce, MAC, flags), which
ZMQ_MAXMSGSIZE counts: added to ``max_message_bytes`` so that it limits the plaintext frame."""
MIN_MAX_MESSAGE_BYTES = 4096
"""Smallest non-zero ``max_message_bytes``: ZMQ_MAXMSGSIZE also limits the handshake's commands."""


def new_event_loop() -> asyncio.AbstractEventLoop:
    """A new event loop: uvloop's when importable, asyncio's default otherwise."""
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


def run(main: Coroutine[Any, Any, T]) -> T:
    """Run ``main`` to completion on a fresh loop from :func:`new_event_loop` (one per peer)."""
    with asyncio.Runner(loop_factory=new_event_loop) as runner:
        return runner.run(main)


KEYS_REMEMBERED = 4096
"""Routing ids whose CURVE key a pinned transport remembers (the oldest is forgotten first)."""
HANDSHAKE_TIMEOUT_MS = 10_000
"""How long an inbound connection may take to complete its ZMTP (and CURVE) handshake
(``ZMQ_HANDSHAKE_IVL``; libzmq's default is 30 s). A CURVE handshake is 2 round trips."""


DIAL_OUT = "dialout"
"""The address part of a dial-out peer's contact, ``dialout#<hex key>``: it accepts no connection."""
REVERSE_RETRY_S = 0.05
"""How often a reverse link tries again to send while its dial-out peer's connection is being made
again (ZeroMQ's ROUTER refuses a routing id that has no connection, rather than queueing)."""
REVERSE_QUEUE = 1000
"""Messages a reverse link holds for its dial-out peer's connection (ZeroMQ's default send high-water
mark of a DEALER); beyond it the oldest is dropped."""


def contact(endpoint: str, curve_public: bytes) -> str:
    """``endpoint#<hex>``: where a certified peer listens and the CURVE key (32 raw bytes) it proves there."""
    if len(curve_public) != 32:
        raise ConfigError("a contact's CURVE key is 32 bytes")
    return f"{endpoint}#{curve_public.hex()}"


def split_contact(text: str) -> tuple[str, bytes | None]:
    """``(endpoint, CURVE key or None)`` of a contact or a bare endpoint; a malformed key is a
    :class:`NetError` naming the contact."""
    endpoint, hash_, key = text.partition("#")
    if not hash_:
        return text, None
    try:
        raw = bytes.fromhex(key)
    except ValueError:
        raw = b""
    if len(raw) != 32 or key != key.lower():
        raise NetError(f"contact {text!r}: the part after '#' must be 64 lowercase hex digits (a CURVE key)")
    return endpoint, raw


def is_dial_out(text: str) -> bool:
    """``text`` is a dial-out peer's contact (``dialout#<hex key>``): it is reached only on the
    connections it opens itself."""
    return text.partition("#")[0] == DIAL_OUT


def tcp_endpoint(host: str, port: int) -> str:
    """``tcp://HOST:PORT``, with IPv6 literals bracketed."""
    try:
        if ipaddress.ip_address(host).version == 6:
            host = f"[{host}]"
    except ValueError:
        pass
    return f"tcp://{host}:{port}"


@dataclass(frozen=True, kw_only=True)
class TransportConfig:
    """Where a peer listens, what it advertises, and its socket limits."""

    bind_host: str = "0.0.0.0"
    """Interface to bind the inbound ROUTER to; ``0.0.0.0`` (or ``::``) means all interfaces."""
    bind_port: int = 0
    """TCP port to bind; 0 lets the OS pick one (read it back from :attr:`Transport.port`)."""
    advertise_host: str | None = None
    """Host others use to reach this peer (announced in the DHT). ``None``: the bind host, or,
    when bound to a wildcard, this machine's hostname address (127.0.0.1 if that fails)."""
    send_hwm: int = 1000
    """ZeroMQ send high-water mark per neighbour, in messages (queued while it is down)."""
    recv_hwm: int = 1000
    """ZeroMQ receive high-water mark of the inbound socket, in messages."""
    send_timeout_s: float = 60.0
    """Default deadline of :meth:`Transport.send` (waiting for room in the link's send buffer)."""
    curve: CurveKeys | None = None
    """This peer's own CURVE keypair (:attr:`PeerIdentity.curve
    <mapl_swarm.net.identity.PeerIdentity.curve>`): links to named peers (module docstring),
    ``connect`` pins the server key of a contact and each message is attributed to its key.
    None: insecure (plain TCP, anyone may connect and read)."""
    max_message_bytes: int = 0
    """Largest frame the ROUTER accepts, in plaintext bytes (``ZMQ_MAXMSGSIZE``, which ZeroMQ
    applies to each frame); a connection sending a larger one is dropped. 0: unlimited."""
    zmq_heartbeat_s: float = 5.0
    """ZeroMQ heartbeat interval on every socket (``ZMQ_HEARTBEAT_IVL``); a connection that does not
    answer within 3x this (``ZMQ_HEARTBEAT_TIMEOUT``, also the TTL announced to the other side)
    is dropped. Keep 3x it above the time the slowest link needs to carry the largest frame
    (a PONG waits behind a frame being sent). A DEALER waits 5x this (to 10x, ZeroMQ's jitter)
    before it reconnects, so that the ROUTER has dropped the dead connection by then (without
    handover a reconnection arriving while the old one is held would never be served).
    0: no ZeroMQ heartbeats, reconnects after 0.1 s."""
    dial_out: bool = False
    """This peer accepts no inbound connection (behind NAT or a firewall): it advertises
    ``dialout#<hex key>`` and its neighbours send to it on the connections it dials (module
    docstring). Needs ``curve``."""

    def __post_init__(self) -> None:
        if not (0 <= self.bind_port <= 65535):
            raise ConfigError(f"transport.bind_port must be in 0..65535, got {self.bind_port}")
        for name in ("send_hwm", "recv_hwm"):
            if getattr(self, name) < 0:
                raise ConfigError(f"transport.{name} must be >= 0, got {getattr(self, name)}")
        if not self.send_timeout_s > 0:
            raise ConfigError(f"transport.send_timeout_s must be > 0, got {self.send_timeout_s}")
        if self.max_message_bytes != 0 and self.max_message_bytes < MIN_MAX_MESSAGE_BYTES:
            raise ConfigError(f"transport.max_message_bytes must be 0 (unlimited) or >= {MIN_MAX_MESSAGE_BYTES}, "
                              f"got {self.max_message_bytes}")
        if not (math.isfinite(self.zmq_heartbeat_s) and self.zmq_heartbeat_s >= 0):
            raise ConfigError(f"transport.zmq_heartbeat_s must be >= 0, got {self.zmq_heartbeat_s}")
        if self.curve is not None and not isinstance(self.curve, CurveKeys):
            raise ConfigError("transport.curve must be CurveKeys (a peer identity's) or None")
        if self.dial_out and self.curve is None:
            raise ConfigError("net.reachable = \"no\" (a dial-out peer) needs certified peers (--peer-key and --cert): "
                              "its neighbours know its connections by the CURVE key in its contact")

    @classmethod
    def for_run(cls, cfg: TrainConfig, membership: Membership | None) -> "TransportConfig":
        """A stage peer's transport: the run's ``[net]`` section, the certified peer's own CURVE
        keypair (None: insecure) and the run's message bound
        (:func:`~mapl_swarm.net.limits.max_message_bytes`)."""
        net = cfg.net
        return cls(bind_host=net.bind_host, bind_port=net.port, advertise_host=net.advertise_host or None,
                   send_timeout_s=net.timeout_s, curve=membership.curve if membership is not None else None,
                   max_message_bytes=max_message_bytes(cfg), zmq_heartbeat_s=net.zmq_heartbeat_s,
                   dial_out=net.reachable == "no")

    def heartbeat_options(self) -> dict[int, int]:
        """The ZeroMQ heartbeat socket options (milliseconds) of every socket; empty when off."""
        if self.zmq_heartbeat_s == 0:
            return {}
        ivl = max(1, round(self.zmq_heartbeat_s * 1000))
        timeout = _HEARTBEAT_TIMEOUT_FACTOR * ivl
        return {zmq.HEARTBEAT_IVL: ivl, zmq.HEARTBEAT_TIMEOUT: timeout,
                zmq.HEARTBEAT_TTL: min(timeout, _MAX_HEARTBEAT_TTL_MS)}

    def dealer_options(self) -> dict[int, int]:
        """The heartbeat options plus the DEALER's reconnect interval (see ``zmq_heartbeat_s``)."""
        options = self.heartbeat_options()
        if options:
            options[zmq.RECONNECT_IVL] = _RECONNECT_FACTOR * options[zmq.HEARTBEAT_IVL]
        return options


def peer_transport(name: str, cfg: TrainConfig, membership: Membership | None) -> "Transport":
    """A stage peer's transport (:meth:`TransportConfig.for_run`), with the relay of ``net.relay``
    when it dials out."""
    from mapl_swarm.config.run import relay_address

    relay = None
    if cfg.net.relay and cfg.net.reachable == "no" and membership is not None:
        host, port, key = relay_address(cfg.net.relay)  # checked with the config
        relay = RelayClient(host, port, key, membership)
    return Transport(name, TransportConfig.for_run(cfg, membership), relay=relay)


class Transport:
    """One peer's ZeroMQ endpoint: an inbound ROUTER plus a shaped DEALER per neighbour.

    Usage (inside the peer's event loop)::

        config = TransportConfig(advertise_host="10.0.0.5", curve=identity.curve)
        async with Transport("stage1", config) as t:
            announce(t.endpoint)                     # e.g. tcp://10.0.0.5:41234
            t.connect("stage2", endpoint_of_stage2, LinkConfig(bandwidth_mbps=100))
            await t.send("stage2", frames, kind="ACT")
            sender, frames = await t.recv(timeout_s=30)   # sender: e.g. "stage0.5f3a9c01"
            await t.reply(sender, answer, kind="WELCOME")  # on the connection it came in on
            link, frames = await t.recv_reply(timeout_s=30)  # an answer to what a DEALER sent
    """

    def __init__(self, name: str, config: TransportConfig = TransportConfig(), *,
                 rx_kind: Callable[[Sequence[Frame]], str] | None = None,
                 context: zmq.asyncio.Context | None = None, relay: RelayClient | None = None) -> None:
        if not name or not name.isprintable():
            raise ConfigError(f"transport name must be a non-empty printable string, got {name!r}")
        self.name = name
        self.config = config
        self.routing_id = f"{name}.{secrets.token_hex(4)}"
        """This instance's routing id, ``<name>.<8 hex>``, carried by every DEALER it connects."""
        self.mismatched_keys = 0
        """Messages dropped (pinned): their routing id was bound to another CURVE key."""
        self._keys: OrderedDict[str, str] = OrderedDict()
        """Routing id -> the Z85 CURVE key (ZeroMQ's ``User-Id``) it is bound to, most recent last."""
        self.counters = TrafficCounters()
        self._rx_kind = rx_kind
        self._own_context = context is None
        self._ctx = context if context is not None else zmq.asyncio.Context()
        self._router: zmq.asyncio.Socket | None = None
        self._auth: ThreadAuthenticator | None = None
        self._dealers: dict[str, zmq.asyncio.Socket] = {}
        self._endpoints: dict[str, str] = {}
        self._server_keys: dict[str, bytes | None] = {}
        self._shapers: dict[str, LinkShaper] = {}
        self._listeners: list[Callable[[str], None]] = []
        self._readers: dict[str, asyncio.Task[None]] = {}
        self._watchers: dict[str, tuple[asyncio.Task[None], zmq.asyncio.Socket]] = {}
        """Per outbound link: the task reading its DEALER's connection events, and their socket."""
        self._connection_listeners: list[Callable[[str, bool], None]] = []
        self.relay = relay
        """Dial-out transports: the relay that joins this peer to dial-out neighbours (None: none)."""
        self._relayed: dict[str, Callable[[], None]] = {}
        """Links through the relay -> the call that stops carrying them."""
        self._reverse: dict[str, _ReverseLink] = {}
        """Reverse links (to dial-out peers), by link name."""
        self._requests: dict[str, str] = {}
        """Dial-out side: the routing id each DEALER's neighbour is known by (:meth:`request_sender`) -> link."""
        self._replies: asyncio.Queue[tuple[str, list[Frame]]] = asyncio.Queue(
            maxsize=0 if config.dial_out else REPLY_QUEUE_MESSAGES)
        self.dropped_replies = 0
        """Replies dropped because :attr:`REPLY_QUEUE_MESSAGES` were already waiting."""
        self._bound_endpoint = ""
        self._endpoint = ""
        self._closed = False

    # -- lifecycle -------------------------------------------------------------------------------
    def start(self) -> str:
        """Bind the inbound socket; returns the advertised endpoint (``tcp://HOST:PORT``)."""
        if self._router is not None:
            return self._endpoint
        self._check_open()
        cfg = self.config
        if cfg.curve is not None:
            self._start_authenticator(cfg.curve)  # before the bind: libzmq admits everyone without one
        router = self._ctx.socket(zmq.ROUTER)
        router.setsockopt(zmq.LINGER, 0)
        router.setsockopt(zmq.RCVHWM, cfg.recv_hwm)
        router.setsockopt(zmq.ROUTER_HANDOVER, 0)  # a second connection cannot take a routing id over
        router.setsockopt(zmq.ROUTER_MANDATORY, 1)  # replies to a gone connection fail loudly
        router.setsockopt(zmq.MAXMSGSIZE, self._max_msg_size())
        # a connection that has not completed its ZMTP/CURVE handshake (a stranger holding sockets
        # open) is closed after this, so held connections cost descriptors only briefly
        router.setsockopt(zmq.HANDSHAKE_IVL, HANDSHAKE_TIMEOUT_MS)
        for option, value in cfg.heartbeat_options().items():
            router.setsockopt(option, value)
        if cfg.curve is not None:
            router.setsockopt(zmq.CURVE_SERVER, 1)
            router.setsockopt(zmq.CURVE_SECRETKEY, cfg.curve.secret)
            router.setsockopt(zmq.CURVE_PUBLICKEY, cfg.curve.public)
            router.setsockopt_string(zmq.ZAP_DOMAIN, ZAP_DOMAIN)
        try:
            router.bind(tcp_endpoint(cfg.bind_host, cfg.bind_port))
        except zmq.ZMQError as exc:
            router.close(linger=0)
            self._stop_authenticator()
            raise NetError(f"cannot bind {tcp_endpoint(cfg.bind_host, cfg.bind_port)}: {exc}") from exc
        self._router = router
        self._bound_endpoint = router.getsockopt_string(zmq.LAST_ENDPOINT)
        self._endpoint = tcp_endpoint(self._advertise_host(), self.port)
        if cfg.curve is not None:
            self._endpoint = contact(DIAL_OUT if cfg.dial_out else self._endpoint, z85.decode(cfg.curve.public))
        logger.info("%s: bound %s, advertising %s (%s, routing id %s)", self.name, self._bound_endpoint,
                    self._endpoint, "INSECURE: plain TCP" if cfg.curve is None else "CURVE, certified peers",
                    self.routing_id)
        return self._endpoint

    def _max_msg_size(self) -> int:
        limit = self.config.max_message_bytes
        if limit == 0:
            return -1
        return limit + (_CURVE_FRAME_OVERHEAD if self.config.curve is not None else 0)

    def _start_authenticator(self, curve: CurveKeys) -> None:
        auth = ThreadAuthenticator(self._ctx, log=logging.getLogger(f"{__name__}.zap"))
        try:
            auth.start()
        except zmq.ZMQError as exc:
            raise NetError(f"{self.name}: cannot start the ZAP handler ({exc}): a CURVE transport needs a "
                           f"ZeroMQ context of its own") from exc
        # every CURVE client is admitted (CURVE proved its key); the peer decides who may speak, by certificate
        auth.configure_curve(domain=ZAP_DOMAIN, location=zmq.auth.CURVE_ALLOW_ANY)
        self._auth = auth

    def _stop_authenticator(self) -> None:
        if self._auth is not None:
            self._auth.stop()
            self._auth = None

    async def __aenter__(self) -> "Transport":
        self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self, *, drain_timeout_s: float = 0.0, linger_s: float = 0.0) -> None:
        """Close every socket; with ``drain_timeout_s`` > 0, flush links first. ``linger_s`` > 0
        gives ZeroMQ up to that long to put what it still queues on the wire (e.g. a last BYE; the
        close then blocks at most that long); 0 drops it."""
        if self._closed:
            return
        if drain_timeout_s > 0:
            try:
                await self.flush(drain_timeout_s)
            except NetError as exc:
                logger.warning("%s: closing with undelivered messages: %s", self.name, exc)
        self._closed = True
        for link in list(self._shapers):
            await self.disconnect(link, linger_s=linger_s)
        if self._router is not None:
            self._router.close(linger=0)
        if self.relay is not None:
            await self.relay.aclose()
        self._stop_authenticator()  # after the ROUTER: never a moment without the ZAP handler
        if self._own_context:
            self._ctx.term()

    # -- addresses -------------------------------------------------------------------------------
    @property
    def bound_endpoint(self) -> str:
        """The endpoint actually bound, as ZeroMQ reports it (e.g. ``tcp://0.0.0.0:41234``)."""
        return self._bound_endpoint

    @property
    def endpoint(self) -> str:
        """The endpoint to advertise to neighbours (``tcp://advertise_host:port``; pinned: its
        contact, ``tcp://advertise_host:port#<hex key>``)."""
        return self._endpoint

    @property
    def port(self) -> int:
        """The bound TCP port (resolved when ``bind_port`` was 0)."""
        return int(self._bound_endpoint.rsplit(":", 1)[1])

    def _advertise_host(self) -> str:
        if self.config.advertise_host:
            return self.config.advertise_host
        if self.config.bind_host not in _WILDCARD_HOSTS:
            return self.config.bind_host
        try:
            host = socket.gethostbyname(socket.gethostname())
        except OSError:
            host = "127.0.0.1"
        logger.warning("%s: bound to a wildcard without advertise_host; advertising %s", self.name, host)
        return host

    # -- outbound --------------------------------------------------------------------------------
    def connect(self, link: str, endpoint: str, config: LinkConfig = LinkConfig()) -> None:
        """Open the outbound link ``link`` to ``endpoint`` (returns at once; ZeroMQ queues
        messages until the neighbour is reachable); a pinned transport takes a contact and pins its
        key. Must be called inside the event loop."""
        self._check_open()
        if link in self._dealers:
            raise NetError(f"{self.name}: link {link!r} is already connected")
        cfg = self.config
        address, server_key = split_contact(endpoint)
        if cfg.curve is not None and server_key is None:
            raise NetError(f"{self.name}: link {link!r} to {endpoint!r}: a certified peer dials contacts only "
                           f"(endpoint#<its CURVE key>, from its DHT record)")
        if address == DIAL_OUT:
            if not (cfg.dial_out and self.relay is not None and server_key is not None
                    and role_of(z85.decode(cfg.curve.public), server_key) == "dial"):
                self._connect_reverse(link, endpoint, server_key, config)
                return
            address, self._relayed[link] = self.relay.dial_endpoint(server_key)  # its ROUTER, through the relay
        dealer = self._ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.setsockopt(zmq.SNDHWM, cfg.send_hwm)
        dealer.setsockopt(zmq.ROUTING_ID, self.routing_id.encode())
        for option, value in cfg.dealer_options().items():
            dealer.setsockopt(option, value)
        if cfg.curve is not None:  # client of the pinned server key, proving our keypair
            dealer.setsockopt(zmq.CURVE_SERVERKEY, z85.encode(server_key))
            dealer.setsockopt(zmq.CURVE_PUBLICKEY, cfg.curve.public)
            dealer.setsockopt(zmq.CURVE_SECRETKEY, cfg.curve.secret)
        events = dealer.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
        try:
            dealer.connect(address)
        except zmq.ZMQError as exc:
            dealer.disable_monitor()
            events.close(linger=0)
            dealer.close(linger=0)
            raise NetError(f"{self.name}: cannot connect link {link!r} to {endpoint!r}: {exc}") from exc

        async def deliver(frames: list[Frame]) -> None:
            # copy=False: a frame of 64 KiB or more becomes a zmq.Frame whose buffer object pyzmq
            # keeps referenced (zmq.utils.garbage) until libzmq has sent or dropped the message, so
            # the memory under a memoryview frame (e.g. a pinned tensor: peer.tensors.to_wire)
            # stays alive until then; smaller frames are copied. (Until this call the frames list
            # is held by the shaper; a send that waits for room holds it in pyzmq's future.)
            await dealer.send_multipart(frames, copy=False)

        self._dealers[link] = dealer
        self._endpoints[link] = endpoint
        self._server_keys[link] = server_key
        if cfg.dial_out:  # the neighbour's requests come on this connection, under a name of their own
            self._requests[f"{self.name_of_link(link)}.{secrets.token_hex(4)}"] = link
        self._shapers[link] = LinkShaper(config, deliver, name=f"{self.name}->{link}")
        self._readers[link] = asyncio.get_running_loop().create_task(self._read_replies(link, dealer),
                                                                     name=f"{self.name}<-{link} replies")
        self._watchers[link] = (asyncio.get_running_loop().create_task(
            self._watch_connection(link, events), name=f"{self.name}->{link} events"), events)
        logger.debug("%s: link %r -> %s (%s)", self.name, link, endpoint, config.describe())

    def _connect_reverse(self, link: str, endpoint: str, key: bytes | None, config: LinkConfig) -> None:
        """A link to the dial-out peer at ``endpoint`` (module docstring): sent on the ROUTER to the
        routing id :meth:`bind_reverse` binds."""
        if self.config.curve is None or key is None:
            raise NetError(f"{self.name}: link {link!r} to the dial-out peer {endpoint!r}: only certified peers "
                           f"link to dial-out peers (the key in its contact names its connection)")
        if self.config.dial_out:
            if self.relay is None:
                raise RelayNeeded(f"{self.name}: link {link!r}: the peer at {endpoint} accepts no connection, and "
                                  f"neither does this one (both dial out): a relay between them is needed (net.relay, "
                                  f"or `mapl-swarm relay --initial-peer ...` on a reachable host, announced in the "
                                  f"DHT)")
            host = self._bound_endpoint.rsplit(":", 1)[0].removeprefix("tcp://").strip("[]")
            local = ("127.0.0.1" if host in _WILDCARD_HOSTS else host, self.port)
            self._relayed[link] = self.relay.serve(key, local)  # its connection comes through the relay
        reverse = _ReverseLink(key)

        async def deliver(frames: list[Frame]) -> None:
            # handed over at once, as to a DEALER's queue: a flush never waits for a gone dial-out peer
            if not reverse.pending and reverse.bound.is_set() and await self._send_reverse(link, reverse, frames):
                return
            if len(reverse.pending) >= REVERSE_QUEUE:
                reverse.pending.popleft()
                logger.warning("%s: link %r: %d messages wait for the dial-out peer's connection; dropped the "
                               "oldest", self.name, link, REVERSE_QUEUE)
            reverse.pending.append(frames)
            if reverse.task is None or reverse.task.done():
                reverse.task = asyncio.get_running_loop().create_task(self._resend_reverse(link, reverse))

        self._reverse[link] = reverse
        self._endpoints[link] = endpoint
        self._server_keys[link] = key
        self._shapers[link] = LinkShaper(config, deliver, name=f"{self.name}->{link}")
        logger.debug("%s: link %r -> %s, reversed: it goes out on the connection that peer dials (%s)", self.name,
                     link, endpoint, config.describe())

    async def _send_reverse(self, link: str, reverse: _ReverseLink, frames: list[Frame]) -> bool:
        """Send on the ROUTER to the reverse link's connection; False while that connection is gone."""
        router = self._router
        if router is None:
            raise NetError(f"{self.name}: reverse link {link!r} used before start()")
        try:
            await router.send_multipart([reverse.routing_id.encode(), *frames], copy=False)
            return True
        except zmq.ZMQError as exc:
            if exc.errno != zmq.EHOSTUNREACH:
                raise NetError(f"{self.name}: send on reverse link {link!r} failed: {exc}") from exc
            return False

    async def _resend_reverse(self, link: str, reverse: _ReverseLink) -> None:
        """Send a reverse link's waiting messages, in order, once it is bound and while its
        connection is there; all of them are dropped once that connection has been gone for
        ``send_timeout_s`` (a DEALER's queue would hold them; the heartbeats tell the rest)."""
        loop = asyncio.get_running_loop()
        gone_since: float | None = None
        while reverse.pending:
            await reverse.bound.wait()
            if await self._send_reverse(link, reverse, reverse.pending[0]):
                reverse.pending.popleft()
                gone_since = None
                continue
            gone_since = loop.time() if gone_since is None else gone_since
            if loop.time() - gone_since > self.config.send_timeout_s:
                logger.warning("%s: dropped %d message(s) on link %r: the dial-out peer's connection %r has been "
                               "gone for %g s", self.name, len(reverse.pending), link, reverse.routing_id,
                               self.config.send_timeout_s)
                reverse.pending.clear()
                return
            await asyncio.sleep(REVERSE_RETRY_S)

    def bind_reverse(self, link: str, routing_id: str) -> None:
        """Send the reverse link ``link``'s messages to the connection ``routing_id`` from now on (its
        dial-out peer's HELLO came on it). The connection must have proved the link's pinned key."""
        reverse = self._reverse.get(link)
        if reverse is None:
            raise NetError(f"{self.name}: {link!r} is not a reverse link")
        key = self.peer_key(routing_id)
        if key is None or key != reverse.key:
            raise NetError(f"{self.name}: connection {routing_id!r} has not proved the key of the dial-out peer of "
                           f"link {link!r}")
        if reverse.routing_id != routing_id:
            logger.debug("%s: reverse link %r now goes out on connection %r", self.name, link, routing_id)
        reverse.routing_id = routing_id
        reverse.bound.set()

    def is_reverse(self, link: str) -> bool:
        """``link`` goes to a dial-out peer (its messages leave on the ROUTER)."""
        return link in self._reverse

    def reverse_link(self, routing_id: str) -> str | None:
        """The reverse link bound to the connection ``routing_id`` (its dial-out peer's), or None."""
        return next((link for link, reverse in self._reverse.items() if reverse.routing_id == routing_id), None)

    def request_sender(self, link: str) -> str | None:
        """Dial-out transports: the routing id under which the neighbour of ``link`` speaks on that
        link's own connection (``<its stage name>.<8 hex>``, new per connect); None otherwise."""
        return next((sender for sender, name in self._requests.items() if name == link), None)

    @staticmethod
    def name_of_link(link: str) -> str:
        """The neighbour's transport name in a link name: ``"stage1@3fa2c9d1"`` -> ``"stage1"``."""
        return link.partition("@")[0]

    def new_routing_id(self) -> str:
        """A fresh routing id for the DEALERs connected from now on (a session that re-forms the swarm:
        its neighbours' ROUTERs may still hold the connections of the old id, ZeroMQ would not serve a
        second one until they drop them, and a DEALER would reconnect only after that)."""
        self.routing_id = f"{self.name}.{secrets.token_hex(4)}"
        return self.routing_id

    def endpoint_of(self, link: str) -> str | None:
        """Where the outbound link ``link`` goes (None: not connected)."""
        return self._endpoints.get(link)

    async def disconnect(self, link: str, *, linger_s: float = 0.0) -> None:
        """Close an outbound link; undelivered messages are dropped (``flush`` first to keep them),
        except what ZeroMQ can send within ``linger_s``."""
        shaper = self._shapers.pop(link, None)
        dealer = self._dealers.pop(link, None)
        reverse = self._reverse.pop(link, None)
        if reverse is not None and reverse.task is not None:
            reverse.task.cancel()
            await asyncio.gather(reverse.task, return_exceptions=True)
        stop_relaying = self._relayed.pop(link, None)
        if stop_relaying is not None:
            stop_relaying()
        for sender in [sender for sender, name in self._requests.items() if name == link]:
            del self._requests[sender]
        self._endpoints.pop(link, None)
        self._server_keys.pop(link, None)
        reader = self._readers.pop(link, None)
        if reader is not None:
            reader.cancel()
            await asyncio.gather(reader, return_exceptions=True)
        watcher = self._watchers.pop(link, None)
        if watcher is not None:
            watcher[0].cancel()
            await asyncio.gather(watcher[0], return_exceptions=True)
            if dealer is not None:
                dealer.disable_monitor()
            watcher[1].close(linger=0)
        if shaper is not None:
            await shaper.aclose()
        if dealer is not None:
            dealer.close(linger=max(0, round(linger_s * 1000)))

    def links(self) -> list[str]:
        """Names of the connected outbound links."""
        return list(self._shapers)

    def shaper(self, link: str) -> LinkShaper:
        """The shaper of an outbound link (its ``stats()`` give utilisation)."""
        return self._shaper(link)

    async def send(self, link: str, frames: Sequence[Frame], *, kind: str = "control",
                   timeout_s: float | None = None) -> None:
        """Send one multipart message on ``link`` through its shaper, counted under ``kind``.

        Returns once the message is queued. Raises :class:`NetTimeoutError` (and queues nothing)
        if the link's send buffer stays full for ``timeout_s`` (default ``config.send_timeout_s``):
        the link is saturated or the neighbour stopped reading."""
        shaper = self._shaper(link)
        frames = list(frames)
        timeout_s = self.config.send_timeout_s if timeout_s is None else timeout_s
        try:
            await within(shaper.send(frames), timeout_s)
        except asyncio.TimeoutError:
            raise NetTimeoutError(f"{self.name}: send of a {kind} message on link {link!r} "
                                  f"not accepted within {timeout_s:g} s (send buffer full)") from None
        self.counters.add(link, "tx", kind, frames)

    async def flush(self, timeout_s: float) -> None:
        """Wait until every outbound link has handed all its messages to ZeroMQ."""
        await within(asyncio.gather(*(s.flush(timeout_s) for s in self._shapers.values())), timeout_s + 1.0)

    async def reply(self, routing_id: str, frames: Sequence[Frame], *, kind: str = "control",
                    timeout_s: float | None = None) -> None:
        """Send one message on the ROUTER to the connection ``routing_id`` (as :meth:`recv` returned
        it): the answer goes back on the very connection the message came in on, e.g. WELCOME or
        REJECT to a HELLO. Unshaped; counted under the sender's name and ``kind``. Raises
        :class:`NetError` when that connection is gone (``ROUTER_MANDATORY``) and
        :class:`NetTimeoutError` when it accepts nothing within ``timeout_s`` (default
        ``config.send_timeout_s``)."""
        self._check_open()
        link = self._requests.get(routing_id)
        if link is not None:  # a dial-out peer answers its neighbour on the connection it dialed
            await self.send(link, frames, kind=kind, timeout_s=timeout_s)
            return
        router = self._router
        if router is None:
            raise NetError(f"{self.name}: reply before start()")
        frames = list(frames)
        timeout_s = self.config.send_timeout_s if timeout_s is None else timeout_s
        try:
            await within(router.send_multipart([routing_id.encode(), *frames], copy=False), timeout_s)
        except asyncio.TimeoutError:
            raise NetTimeoutError(f"{self.name}: reply ({kind}) to {routing_id!r} not accepted within "
                                  f"{timeout_s:g} s") from None
        except zmq.ZMQError as exc:
            if exc.errno == zmq.EHOSTUNREACH:
                raise NetError(f"{self.name}: cannot reply ({kind}) to {routing_id!r}: no such connection "
                               f"(gone)") from None
            raise NetError(f"{self.name}: reply ({kind}) to {routing_id!r} failed: {exc}") from exc
        self.counters.add(self.name_of(routing_id), "tx", kind, frames)

    @staticmethod
    def name_of(routing_id: str) -> str:
        """The transport name in a routing id: ``"stage1.5f3a9c01"`` -> ``"stage1"`` (the part before
        the last dot; a routing id without one is its own name)."""
        name, dot, _ = routing_id.rpartition(".")
        return name if dot else routing_id

    # -- inbound ---------------------------------------------------------------------------------
    async def recv(self, timeout_s: float) -> tuple[str, list[Frame]]:
        """Next inbound message as ``(sender routing id, frames)`` (:meth:`name_of` gives the
        sender's name; :meth:`reply` answers on its connection); raises :class:`NetTimeoutError`
        naming this peer and the timeout when nothing arrives within ``timeout_s``."""
        self._check_open()
        router = self._router
        if router is None:
            raise NetError(f"{self.name}: recv before start()")
        deadline = asyncio.get_running_loop().time() + timeout_s
        while True:
            try:
                parts = await within(router.recv_multipart(copy=False),
                                     max(0.0, deadline - asyncio.get_running_loop().time()))
            except asyncio.TimeoutError:
                raise NetTimeoutError(f"{self.name}: no message received on {self._endpoint} within "
                                      f"{timeout_s:g} s") from None
            sender = parts[0].bytes.decode(errors="replace")
            if self.config.curve is None or self._attribute(sender, parts[0]):
                break
        frames: list[Frame] = [p.buffer if len(p) >= _ZERO_COPY_MIN_BYTES else p.bytes for p in parts[1:]]
        kind = self._rx_kind(frames) if self._rx_kind is not None else "rx"
        self.counters.add(self.name_of(sender), "rx", kind, frames)
        for listener in self._listeners:
            listener(sender)
        return sender, frames

    def _attribute(self, sender: str, frame: zmq.Frame) -> bool:
        """Bind ``sender`` to the CURVE key of the connection ``frame`` came on (pinned), or drop the
        message when that routing id is bound to another key (compared as Z85 text: nothing is
        decoded per message)."""
        key = frame.get("User-Id")
        bound = self._keys.get(sender)
        if bound is not None and bound != key:
            self.mismatched_keys += 1
            logger.warning("%s: dropped a message under routing id %r from another CURVE key than the one that "
                           "id is bound to (%d so far)", self.name, sender, self.mismatched_keys)
            return False
        self._keys[sender] = key
        self._keys.move_to_end(sender)
        if len(self._keys) > KEYS_REMEMBERED:
            self._keys.popitem(last=False)
        return True

    def server_key(self, link: str) -> bytes | None:
        """The CURVE key (32 raw bytes) the outbound link ``link`` is pinned to (None: not pinned)."""
        return self._server_keys.get(link)

    def peer_key(self, routing_id: str) -> bytes | None:
        """The CURVE public key (32 raw bytes) that the connection ``routing_id`` proved (pinned
        transports; None when none is known)."""
        link = self._requests.get(routing_id)
        if link is not None:
            return self._server_keys.get(link)
        key = self._keys.get(routing_id)
        return None if key is None else z85.decode(key)

    async def recv_reply(self, timeout_s: float) -> tuple[str, list[Frame]]:
        """Next message received on one of this transport's DEALERs, as ``(link name, frames)``: a
        ROUTER reply of the neighbour that link dialed (WELCOME or REJECT to a HELLO, SPEC §1.2), on
        the very connection the HELLO went out on; on a dial-out transport also everything else its
        neighbour sends (module docstring). Raises :class:`NetTimeoutError` when none arrives within
        ``timeout_s``."""
        self._check_open()
        try:
            return await within(self._replies.get(), timeout_s)
        except asyncio.TimeoutError:
            raise NetTimeoutError(f"{self.name}: no reply received within {timeout_s:g} s") from None

    async def _read_replies(self, link: str, dealer: zmq.asyncio.Socket) -> None:
        while True:
            try:
                parts = await dealer.recv_multipart(copy=False)
            except zmq.ZMQError as exc:  # the socket closed under us
                logger.debug("%s: replies on link %r end: %s", self.name, link, exc)
                return
            frames: list[Frame] = [p.buffer if len(p) >= _ZERO_COPY_MIN_BYTES else p.bytes for p in parts]
            kind = self._rx_kind(frames) if self._rx_kind is not None else "rx"
            self.counters.add(link, "rx", kind, frames)
            if self.config.dial_out:  # everything the neighbour sends comes here: wait for room, drop nothing
                await self._replies.put((link, frames))
                continue
            try:
                self._replies.put_nowait((link, frames))
            except asyncio.QueueFull:
                self.dropped_replies += 1
                logger.warning("%s: dropped a reply on link %r: %d replies wait already (%d dropped)", self.name,
                               link, REPLY_QUEUE_MESSAGES, self.dropped_replies)

    async def _watch_connection(self, link: str, events: zmq.asyncio.Socket) -> None:
        """Tell the connection listeners when the TCP connection of outbound link ``link`` is made or
        ends (the neighbour's process exited or was killed, or ZeroMQ's heartbeat dropped it)."""
        while True:
            try:
                event = zmq.utils.monitor.parse_monitor_message(await events.recv_multipart())
            except zmq.ZMQError:  # closed under us
                return
            up = event["event"] == zmq.EVENT_CONNECTED
            logger.debug("%s: the connection of link %r %s", self.name, link, "is made" if up else "ended")
            for listener in list(self._connection_listeners):
                listener(link, up)

    def add_connection_listener(self, listener: Callable[[str, bool], None]) -> Callable[[], None]:
        """Call ``listener(link name, up)`` whenever the TCP connection of an outbound link is made
        (``up``) or ends (ZeroMQ reconnects it later by itself); returns the call that removes the
        listener."""
        self._connection_listeners.append(listener)
        return lambda: self._connection_listeners.remove(listener)

    def add_receive_listener(self, listener: Callable[[str], None]) -> None:
        """Call ``listener(sender routing id)`` on every received message (the heartbeat monitor's,
        :func:`~mapl_swarm.net.heartbeat.attach_heartbeat`, maps it to the sender's name)."""
        self._listeners.append(listener)

    # -- helpers ---------------------------------------------------------------------------------
    def _shaper(self, link: str) -> LinkShaper:
        self._check_open()
        try:
            return self._shapers[link]
        except KeyError:
            raise NetError(f"{self.name}: no outbound link {link!r} (connected: {sorted(self._shapers)})") \
                from None

    def _check_open(self) -> None:
        if self._closed:
            raise LinkClosedError(f"transport {self.name!r} is closed")


class _ReverseLink:
    """A reverse link's pinned key, the connection its dial-out peer's HELLO came on, and the
    messages waiting for that connection (before it is bound, or while it is made again)."""

    def __init__(self, key: bytes) -> None:
        self.key = key
        self.routing_id = ""
        self.bound = asyncio.Event()
        self.pending: deque[list[Frame]] = deque()
        self.task: asyncio.Task[None] | None = None
