"""``mapl-swarm doctor``: why this host's peer would not meet its swarm, checked before it starts.

One line per check, with its fix. On this host: the peer key file (present, well formed, mode
0600), the certificate (of this run, the stage, this key; not revoked; not expiring within a day),
the ports the peer will listen on (``net.port``, ``net.dht_port``, ``metrics.prometheus_port``)
and the address it will advertise (not a wildcard; not a loopback or private address announced to
a swarm whose bootstrap is elsewhere or public). Against the swarm (``--initial-peer``): each
bootstrap node answers on its TCP port; this host joins the DHT; the live peers' config records
(SPEC §9.1) carry this host's protocol major version and config fingerprint, and where they do not,
the settings that differ are named; this host's clock agrees with the peers' records; and a live
peer, asked for a dial-back (SPEC §9.11), reaches the contact this host's peer would advertise,
bound where it would listen (``net.bind_host``, ``net.port``).

The outcome of a check is ``ok``, ``FAIL`` (exit status 1) or ``skip`` (could not be checked:
nothing to check it against, or an earlier check failed).
"""

from __future__ import annotations

import ipaddress
import logging
import socket
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from mapl_swarm.errors import MaplError

__all__ = ["Check", "local_checks", "swarm_checks", "CERT_WARN_S", "CLOCK_SKEW_S"]

log = logging.getLogger(__name__)

CERT_WARN_S = 86400.0
"""A certificate that expires within this many seconds is flagged."""
CLOCK_SKEW_S = 5.0
"""A clock further than this from the swarm's is flagged (certificates and records carry times)."""
_WILDCARDS = ("", "0.0.0.0", "::", "*")


@dataclass(frozen=True)
class Check:
    """One check's outcome: ``ok`` True, False (a failure) or None (skipped)."""

    name: str
    ok: bool | None
    detail: str
    fix: str = ""

    def line(self) -> str:
        mark = {True: "ok  ", False: "FAIL", None: "skip"}[self.ok]
        return f"{mark} {self.name}: {self.detail}" + (f"; fix: {self.fix}" if self.fix and self.ok is False else "")


def _key_check(peer_key: str | None) -> tuple[Check, Any]:
    from mapl_swarm.net.identity import load_peer_key

    if not peer_key:
        return Check("peer key", None, "no --peer-key given (an insecure peer has none)"), None
    try:
        key = load_peer_key(peer_key)
    except MaplError as exc:  # a mode too open names its chmod itself
        return Check("peer key", False, str(exc), "" if "chmod" in str(exc) else f"mapl-swarm keys peer --out "
                                                                                  f"{peer_key}"), None
    return Check("peer key", True, f"{peer_key}: well formed, mode 0600, key {key.key_id}"), key


def _cert_check(cfg: Any, peer_key: str | None, key: Any, cert: str | None, stage: int | None,
                revocations: str | None, now: float) -> Check:
    from mapl_swarm.net.identity import load_identity

    if not cert:
        return Check("certificate", None, "no --cert given")
    if key is None:
        return Check("certificate", None, f"{cert}: not checked without a usable --peer-key")
    try:
        identity = load_identity(peer_key, cert, run_id=cfg.run.run_id, stage=stage, revocations=revocations)
    except MaplError as exc:
        return Check("certificate", False, str(exc),
                     "ask the run's authority for a certificate of this run and stage for this key "
                     "(mapl-swarm keys request / keys issue)")
    left = identity.body.not_after - now
    stages = ",".join(map(str, identity.body.stages)) or "any"
    if left < CERT_WARN_S:
        return Check("certificate", False, f"{cert} expires in {left / 3600:.1f} h",
                     "ask the run's authority for a new certificate before it lapses (keys request / keys issue)")
    return Check("certificate", True, f"{cert}: run {cfg.run.run_id!r}, stage(s) {stages}, this key, "
                                      f"{'not revoked, ' if revocations else ''}valid {left / 86400:.1f} more days")


def _port_checks(cfg: Any) -> list[Check]:
    from mapl_swarm.errors import ConfigError
    from mapl_swarm.net.dht_node import check_listen_address

    wanted = [("net.port", cfg.net.bind_host, cfg.net.port, "peer"),
              ("net.dht_port", cfg.net.dht_host, cfg.net.dht_port, "DHT"),
              ("metrics.prometheus_port", cfg.metrics.prometheus_host, cfg.metrics.prometheus_port or 0, "metrics")]
    out = []
    for name, host, port, what in wanted:
        if not port:
            out.append(Check(name, None, "0: the system picks a free port at start"))
            continue
        try:
            check_listen_address(host, port, what)
        except (MaplError, ConfigError) as exc:
            out.append(Check(name, False, str(exc), f"stop what listens on {host}:{port} (ss -ltnp) or set "
                                                   f"{name} to another port"))
            continue
        out.append(Check(name, True, f"{host}:{port} is free"))
    return out


