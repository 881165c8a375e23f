"""The DHT node process: a ``hivemind.DHT`` that fails fast, dies with its parent and stops cleanly.

hivemind runs a DHT node in a *forked* child process, which spawns the go-libp2p daemon
``p2pd``. :func:`start_dht` starts one (see the start-order note in
:mod:`mapl_swarm.net.discovery`); this module holds everything that touches those processes.

**Fail fast.** Before forking, :func:`check_initial_peers` parses every initial peer with
hivemind's multiaddr parser, requires its ``/p2p/<peer id>`` and resolves its DNS name, and
:func:`check_listen_address` binds the DHT port briefly. p2pd listens with ``SO_REUSEPORT``, so
without that check a second node on a taken port does not fail at all: it shares the port and
the kernel splits incoming connections between the two. A failure p2pd still reports (a race
for the port, an unreadable identity file, anything the checks miss) is raised at once with
p2pd's own reason; only "none of the initial peers answered" and a start slower than its deadline
are retried until the deadline, since peers may start before the bootstrap node.

**Nothing left behind.** The node process (1) leaves its parent's process group, so Ctrl-C in
a terminal or a signal to the group reaches only the peer, which then stops the node through
:meth:`shutdown` (a p2pd that got the SIGINT itself would die and turn the shutdown into
hivemind's hard-kill path, with go-libp2p errors and tracebacks); (2) receives SIGTERM when its parent dies,
even by SIGKILL (:mod:`mapl_swarm.procs`: ``PR_SET_PDEATHSIG``, or a pidfd watcher thread when
started off the main thread); its SIGTERM handler kills p2pd, removes p2pd's two unix sockets
and exits at once; (3) spawns p2pd with ``PR_SET_PDEATHSIG=SIGKILL``, so p2pd dies with it
however it ends. ``torch_shm_manager`` needs nothing more: hivemind's ``MPFuture`` switches torch
to the ``file_system`` sharing strategy and allocates its state bytes with ``share_memory_()``,
which starts that daemon (its own session, a child of the peer). It owns the run's
``/dev/shm/torch_*`` segments and exits about 2 s after its last client — the peer and the DHT
process, which inherits the peer's connection — disconnects, unlinking them. It outlived a killed
peer only because the DHT process did. (Avoiding it would take torch's ``file_descriptor``
strategy for all of hivemind, which passes a file descriptor through a helper thread and socket
of the peer for every DHT request.)

**Clean shutdown.** :meth:`shutdown` of the returned node asks it to stop, waits
``shutdown_timeout_s`` and only then sends SIGTERM (handled as above), instead of hivemind's
"did not shut down within the grace period; terminating it the hard way".
"""

from __future__ import annotations

import asyncio
import errno
import ipaddress
import logging
import os
import re
import shutil
import signal
import socket
import tempfile
import threading
import time
from contextlib import contextmanager, suppress
from typing import Any, Iterator, Sequence

from mapl_swarm.errors import ConfigError
from mapl_swarm.net.errors import DiscoveryError
from mapl_swarm.procs import die_with_parent, set_parent_death_signal, watch_parent
from mapl_swarm.startup import without_collections

__all__ = ["start_dht", "host_maddr", "check_initial_peers", "check_listen_address", "SHUTDOWN_TIMEOUT_S"]

logger = logging.getLogger(__name__)

SHUTDOWN_TIMEOUT_S = 15.0
"""How long :meth:`shutdown` waits for the node process before SIGTERM (hivemind's 3 s is short on
a loaded machine)."""
_RESOLVE_TIMEOUT_S = 3.0
"""Longest wait for the DNS name of an initial peer; when it runs out, p2pd resolves it itself."""
_DNS_PROTOCOLS = {"dns": socket.AF_UNSPEC, "dns4": socket.AF_INET, "dns6": socket.AF_INET6}
_TRANSIENT = ("bootstrap", "timeout", "timed out", "failed to start in")
"""Lower-case fragments of the start failures worth retrying: initial peers that do not answer
(yet), a start slower than its deadline. Any other failure (a malformed address, a taken port, an
unreadable identity file...) is raised at once."""


