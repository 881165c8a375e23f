"""Peer discovery through hivemind's DHT: ``(run, stage) -> ZeroMQ endpoint`` with expiry.

Record layout: key ``mapl/{run_id}/stage/{stage}``, one subkey per announcing peer (its
routing id; by default its DHT peer id), value = its advertised endpoint (``tcp://HOST:PORT``),
expiring ``ttl_s`` after each store. The subkeys keep claimants of one stage (a restarted peer
and its stale predecessor, or an impostor) apart: :meth:`Discovery.lookup_all`
returns every claimed endpoint, freshest (latest expiring) first, so a peer can try each until
one completes an authenticated handshake; :meth:`Discovery.lookup` returns the first. A withdrawn
stage is overwritten by an empty-endpoint tombstone, which lookups skip.

**Certified records.** In a certified run (``membership=`` a
:class:`~mapl_swarm.net.identity.PeerIdentity`; a bootstrap node a :class:`TrustedAuthority`)
every DHT node runs a :class:`~mapl_swarm.net.dht_validation.CertifiedRecordValidator`: each
record is signed by its announcer's own key and carries its certificate, and a node stores, caches
and returns only records certified by the run's authority for one of the run's stage keys, so a
member can announce only the stages its certificate allows, at a contact of its own key, and
records of anyone else are never seen. Certified and insecure nodes do not mix: an insecure node
(no membership) neither signs nor checks records and cannot decode certified ones.

**Start order matters.** ``hivemind.DHT`` runs its node in a *forked* child process. Forking a
process that already runs threads (ZeroMQ's I/O threads, torch's thread pools, an executor)
can deadlock the child, so a peer must call :meth:`Discovery.start` first — before creating its
event loop, its ZeroMQ context or doing any torch work — and only then build everything else::

    discovery = Discovery("run-42", DiscoveryConfig(initial_peers=(bootstrap,)))
    discovery.start()                       # forks the DHT process: do this first
    run(peer_main(discovery))               # then the event loop, zmq, torch ...

The DHT process and its p2pd daemon live in their own process group, so Ctrl-C reaches only
the peer, and die with the peer even when it is SIGKILLed; :meth:`Discovery.close` stops them
cleanly (:mod:`mapl_swarm.net.dht_node`). Stop them with :meth:`Discovery.close`, not a signal:
a DHT process killed while it holds hivemind's cross-process MPFuture lock makes every later DHT
start in the process tree hang. A malformed initial peer, an unresolvable host or a taken DHT
port fail :meth:`Discovery.start` at once, naming the address.

Inside the loop use :meth:`Discovery.announce` / :meth:`Discovery.lookup_async`; the blocking
DHT calls go to the default executor. Re-announcement runs on a daemon thread every
``refresh_s`` seconds. ``hivemind`` (and with it torch) is imported only by :meth:`start`.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import math
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from mapl_swarm.errors import ConfigError
from mapl_swarm.net.dht_node import host_maddr, start_dht
from mapl_swarm.net.errors import DiscoveryError, DiscoveryTimeoutError
from mapl_swarm.net.identity import PeerIdentity
from mapl_swarm.procs import wait_for_signal

__all__ = ["DiscoveryConfig", "Discovery", "start_dht", "run_bootstrap_node", "host_maddr", "stage_key",
           "averaging_prefix", "member_keys", "relay_key", "status_key", "dht_validators", "TrustedAuthority",
           "MAX_STAGES", "MAX_TTL_S", "StagePeer", "STATUS_FIELDS", "config_key", "checked_config"]

logger = logging.getLogger(__name__)

MAX_STAGES = 1024
"""A certified DHT node accepts records only under ``stage_key(run_id, s)`` for s below this."""
MAX_TTL_S = 600.0
"""Longest announcement lifetime: a certified node refuses records expiring later
(``dht_validation.CERTIFIED_MAX_TTL_S``; not imported from there, which would import hivemind)."""


def stage_key(run_id: str, stage: int) -> str:
    """The DHT key under which the peers of ``stage`` in ``run_id`` announce themselves."""
    return f"mapl/{run_id}/stage/{stage}"


def averaging_prefix(run_id: str, stage: int) -> str:
    """The hivemind averager prefix of ``stage``'s replicas in ``run_id`` (hivemind's prefixes
    hold no ``.``, a run id may: the run appears as the first 16 hex digits of its SHA-256)."""
    return f"mapl/avg/{hashlib.sha256(run_id.encode()).hexdigest()[:16]}/{stage}"


def status_key(run_id: str, stage: int) -> str:
    """The DHT key of the status records of ``stage``'s peers (SPEC §9.1 "Status records")."""
    return f"mapl/{run_id}/status/{stage}"