def _ip_of(maddr: str) -> tuple[str, int] | None:
    parts = maddr.split("/")
    try:
        return parts[2], int(parts[parts.index("tcp") + 1])
    except (ValueError, IndexError):
        return None


def _address_check(cfg: Any, initial_peers: Sequence[str]) -> Check:
    host = cfg.net.advertise_host or cfg.net.bind_host
    if host in _WILDCARDS:
        return Check("advertised address", False,
                     f"net.bind_host {cfg.net.bind_host!r} without net.advertise_host: the peer would advertise "
                     "whatever this host's name resolves to", "set net.advertise_host to the address other hosts dial")
    try:
        mine = ipaddress.ip_address(socket.gethostbyname(host))
    except (OSError, ValueError):
        return Check("advertised address", False, f"{host!r} does not resolve", "set net.advertise_host to an IP")
    swarm = []
    for maddr in initial_peers:
        got = _ip_of(maddr)
        try:
            swarm.append(ipaddress.ip_address(socket.gethostbyname(got[0])) if got else None)
        except (OSError, ValueError):
            continue
    remote = [ip for ip in swarm if ip is not None and not ip.is_loopback]
    if mine.is_loopback and remote:
        return Check("advertised address", False, f"{host} is this host's loopback, but the swarm's bootstrap is at "
                                                  f"{remote[0]}: no other host can dial it",
                     "set net.bind_host / net.advertise_host to an address the other hosts reach")
    if mine.is_private and any(ip.is_global for ip in remote):
        return Check("advertised address", False, f"{host} is a private address announced to a swarm on the public "
                                                  f"internet ({next(ip for ip in remote if ip.is_global)})",
                     "advertise this host's public address (net.advertise_host) and forward the port, or serve "
                     "from a host with one")
    return Check("advertised address", True, f"{host} (whether the swarm reaches it: the dial-back, `reachable`)")


def local_checks(cfg: Any, *, peer_key: str | None, cert: str | None, stage: int | None,
                 revocations: str | None, initial_peers: Sequence[str], now: float | None = None) -> list[Check]:
    """The checks of this host alone (no network)."""
    now = time.time() if now is None else now
    key_check, key = _key_check(peer_key)
    return [key_check, _cert_check(cfg, peer_key, key, cert, stage, revocations, now), *_port_checks(cfg),
            _address_check(cfg, initial_peers)]


def _bootstrap_checks(initial_peers: Sequence[str], timeout_s: float) -> list[Check]:
    out = []
    for maddr in initial_peers:
        got = _ip_of(maddr)
        if got is None:
            out.append(Check("bootstrap", False, f"{maddr}: not a /ip4|ip6|dns/HOST/tcp/PORT/p2p/ID multiaddr",
                             "copy the multiaddr `mapl-swarm dht` printed"))
            continue
        host, port = got
        try:
            with socket.create_connection((host, port), timeout=timeout_s):
                pass
        except OSError as exc:
            why = "timed out" if isinstance(exc, TimeoutError) else (exc.strerror or str(exc))
            out.append(Check("bootstrap", False, f"{host}:{port} unreachable ({why})",
                             f"start `mapl-swarm dht` there, or open TCP port {port} on its firewall"))
            continue
        out.append(Check("bootstrap", True, f"{host}:{port} answers"))
    return out