def host_maddr(host: str, port: int) -> str:
    """Multiaddr ``/ip4|ip6|dns/HOST/tcp/PORT`` for a host name or IP literal."""
    try:
        proto = "ip6" if ipaddress.ip_address(host).version == 6 else "ip4"
    except ValueError:
        proto = "dns"
    return f"/{proto}/{host}/tcp/{port}"


def precheck_initial_peers(initial_peers: Sequence[str]) -> None:
    """What :func:`check_initial_peers` refuses for certain, without hivemind (so without torch):
    a ConfigError at once for a multiaddr that does not start with ``/ip4``, ``/ip6`` or ``/dns*``,
    carries no ``/p2p/`` peer id, or whose IP literal is not one. The full parse comes later."""
    for text in map(str, initial_peers):
        parts = text.split("/")
        if len(parts) < 3 or parts[0] != "" or parts[1] not in ("ip4", "ip6", *_DNS_PROTOCOLS):
            raise ConfigError(f"initial peer {text!r} must start with /ip4/, /ip6/ or /dns/ HOST")
        if parts[1] in ("ip4", "ip6"):
            try:
                address = ipaddress.ip_address(parts[2])
            except ValueError:
                address = None
            if address is None or address.version != int(parts[1][-1]):
                raise ConfigError(f"initial peer {text!r} is not a valid multiaddr: {parts[2]!r} is not an "
                                  f"IPv{parts[1][-1]} address")
        if "p2p" not in parts[3:-1]:
            raise ConfigError(f"initial peer {text!r} has no peer id: expected .../tcp/PORT/p2p/PEER_ID, "
                              "as printed by `mapl-swarm dht`")


def check_initial_peers(initial_peers: Sequence[str]) -> list[str]:
    """The initial peers as strings, each checked: a multiaddr (ConfigError naming it and what
    is wrong) starting with ``/ip4``, ``/ip6`` or ``/dns*``, ending in ``/p2p/<peer id>``, whose
    DNS name resolves (DiscoveryError otherwise). Imports hivemind."""
    from hivemind.utils.multiaddr import Multiaddr  # deferred: imports torch

    checked = []
    for text in map(str, initial_peers):
        try:
            maddr = Multiaddr(text)
        except Exception as exc:  # noqa: BLE001 - the vendored parser raises several types
            reason = str(exc).replace(f"Invalid MultiAddr '{text}'", "").strip(" :") or type(exc).__name__
            raise ConfigError(f"initial peer {text!r} is not a valid multiaddr: {reason}") from None
        protocols = [p.name for p in maddr.protocols()]
        if not protocols or protocols[0] not in ("ip4", "ip6", *_DNS_PROTOCOLS):
            raise ConfigError(f"initial peer {text!r} must start with /ip4/, /ip6/ or /dns/ HOST")
        if "p2p" not in protocols:
            raise ConfigError(f"initial peer {text!r} has no peer id: expected .../tcp/PORT/p2p/PEER_ID, "
                              "as printed by `mapl-swarm dht`")
        if protocols[0] in _DNS_PROTOCOLS:
            _check_resolves(maddr.value_for_protocol(protocols[0]), _DNS_PROTOCOLS[protocols[0]], text)
        checked.append(text)
    return checked


