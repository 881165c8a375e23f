"""launch: each peer gets its own port from a base port, and taken or clashing ports fail before anything starts."""

from __future__ import annotations

import socket

import pytest

from mapl_swarm.config import config_from_dict
from mapl_swarm.errors import ConfigError, MaplError
from mapl_swarm.launch import check_ports, peer_ports, peer_processes


def _cfg(**net):
    return config_from_dict({"pipeline": {"num_stages": 3}, "net": net})


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_each_peer_gets_its_own_ports_from_a_base():
    assert peer_ports(0, 3) == [0, 0, 0]
    assert peer_ports(7000, 3) == [7000, 7001, 7002]
    assert peer_ports(9000, 3, offset=1) == [9001, 9002, 9003]
    procs = peer_processes(3, ["--config", "x.toml", "--set", "net.port=7000"], maddr="/ip4/1/tcp/2/p2p/Q",
                           threads=1, progress=False, gpus=[None] * 3, environ={}, member_args=[[]] * 3,
                           net_port=7000, dht_port=9000)
    for s, p in enumerate(procs):
        # the peer's own settings come after the shared ones, so they win
        assert p.cmd.index(f"net.port={7000 + s}") > p.cmd.index("net.port=7000") if s else True
        assert f"net.dht_port={9001 + s}" in p.cmd and p.cmd.count("--set") == 4
    plain = peer_processes(2, [], maddr="m", threads=1, progress=False, gpus=[None] * 2, environ={}, member_args=[[]] * 2)
    assert not any("net.port=" in a or "net.dht_port=" in a for p in plain for a in p.cmd)


def test_taken_and_clashing_ports_are_refused_at_once():
    check_ports(_cfg())  # OS-chosen ports: nothing to check
    base = _free_port()
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", base + 1 if base < 65000 else base - 10))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(MaplError, match=str(port)):
            check_ports(_cfg(port=port - 1, bind_host="127.0.0.1"))
    with pytest.raises(ConfigError, match="overlapping ports"):
        check_ports(_cfg(port=7000, dht_port=7001))
    # every replica is a peer with ports of its own: 5 peers reach 7004, past a metrics base of 7004
    with pytest.raises(ConfigError, match=r"overlapping ports \[7004\]: its 5 peers"):
        check_ports(config_from_dict({"pipeline": {"num_stages": 3}, "net": {"port": 7000},
                                      "replicas": {"enabled": True, "initial": [1, 2, 2]},
                                      "metrics": {"prometheus_port": 7004}}))
