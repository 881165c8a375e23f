"""Signed discovery records on real hivemind DHT nodes (issue 12, item 6 "Trusted discovery").

One keyed bootstrap node (``run_bootstrap_node(membership=...)``, as ``mapl-swarm dht`` runs it),
two honest keyed peers claiming the same stage, a peer without the key and one with another
key, both storing records for that stage that expire much later. Every check runs on this one
set of nodes (a DHT start is slow). All nodes are started from the main thread (inside the
bootstrap's ``ready`` callback) before any lookup thread or event loop exists.
"""

from __future__ import annotations

import asyncio
import functools
import threading
from typing import Any

import pytest

import mapl_swarm.net.discovery as discovery_module
from mapl_swarm.net.discovery import Discovery, DiscoveryConfig, run_bootstrap_node, stage_key
from mapl_swarm.net.errors import DiscoveryTimeoutError

# hivemind imports torch, whose jit module warns on import; not ours to fix.
pytestmark = pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated:DeprecationWarning")

RUN = "run-signed"


class Key:
    """Stands in for ``mapl_swarm.net.runkey.RunKey`` (discovery needs only ``dht_key``)."""

    def __init__(self, dht_key: bytes) -> None:
        self.dht_key = dht_key


RUN_KEY, WRONG_KEY = Key(bytes(range(32))), Key(bytes(range(100, 132)))


async def stored_subkeys(key: str, _dht: Any, node: Any) -> dict[str, bytes]:
    """Runs inside a DHT process: the subkeys (and raw values) that node stores under ``key``."""
    from hivemind.dht.routing import DHTID

    item = node.protocol.storage.get(DHTID.generate(source=key))
    if item is None:
        return {}
    return {str(sub): bytes(entry.value) for sub, entry in item.value.items()}


def config(maddrs: list[str], **kwargs: float) -> DiscoveryConfig:
    return DiscoveryConfig(initial_peers=tuple(maddrs), host="127.0.0.1", poll_s=0.1, **kwargs)


def scenario(bootstrap_dht: Any, maddrs: list[str]) -> None:
    late = dict(ttl_s=600.0, refresh_s=300.0)  # forged records outlive the honest ones (ttl 30 s)
    with Discovery(RUN, config(maddrs), membership=RUN_KEY) as a, \
            Discovery(RUN, config(maddrs), membership=RUN_KEY) as b, \
            Discovery(RUN, config(maddrs, **late)) as outsider, \
            Discovery(RUN, config(maddrs, **late), membership=WRONG_KEY) as stranger:
        assert a.signed and not outsider.signed
        a.announce(1, "tcp://10.0.0.1:5001", subkey="stage1.aaaa")
        b.announce(1, "tcp://10.0.0.2:5001", subkey="stage1.bbbb")  # stored later: fresher
        outsider.announce(1, "tcp://6.6.6.6:1", subkey="stage1.evil")
        outsider.announce(2, "tcp://6.6.6.6:2", subkey="stage2.evil")
        stranger.announce(1, "tcp://7.7.7.7:1", subkey="stage1.alien")
        # The forged records exist (each forger stored its own), so what follows is not vacuous.
        assert outsider.lookup_all(2, timeout_s=5) == ["tcp://6.6.6.6:2"]
        assert stranger.lookup_all(1, timeout_s=5) == ["tcp://7.7.7.7:1"]

        # Keyed peers see both honest claimants, freshest first, and nothing forged.
        honest = ["tcp://10.0.0.2:5001", "tcp://10.0.0.1:5001"]
        assert a.lookup_all(1, timeout_s=10) == honest
        assert [e[0] for e in b.entries(1)] == ["stage1.bbbb", "stage1.aaaa"]
        assert a.lookup(1, timeout_s=5) == honest[0]
        assert asyncio.run(b.lookup_all_async(1, timeout_s=5)) == honest
        with pytest.raises(DiscoveryTimeoutError, match="stage 2"):
            a.lookup_all(2, timeout_s=0.5)

        # The keyed bootstrap node stored neither forgery (they would expire after the honest ones).
        held = functools.partial(stored_subkeys, stage_key(RUN, 1))
        assert set(bootstrap_dht.run_coroutine(held)) == {"stage1.aaaa", "stage1.bbbb"}
        assert bootstrap_dht.run_coroutine(functools.partial(stored_subkeys, stage_key(RUN, 2))) == {}

        # A tombstone from the honest owner hides its entry from every keyed reader.
        b.withdraw(1)
        assert a.lookup_all(1, timeout_s=5) == ["tcp://10.0.0.1:5001"]
        assert b.lookup(1, timeout_s=5) == "tcp://10.0.0.1:5001"


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


@pytest.mark.timeout(120)
def test_keyed_nodes_ignore_unsigned_and_wrongly_signed_records(monkeypatch: pytest.MonkeyPatch) -> None:
    with_bootstrap(monkeypatch, RUN_KEY, scenario)
