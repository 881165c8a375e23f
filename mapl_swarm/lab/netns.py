"""Network-namespace lab: the compose topology on real, kernel-shaped links.

Each host (``dht``, ``stage0`` ... ``stage{P-1}``) gets its own Linux network namespace joined to
a bridge in the root namespace by a veth pair. With ``rate_mbit`` set, both ends of every veth get
a ``tbf`` qdisc, so everything a host sends *and* receives is shaped by the kernel (checked by
tests/netns). ``netem`` is usually missing on these machines, so delay comes from
the app-level emulator (``net.latency_ms``). Needs root and iproute2; every command is checked and
the lab tears itself down on exit, even after a failure.

Addresses: ``10.<subnet>.0.1`` is the bridge, host i is ``10.<subnet>.0.(10 + i)``; these are the
lab's own hosts, inside namespaces this process created.

Hosts behind NAT (``nat``): such a host's namespace has no interface on the bridge. It sits at
``10.<subnet>.(1 + i).2`` behind a router namespace of its own, which holds the host's bridge address
(and so its shaped uplink) and ``10.<subnet>.(1 + i).1``, forwards and masquerades what the host
sends (iptables ``MASQUERADE``), lets in only the replies of connections the host opened (conntrack
``ESTABLISHED,RELATED``) and drops every new inbound connection, to itself or the host: a home
router without port forwarding. :meth:`NetnsLab.address` is then the address the host binds
(private), :meth:`NetnsLab.public_address` the one the others see. Needs iptables.

Beside a Docker engine: dockerd sets the iptables FORWARD policy to DROP and turns on
``bridge-nf-call-iptables``, so frames crossing any bridge it does not own are dropped, and that
kernel state outlives dockerd. The lab therefore inserts one FORWARD accept rule for traffic within
its own bridge (tagged with a comment naming the bridge) and deletes it again on teardown; it touches
no other rule, policy or sysctl.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
from collections.abc import Iterable
from dataclasses import dataclass

from mapl_swarm.errors import MaplError

log = logging.getLogger(__name__)

__all__ = ["NetnsLab", "LabError", "nat_available", "netns_available"]


class LabError(MaplError):
    """The namespace lab could not be set up (not root, no iproute2, a command failed)."""


def nat_available() -> tuple[bool, str]:
    """Whether the lab can put hosts behind NAT here (namespaces and iptables), and if not, why."""
    ok, why = netns_available()
    if not ok:
        return ok, why
    if shutil.which("iptables") is None:
        return False, "iptables not installed (apt-get install iptables)"
    return True, ""


def netns_available() -> tuple[bool, str]:
    """Whether namespaces, veth and tbf can be used here, and if not, why."""
    if os.geteuid() != 0:
        return False, "needs root"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return False, f"{tool} (iproute2) not installed"
    probe = f"mapl-probe-{os.getpid()}"
    try:
        _run(["ip", "netns", "add", probe])
        _run(["ip", "netns", "del", probe])
    except LabError as exc:
        return False, f"cannot create network namespaces: {exc}"
    return True, ""


def _run(cmd: list[str]) -> str:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    if proc.returncode != 0:
        raise LabError(f"`{' '.join(cmd)}` failed: {proc.stderr.strip() or proc.stdout.strip()}")
    return proc.stdout


def _forward_policy() -> str:
    """The iptables FORWARD chain's policy (``ACCEPT``, ``DROP``), or ``unknown``."""
    proc = subprocess.run(["iptables", "-w", "5", "-S", "FORWARD"], capture_output=True, text=True, timeout=30)
    for line in proc.stdout.splitlines():
        if line.startswith("-P FORWARD "):
            return line.split()[2]
    return "unknown"


@dataclass(frozen=True)
class LabHost:
    name: str
    namespace: str
    """Where the host's processes run."""
    address: str
    """Its address on the bridge: its own, or its NAT router's."""
    veth_root: str
    veth_ns: str
    """The bridge link's end in the host's namespace, or in its NAT router's."""
    nat: "NatRouter | None" = None


