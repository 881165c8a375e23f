"""Certified discovery records on real hivemind DHT nodes (SPEC §7).

A bootstrap node that trusts the run's authority (``run_bootstrap_node(membership=TrustedAuthority)``,
as ``mapl-swarm dht --cert`` runs it), an honest stage-1 peer, a member certified for stage 2 that
also announces stage 1 (a relay's record: the far-expiry attack of the issue, within the bound a
certified node allows) and an outsider's unsigned record for stage 1 that expires later. A
reader certified for stage 0 sees only the honest records; once the authority revokes the member,
a reader holding the revocation list reads its records as withdrawn. One set of nodes for every check (a DHT
start is slow), all started from the main thread before any lookup thread or event loop exists.
"""

from __future__ import annotations

import functools
import json
import subprocess
import sys
import threading
from typing import Any

import pytest

import mapl_swarm.net.discovery as discovery_module
from mapl_swarm.net.discovery import Discovery, DiscoveryConfig, TrustedAuthority, run_bootstrap_node, stage_key
from mapl_swarm.net.identity import issue_local, load_identity, revoke, write_signed
from mapl_swarm.net.transport import contact

from deadlines import wait_until

pytestmark = pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated:DeprecationWarning")

RUN = "run-certified"


async def stored_subkeys(key: str, _dht: Any, node: Any) -> dict[str, bytes]:
    """Runs inside a DHT process: the subkeys (and raw values) that node stores under ``key``."""
    from hivemind.dht.routing import DHTID

    item = node.protocol.storage.get(DHTID.generate(source=key))
    if item is None:
        return {}
    return {str(sub): bytes(entry.value) for sub, entry in item.value.items()}


def config(maddrs: list[str], **kwargs: float) -> DiscoveryConfig:
    return DiscoveryConfig(initial_peers=tuple(maddrs), host="127.0.0.1", poll_s=0.1, **kwargs)


def with_bootstrap(monkeypatch: pytest.MonkeyPatch, membership: Any, scenario: Any) -> None:
    """Run ``scenario(bootstrap_dht, maddrs)`` inside a bootstrap node of ``membership`` (as
    ``mapl-swarm dht`` runs it), started from the main thread."""
    started: list[Any] = []
    start_dht = discovery_module.start_dht

    def recording_start_dht(**kwargs: Any) -> Any:
        dht = start_dht(**kwargs)
        started.append(dht)
        return dht

    monkeypatch.setattr(discovery_module, "start_dht", recording_start_dht)
    stop = threading.Event()

    def ready(maddrs: list[str]) -> None:
        try:
            scenario(started[0], maddrs)
        finally:
            stop.set()

    run_bootstrap_node("127.0.0.1", 0, membership=membership, ready=ready, stop=stop)
    assert stop.is_set()



def scenario(bootstrap_dht: Any, maddrs: list[str], ids: list, local: Any, lists: Any) -> None:
    """``ids[0]`` (the reader) was loaded with the revocation list ``lists``."""
    late = dict(ttl_s=600.0, refresh_s=300.0)  # the longest a certified record may live
    honest = contact("tcp://10.0.0.1:5001", ids[1].key.curve_public)
    relay = contact("tcp://10.0.0.9:5001", ids[2].key.curve_public)
    with Discovery(RUN, config(maddrs), membership=ids[1]) as stage1, \
            Discovery(RUN, config(maddrs, **late), membership=ids[2]) as member, \
            Discovery(RUN, config(maddrs, **late)) as outsider, \
            Discovery(RUN, config(maddrs), membership=ids[0]) as reader, \
            Discovery(RUN, config(maddrs), membership=load_identity(  # a second replica of stage 1
                local.key_file(1, 1), local.cert_file(1, 1), run_id=RUN, stage=1)) as replica:  # ids[0]: the list
        stage1.announce(1, honest)
        member.announce(2, contact("tcp://10.0.0.9:5002", ids[2].key.curve_public))
        member.announce(1, relay, subkey="relay")
        outsider.announce(1, "tcp://6.6.6.6:1", subkey="stage1.evil")
        outsider.announce(0, "tcp://6.6.6.6:0", subkey="stage0.evil")
        assert outsider.lookup_all(0, timeout_s=5) == ["tcp://6.6.6.6:0"]  # the forgeries exist on its node

        assert reader.lookup_all(1, timeout_s=10) == [honest]
        assert reader.lookup_all(2, timeout_s=10) == [contact("tcp://10.0.0.9:5002", ids[2].key.curve_public)]
        assert member.lookup_all(1, timeout_s=5) == [honest]  # not even its own node keeps the relay record
        # each record goes to the 5 nodes nearest its key (hivemind's num_replicas) of these 6, so
        # which certified node holds it varies; together they hold the honest record and nothing else
        certified_nodes = [bootstrap_dht] + [d._dht for d in (stage1, member, reader, replica)]
        held = [set(node.run_coroutine(functools.partial(stored_subkeys, stage_key(RUN, 1))))
                for node in certified_nodes]
        assert set().union(*held) == {stage1.peer_id}, held
        with pytest.raises(discovery_module.DiscoveryTimeoutError, match="stage 0"):
            reader.lookup_all(0, timeout_s=1)
        check_status_records(maddrs, stage1, member, outsider, reader, local, replica)
        check_doctor(maddrs, stage1, reader, local)

        # the authority revokes the member: the node of a peer holding the list re-reads it (in the
        # DHT's own process) and reads the member's records as withdrawn; one without keeps them
        member_at = [contact("tcp://10.0.0.9:5002", ids[2].key.curve_public)]
        write_signed(lists, revoke(local.authority, [ids[2].body.serial], run_id=RUN), force=True)

        def withdrawn() -> bool:
            try:
                return reader.lookup_all(2, timeout_s=0.5) == []
            except discovery_module.DiscoveryTimeoutError:
                return True

        wait_until(withdrawn, 10, "the revoked member's record for stage 2 read as withdrawn")
        assert stage1.lookup_all(2, timeout_s=10) == member_at and reader.lookup_all(1, timeout_s=10) == [honest]

        stage1.withdraw(1)  # a tombstone of the certified owner hides its entry
        with pytest.raises(discovery_module.DiscoveryTimeoutError, match="stage 1"):
            reader.lookup_all(1, timeout_s=1)


