"""The discovery refresher's pacing (:class:`~mapl_swarm.net.discovery.Discovery`): a status
record is renewed every ``status_s`` even when it was published after the refresher began waiting
for a re-announcement (``refresh_s``, much longer), as every peer does (announce, then publish its
status). Before, the next renewal came only when that wait ended, so ``mapl-swarm status`` read a
live peer as silent (no status for three periods). The DHT is a stand-in that records each store
and answers at once: what is under test is the scheduling, not hivemind (the certified DHT
integration test runs the same path on real nodes)."""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future
from typing import Any

import pytest

from mapl_swarm.net.discovery import Discovery, DiscoveryConfig, stage_key, status_key

from deadlines import wait_until

pytestmark = pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated:DeprecationWarning")

RUN = "refresh"


class RecordingDHT:
    """Answers every store at once and notes (key, monotonic time)."""

    peer_id = type("PeerId", (), {"to_bytes": lambda self: b"me", "__str__": lambda self: "me"})()

    def __init__(self) -> None:
        self.stores: list[tuple[str, float]] = []
        self._lock = threading.Lock()

    def store(self, key: str, *_: Any, **__: Any) -> Future:
        with self._lock:
            self.stores.append((key, time.monotonic()))
        done: Future = Future()
        done.set_result(True)
        return done

    def times(self, key: str) -> list[float]:
        with self._lock:
            return [t for k, t in self.stores if k == key]

    def shutdown(self) -> None:
        pass


def test_a_status_published_after_an_announcement_is_renewed_every_status_period() -> None:
    config = DiscoveryConfig(initial_peers=(), refresh_s=20.0, status_s=0.5)
    discovery = Discovery(RUN, config)
    dht = discovery._dht = RecordingDHT()  # started: what start() sets, without a DHT process
    discovery._peer_id = "me"
    try:
        discovery.announce(1, "tcp://10.0.0.1:5001")  # the refresher starts, due to re-announce in 20 s
        discovery.publish_status(1, lambda: {"state": "training"})
        wait_until(lambda: len(dht.times(status_key(RUN, 1))) >= 4, 10, "three renewals of the status record")
        renewals = dht.times(status_key(RUN, 1))
        # never three periods without a store: a reader would take the peer for silent
        assert all(b - a < 3 * config.status_s for a, b in zip(renewals, renewals[1:])), renewals
        assert len(dht.times(stage_key(RUN, 1))) == 1  # the announcement is not renewed before refresh_s
    finally:
        discovery.close()