@dataclass(frozen=True)
class NatRouter:
    """The router namespace in front of a host behind NAT, and the private link between them."""

    namespace: str
    inside: str
    """The router's address on the private link (the host's default route)."""
    host_address: str
    """The host's own, private address."""
    veth_router: str
    veth_host: str


class NetnsLab:
    """``with NetnsLab(["dht", "stage0", "stage1"], rate_mbit=20) as lab: lab.popen("stage0", cmd)``."""

    def __init__(self, hosts: list[str], *, rate_mbit: float = 0.0, subnet: int = 77, tag: str = "",
                 nat: Iterable[str] = ()) -> None:
        if not 1 <= subnet <= 254:
            raise LabError(f"subnet must be in 1..254, got {subnet}")
        nat = set(nat)
        if not nat <= set(hosts):
            raise LabError(f"hosts to put behind NAT are not lab hosts: {sorted(nat - set(hosts))}")
        if nat and shutil.which("iptables") is None:
            raise LabError("hosts behind NAT need iptables (apt-get install iptables)")
        self.tag = tag or f"m{os.getpid() % 100000}"
        self.rate_mbit = rate_mbit
        self.bridge = f"mbr{self.tag}"[:15]
        self.gateway = f"10.{subnet}.0.1"
        self.hosts = {}
        for i, name in enumerate(hosts):
            namespace = f"mapl-{self.tag}-{name}"
            router = NatRouter(f"{namespace}-nat", f"10.{subnet}.{1 + i}.1", f"10.{subnet}.{1 + i}.2",
                               f"mv{self.tag}{i}a"[:15], f"mv{self.tag}{i}b"[:15]) if name in nat else None
            self.hosts[name] = LabHost(name, namespace, f"10.{subnet}.0.{10 + i}", f"mv{self.tag}{i}r"[:15],
                                       f"mv{self.tag}{i}n"[:15], router)
        self._up = False
        self._forward_rule: list[str] | None = None

    def up(self) -> "NetnsLab":
        try:
            _run(["ip", "link", "add", self.bridge, "type", "bridge"])
            _run(["ip", "addr", "add", f"{self.gateway}/24", "dev", self.bridge])
            _run(["ip", "link", "set", self.bridge, "up"])
            self._up = True
            self._allow_forwarding()
            for h in self.hosts.values():
                _run(["ip", "netns", "add", h.namespace])
                outer = h.namespace if h.nat is None else h.nat.namespace  # where the bridge link ends
                if h.nat is not None:
                    _run(["ip", "netns", "add", outer])
                _run(["ip", "link", "add", h.veth_root, "type", "veth", "peer", "name", h.veth_ns])
                _run(["ip", "link", "set", h.veth_ns, "netns", outer])
                _run(["ip", "link", "set", h.veth_root, "master", self.bridge])
                _run(["ip", "link", "set", h.veth_root, "up"])
                _run(["ip", "-n", outer, "addr", "add", f"{h.address}/24", "dev", h.veth_ns])
                _run(["ip", "-n", outer, "link", "set", h.veth_ns, "up"])
                _run(["ip", "-n", h.namespace, "link", "set", "lo", "up"])
                if self.rate_mbit > 0:
                    self._shape(["tc"], h.veth_root)  # towards the host
                    self._shape(["ip", "netns", "exec", outer, "tc"], h.veth_ns)  # from the host
                if h.nat is not None:
                    self._nat(h, h.nat)
            log.info("netns lab up: %s", ", ".join(f"{h.name}={h.address}" for h in self.hosts.values()))
        except BaseException:
            self.down()
            raise
        return self

    def _shape(self, tc: list[str], dev: str) -> None:
        # burst: at least one MTU-sized packet per timer tick; 400 ms of queue.
        burst_bytes = max(16 * 1024, int(self.rate_mbit * 1e6 / 8 / 250))
        _run(tc + ["qdisc", "add", "dev", dev, "root", "tbf", "rate", f"{self.rate_mbit}mbit",
                   "burst", str(burst_bytes), "latency", "400ms"])

    def _nat(self, h: LabHost, r: NatRouter) -> None:
        """The host's private link to its router, and the router's masquerade and inbound drop."""
        _run(["ip", "link", "add", r.veth_router, "type", "veth", "peer", "name", r.veth_host])
        _run(["ip", "link", "set", r.veth_router, "netns", r.namespace])
        _run(["ip", "link", "set", r.veth_host, "netns", h.namespace])
        _run(["ip", "-n", r.namespace, "addr", "add", f"{r.inside}/24", "dev", r.veth_router])
        _run(["ip", "-n", r.namespace, "link", "set", r.veth_router, "up"])
        _run(["ip", "-n", r.namespace, "link", "set", "lo", "up"])
        _run(["ip", "-n", h.namespace, "addr", "add", f"{r.host_address}/24", "dev", r.veth_host])
        _run(["ip", "-n", h.namespace, "link", "set", r.veth_host, "up"])
        _run(["ip", "-n", h.namespace, "route", "add", "default", "via", r.inside])
        _run(["ip", "netns", "exec", r.namespace, "sysctl", "-q", "-w", "net.ipv4.ip_forward=1"])
        iptables = ["ip", "netns", "exec", r.namespace, "iptables", "-w", "5"]
        _run(iptables + ["-t", "nat", "-A", "POSTROUTING", "-o", h.veth_ns, "-j", "MASQUERADE"])
        for chain in ("FORWARD", "INPUT"):  # replies in; every new connection from outside dropped
            _run(iptables + ["-A", chain, "-i", h.veth_ns, "-m", "conntrack", "--ctstate", "ESTABLISHED,RELATED",
                             "-j", "ACCEPT"])
            _run(iptables + ["-A", chain, "-i", h.veth_ns, "-j", "DROP"])

    def _allow_forwarding(self) -> None:
        """Accept forwarding within the lab's bridge in iptables' FORWARD chain (see the module note)."""
        if shutil.which("iptables") is None:
            log.debug("no iptables here: the lab's bridge needs no FORWARD rule")
            return
        rule = ["FORWARD", "-i", self.bridge, "-o", self.bridge,
                "-m", "comment", "--comment", f"mapl_swarm lab {self.bridge}", "-j", "ACCEPT"]
        _run(["iptables", "-w", "5", "-I", *rule])
        self._forward_rule = rule
        policy = _forward_policy()
        if policy != "ACCEPT":
            log.info("iptables FORWARD policy is %s (as a Docker engine sets it): the lab accepts forwarding within "
                     "its bridge %s by one rule, removed at exit", policy, self.bridge)

    def down(self) -> None:
        if self._forward_rule is not None:
            subprocess.run(["iptables", "-w", "5", "-D", *self._forward_rule], capture_output=True, timeout=30)
            self._forward_rule = None
        for h in self.hosts.values():
            subprocess.run(["ip", "netns", "del", h.namespace], capture_output=True, timeout=30)
            if h.nat is not None:
                subprocess.run(["ip", "netns", "del", h.nat.namespace], capture_output=True, timeout=30)
            subprocess.run(["ip", "link", "del", h.veth_root], capture_output=True, timeout=30)
        if self._up:
            subprocess.run(["ip", "link", "del", self.bridge], capture_output=True, timeout=30)
            self._up = False

    def address(self, host: str) -> str:
        """The address ``host`` binds: its bridge address, or behind NAT its private one."""
        h = self.hosts[host]
        return h.address if h.nat is None else h.nat.host_address

    def public_address(self, host: str) -> str:
        """The address the other hosts see ``host``'s connections come from (its NAT router's)."""
        return self.hosts[host].address

    def behind_nat(self, host: str) -> bool:
        return self.hosts[host].nat is not None

    def command(self, host: str, cmd: list[str]) -> list[str]:
        """``cmd`` wrapped to run inside ``host``'s namespace."""
        return ["ip", "netns", "exec", self.hosts[host].namespace, *cmd]

    def popen(self, host: str, cmd: list[str], **kwargs) -> subprocess.Popen:
        return subprocess.Popen(self.command(host, cmd), **kwargs)

    def __enter__(self) -> "NetnsLab":
        return self.up()

    def __exit__(self, *exc: object) -> None:
        self.down()