def config_key(run_id: str, stage: int) -> str:
    """The DHT key of the config records of ``stage``'s peers (SPEC §9.1 "Config records")."""
    return f"mapl/{run_id}/config/{stage}"


def relay_key(run_id: str) -> str:
    """The DHT key under which members announce the relays they run (SPEC §9.12), each at its own
    peer id: ``HOST:PORT#<hex key>``, the key its certificate's."""
    return f"mapl/{run_id}/relays"


def member_keys(run_id: str, stage: int) -> tuple[str, str, str, str]:
    """The DHT keys each peer of ``stage`` writes at its own libp2p peer id: its averager's
    matchmaking (hivemind's ``<prefix>.0b``, one group, no group bits) and state download
    (``<prefix>.all_averagers``), its status record (:func:`status_key`) and its config record
    (:func:`config_key`). A certified node accepts a record under them only from a member of that
    stage, at its own peer id (SPEC §9.1)."""
    prefix = averaging_prefix(run_id, stage)
    return f"{prefix}.0b", f"{prefix}.all_averagers", status_key(run_id, stage), config_key(run_id, stage)


def dht_validators(membership: Any) -> list[Any]:
    """Record validators for a DHT node of a run: none without a membership (insecure); for a
    certified peer (:class:`~mapl_swarm.net.identity.PeerIdentity`) a
    :class:`~mapl_swarm.net.dht_validation.CertifiedRecordValidator` that signs with its key; for a
    :class:`TrustedAuthority` (a bootstrap node) one that only verifies. Imports hivemind (and
    torch) only with a membership."""
    if membership is None:
        return []
    from mapl_swarm.net.dht_validation import CertifiedRecordValidator  # deferred: imports hivemind

    signer = None if isinstance(membership, TrustedAuthority) else membership
    keys = {stage_key(membership.run_id, s): s for s in range(MAX_STAGES)}
    watch = getattr(membership, "watch", None)  # a peer's revocation list (a bootstrap node reads no records)
    members = {key: s for s in range(MAX_STAGES) for key in member_keys(membership.run_id, s)}
    return [CertifiedRecordValidator(run_id=membership.run_id, authority=membership.authority, identity=signer,
                                     stage_keys=keys, member_keys=members, relay_keys={relay_key(membership.run_id)},
                                     revoked=membership.revoked,
                                     revocations=None if watch is None else watch.path)]


STATUS_FIELDS: dict[str, type] = {"state": str, "step": int, "tokens_per_s": float, "queue": int, "capacity": float,
                                  "averaging": str, "averaging_bytes": int, "links": list, "rejects": dict,
                                  "relayed_bytes": int}
"""A status record's fields and their types (SPEC §9.1 "Status records"); a reader keeps only these."""
LINK_FIELDS: dict[str, type] = {"peer": str, "tx_bps": float, "rx_bps": float, "rate_bps": float, "rtt_s": float,
                                "heard_s": float}
"""The fields of one entry of a status record's ``links`` (``peer`` required)."""
MAX_STATUS_LINKS, MAX_STATUS_CODES = 16, 32
"""A reader keeps at most this many ``links`` entries and ``rejects`` codes of a record."""