def check_status_records(maddrs: list[str], stage1: Discovery, member: Discovery, outsider: Discovery,
                         reader: Discovery, local: Any, replica: Discovery) -> None:
    """Status records (SPEC §9.1): the stage's certified peer's is read with its contact; a member
    of another stage and an outsider cannot publish one for it; ``mapl-swarm status`` prints them
    and exits 1 naming the stage no peer serves."""
    status = {"state": "training", "step": 7, "tokens_per_s": 1234.5, "queue": 2,
              "links": [{"peer": "stage2", "tx_bps": 250_000.0, "rx_bps": 125_000.0, "rate_bps": 1.25e6,
                         "rtt_s": 0.012, "heard_s": 0.4}], "rejects": {"replay": 3}}
    stage1.publish_status(1, lambda: {**status, "not_a_field": "dropped"})
    member.publish_status(1, lambda: {**status, "step": 666})  # its certificate is stage 2's
    outsider.publish_status(0, lambda: status)
    wait_until(lambda: reader.stage_peers(1) != [], 10, "stage 1's status record")
    (peer,) = reader.stage_peers(1)
    assert (peer.peer_id, peer.contact, peer.status) == (stage1.peer_id, stage1.entries(1)[0][1], status)
    assert 0 < peer.expires_in_s <= 30.5
    assert peer.heard_s is not None and not peer.silent(2.0)  # it stores its status every 2 s
    assert reader.stage_peers(0) == [] and [p.peer_id for p in member.stage_peers(1)] == [stage1.peer_id]

    done = subprocess.run([sys.executable, "-m", "mapl_swarm", "status", "--set", "pipeline.num_stages=3",
                           "--set", f'run.run_id="{RUN}"', "--cert", str(local.cert_file(0)), "--json",
                           *(a for m in maddrs for a in ("--initial-peer", m))],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 1 and "no peer serves stage(s) 0" in done.stderr, done.stderr
    stages = json.loads(done.stdout)["stages"]
    assert [len(peers) for peers in stages] == [0, 1, 1]
    assert {k: stages[1][0][k] for k in ("peer_id", "contact", "status", "silent")} == {
        "peer_id": stage1.peer_id, "contact": peer.contact, "status": status, "silent": False}

    # the live table, drawn in a pseudo-terminal as an operator sees it: every stage, each replica, links
    replica.publish_status(1, lambda: {**status, "step": 8, "links": []})
    member.publish_status(2, lambda: {"state": "training", "step": 7, "tokens_per_s": 99.0, "queue": 0})
    wait_until(lambda: len(reader.stage_peers(1)) == 2, 10, "the second replica's status record")
    screen = in_pty([sys.executable, "-m", "mapl_swarm", "status", "--set", "pipeline.num_stages=3", "--set",
                     f'run.run_id="{RUN}"', "--cert", str(local.cert_file(0)), "--watch", "--every", "0.2",
                     "--count", "2", *(a for m in maddrs for a in ("--initial-peer", m))])
    assert f"run '{RUN}': 3 stages" in screen and "no peer" in screen, screen
    assert stage1.peer_id[:8] in screen and "stage2: ↑0.25/1.25 ↓0.12 MB/s rtt 12 ms" in screen, screen
    rows = [line for line in screen.splitlines() if "│" in line and line.split("│")[1].strip().isdigit()]
    shown = {(row.split("│")[1].strip(), row.split("│")[2].strip()) for row in rows}
    assert {stage for stage, _ in shown} == {"0", "1", "2"}, screen  # every stage, stage 0 "no peer"
    assert {f"{p.peer_id[:8]}…{p.peer_id[-6:]}" for p in (stage1, replica)} <= {peer for _, peer in shown}, screen
    assert "replay 3" in screen and "training" in screen

    # a certificate of another authority for the same run learns nothing: every record is refused
    other = issue_local(local.folder.parent / "other-ids", run_id=RUN, num_stages=3)
    done = subprocess.run([sys.executable, "-m", "mapl_swarm", "status", "--set", "pipeline.num_stages=3",
                           "--set", f'run.run_id="{RUN}"', "--cert", str(other.cert_file(0)), "--json",
                           *(a for m in maddrs for a in ("--initial-peer", m))],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 1 and json.loads(done.stdout)["stages"] == [[], [], []], done.stdout


def check_doctor(maddrs: list[str], stage1: Discovery, reader: Discovery, local: Any) -> None:
    """``mapl-swarm doctor`` against the swarm: its bootstrap answers, the DHT joins, and a live
    stage-1 peer's config record differs from this host's in one setting, which it names."""
    from mapl_swarm.config import config_from_dict
    from mapl_swarm.peer.main import config_record, peer_assets

    cache = local.folder.parent / "doctor-cache"
    cfg = config_from_dict({"pipeline": {"num_stages": 3}, "run": {"run_id": RUN},
                            "data": {"cache_dir": str(cache)}}, "test")
    assets = peer_assets(cfg)
    rank = assets.config["compression.rank"]
    stage1.publish_config(1, config_record("f" * 32, {**assets.config, "compression.rank": 2 * rank}))
    wait_until(lambda: reader.stage_configs(1) != {}, 10, "stage 1's config record")
    done = subprocess.run([sys.executable, "-m", "mapl_swarm", "doctor", "--set", "pipeline.num_stages=3",
                           "--set", f'run.run_id="{RUN}"', "--set", f'data.cache_dir="{cache}"', "--stage", "0",
                           "--peer-key", str(local.key_file(0)), "--cert", str(local.cert_file(0)),
                           *(a for m in maddrs for a in ("--initial-peer", m))],
                          capture_output=True, text=True, timeout=120)
    lines = done.stdout.splitlines()
    assert done.returncode == 1, (done.stdout, done.stderr)
    assert [line for line in lines if line.startswith("FAIL")] == [
        f"FAIL config: differs from stage 1's: compression.rank (stage 1 has {2 * rank}, this host {rank}); fix: use "
        "the swarm's config file (peers/*.toml) and --set only host-local settings"], lines
    assert any(line.startswith("ok   bootstrap: 127.0.0.1:") for line in lines)
    assert any(line.startswith("ok   protocol: 2.2") for line in lines) and any(
        line.startswith("ok   clock:") for line in lines), lines
    # the records' contacts (10.0.0.x) serve nothing: nobody could be asked for a dial-back
    assert lines[-1].startswith("skip reachable: not checked: no live peer acknowledged"), lines


def in_pty(cmd: list[str], timeout_s: float = 60) -> str:
    """What ``cmd`` draws on a pseudo-terminal of 200 columns (its whole output, until it exits)."""
    import fcntl
    import os
    import pty
    import struct
    import termios

    leader, follower = pty.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 50, 200, 0, 0))
    env = {**os.environ, "COLUMNS": "200", "LINES": "50", "TERM": "xterm"}  # as a terminal's shell sets them
    proc = subprocess.Popen(cmd, stdin=follower, stdout=follower, stderr=follower, close_fds=True, env=env)
    os.close(follower)
    chunks = []
    try:
        while True:
            try:
                chunk = os.read(leader, 65536)
            except OSError:  # the terminal closed: the process exited
                break
            if not chunk:
                break
            chunks.append(chunk)
        assert proc.wait(timeout=timeout_s) == 0, b"".join(chunks).decode(errors="replace")
    finally:
        os.close(leader)
        if proc.poll() is None:
            proc.kill()
    return b"".join(chunks).decode(errors="replace")


@pytest.mark.timeout(120)
def test_certified_nodes_keep_only_records_of_a_peer_certified_for_the_stage(tmp_path, monkeypatch) -> None:
    local = issue_local(tmp_path / "ids", run_id=RUN, num_stages=3, replicas=[1, 2, 1])
    lists = tmp_path / "revoked.list"
    write_signed(lists, revoke(local.authority, [], run_id=RUN, now=1000))
    ids = [load_identity(local.key_file(s), local.cert_file(s), run_id=RUN, stage=s,
                         revocations=lists if s == 0 else None) for s in range(3)]
    with_bootstrap(monkeypatch, TrustedAuthority(RUN, local.authority.public),
                   functools.partial(scenario, ids=ids, local=local, lists=lists))
