"""``mapl-swarm doctor`` on this host: each mistake an operator makes is one FAIL line naming it and
its fix, and exit status 1; a host without them passes. (Against a live swarm's DHT: the config
check, in tests/integration/test_dht_certified.py.)"""

from __future__ import annotations

import os
import socket

import pytest

from mapl_swarm.cli import main
from mapl_swarm.net.identity import issue_local

RUN = "doctor-run"


@pytest.fixture
def ids(tmp_path):
    return issue_local(tmp_path / "ids", run_id=RUN, num_stages=2)


def doctor(capsys, *args: str) -> tuple[int, list[str]]:
    code = main(["doctor", "--set", f'run.run_id="{RUN}"', "--set", "pipeline.num_stages=2", *args])
    out = capsys.readouterr()
    return code, out.out.splitlines()


def failed(lines: list[str]) -> list[str]:
    return [line for line in lines if line.startswith("FAIL")]


def test_a_host_without_mistakes_passes(capsys, ids):
    code, lines = doctor(capsys, "--stage", "1", "--peer-key", str(ids.key_file(1)), "--cert", str(ids.cert_file(1)))
    assert code == 0 and not failed(lines), lines
    assert any(line.startswith("ok   certificate:") and f"run '{RUN}'" in line for line in lines)
    assert any(line.startswith("ok   peer key:") for line in lines)


def test_a_world_readable_key_file_is_flagged(capsys, ids):
    os.chmod(ids.key_file(0), 0o644)
    code, lines = doctor(capsys, "--stage", "0", "--peer-key", str(ids.key_file(0)), "--cert", str(ids.cert_file(0)))
    assert code == 1 and len(failed(lines)) == 1, lines
    assert "readable by others (mode 0644)" in failed(lines)[0] and "chmod 600" in failed(lines)[0]


def test_a_certificate_of_another_run_is_flagged(capsys, tmp_path, ids):
    other = issue_local(tmp_path / "other", run_id="another-run", num_stages=2)
    code, lines = doctor(capsys, "--peer-key", str(other.key_file(0)), "--cert", str(other.cert_file(0)))
    assert code == 1 and len(failed(lines)) == 1, lines
    assert failed(lines)[0].startswith("FAIL certificate:") and "another-run" in failed(lines)[0]


def test_a_certificate_for_another_stage_is_flagged(capsys, ids):
    code, lines = doctor(capsys, "--stage", "0", "--peer-key", str(ids.key_file(1)), "--cert", str(ids.cert_file(1)))
    assert code == 1 and [line.split(":")[0] for line in failed(lines)] == ["FAIL certificate"], lines


def test_a_port_in_use_is_flagged(capsys):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        code, lines = doctor(capsys, "--set", f"net.port={port}")
    assert code == 1 and len(failed(lines)) == 1, lines
    assert failed(lines)[0].startswith(f"FAIL net.port: peer port {port} on 127.0.0.1 is already in use")


def test_an_unreachable_bootstrap_node_is_flagged(capsys):
    with socket.socket() as closed:  # a port nothing listens on: bound, never listening
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
        code, lines = doctor(capsys, "--initial-peer",
                             f"/ip4/127.0.0.1/tcp/{port}/p2p/QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N")
    assert code == 1 and len(failed(lines)) == 1, lines
    assert failed(lines)[0].startswith(f"FAIL bootstrap: 127.0.0.1:{port} unreachable") and "mapl-swarm dht" in \
        failed(lines)[0]
    assert lines[-1].startswith("skip swarm: not checked")


def test_a_loopback_address_advertised_to_a_remote_swarm_is_flagged(capsys):
    remote = "/ip4/192.0.2.1/tcp/9/p2p/QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N"
    code, lines = doctor(capsys, "--initial-peer", remote)
    assert code == 1
    assert any(line.startswith("FAIL advertised address: 127.0.0.1 is this host's loopback") for line in lines), lines


def test_a_clock_behind_or_ahead_of_the_peers_records_is_flagged():
    """The median age of the live peers' status records (they store one every 2 s) by this host's
    clock: in the future, this host is behind; far in the past, ahead (or every peer stopped)."""
    from types import SimpleNamespace

    from mapl_swarm.doctor import _clock_check

    def peers(*ages):
        return [SimpleNamespace(clock_age_s=a) for a in ages]

    assert _clock_check(peers(0.4, 1.9, -570.0), 2.0).ok is True  # one peer's other record lifetime: outvoted
    behind = _clock_check(peers(-61.0, -60.2, 1.0), 2.0)
    assert behind.ok is False and "about 60 s behind" in behind.line() and "NTP" in behind.line()
    ahead = _clock_check(peers(95.0, 96.5), 2.0)
    assert ahead.ok is False and "ahead of the swarm's" in ahead.line()
    assert _clock_check(peers(), 2.0).ok is None