def _typed(value: Any, kind: type, length: int = 32) -> Any:
    """``value`` if it has type ``kind`` (an int taken for a float; a float finite; a str cut to
    ``length``), else None."""
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if not isinstance(value, kind) or isinstance(value, bool) or (kind is float and not math.isfinite(value)):
        return None
    return value[:length] if kind is str else value


MAX_CONFIG_SETTINGS = 256
"""A reader keeps at most this many settings of a config record."""


def checked_config(value: Any) -> dict[str, Any]:
    """A config record's fields that have their types (SPEC §9.1 "Config records"): ``protocol``
    and ``fingerprint`` (str), ``config`` (str -> bool, int, finite float or str; at most
    :data:`MAX_CONFIG_SETTINGS`, names cut to 64 characters, strings to 128)."""
    if not isinstance(value, dict):
        return {}
    out: dict[str, Any] = {k: v for k in ("protocol", "fingerprint") if (v := _typed(value.get(k), str, 64))}
    settings = value.get("config")
    if isinstance(settings, dict):
        out["config"] = {}
        for name, v in list(settings.items())[:MAX_CONFIG_SETTINGS]:
            if not isinstance(name, str) or not isinstance(v, (bool, int, float, str)):
                continue
            if not isinstance(v, float) or math.isfinite(v):
                out["config"][name[:64]] = v[:128] if isinstance(v, str) else v
    return out


def _checked_link(entry: Any) -> dict[str, Any]:
    """One ``links`` entry's fields that have their types (figures >= 0); empty without ``peer``."""
    if not isinstance(entry, dict):
        return {}
    out = {}
    for name, kind in LINK_FIELDS.items():
        v = _typed(entry.get(name), kind, 64)
        if v is not None and (kind is str or v >= 0):
            out[name] = v
    return out if "peer" in out else {}


def _checked_status(value: Any) -> dict[str, Any]:
    """The fields of a status record that have their types (the record comes from the network:
    what is printed or compared must be what the spec says, whatever a member wrote)."""
    if not isinstance(value, dict):
        return {}
    out: dict[str, Any] = {}
    for name, kind in STATUS_FIELDS.items():
        v = _typed(value.get(name), kind)
        if v is None:
            continue
        if name == "links":
            v = [link for link in map(_checked_link, v[:MAX_STATUS_LINKS]) if link]
        elif name == "rejects":
            v = {code[:32]: n for code, n in list(v.items())[:MAX_STATUS_CODES]
                 if isinstance(code, str) and type(n) is int and n >= 0}
        out[name] = v
    return out


@dataclass(frozen=True)
class StagePeer:
    """One peer of a stage as the DHT shows it (:meth:`Discovery.stage_peers`)."""

    peer_id: str
    """Its DHT peer id (a certified peer's derives from its own key)."""
    contact: str
    """The contact of its stage record; ``""`` when it withdrew it (or published only a status)."""
    expires_in_s: float
    """Seconds until its freshest record lapses unless renewed."""
    status: dict[str, Any]
    """Its status record's fields (:data:`STATUS_FIELDS`; empty when it published none)."""
    heard_s: float | None = None
    """Seconds since it last stored its status record (every ``status_s`` while it lives; None: it
    published none)."""
    clock_age_s: float | None = None
    """:attr:`heard_s` as this host's clock reads it, not clamped at 0: below 0 (a record stored in
    this host's future) this host's clock is behind the peer's (``mapl-swarm doctor``)."""

    def silent(self, status_s: float) -> bool:
        """It stopped storing its status record: none for three of its periods (a process killed;
        its stage record still lasts until it lapses)."""
        return self.heard_s is not None and self.heard_s > 3 * status_s


@dataclass(frozen=True)
class TrustedAuthority:
    """What a certified run's DHT bootstrap node trusts: the run and its authority (it announces
    nothing, so it holds no identity of its own); read from any certificate of the run."""

    run_id: str
    authority: bytes
    revoked: frozenset[int] = frozenset()