def _check_resolves(host: str, family: int, maddr: str) -> None:
    """DiscoveryError when ``host`` does not exist; a slow or failing resolver is left to p2pd."""
    outcome: list[BaseException | None] = []

    def resolve() -> None:
        try:
            socket.getaddrinfo(host, None, family, socket.SOCK_STREAM)
            outcome.append(None)
        except (socket.gaierror, UnicodeError) as exc:
            outcome.append(exc)

    worker = threading.Thread(target=resolve, name="mapl-dht-resolve", daemon=True)
    worker.start()
    worker.join(_RESOLVE_TIMEOUT_S)
    exc = outcome[0] if outcome else None
    if isinstance(exc, UnicodeError) or (isinstance(exc, socket.gaierror) and exc.errno in
                                         (socket.EAI_NONAME, getattr(socket, "EAI_NODATA", socket.EAI_NONAME))):
        reason = exc.strerror if isinstance(exc, socket.gaierror) else "not a valid host name"
        raise DiscoveryError(f"initial peer {maddr!r}: host {host!r} cannot be resolved ({reason})")


def check_listen_address(host: str, port: int, what: str = "DHT") -> None:
    """Bind ``host:port`` (TCP) for a moment: DiscoveryError naming them (as ``what``'s port) when
    the port is taken, the host is not this machine's or cannot be resolved, or binding is not
    permitted."""
    try:
        family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                          flags=socket.AI_PASSIVE)[0]
    except (socket.gaierror, UnicodeError) as exc:
        raise DiscoveryError(f"{what} host {host!r} cannot be resolved ({getattr(exc, 'strerror', exc)})") from None
    with socket.socket(family, kind, proto) as probe:
        # Like p2pd's listener: a port whose old connections linger in TIME_WAIT is free.
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(addr)
        except OSError as exc:
            raise DiscoveryError(_bind_failure(host, port, exc, what)) from None


def _bind_failure(host: str, port: int, exc: OSError, what: str = "DHT") -> str:
    if exc.errno == errno.EADDRINUSE:
        return (f"{what} port {port} on {host} is already in use (another {'DHT node' if what == 'DHT' else 'peer'} "
                "or program listens on it); choose a free port, or 0 for any")
    if exc.errno == errno.EADDRNOTAVAIL:
        return f"{what} host {host} is not an address of this machine (cannot listen on {host}:{port})"
    if exc.errno == errno.EACCES:
        return f"not permitted to listen on {what} port {port} on {host} (ports below 1024 need privileges)"
    return f"cannot listen on {what} address {host}:{port}: {exc.strerror or exc}"


def start_dht(*, host: str = "0.0.0.0", port: int = 0, announce_host: str | None = None,
              initial_peers: Sequence[str] = (), identity_path: str | None = None,
              identity_key: bytes | None = None, client_mode: bool = False, record_validators: Sequence[Any] = (),
              timeout_s: float = 30.0, shutdown_timeout_s: float = SHUTDOWN_TIMEOUT_S) -> Any:
    """Fork and start a DHT node (a ``hivemind.DHT``); returns it once ready.

    ``announce_host`` requires an explicit ``port`` (hivemind refuses to announce port 0).
    ``identity_path`` makes the peer id, hence the multiaddr, stable across restarts (useful
    for a bootstrap node whose address is written into configs); ``identity_key`` instead gives the
    identity itself (a certified peer's, :meth:`~mapl_swarm.net.identity.PeerKey.libp2p_private_key`,
    so its peer id derives from its certificate): it is written to a private temporary file only
    until the node has read it. ``record_validators`` go to
    the forked node. Bad addresses and a taken port fail at once (ConfigError / DiscoveryError);
    unreachable initial peers are retried until ``timeout_s``. Stop it with ``.shutdown()``."""
    if announce_host and port == 0:
        raise ConfigError("discovery: announce_host needs an explicit DHT port (hivemind cannot "
                          "announce port 0)")
    if identity_path and identity_key is not None:
        raise ConfigError("a DHT node takes an identity file or an identity key, not both")
    with without_collections():  # hivemind and torch load here: before the fork below
        peers = check_initial_peers(initial_peers)
        node_class = _node_class()
    check_listen_address(host, port)
    kwargs: dict[str, Any] = dict(host_maddrs=[host_maddr(host, port)], client_mode=client_mode,
                                  record_validators=list(record_validators))
    if announce_host:
        kwargs["announce_maddrs"] = [host_maddr(announce_host, port)]
    if identity_path:
        kwargs["identity_path"] = identity_path
    where = f"{host_maddr(host, port)} joining {peers or 'no peers'}"
    if identity_path:
        where += f" with identity {identity_path}"
    if identity_key is not None:
        with _identity_file(identity_key) as path:
            # hivemind's check that an identity is free reads only RSA keys (and a certified peer's
            # key is its own: no other peer can hold its id)
            return _start(node_class, peers, dict(kwargs, identity_path=path, check_if_identity_free=False),
                          where, timeout_s, shutdown_timeout_s)
    return _start(node_class, peers, kwargs, where, timeout_s, shutdown_timeout_s)


