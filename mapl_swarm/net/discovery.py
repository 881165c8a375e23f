"""Peer discovery through hivemind's DHT: ``(run, stage) -> ZeroMQ endpoint`` with expiry.

Record layout: key ``mapl/{run_id}/stage/{stage}``, subkey = the announcer's DHT peer id,
value = its advertised endpoint (``tcp://HOST:PORT``), expiring ``ttl_s`` after each store. The
subkey keeps two claimants of one stage (e.g. a restarted peer and its stale predecessor) apart;
:meth:`Discovery.lookup` picks the entry that expires last, i.e. the freshest announcement. A
withdrawn stage is overwritten by an empty-endpoint tombstone, which lookups skip.

**Start order matters.** ``hivemind.DHT`` runs its node in a *forked* child process. Forking a
process that already runs threads (ZeroMQ's I/O threads, torch's thread pools, an executor)
can deadlock the child, so a peer must call :meth:`Discovery.start` first — before creating its
event loop, its ZeroMQ context or doing any torch work — and only then build everything else::

    discovery = Discovery("run-42", DiscoveryConfig(initial_peers=(bootstrap,)))
    discovery.start()                       # forks the DHT process: do this first
    run(peer_main(discovery))               # then the event loop, zmq, torch ...

Never SIGTERM a DHT child (call :meth:`Discovery.close`): a child killed while it holds
hivemind's cross-process MPFuture lock makes every later DHT start in the process tree hang.

Inside the loop use :meth:`Discovery.announce` / :meth:`Discovery.lookup_async`; the blocking
DHT calls go to the default executor. Re-announcement runs on a daemon thread every
``refresh_s`` seconds. ``hivemind`` (and with it torch) is imported only by :meth:`start`.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import math
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from mapl_swarm.errors import ConfigError
from mapl_swarm.net.errors import DiscoveryError, DiscoveryTimeoutError

__all__ = ["DiscoveryConfig", "Discovery", "start_dht", "run_bootstrap_node", "host_maddr", "stage_key"]

logger = logging.getLogger(__name__)

_CHILD_EXIT_TIMEOUT_S = 15.0
"""Grace period for a DHT child to exit before it is terminated (hivemind's default, 3 s, is
short on a loaded machine, and a terminated child can leave hivemind's MPFuture lock held)."""


def host_maddr(host: str, port: int) -> str:
    """Multiaddr ``/ip4|ip6|dns/HOST/tcp/PORT`` for a host name or IP literal."""
    try:
        proto = "ip6" if ipaddress.ip_address(host).version == 6 else "ip4"
    except ValueError:
        proto = "dns"
    return f"/{proto}/{host}/tcp/{port}"


def stage_key(run_id: str, stage: int) -> str:
    """The DHT key under which the peers of ``stage`` in ``run_id`` announce themselves."""
    return f"mapl/{run_id}/stage/{stage}"


def start_dht(*, host: str = "0.0.0.0", port: int = 0, announce_host: str | None = None,
              initial_peers: Sequence[str] = (), identity_path: str | None = None,
              client_mode: bool = False, timeout_s: float = 30.0) -> Any:
    """Fork and start a ``hivemind.DHT``; returns it once ready (see the start-order note).

    ``announce_host`` requires an explicit ``port`` (hivemind refuses to announce port 0).
    ``identity_path`` makes the peer id, hence the multiaddr, stable across restarts (useful
    for a bootstrap node whose address is written into configs). Unreachable initial peers are
    retried until ``timeout_s``, so peers may start before the bootstrap node."""
    if announce_host and port == 0:
        raise ConfigError("discovery: announce_host needs an explicit DHT port (hivemind cannot "
                          "announce port 0)")
    from hivemind import DHT  # deferred: imports torch

    kwargs: dict[str, Any] = dict(host_maddrs=[host_maddr(host, port)], client_mode=client_mode,
                                  shutdown_timeout=_CHILD_EXIT_TIMEOUT_S)
    if announce_host:
        kwargs["announce_maddrs"] = [host_maddr(announce_host, port)]
    if identity_path:
        kwargs["identity_path"] = identity_path
    deadline = time.monotonic() + timeout_s
    while True:
        dht = DHT(initial_peers=list(initial_peers) or None, start=False, **kwargs)
        try:
            dht.run_in_background(await_ready=True, timeout=max(0.1, deadline - time.monotonic()))
            return dht
        except Exception as exc:  # noqa: BLE001 - hivemind raises assorted daemon errors
            # Let the failed child exit by itself: SIGTERM can kill it while it holds hivemind's
            # cross-process MPFuture lock, after which every later DHT start here hangs.
            dht.join(_CHILD_EXIT_TIMEOUT_S)
            if dht.is_alive():
                logger.warning("failed DHT process %s did not exit; terminating it", dht.pid)
                dht.terminate()
            if time.monotonic() >= deadline:
                raise DiscoveryError(f"could not start a DHT node on {host_maddr(host, port)} joining "
                                     f"{list(initial_peers) or 'no peers'} within {timeout_s:g} s: "
                                     f"{exc}") from exc
            logger.info("DHT start failed (%s); retrying", exc)
            time.sleep(min(1.0, max(0.0, deadline - time.monotonic())))


def run_bootstrap_node(host: str = "0.0.0.0", port: int = 0, *, announce_host: str | None = None,
                       initial_peers: Sequence[str] = (), identity_path: str | None = None,
                       ready: Callable[[list[str]], None] | None = None,
                       stop: threading.Event | None = None) -> list[str]:
    """Run a DHT bootstrap node until ``stop`` is set (or forever / Ctrl-C when it is None).

    ``ready`` receives the node's visible multiaddrs once it is up (the CLI prints them; any one
    is enough for peers to join). Returns those multiaddrs after shutting the node down."""
    dht = start_dht(host=host, port=port, announce_host=announce_host, initial_peers=initial_peers,
                    identity_path=identity_path)
    try:
        maddrs = [str(m) for m in dht.get_visible_maddrs()]
        logger.info("DHT bootstrap node up: %s", " ".join(maddrs))
        if ready is not None:
            ready(maddrs)
        (stop or threading.Event()).wait()
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

    def __post_init__(self) -> None:
        if isinstance(self.initial_peers, (list, str)):  # TOML arrays arrive as lists
            peers = [self.initial_peers] if isinstance(self.initial_peers, str) else self.initial_peers
            object.__setattr__(self, "initial_peers", tuple(peers))
        if not (0 <= self.port <= 65535):
            raise ConfigError(f"discovery.port must be in 0..65535, got {self.port}")
        if self.announce_host and self.port == 0:
            raise ConfigError("discovery.announce_host needs an explicit discovery.port")
        for name in ("ttl_s", "refresh_s", "poll_s", "start_timeout_s", "request_timeout_s"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise ConfigError(f"discovery.{name} must be a finite number > 0, got {value}")
        if self.refresh_s >= self.ttl_s:
            raise ConfigError(f"discovery.refresh_s ({self.refresh_s}) must be below ttl_s ({self.ttl_s})")


class Discovery:
    """Announce this peer's stages and look up neighbours in one run (see module docstring)."""

    def __init__(self, run_id: str, config: DiscoveryConfig = DiscoveryConfig()) -> None:
        if not run_id or "/" in run_id:
            raise ConfigError(f"run id must be non-empty and contain no '/', got {run_id!r}")
        self.run_id = run_id
        self.config = config
        self._dht: Any = None
        self._peer_id = ""
        self._announced: dict[int, str] = {}
        self._lock = threading.Lock()  # guards the DHT command pipe
        self._state = threading.Lock()  # serialises announce / withdraw / refresh
        self._stop = threading.Event()
        self._refresher: threading.Thread | None = None

    def start(self) -> "Discovery":
        """Fork and join the DHT. Call before any event loop, ZeroMQ context or torch work."""
        if self._dht is None:
            self._stop.clear()
            c = self.config
            self._dht = start_dht(host=c.host, port=c.port, announce_host=c.announce_host,
                                  initial_peers=c.initial_peers, identity_path=c.identity_path,
                                  client_mode=c.client_mode, timeout_s=c.start_timeout_s)
            self._peer_id = str(self._dht.peer_id)
            logger.info("joined DHT as %s", self._peer_id)
        return self

    def __enter__(self) -> "Discovery":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def peer_id(self) -> str:
        """This node's DHT peer id (the subkey of its announcements)."""
        return self._peer_id

    def visible_maddrs(self) -> list[str]:
        """Multiaddrs other nodes can use as ``initial_peers`` to join through this one."""
        return [str(m) for m in self._require().get_visible_maddrs()]

    def announce(self, stage: int, endpoint: str) -> None:
        """Publish ``endpoint`` for ``stage`` now and keep refreshing it every ``refresh_s``."""
        if not endpoint:
            raise ConfigError("cannot announce an empty endpoint")
        with self._state:
            self._store(stage, endpoint)
            self._announced[stage] = endpoint
        if self._refresher is None:
            self._refresher = threading.Thread(target=self._refresh_loop, name="mapl-dht-refresh",
                                               daemon=True)
            self._refresher.start()

    def withdraw(self, stage: int, *, tombstone: bool = True) -> None:
        """Stop refreshing ``stage``. With ``tombstone`` the entry is hidden at once; without,
        it stays visible until its expiry (at most ``ttl_s``)."""
        with self._state:
            self._announced.pop(stage, None)
            if tombstone:
                self._store(stage, "")

    def entries(self, stage: int) -> list[tuple[str, str, float]]:
        """Live announcements of ``stage`` as ``(peer_id, endpoint, expiration)``, freshest first."""
        result = self._call(lambda dht: dht.get(stage_key(self.run_id, stage), latest=True,
                                                return_future=True), f"get stage {stage}")
        if result is None:
            return []
        value = result.value
        items = value.items() if isinstance(value, dict) else [("", result)]
        out = [(str(sub), str(v.value), float(v.expiration_time)) for sub, v in items
               if isinstance(v.value, str)]
        return sorted(out, key=lambda e: e[2], reverse=True)

    def lookup(self, stage: int, timeout_s: float) -> str:
        """Endpoint of ``stage``, polling until it appears; raises :class:`DiscoveryTimeoutError`."""
        deadline = time.monotonic() + timeout_s
        while True:
            endpoint = self._freshest(stage)
            if endpoint:
                return endpoint
            remaining = deadline - time.monotonic()
            if remaining <= 0 or self._stop.wait(min(self.config.poll_s, remaining)):
                raise self._timeout(stage, timeout_s)

    async def lookup_async(self, stage: int, timeout_s: float) -> str:
        """:meth:`lookup` for the event loop: DHT reads run in the executor, waits are cancellable."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while True:
            endpoint = await loop.run_in_executor(None, self._freshest, stage)
            if endpoint:
                return endpoint
            remaining = deadline - loop.time()
            if remaining <= 0:
                raise self._timeout(stage, timeout_s)
            await asyncio.sleep(min(self.config.poll_s, remaining))

    def close(self) -> None:
        """Stop refreshing and shut the DHT process down (announcements expire by themselves)."""
        self._stop.set()
        if self._refresher is not None:
            self._refresher.join(self.config.request_timeout_s)
            self._refresher = None
        if self._dht is not None:
            self._dht.shutdown()
            self._dht = None

    # -- internals -------------------------------------------------------------------------------
    def _timeout(self, stage: int, timeout_s: float) -> DiscoveryTimeoutError:
        return DiscoveryTimeoutError(f"no peer announced run {self.run_id!r} stage {stage} within "
                                     f"{timeout_s:g} s (DHT key {stage_key(self.run_id, stage)!r})")

    def _freshest(self, stage: int) -> str:
        live = [e for e in self.entries(stage) if e[1]]
        if len({e[1] for e in live}) > 1:
            logger.warning("run %r stage %d announced by %d peers; using %s", self.run_id, stage,
                           len(live), live[0][1])
        return live[0][1] if live else ""

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
            raise DiscoveryError(f"DHT {what} for run {self.run_id!r} failed: {exc!r}") from exc

    def _store(self, stage: int, endpoint: str) -> None:
        from hivemind.utils import get_dht_time

        expiration = get_dht_time() + self.config.ttl_s
        ok = self._call(lambda dht: dht.store(stage_key(self.run_id, stage), endpoint, expiration,
                                              subkey=self._peer_id, return_future=True),
                        f"store stage {stage}")
        if not ok:
            raise DiscoveryError(f"DHT refused to store run {self.run_id!r} stage {stage}")

    def _refresh_loop(self) -> None:
        while not self._stop.wait(self.config.refresh_s):
            with self._state:
                for stage, endpoint in self._announced.items():
                    try:
                        self._store(stage, endpoint)
                    except DiscoveryError as exc:
                        logger.warning("re-announce failed: %s", exc)
