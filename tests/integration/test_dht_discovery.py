"""hivemind DHT discovery: shuffled start order, lookup timeout, refresh, expiry, re-announce,
several claimants of one stage (unsigned records; signed ones: test_dht_signed.py), errors that
cannot go away failing at once (process lifetime and shutdown: test_dht_lifecycle.py).

All DHT nodes are started from the test's main thread before any lookup thread or event loop
exists (hivemind forks its DHT process; see mapl_swarm.net.discovery).
"""

from __future__ import annotations

import asyncio
import random
import re
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Iterator

import pytest

from mapl_swarm.errors import ConfigError
from mapl_swarm.net.discovery import Discovery, DiscoveryConfig, run_bootstrap_node, start_dht
from mapl_swarm.net.errors import DiscoveryError, DiscoveryTimeoutError

from deadlines import wait_until

# hivemind imports torch, whose jit module warns on import; not ours to fix.
pytestmark = pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated:DeprecationWarning")


@pytest.fixture(scope="module")
def bootstrap() -> Iterator[list[str]]:
    dht = start_dht(host="127.0.0.1", timeout_s=30)
    try:
        yield [str(m) for m in dht.get_visible_maddrs()]
    finally:
        dht.shutdown()


def peer_config(bootstrap: list[str], **kwargs: float) -> DiscoveryConfig:
    return DiscoveryConfig(initial_peers=tuple(bootstrap), host="127.0.0.1", **kwargs)


@pytest.mark.timeout(60)
def test_peers_in_shuffled_order_find_neighbours(bootstrap: list[str]) -> None:
    stages = [0, 1, 2]
    order = stages[:]
    random.Random(time.time_ns()).shuffle(order)
    peers: dict[int, Discovery] = {}
    try:
        for s in order:  # forks, from the main thread, before any lookup thread exists
            peers[s] = Discovery("run-shuffle", peer_config(bootstrap)).start()
        wanted = [(s, n) for s in stages for n in (s - 1, s + 1) if n in stages]
        with ThreadPoolExecutor(len(wanted)) as pool:
            # Every lookup starts before anything is announced and must wait for it.
            futures = {(s, n): pool.submit(peers[s].lookup, n, 20.0) for s, n in wanted}
            random.shuffle(order)
            for s in order:
                peers[s].announce(s, f"tcp://127.0.0.1:{5000 + s}")
            found = {key: f.result(timeout=30) for key, f in futures.items()}
        assert found == {(s, n): f"tcp://127.0.0.1:{5000 + n}" for s, n in wanted}
        assert peers[1].entries(0)[0][:2] == (peers[0].peer_id, "tcp://127.0.0.1:5000")

        async def async_lookup() -> str:
            return await peers[0].lookup_async(2, timeout_s=5)

        assert asyncio.run(async_lookup()) == "tcp://127.0.0.1:5002"
    finally:
        for p in peers.values():
            p.close()


@pytest.mark.timeout(30)
def test_missing_stage_times_out_with_clear_message(bootstrap: list[str]) -> None:
    with Discovery("run-missing", peer_config(bootstrap, poll_s=0.1)) as d:
        t0 = time.monotonic()
        with pytest.raises(DiscoveryTimeoutError, match=r"run 'run-missing' stage 7 within 1 s") as info:
            d.lookup(7, timeout_s=1.0)
        assert 1.0 <= time.monotonic() - t0 < 3.0
        assert isinstance(info.value, TimeoutError)

        async def async_lookup() -> str:
            return await d.lookup_async(7, timeout_s=0.5)

        with pytest.raises(DiscoveryTimeoutError, match="stage 7"):
            asyncio.run(async_lookup())


@pytest.mark.timeout(60)
def test_refresh_expiry_and_reannounce(bootstrap: list[str]) -> None:
    cfg = peer_config(bootstrap, ttl_s=1.5, refresh_s=0.3, poll_s=0.1)
    with Discovery("run-ttl", cfg) as d, Discovery("run-ttl", peer_config(bootstrap)) as reader:
        d.announce(3, "tcp://10.0.0.3:7000")
        first_expiry = d.entries(3)[0][2]
        # Refresh keeps the entry alive past its first expiry.
        wait_until(lambda: time.time() > first_expiry + 0.3, 5, "first expiry to pass")
        assert reader.lookup(3, timeout_s=2) == "tcp://10.0.0.3:7000"
        assert reader.entries(3)[0][2] > first_expiry
        # Without refresh (and no tombstone) the entry expires within ttl_s.
        d.withdraw(3, tombstone=False)
        wait_until(lambda: reader.entries(3) == [], cfg.ttl_s + 3, "entry to expire")
        with pytest.raises(DiscoveryTimeoutError):
            reader.lookup(3, timeout_s=0.3)
        # Re-announcing after expiry makes it visible again, with a new endpoint.
        d.announce(3, "tcp://10.0.0.3:7001")
        assert reader.lookup(3, timeout_s=5) == "tcp://10.0.0.3:7001"
        # A tombstone hides it at once.
        d.withdraw(3)
        with pytest.raises(DiscoveryTimeoutError):
            reader.lookup(3, timeout_s=0.3)


