"""A peer's status record (SPEC §9.1 "Status records"): what it publishes, and what a reader keeps
of what the network hands it."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest

from mapl_swarm.net.discovery import STATUS_FIELDS, _checked_status
from mapl_swarm.peer.mailbox import Mailbox
from mapl_swarm.peer.runtime import PeerState
from mapl_swarm.peer.status import StatusSource


def test_a_reader_keeps_only_the_fields_of_the_spec_with_their_types():
    assert _checked_status({"state": "training", "step": 3, "tokens_per_s": 10, "queue": 1, "evil": "x"}) == {
        "state": "training", "step": 3, "tokens_per_s": 10.0, "queue": 1}
    assert _checked_status({"state": 5, "step": "3", "tokens_per_s": math.nan, "queue": True}) == {}
    assert _checked_status({"state": "x" * 1000})["state"] == "x" * 32
    assert _checked_status([1, 2]) == {} and _checked_status(None) == {}
    # links and rejects: typed entries only, bounded; an entry without its peer is dropped
    got = _checked_status({"links": [{"peer": "stage1", "tx_bps": 10, "rx_bps": -1.0, "rtt_s": "x", "evil": 1},
                                     {"tx_bps": 5.0}, "junk"] + [{"peer": f"p{i}"} for i in range(40)],
                           "rejects": {"replay": 3, "bad": -1, "x" * 100: 1, 7: 1, "f": 1.5}})
    assert got["links"][0] == {"peer": "stage1", "tx_bps": 10.0} and len(got["links"]) == 14  # of the first 16
    assert got["rejects"] == {"replay": 3, "x" * 32: 1}


def test_the_source_reports_state_step_queue_and_a_windowed_token_rate(monkeypatch):
    now = [100.0]
    monkeypatch.setattr("mapl_swarm.peer.status.time.monotonic", lambda: now[0])
    source = StatusSource(window_s=10.0)
    assert source() == {"state": "starting", "step": 0, "tokens_per_s": 0.0, "queue": 0, "capacity": 0.0}
    rows = [{"link": "stage1", "direction": "tx", "kind": "act", "wire_bytes": 0},
            {"link": "stage1", "direction": "rx", "kind": "grad", "wire_bytes": 0},
            {"link": "stage0", "direction": "rx", "kind": "rx", "wire_bytes": 0}]  # received from stage 0's peers
    peer = SimpleNamespace(rt=SimpleNamespace(tokens_trained=0), state=PeerState.TRAINING,
                           schedule=SimpleNamespace(step=4), mailbox=Mailbox("t"), compute=SimpleNamespace(busy_s=0.0),
                           transport=SimpleNamespace(counters=SimpleNamespace(rows=lambda: rows)),
                           monitor=SimpleNamespace(figures=lambda: {"stage1": (0.0125, 0.5)}),
                           result=SimpleNamespace(rejects={"replay": 2}),
                           cfg=SimpleNamespace(net=SimpleNamespace(bandwidth_mbps=8.0)))
    source.peer = peer
    assert source()["tokens_per_s"] == 0.0
    for _ in range(10):  # 1000 tokens a second, sampled every 2 s, computing half of the time
        now[0] += 2.0
        peer.rt.tokens_trained += 2000
        peer.compute.busy_s += 1.0
        rows[0]["wire_bytes"] += 2_000_000
        rows[1]["wire_bytes"] += 500_000
        rows[2]["wire_bytes"] += 100_000
    status = source()
    optional = {"averaging", "averaging_bytes", "relayed_bytes"}  # a replica's, a relayed dial-out peer's
    # per link: bytes per second each way since the last record, the emulated rate, round trip, silence
    assert status["links"] == [  # 20 MB and 5 MB in the 20 s since the last call; stage 0's peers not watched
        {"peer": "stage0", "tx_bps": 0.0, "rx_bps": 50_000.0, "rate_bps": 1e6},
        {"peer": "stage1", "tx_bps": 1e6, "rx_bps": 250_000.0, "rate_bps": 1e6, "heard_s": 0.5, "rtt_s": 0.0125}]
    assert status["rejects"] == {"replay": 2}
    assert set(status) == set(STATUS_FIELDS) - optional and status["state"] == "training" and status["step"] == 4
    assert status["tokens_per_s"] == pytest.approx(1000.0)
    assert status["capacity"] == pytest.approx(2000.0)  # what it would train never waiting
    now[0] += 2.0  # a stall: the rate falls, over the window
    peer.rt.tokens_trained += 0
    rows[0]["wire_bytes"] += 1_000_000
    stalled = source()
    assert stalled["tokens_per_s"] == pytest.approx(20000 / 22, abs=0.1)  # published to 0.1 token/s
    assert (stalled["links"][1]["tx_bps"], stalled["links"][1]["rx_bps"]) == (500_000.0, 0.0)
    assert _checked_status(stalled)["links"] == stalled["links"]
    peer.rt = SimpleNamespace(tokens_trained=0)  # a re-formed session's new stage runtime
    now[0] += 2.0
    assert source()["tokens_per_s"] == 0.0
    # a replica also says how it averages and what its last round sent (SPEC §9.10 item 16)
    peer.schedule.replicas = SimpleNamespace(scheme="powersgd", last_sent=123_456)
    status = source()
    assert set(status) == set(STATUS_FIELDS) - {"relayed_bytes"} and status["averaging"] == "powersgd"
    assert _checked_status(status)["averaging_bytes"] == 123_456
    # a dial-out peer says what its links carried through a relay (SPEC §9.12)
    peer.transport.relay = SimpleNamespace(bytes=4_096_000)
    status = source()
    assert set(status) == set(STATUS_FIELDS) and _checked_status(status)["relayed_bytes"] == 4_096_000


def test_status_marks_a_peer_that_stopped_storing_its_status_silent_and_not_serving():
    """A killed replica's stage record lasts until it lapses (up to ``ttl_s``), but it stops storing
    its status record every ``status_s``: three periods without one and ``status`` shows it silent,
    not serving; the time left on its records is said as such, not as a renewal."""
    from mapl_swarm.cli import _status_line
    from mapl_swarm.net.discovery import StagePeer

    status = {"state": "training", "step": 12, "tokens_per_s": 900.0, "queue": 0}
    live = StagePeer("12D3KooWlive", "tcp://10.0.0.2:5556#ab", 28.0, status, heard_s=1.5)
    killed = StagePeer("12D3KooWdead", "tcp://10.0.0.3:5556#cd", 21.0, status, heard_s=9.0)
    assert not live.silent(2.0) and killed.silent(2.0) and not StagePeer("x", "tcp://h:1", 5.0, {}).silent(2.0)
    # the step shown is as old as the record (a peer stores it every status_s): said, not hidden
    assert _status_line(live, 2.0).endswith("tcp://10.0.0.2:5556  as of 1.5 s ago; its records lapse in 28 s")
    assert "SILENT for 9 s: not serving (stopped or lost); its records lapse in 21 s" in _status_line(killed, 2.0)
    replica = StagePeer("12D3KooWrep", "tcp://10.0.0.4:5556#ef", 28.0,
                        {**status, "averaging": "topk", "averaging_bytes": 250_000}, heard_s=1.0)
    assert "queue 0    averaging topk 0.25 MB/step  tcp://10.0.0.4:5556" in _status_line(replica, 2.0)
    relayed = StagePeer("12D3KooWnat", "dialout#" + "ab" * 32, 28.0, {**status, "relayed_bytes": 3_500_000},
                        heard_s=1.0)
    assert "queue 0    relayed 3.50 MB  dialout  as of 1.0 s ago" in _status_line(relayed, 2.0)