@contextmanager
def _identity_file(key: bytes) -> Iterator[str]:
    folder = tempfile.mkdtemp(prefix="mapl-dht-id-")  # mode 0700
    path = os.path.join(folder, "identity.key")
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(key)
        yield path
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _start(node_class: Any, peers: list[str], kwargs: dict[str, Any], where: str, timeout_s: float,
           shutdown_timeout_s: float) -> Any:
    deadline = time.monotonic() + timeout_s
    last_reason, attempt = "", 0
    while True:
        dht = node_class(initial_peers=peers or None, start=False, **kwargs)
        dht.shutdown_timeout = shutdown_timeout_s
        try:
            dht.run_in_background(await_ready=True, timeout=max(0.1, deadline - time.monotonic()))
            return dht
        except Exception as exc:  # noqa: BLE001 - hivemind raises assorted daemon errors
            _reap_failed_start(dht)
            reason = _failure_reason(exc)
            if reason and not any(fragment in reason.lower() for fragment in _TRANSIENT):
                raise DiscoveryError(f"could not start a DHT node on {where}: {reason}") from None
            last_reason = reason or last_reason
            if time.monotonic() >= deadline:
                hint = (f"; is a DHT node running at {peers[0]}?" if peers and "bootstrap" in last_reason.lower()
                        else "")
                raise DiscoveryError(f"could not start a DHT node on {where} within {timeout_s:g} s: "
                                     f"{last_reason or 'the node did not become ready'}{hint}") from exc
            (logger.debug if attempt else logger.info)("DHT start failed (%s); retrying for up to %g s",
                                                      reason or "not ready in time", timeout_s)
            attempt += 1
            time.sleep(min(1.0, max(0.0, deadline - time.monotonic())))


def _failure_reason(exc: BaseException) -> str:
    """What went wrong, without hivemind's prefix and Go's log timestamp ("" for a bare timeout)."""
    text = str(exc).strip()
    text = text.removeprefix("Daemon failed to start:").strip()
    text = re.sub(r"^\d{4}/\d\d/\d\d \d\d:\d\d:\d\d(\.\d+)? ", "", text)
    if not text and not isinstance(exc, TimeoutError):
        text = type(exc).__name__
    return text


def _reap_failed_start(dht: Any) -> None:
    """A node that failed to start exits by itself (after any bootstrap attempt in flight)."""
    dht.join(dht.shutdown_timeout)
    if dht.is_alive():
        logger.warning("DHT process %s did not exit after a failed start; stopping it", dht.pid)
        _terminate(dht)


def _terminate(dht: Any) -> None:
    """SIGTERM (the node's handler kills p2pd and removes its sockets), then SIGKILL."""
    dht.terminate()
    dht.join(5.0)
    if dht.is_alive():
        dht.kill()
        dht.join(5.0)


# -- the node process class -------------------------------------------------------------------
_NODE_CLASS: Any = None