def run_bootstrap_node(host: str = "0.0.0.0", port: int = 0, *, announce_host: str | None = None,
                       initial_peers: Sequence[str] = (), identity_path: str | None = None,
                       ready: Callable[[list[str]], None] | None = None,
                       stop: threading.Event | None = None, membership: Any = None) -> list[str]:
    """Run a DHT bootstrap node until ``stop`` is set (or forever / Ctrl-C when it is None).

    ``ready`` receives the node's visible multiaddrs once it is up (the CLI prints them; any one
    is enough for peers to join). Returns those multiaddrs after shutting the node down.
    With a :class:`TrustedAuthority` (``membership``) the node stores only certified records of its
    run; without, it stores anything (insecure runs)."""
    dht = start_dht(host=host, port=port, announce_host=announce_host, initial_peers=initial_peers,
                    identity_path=identity_path, record_validators=dht_validators(membership))
    try:
        maddrs = [str(m) for m in dht.get_visible_maddrs()]
        logger.info("DHT bootstrap node up (%s records): %s",
                    "certified" if membership is not None else "unsigned", " ".join(maddrs))
        if ready is not None:
            ready(maddrs)
        wait_for_signal(stop)  # the signals' handlers (Ctrl-C, the CLI's SIGTERM) still run
        return maddrs
    finally:
        dht.shutdown()