def _config_checks(configs: dict[int, dict[str, dict[str, Any]]], *, fingerprint: str,
                   summary: dict[str, Any]) -> list[Check]:
    from mapl_swarm.peer.link import config_differences
    from mapl_swarm.peer.main import config_record

    mine = config_record(fingerprint, summary)
    records = [(s, peer, rec) for s, by_peer in sorted(configs.items()) for peer, rec in sorted(by_peer.items())]
    if not records:
        return [Check("protocol", None, "no live peer published a config record (no swarm yet, or peers older than "
                                        "this version)"),
                Check("config", None, "nothing to compare with")]
    out = []
    major = mine["protocol"].split(".")[0]
    wrong = [(s, rec.get("protocol", "?")) for s, _, rec in records
             if str(rec.get("protocol", "")).split(".")[0] != major]
    if wrong:
        out.append(Check("protocol", False, f"this host speaks {mine['protocol']}, stage {wrong[0][0]} "
                                            f"{wrong[0][1]}", "run the same major version of mapl-swarm on every host"))
    else:
        out.append(Check("protocol", True, f"{mine['protocol']}; the swarm's: "
                                           f"{', '.join(sorted({str(r.get('protocol')) for _, _, r in records}))}"))
    other = next(((s, rec) for s, _, rec in records if rec.get("fingerprint") != fingerprint), None)
    if other is None:
        out.append(Check("config", True, f"fingerprint {fingerprint} equals every live peer's ({len(records)})"))
    else:
        s, rec = other
        differ = [d.replace("stage -1 ", "this host ")  # config_differences names this host as stage -1
                  for d in config_differences(summary, rec.get("config", {}), s, -1)]
        shown = ", ".join(differ) if differ else \
            f"fingerprint {rec.get('fingerprint')} against this host's {fingerprint}"
        out.append(Check("config", False, f"differs from stage {s}'s: {shown}",
                         "use the swarm's config file (peers/*.toml) and --set only host-local settings"))
    return out


def _clock_check(peers: Sequence[Any], status_s: float) -> Check:
    ages = sorted(p.clock_age_s for p in peers if p.clock_age_s is not None)
    if not ages:
        return Check("clock", None, "no live peer's status record to compare with")
    # a live peer stores one every status_s by its own clock; the median, so that one peer with
    # another record lifetime (or clock) does not decide
    age = ages[len(ages) // 2]
    if age < -CLOCK_SKEW_S:
        return Check("clock", False, f"this host's clock is about {-age:.0f} s behind the swarm's",
                     "run NTP (timedatectl set-ntp true / chrony)")
    if age > 4 * status_s + CLOCK_SKEW_S:
        return Check("clock", False, f"the peers' records look {age:.0f} s old: this host's clock is ahead of "
                                     "the swarm's (or the peers stopped)",
                     "run NTP (timedatectl set-ntp true / chrony)")
    return Check("clock", True, f"within {CLOCK_SKEW_S:.0f} s of the swarm's (median record {max(age, 0):.1f} s "
                                "old)")


def dial_back_check(cfg: Any, identity: Any, stage: int | None, staged: Sequence[tuple[int, Any]],
                    status_s: float, wait_s: float = 10.0) -> Check:
    """``reachable``: live peers dial this host back (:func:`~mapl_swarm.peer.dialback.reachability`)."""
    from mapl_swarm.peer.dialback import reachability

    found = reachability(cfg, identity, stage, staged, status_s, wait_s)
    return Check("reachable", found.ok, found.detail, found.fix)


def swarm_checks(cfg: Any, *, initial_peers: Sequence[str], membership: Any,
                 settings: Callable[[], tuple[str, dict[str, Any]]], stage: int | None = None,
                 timeout_s: float = 5.0) -> list[Check]:
    """The checks against the swarm: its bootstrap nodes, the DHT, the live peers' config records
    (against ``settings()``: this host's config fingerprint and summary, asked for only once the
    DHT answers), clocks, and a dial-back of the contact this host's peer would advertise (with a
    certified ``membership``: a peer identity)."""
    from mapl_swarm.net.discovery import Discovery, DiscoveryConfig, DiscoveryError

    if not initial_peers:
        return [Check("bootstrap", None, "no --initial-peer given: the swarm is not checked")]
    out = _bootstrap_checks(initial_peers, timeout_s)
    if not any(c.ok for c in out):
        return out + [Check("swarm", None, "not checked: no bootstrap node answers")]
    dht = DiscoveryConfig(initial_peers=tuple(initial_peers), client_mode=True)
    try:
        with Discovery(cfg.run.run_id, dht, membership=membership) as discovery:
            P = cfg.pipeline.num_stages
            configs = {s: discovery.stage_configs(s) for s in range(P)}
            staged = [(s, p) for s in range(P) for p in discovery.stage_peers(s)]
    except (DiscoveryError, MaplError) as exc:
        return out + [Check("DHT", False, f"cannot join the swarm's DHT: {exc}",
                            "check the multiaddr's peer id and that the node runs this run's authority")]
    out.append(Check("DHT", True, f"joined; {len(staged)} peer record(s) of run {cfg.run.run_id!r}"))
    fingerprint, summary = settings()
    identity = membership if hasattr(membership, "encoded_cert") else None
    return out + _config_checks(configs, fingerprint=fingerprint, summary=summary) + \
        [_clock_check([p for _, p in staged], dht.status_s),
         dial_back_check(cfg, identity, stage, staged, dht.status_s)]