@pytest.mark.timeout(60)
def test_restarted_peer_wins_and_bad_bootstrap_fails(bootstrap: list[str]) -> None:
    with Discovery("run-restart", peer_config(bootstrap)) as old, \
            Discovery("run-restart", peer_config(bootstrap)) as new:
        old.announce(1, "tcp://10.0.0.1:1111")
        new.announce(1, "tcp://10.0.0.1:2222", subkey="stage1.0002")  # stored later: expires later
        assert old.lookup(1, timeout_s=5) == "tcp://10.0.0.1:2222"
        assert [e[0] for e in old.entries(1)] == ["stage1.0002", old.peer_id]
        assert new.lookup_all(1, timeout_s=5) == ["tcp://10.0.0.1:2222", "tcp://10.0.0.1:1111"]
        # Re-announcing under another subkey retires the previous one (its tombstone is skipped).
        new.announce(1, "tcp://10.0.0.1:3333", subkey="stage1.0003")
        assert asyncio.run(old.lookup_all_async(1, timeout_s=5)) == ["tcp://10.0.0.1:3333",
                                                                      "tcp://10.0.0.1:1111"]
        new.withdraw(1)  # tombstones the current subkey
        assert old.lookup_all(1, timeout_s=5) == ["tcp://10.0.0.1:1111"]
    parts = bootstrap[0].split("/")  # ['', 'ip4', HOST, 'tcp', PORT, 'p2p', PEER_ID]
    parts[4] = "1"  # nothing listens on port 1
    dead = "/".join(parts)
    t0 = time.monotonic()
    with pytest.raises(DiscoveryError, match="could not start a DHT node"):
        Discovery("run-x", DiscoveryConfig(initial_peers=(dead,), host="127.0.0.1",
                                           start_timeout_s=2.0)).start()
    assert time.monotonic() - t0 < 10


@pytest.mark.timeout(30)
def test_bootstrap_node_reports_maddrs_and_stops() -> None:
    stop = threading.Event()
    seen: list[str] = []

    def ready(maddrs: list[str]) -> None:
        seen.extend(maddrs)
        stop.set()

    assert run_bootstrap_node("127.0.0.1", 0, ready=ready, stop=stop) == seen
    assert seen and all(m.startswith("/ip4/127.0.0.1/tcp/") and "/p2p/" in m for m in seen)
    with pytest.raises(ConfigError, match="explicit"):
        DiscoveryConfig(announce_host="dht.example", port=0)
    with pytest.raises(ConfigError, match="refresh_s"):
        DiscoveryConfig(ttl_s=5, refresh_s=5)
    with pytest.raises(DiscoveryError, match="start"):
        Discovery("run-y").lookup(0, timeout_s=0.1)


@pytest.mark.timeout(60)
def test_bad_addresses_and_a_taken_port_fail_at_once(bootstrap: list[str], tmp_path: Path) -> None:
    """No retries for what retrying cannot fix: each fails within 5 s, naming the address (the
    last case passes every check before the fork and fails in p2pd, which gives the reason)."""
    garbled = tmp_path / "identity.key"
    garbled.write_text("not a private key")
    peer_id = bootstrap[0].rsplit("/", 1)[1]
    taken_by_dht = int(bootstrap[0].split("/")[4])  # p2pd listens with SO_REUSEPORT: it would be shared
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        taken = listener.getsockname()[1]
        cases: list[tuple[dict, type[Exception], str]] = [
            (dict(initial_peers=("garbage",)), ConfigError, "'garbage' is not a valid multiaddr: Must begin with /"),
            (dict(initial_peers=(f"/ip4/127.0.0.1/tcp/http/p2p/{peer_id}",)), ConfigError,
             "/tcp/http/p2p/.* is not a valid multiaddr"),
            (dict(initial_peers=("/ip4/127.0.0.1/tcp/4001",)), ConfigError, "'/ip4/127.0.0.1/tcp/4001' has no peer id"),
            (dict(initial_peers=tuple(bootstrap), port=taken_by_dht), DiscoveryError,
             f"DHT port {taken_by_dht} on 127.0.0.1 is already in use"),
            (dict(port=taken), DiscoveryError, f"DHT port {taken} on 127.0.0.1 is already in use"),
            (dict(host="192.0.2.1", port=taken), DiscoveryError, "192.0.2.1 is not an address of this machine"),
            (dict(identity_path=str(garbled)), DiscoveryError, f"with identity {re.escape(str(garbled))}: .+"),
        ]
        try:
            socket.getaddrinfo("no-such-host.invalid", None)
        except socket.gaierror as exc:
            if exc.errno == socket.EAI_NONAME:  # a resolver that answers (else p2pd would decide)
                cases.append((dict(initial_peers=(f"/dns/no-such-host.invalid/tcp/4001/p2p/{peer_id}",)),
                              DiscoveryError, "no-such-host.invalid.* cannot be resolved"))
        for settings, error, message in cases:
            config = DiscoveryConfig(**{"host": "127.0.0.1", **settings})
            t0 = time.monotonic()
            with pytest.raises(error, match=message):
                Discovery("run-bad", config).start()
            assert time.monotonic() - t0 < 5.0, settings