def _node_class() -> Any:
    """``hivemind.DHT`` subclass that guards its process (built on first use: imports hivemind)."""
    global _NODE_CLASS
    if _NODE_CLASS is None:
        from hivemind import DHT  # deferred: imports torch

        class GuardedDHT(DHT):  # type: ignore[misc, valid-type]
            """A DHT node bound to its parent's lifetime, stopped without hard kills."""

            def start(self) -> None:
                self._mapl_main_thread = threading.current_thread() is threading.main_thread()
                super().start()

            def run(self) -> None:  # in the forked node process
                _guard_node_process(self._parent_pid, self._mapl_main_thread)
                try:
                    super().run()
                finally:
                    _release_p2pd()

            def shutdown(self) -> None:
                _shutdown(self)

        _NODE_CLASS = GuardedDHT
    return _NODE_CLASS


def _shutdown(dht: Any) -> None:
    """Ask the node to stop and wait for it; SIGTERM only after ``dht.shutdown_timeout``."""
    if not dht.is_alive():
        return
    with suppress(OSError, ValueError):  # the pipe is gone when the node already died
        dht._outer_pipe.send(("_shutdown", [], {}))
        dht._outer_pipe.close()
    dht.join(dht.shutdown_timeout)
    if dht.is_alive():
        logger.warning("DHT process %s did not stop within %g s; terminating it", dht.pid, dht.shutdown_timeout)
        _terminate(dht)


# -- inside the node process ------------------------------------------------------------------
_p2pd_processes: list[Any] = []
_p2pd_sockets: list[str] = []


def _guard_node_process(parent_pid: int, forked_on_main_thread: bool) -> None:
    """First thing in the forked node process: own process group, die with the parent, p2pd
    dies with this process (see the module docstring)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTTOU, signal.SIG_IGN)  # writing to a terminal from a background group
    signal.signal(signal.SIGTERM, _exit_now)  # replaces any handler inherited from the peer
    with suppress(OSError):
        os.setpgid(0, 0)
    if not (forked_on_main_thread and set_parent_death_signal(signal.SIGTERM, parent_pid=parent_pid)):
        watch_parent(parent_pid, lambda: os.kill(os.getpid(), signal.SIGTERM))
    asyncio.subprocess.create_subprocess_exec = _p2pd_dies_with_us(asyncio.subprocess.create_subprocess_exec)


def _p2pd_dies_with_us(create: Any) -> Any:
    """Wraps ``asyncio.subprocess.create_subprocess_exec`` (what hivemind spawns p2pd with) so
    p2pd gets SIGKILL when this process ends, and records its pid and unix sockets."""

    async def create_subprocess_exec(program: Any, *args: Any, **kwargs: Any) -> Any:
        if os.path.basename(str(program)) != "p2pd":
            return await create(program, *args, **kwargs)
        kwargs.setdefault("stdin", asyncio.subprocess.DEVNULL)
        kwargs["preexec_fn"] = die_with_parent(signal.SIGKILL)
        for arg in map(str, args):  # -listen=/unix/tmp/hivemind-p2pd-UID.sock; the client's is p2pclient-UID
            if arg.startswith("-listen=/unix/"):
                path = arg.removeprefix("-listen=/unix")
                _p2pd_sockets.extend([path, path.replace("-p2pd-", "-p2pclient-")])
        process = await create(program, *args, **kwargs)
        _p2pd_processes.append(process)
        return process

    return create_subprocess_exec


def _release_p2pd() -> None:
    """Kill this process's p2pd daemons that still run and remove their unix sockets."""
    for process in _p2pd_processes:
        if process.returncode is None:  # not reaped yet, so its pid is still its own
            with suppress(OSError):
                os.kill(process.pid, signal.SIGKILL)
    for path in _p2pd_sockets:
        with suppress(OSError):
            os.unlink(path)


def _exit_now(signum: int = signal.SIGTERM, _frame: Any = None) -> None:
    """SIGTERM in the node process (its parent died, or it was stopped the hard way)."""
    _release_p2pd()
    os._exit(128 + signum)
