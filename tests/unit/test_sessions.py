"""A peer process across sessions (peer/sessions.py) and who takes part in live rejoin (SPEC §9.6)."""

from __future__ import annotations

import asyncio
import logging

from mapl_swarm.peer.result import PeerResult
from mapl_swarm.peer.sessions import merge
from mapl_swarm.wire import REJOIN_CAPABILITY

from peer_fakes import serve_all
from test_drain import _swarm


def test_merge_keeps_the_losses_before_the_rollback_and_adds_up_the_counters():
    first = PeerResult(0, train_losses=[5.0, 4.9, 4.8, 4.7, 4.6], report_times_s=[1, 2, 3, 4, 5],
                       val_history=[(2, 5.1), (4, 4.9)], tokens=500, wall_s=10.0, bad_frames=1,
                       rejects={"wrong_session": 1}, payload_tx={"stage1": {"act": 100}}, end="rejoin",
                       rejoins=["stage 0 paused at step 5: stage 1 ... silent"], epoch=1)
    second = PeerResult(0, train_losses=[4.75, 4.65, 4.55], report_times_s=[1, 2, 3], val_history=[(4, 4.9), (6, 4.7)],
                        tokens=300, wall_s=6.0, bad_frames=2, rejects={"wrong_session": 2, "stale_epoch": 1},
                        payload_tx={"stage1": {"act": 60}}, start_step=3, epoch=1)
    merged = merge(merge(None, first), second)
    assert merged.train_losses == [5.0, 4.9, 4.8, 4.75, 4.65, 4.55]  # steps 4 and 5 were trained again
    assert merged.report_times_s == [1, 2, 3, 1, 2, 3]
    assert merged.val_history == [(2, 5.1), (4, 4.9), (6, 4.7)]
    assert (merged.tokens, merged.wall_s, merged.bad_frames) == (800, 16.0, 3)
    assert merged.rejects == {"wrong_session": 3, "stale_epoch": 1}
    assert merged.payload_tx == {"stage1": {"act": 160}}
    assert merged.rejoins == first.rejoins and merged.end == "finished" and merged.epoch == 1
    assert merged.start_step == 0


def _advertised(peer) -> tuple[str, ...]:
    """The capabilities ``peer`` sends in HELLO/WELCOME."""
    return next(iter(peer.links)).settings.capabilities


def test_only_peers_with_checkpoints_and_a_rejoin_timeout_take_part_in_rejoin(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="mapl_swarm.peer.runtime"):
        peers, _, _ = _swarm(tmp_path / "off", stages=2, interval=0)
    assert all(REJOIN_CAPABILITY not in _advertised(p) for p in peers)
    assert "checkpoint.interval_steps = 0: live rejoin is impossible" in caplog.text
    peers, _, _ = _swarm(tmp_path / "timeout0", stages=2, rejoin_timeout_s=0.0)
    assert all(REJOIN_CAPABILITY not in _advertised(p) for p in peers)
    peers, _, _ = _swarm(tmp_path / "on", stages=2)
    assert all(REJOIN_CAPABILITY in _advertised(p) for p in peers)


def test_a_silent_middle_peer_pauses_both_neighbours_at_the_next_run_epoch(tmp_path):
    """Stage 1 stops at once (no BYE): after the liveness floor stages 0 and 2 end their sessions to
    re-form at run epoch 1, each naming stage 1 (their processes go on: peer/sessions.py)."""
    async def main():
        peers, transports, losses = _swarm(tmp_path, heartbeat_interval_s=0.1, liveness_floor_s=2.0)
        peers[0].agreement.should_stop = lambda: False

        async def kill():
            await losses.wait()
            peers[1].abort("SIGKILL")  # gone at once, without a BYE (and no drain asked of the others)

        asyncio.get_running_loop().create_task(kill())
        return await serve_all(peers, transports, timeout_s=60)

    r0, _, r2 = asyncio.run(main())
    for r, me in ((r0, 0), (r2, 2)):
        assert r.end == "rejoin" and r.epoch == 1, r
        assert len(r.rejoins) == 1 and r.rejoins[0].startswith(f"stage {me} paused at step ")
        assert "stage 1 at mem://stage1 silent since" in r.rejoins[0], r.rejoins


def test_a_neighbour_leaving_after_the_end_of_the_run_is_no_departure(tmp_path):
    """Neighbours exit as they finish: once this peer's schedule ended, one going silent neither
    pauses nor ends it."""
    import time

    from mapl_swarm.peer.departures import Departure
    from mapl_swarm.peer.runtime import PeerState

    peers, _, _ = _swarm(tmp_path, stages=2)
    peer = peers[0]
    peer.state = PeerState.ENDED  # as after its schedule's end
    peer.departures.report(Departure(stage=1, endpoint="mem://stage1", kind="silent", last_seen=time.time(),
                                     detail="silent since 2026-12-05T12:00:00Z (10.0 s; deadline 10.0 s, round trip 1.0 ms)"))
    assert peer.stop_reason is None and not peer._stop_event.is_set()
    peer.state = PeerState.TRAINING
    peer.links.downstream.capabilities = frozenset({REJOIN_CAPABILITY})  # as its WELCOME said
    peer.departures = type(peer.departures)(peer._on_departure)
    peer.departures.report(Departure(stage=1, endpoint="mem://stage1", kind="silent", last_seen=time.time(),
                                     detail="silent"))
    assert peer.stop_reason is not None and peer.stop_reason.end == "rejoin"  # during training: a pause