@dataclass(frozen=True, kw_only=True)
class DiscoveryConfig:
    """How a peer joins the DHT and how it announces and finds stages."""

    initial_peers: tuple[str, ...] = ()
    """Multiaddrs of running DHT nodes (one is enough); empty starts a new DHT."""
    host: str = "0.0.0.0"
    """Interface the DHT node listens on."""
    port: int = 0
    """DHT TCP port; 0 picks a free one (then ``announce_host`` cannot be used)."""
    announce_host: str | None = None
    """Host other DHT nodes should dial (behind NAT or in containers); needs a fixed ``port``."""
    identity_path: str | None = None
    """Private-key file that fixes this node's peer id across restarts (created if missing)."""
    client_mode: bool = False
    """Join as a DHT client that stores nothing for others (for peers that cannot be dialled)."""
    ttl_s: float = 30.0
    """Lifetime of an announcement; a peer that stops refreshing disappears after this."""
    refresh_s: float = 10.0
    """Seconds between re-announcements; must be below ``ttl_s``."""
    poll_s: float = 0.25
    """Seconds between two DHT reads while :meth:`Discovery.lookup` waits for a stage."""
    start_timeout_s: float = 60.0
    """Deadline of :meth:`Discovery.start`, including retries while initial peers are down."""
    request_timeout_s: float = 10.0
    """Deadline of one DHT store or get."""
    status_s: float = 2.0
    """Seconds between two stores of this peer's status record (:meth:`Discovery.publish_status`)."""

    def __post_init__(self) -> None:
        if isinstance(self.initial_peers, (list, str)):  # TOML arrays arrive as lists
            peers = [self.initial_peers] if isinstance(self.initial_peers, str) else self.initial_peers
            object.__setattr__(self, "initial_peers", tuple(peers))
        if not (0 <= self.port <= 65535):
            raise ConfigError(f"discovery.port must be in 0..65535, got {self.port}")
        if self.announce_host and self.port == 0:
            raise ConfigError("discovery.announce_host needs an explicit discovery.port")
        for name in ("ttl_s", "refresh_s", "poll_s", "start_timeout_s", "request_timeout_s", "status_s"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise ConfigError(f"discovery.{name} must be a finite number > 0, got {value}")
        if self.ttl_s > MAX_TTL_S:
            raise ConfigError(f"discovery.ttl_s must be at most {MAX_TTL_S:g} (a certified DHT refuses records "
                              f"expiring later), got {self.ttl_s}")
        if self.refresh_s >= self.ttl_s:
            raise ConfigError(f"discovery.refresh_s ({self.refresh_s}) must be below ttl_s ({self.ttl_s})")


class Discovery:
    """Announce this peer's stages and look up neighbours in one run (see module docstring)."""

    def __init__(self, run_id: str, config: DiscoveryConfig = DiscoveryConfig(), *,
                 membership: Any = None) -> None:
        if not run_id or "/" in run_id:
            raise ConfigError(f"run id must be non-empty and contain no '/', got {run_id!r}")
        self.run_id = run_id
        self.config = config
        self._membership = membership
        self._dht: Any = None
        self._peer_id = ""
        self._announced: dict[int, tuple[str, str]] = {}  # stage -> (subkey, endpoint)
        self._refusals_logged: set[int] = set()
        self._status: tuple[int, Callable[[], dict[str, Any]]] | None = None  # stage, source
        self._config: tuple[int, dict[str, Any]] | None = None  # stage, config record
        self._relay: str | None = None  # the relay this member runs and announces
        self._lock = threading.Lock()  # guards the DHT command pipe
        self._state = threading.Lock()  # serialises announce / withdraw / refresh
        self._stop = threading.Event()
        self._refresher: threading.Thread | None = None

    def start(self) -> "Discovery":
        """Fork and join the DHT. Call before any event loop, ZeroMQ context or torch work."""
        if self._dht is None:
            self._stop.clear()
            c = self.config
            m = self._membership  # a certified peer's DHT peer id derives from its own key
            key = m.key if isinstance(m, PeerIdentity) else None
            self._dht = start_dht(host=c.host, port=c.port, announce_host=c.announce_host,
                                  initial_peers=c.initial_peers, identity_path=c.identity_path,
                                  identity_key=None if key is None or c.identity_path else key.libp2p_private_key(),
                                  client_mode=c.client_mode, timeout_s=c.start_timeout_s,
                                  record_validators=dht_validators(self._membership))
            self._peer_id = str(self._dht.peer_id)
            logger.info("joined DHT as %s (%s records)", self._peer_id,
                        "certified" if self.signed else "unsigned")
        return self

    def __enter__(self) -> "Discovery":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def peer_id(self) -> str:
        """This node's DHT peer id (the default subkey of its announcements)."""
        return self._peer_id

    @property
    def dht(self) -> Any:
        """The running ``hivemind.DHT`` (a stage averager shares its p2p daemon, so its peer id)."""
        return self._require()

    @property
    def signed(self) -> bool:
        """Whether records are certified (signed by their announcer, checked against the authority)."""
        return self._membership is not None

    def visible_maddrs(self) -> list[str]:
        """Multiaddrs other nodes can use as ``initial_peers`` to join through this one."""
        return [str(m) for m in self._require().get_visible_maddrs()]

    def announce(self, stage: int, endpoint: str, *, subkey: str | None = None) -> None:
        """Publish ``endpoint`` for ``stage`` under ``subkey`` (this announcer's routing id; default
        the DHT peer id) now, and keep refreshing it every ``refresh_s``. Announcing the stage
        again under another subkey tombstones the previous one."""
        if not endpoint:
            raise ConfigError("cannot announce an empty endpoint")
        if not 0 <= stage < MAX_STAGES:
            raise ConfigError(f"stage must be in 0..{MAX_STAGES - 1}, got {stage}")
        self._require()
        subkey = subkey or self._peer_id
        with self._state:
            self._store(stage, subkey, endpoint)
            previous = self._announced.get(stage)
            self._announced[stage] = (subkey, endpoint)
            if previous is not None and previous[0] != subkey:
                self._store(stage, previous[0], "")
        self._ensure_refresher()

    def _ensure_refresher(self) -> None:
        with self._state:
            if self._refresher is None:
                self._refresher = threading.Thread(target=self._refresh_loop, name="mapl-dht-refresh",
                                                   daemon=True)
                self._refresher.start()

    def withdraw(self, stage: int, *, tombstone: bool = True) -> None:
        """Stop refreshing ``stage``. With ``tombstone`` the entry is hidden at once; without,
        it stays visible until its expiry (at most ``ttl_s``)."""
        with self._state:
            subkey, _ = self._announced.pop(stage, (self._peer_id, ""))
            if tombstone:
                self._store(stage, subkey, "")

    def publish_status(self, stage: int, source: Callable[[], dict[str, Any]]) -> None:
        """Store this peer's status record of ``stage`` now and every ``status_s`` from then on,
        its value what ``source()`` returns then (:data:`STATUS_FIELDS`; called on the refresh
        thread). The record lapses ``ttl_s`` after the last store."""
        self._require()
        with self._state:
            self._status = (stage, source)
            self._store_status()
        self._ensure_refresher()

    def publish_config(self, stage: int, record: dict[str, Any]) -> None:
        """Store this peer's config record of ``stage`` (its protocol version, config fingerprint and
        the settings its neighbours must share: SPEC §9.1 "Config records") now and with every
        re-announcement; ``mapl-swarm doctor`` compares a host's config with it."""
        self._require()
        with self._state:
            self._config = (stage, record)
            self._store_config()
        self._ensure_refresher()

    def announce_relay(self, address: str) -> None:
        """Publish ``address`` (``HOST:PORT#<hex key>``: a relay this member runs, with its own
        certificate's CURVE key, SPEC §9.12) now and at every re-announcement; :meth:`withdraw_relay`
        tombstones it."""
        self._require()
        with self._state:
            self._relay = address
            self._store_relay(address)
        self._ensure_refresher()

    def withdraw_relay(self) -> None:
        """Stop announcing this member's relay and hide it at once."""
        with self._state:
            if self._relay is not None:
                self._relay = None
                self._store_relay("")

    def relays(self) -> list[str]:
        """The relays the run's members announce (``HOST:PORT#<hex key>``), by their keys, smallest
        first: two dial-out neighbours that read the same records take the same one."""
        from mapl_swarm.config.run import relay_address

        found = self._call(lambda dht: dht.get(relay_key(self.run_id), latest=True, return_future=True),
                           "get the relays")
        live = {value: address[2] for value, _ in _by_peer_id(found).values()
                if isinstance(value, str) and (address := relay_address(value)) is not None}
        return sorted(live, key=live.__getitem__)

    def stage_configs(self, stage: int) -> dict[str, dict[str, Any]]:
        """The config record of each peer of ``stage`` that published one (:func:`checked_config`), by peer id."""
        found = self._call(lambda dht: dht.get(config_key(self.run_id, stage), latest=True, return_future=True),
                           f"get the config of stage {stage}")
        return {peer: checked_config(value) for peer, (value, _) in _by_peer_id(found).items()}

    def stage_peers(self, stage: int) -> list[StagePeer]:
        """Every peer of ``stage`` with a live stage or status record, by peer id."""
        contacts = {sub: (endpoint, expiration) for sub, endpoint, expiration in self.entries(stage)}
        found = self._call(lambda dht: dht.get(status_key(self.run_id, stage), latest=True, return_future=True),
                           f"get the status of stage {stage}")
        statuses = {peer: (_checked_status(value), until) for peer, (value, until) in _by_peer_id(found).items()}
        now = _dht_time()
        peers = []
        for peer_id in dict.fromkeys([*contacts, *statuses]):
            endpoint, until = contacts.get(peer_id, ("", 0.0))
            status, status_until = statuses.get(peer_id, ({}, 0.0))
            heard = self.config.ttl_s - (status_until - now) if peer_id in statuses else None
            peers.append(StagePeer(peer_id, endpoint, max(until, status_until) - now, status,
                                   None if heard is None else max(0.0, heard), heard))
        return sorted(peers, key=lambda p: p.peer_id)

    def entries(self, stage: int) -> list[tuple[str, str, float]]:
        """Live announcements of ``stage`` as ``(subkey, endpoint, expiration)``, freshest first
        (tombstones included, as endpoint ``""``; in a certified run only validly certified ones)."""
        result = self._call(lambda dht: dht.get(stage_key(self.run_id, stage), latest=True,
                                                return_future=True), f"get stage {stage}")
        if result is None:
            return []
        value = result.value
        items = value.items() if isinstance(value, dict) else [("", result)]
        out = [(str(sub), str(v.value), float(v.expiration_time)) for sub, v in items
               if isinstance(v.value, str)]
        return sorted(out, key=lambda e: e[2], reverse=True)

    def lookup_all(self, stage: int, timeout_s: float) -> list[str]:
        """Every endpoint announced for ``stage`` (distinct, freshest first), polling until there
        is at least one; raises :class:`DiscoveryTimeoutError`."""
        deadline = time.monotonic() + timeout_s
        while True:
            endpoints = self._endpoints(stage)
            if endpoints:
                return endpoints
            remaining = deadline - time.monotonic()
            if remaining <= 0 or self._stop.wait(min(self.config.poll_s, remaining)):
                raise self._timeout(stage, timeout_s)

    async def lookup_all_async(self, stage: int, timeout_s: float) -> list[str]:
        """:meth:`lookup_all` for the event loop: DHT reads run in the executor, waits are cancellable."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while True:
            endpoints = await loop.run_in_executor(None, self._endpoints, stage)
            if endpoints:
                return endpoints
            remaining = deadline - loop.time()
            if remaining <= 0:
                raise self._timeout(stage, timeout_s)
            await asyncio.sleep(min(self.config.poll_s, remaining))

    def lookup(self, stage: int, timeout_s: float) -> str:
        """The freshest endpoint of ``stage`` (first of :meth:`lookup_all`)."""
        return self._first(stage, self.lookup_all(stage, timeout_s))

    async def lookup_async(self, stage: int, timeout_s: float) -> str:
        """:meth:`lookup` for the event loop."""
        return self._first(stage, await self.lookup_all_async(stage, timeout_s))

    def close(self) -> None:
        """Stop refreshing, store the status record once more (the peer's last state) and shut the
        DHT process down (announcements expire by themselves)."""
        self._stop.set()
        if self._refresher is not None:
            self._refresher.join(self.config.request_timeout_s)
            self._refresher = None
        if self._dht is not None and self._status is not None:
            with self._state:
                try:
                    self._store_status()  # the peer's last state (ended, stopped) rather than a stale one
                except DiscoveryError as exc:
                    logger.debug("last status store failed: %s", exc)
                self._status = None
        if self._dht is not None:
            self._dht.shutdown()
            self._dht = None

    # -- internals -------------------------------------------------------------------------------
    def _timeout(self, stage: int, timeout_s: float) -> DiscoveryTimeoutError:
        signed = "; only records certified by this run's authority count" if self.signed else ""
        return DiscoveryTimeoutError(f"no peer announced run {self.run_id!r} stage {stage} within "
                                     f"{timeout_s:g} s (DHT key {stage_key(self.run_id, stage)!r}{signed})")

    def _endpoints(self, stage: int) -> list[str]:
        return list(dict.fromkeys(endpoint for _, endpoint, _ in self.entries(stage) if endpoint))

    def _first(self, stage: int, endpoints: list[str]) -> str:
        if len(endpoints) > 1:
            logger.warning("run %r stage %d announced at %d endpoints; using %s", self.run_id, stage,
                           len(endpoints), endpoints[0])
        return endpoints[0]

    def _require(self) -> Any:
        if self._dht is None:
            raise DiscoveryError("Discovery.start() must be called first (and before the event loop)")
        return self._dht

    def _call(self, submit: Callable[[Any], Any], what: str) -> Any:
        dht = self._require()
        with self._lock:  # the DHT's command pipe is not safe for concurrent senders
            future = submit(dht)
        try:
            return future.result(timeout=self.config.request_timeout_s)
        except Exception as exc:  # noqa: BLE001 - MPFuture timeouts and daemon errors
            hint = "" if self.signed or not what.startswith("get") else (
                " (an insecure node cannot read certified records: if this run is certified, give this "
                "peer its --peer-key and --cert)")
            raise DiscoveryError(f"DHT {what} for run {self.run_id!r} failed: {exc!r}{hint}") from exc

    def _store(self, stage: int, subkey: str, endpoint: str) -> None:
        expiration = _dht_time() + self.config.ttl_s
        ok = self._call(lambda dht: dht.store(stage_key(self.run_id, stage), endpoint, expiration,
                                              subkey=subkey, return_future=True),
                        f"store stage {stage}")
        if not ok:
            # hivemind reports the answer of the replica that answered last, so one node that
            # refuses (e.g. one of another membership, or an attacker's) makes this False although
            # other nodes (normally this one too) stored the record: log it, do not fail.
            log = logger.debug if stage in self._refusals_logged else logger.warning
            self._refusals_logged.add(stage)
            log("a DHT node did not store the announcement of run %r stage %d (other nodes normally did; it "
                "may hold a newer entry of it, or refuse it: a node of another authority, or a record this "
                "certificate does not allow)", self.run_id, stage)

    def _store_relay(self, address: str) -> None:
        """Store this member's relay record (holding ``_state``); ``""`` withdraws it."""
        self._call(lambda dht: dht.store(relay_key(self.run_id), address, _dht_time() + self.config.ttl_s,
                                         subkey=dht.peer_id.to_bytes(), return_future=True), "store the relay")

    def _store_config(self) -> None:
        """Store the config record (holding ``_state``)."""
        if self._config is None:
            return
        stage, record = self._config
        self._call(lambda dht: dht.store(config_key(self.run_id, stage), record, _dht_time() + self.config.ttl_s,
                                         subkey=dht.peer_id.to_bytes(), return_future=True),
                   f"store the config of stage {stage}")

    def _store_status(self) -> None:
        """Store the status record (holding ``_state``)."""
        if self._status is None:
            return
        stage, source = self._status
        value = {k: v for k, v in source().items() if k in STATUS_FIELDS}
        self._call(lambda dht: dht.store(status_key(self.run_id, stage), value, _dht_time() + self.config.ttl_s,
                                         subkey=dht.peer_id.to_bytes(), return_future=True),
                   f"store the status of stage {stage}")

    def _refresh_loop(self) -> None:
        """Store the status record every ``status_s`` and re-announce every ``refresh_s``, each
        paced from the start of its last store, the status first: a status published while the
        loop waits for a re-announcement, or a slow store of the announcements, must not leave a
        live peer's status unrenewed long enough to read as silent (three periods)."""
        c = self.config
        start = time.monotonic()
        next_status, next_announce = start + c.status_s, start + c.refresh_s
        while not self._stop.wait(max(0.0, min(next_status, next_announce) - time.monotonic())):
            with self._state:
                now = time.monotonic() + 1e-3
                if now >= next_status:
                    next_status = now + c.status_s
                    try:
                        self._store_status()
                    except DiscoveryError as exc:
                        logger.debug("status store failed: %s", exc)
                if now >= next_announce:
                    next_announce = now + c.refresh_s
                    for stage, (subkey, endpoint) in self._announced.items():
                        try:
                            self._store(stage, subkey, endpoint)
                        except DiscoveryError as exc:
                            logger.warning("re-announce failed: %s", exc)
                    try:
                        self._store_config()
                        if self._relay is not None:
                            self._store_relay(self._relay)
                    except DiscoveryError as exc:
                        logger.debug("config or relay store failed: %s", exc)


def _by_peer_id(found: Any) -> dict[str, tuple[Any, float]]:
    """A dictionary record read from the DHT (``dht.get``), by the peer id each subkey holds:
    (value, expiration time). Subkeys that are no peer id (an insecure run's strangers) are skipped."""
    from hivemind.p2p import PeerID

    out: dict[str, tuple[Any, float]] = {}
    if found is not None and isinstance(found.value, dict):
        for sub, v in found.value.items():
            if isinstance(sub, bytes):
                try:
                    out[PeerID(sub).to_base58()] = (v.value, float(v.expiration_time))
                except Exception:  # noqa: BLE001 - not a peer id: an insecure run's stranger
                    continue
    return out


def _dht_time() -> float:
    from hivemind.utils import get_dht_time  # deferred: imports hivemind

    return get_dht_time()
