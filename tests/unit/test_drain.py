"""Graceful drain and departures (issue 13 items 2 and 4), in memory: real peers on a FakeNet."""

from __future__ import annotations

import asyncio
import re

import pytest

from mapl_swarm.peer.departures import NeighbourLost
from mapl_swarm.peer.checkpoints import CheckpointAgreement
from mapl_swarm.peer.signals import Interrupted
from mapl_swarm.pipeline import checkpoint
from mapl_swarm.wire import Message, MessageType, decode, encode

from peer_fakes import policy_swarm, serve_all, swarm_config

MT = MessageType


# ---------------------------------------------------------------------- the protocol alone
def _drains(P: int = 4, caps=None):
    """P agreements of peers keeping no checkpoints (the drain alone), whose CHECKPOINTs go through
    the wire codec into one FIFO; ``caps``: every neighbour's capabilities (None: all)."""
    queue: list[tuple[int, Message]] = []
    decided: dict[int, list[int]] = {s: [] for s in range(P)}
    drains = []
    for s in range(P):
        async def send(dst, meta, src=s):
            msg = Message(type=MT.CHECKPOINT, run_id="t", src=src, dst=dst, step=meta.get("step") or 0, meta=meta)
            queue.append((dst, decode(encode(msg))))

        async def on_decided(step, s=s):
            decided[s].append(step)

        drains.append(CheckpointAgreement(None, s, P, send, on_drain=on_decided))
        if caps is not None:
            drains[-1].neighbours({n: caps for n in (s - 1, s + 1) if 0 <= n < P})
    return drains, queue, decided


async def _pump(drains, queue):
    while queue:
        dst, msg = queue.pop(0)
        await drains[dst].on_message(msg)


def test_a_request_from_any_stage_reaches_stage_0_once_and_its_decision_every_stage():
    async def main():
        drains, queue, decided = _drains()
        await drains[3].request("SIGTERM at stage 3")
        await drains[2].request("SIGINT at stage 2")  # a second request on the way: relayed at most once
        await _pump(drains, queue)
        assert drains[0].should_stop() and drains[0].requested in ("SIGTERM at stage 3", "SIGINT at stage 2")
        phases = []
        await drains[0].decide(7)
        while queue:
            dst, msg = queue.pop(0)
            phases.append((msg.src, dst, msg.meta["phase"], msg.step))
            await drains[dst].on_message(msg)
        assert phases == [(0, 1, "drain", 7), (1, 2, "drain", 7), (2, 3, "drain", 7)]
        assert decided == {0: [7], 1: [7], 2: [7], 3: [7]}
        assert all(d.drain_step == 7 and d.drain_reason == drains[0].requested for d in drains)
        await drains[3].request("again")  # decided: nothing more goes out
        await drains[0].decide(9)
        assert queue == [] and decided[0] == [7]

    asyncio.run(main())


def test_a_drain_message_from_the_wrong_side_is_ignored():
    async def main():
        drains, queue, decided = _drains(3)
        await drains[1].on_message(Message(type=MT.CHECKPOINT, run_id="t", src=2, dst=1, meta={"phase": "drain",
                                                                                           "step": 3}))
        await drains[1].on_message(Message(type=MT.CHECKPOINT, run_id="t", src=0, dst=1,
                                           meta={"phase": "drain_request"}))
        assert drains[1].drain_step is None and not drains[1].draining and queue == [] and decided[1] == []

    asyncio.run(main())


def test_a_neighbour_without_the_capability_cannot_be_asked():
    async def main():
        drains, queue, _ = _drains(2, caps={"1f1b"})
        with pytest.raises(Exception, match="stage 0 does not take part in drains"):
            await drains[1].request("SIGTERM at stage 1")
        assert queue == []

    asyncio.run(main())


# ---------------------------------------------------------------------- real peers in memory
def _swarm(tmp_path, *, stages: int = 3, interval: int = 1000, steps: int = 10_000, **net):
    """Peers of ``stages`` stages with run policies (checkpoints every ``interval`` steps, i.e. only
    when drained) on a FakeNet; ``losses`` is set once stage 0 recorded 3 losses."""
    cfg = swarm_config(pipeline={"num_stages": stages},
                       run={"steps": steps, "run_id": "mem", "out_dir": str(tmp_path)},
                       checkpoint={"interval_steps": interval}, net=net)
    _, peers, transports = policy_swarm(cfg)
    losses = asyncio.Event()
    policy = peers[0].run_policy
    record = policy.train_loss

    def train_loss(step, loss, tokens):
        record(step, loss, tokens)
        if step >= 3:
            losses.set()

    policy.train_loss = train_loss
    return peers, transports, losses


def test_a_signal_at_the_last_stage_drains_every_stage_at_one_checkpointed_step(tmp_path):
    """SIGTERM reaches stage 2 only: it asks stage 0, which stops at its next step boundary; every
    stage saves that step (the interval is not due) and ends cleanly, and it is complete everywhere."""
    async def main():
        peers, transports, losses = _swarm(tmp_path)

        async def signal_later():
            await losses.wait()
            peers[2].request_drain("SIGTERM")

        asyncio.get_running_loop().create_task(signal_later())
        return peers, await serve_all(peers, transports)

    peers, results = asyncio.run(main())
    assert all(not isinstance(r, BaseException) for r in results), results
    steps = {r.drained_at for r in results}
    assert len(steps) == 1 and [r.end for r in results] == ["drained"] * 3, [(r.end, r.end_note) for r in results]
    step = steps.pop()
    assert step >= 3 and len(results[0].train_losses) == step  # every completed step reported
    for s, (p, r) in enumerate(zip(peers, results)):
        assert checkpoint.stage_steps(tmp_path, s) == [step]  # the drain step, and nothing newer
        assert step in p.run_policy.agreement.declared
        assert p.schedule.step == step
        assert re.fullmatch(rf"stage {s} drained at step {step} \(SIGTERM at stage 2\): checkpoint of step {step} "
                            rf"saved by every stage; continue with --resume", r.end_note), r.end_note


def test_a_second_signal_stops_at_once_and_the_neighbours_name_the_silent_stage(tmp_path):
    """Stage 1 is stopped at once (a second signal, the drain not finished): it leaves no BYE, so its
    neighbours find it silent after the floor and name it, its address and when it was last heard."""
    async def main():
        peers, transports, losses = _swarm(tmp_path, heartbeat_interval_s=0.1, liveness_floor_s=2.0,
                                           rejoin_timeout_s=0.0)  # no live rejoin: the departure ends them
        peers[0].agreement.should_stop = lambda: False  # stage 0 would drain; here nothing ends the run

        async def signals():
            await losses.wait()
            peers[1].request_drain("SIGINT")
            peers[1].abort("SIGINT")

        asyncio.get_running_loop().create_task(signals())
        return await serve_all(peers, transports, timeout_s=60)

    r0, r1, r2 = asyncio.run(main())
    assert isinstance(r1, Interrupted) and r1.exit_code == 130 and "stopped at once by a second SIGINT" in str(r1)
    for r, me in ((r0, 0), (r2, 2)):
        assert isinstance(r, NeighbourLost) and r.exit_code == 2, r
        assert re.match(rf"stage{me}: stage 1 at mem://stage1 silent since \d{{4}}-\d\d-\d\dT\d\d:\d\d:\d\dZ \(\d+\.\d s; "
                        rf"deadline \d+\.\d s, round trip \d+\.\d ms(, longest gap \d+\.\d s)?\)", str(r)), r
        assert r.departure.stage == 1 and r.departure.kind == "silent"


def test_a_step_longer_than_the_deadline_is_survived(tmp_path):
    """Stage 1 computes one forward for 3 s, three times its neighbours' deadline: its event loop goes
    on heartbeating meanwhile, so nobody is declared lost and the run ends normally."""
    import time

    async def main():
        peers, transports, _ = _swarm(tmp_path, steps=3, heartbeat_interval_s=0.1, liveness_floor_s=1.0,
                                      liveness_ceiling_s=1.0)
        forward, slow = peers[1].rt.forward, []

        def long_forward(micro, **kw):
            if not slow and peers[1].rt.step_count == 1:
                slow.append(micro)
                time.sleep(3.0)  # a long compute on the compute thread (it releases the GIL, as torch does)
            return forward(micro, **kw)

        peers[1].rt.forward = long_forward
        return slow, await serve_all(peers, transports, timeout_s=60)

    slow, results = asyncio.run(main())
    assert slow and all(not isinstance(r, BaseException) for r in results), results
    assert [r.end for r in results] == ["finished"] * 3 and len(results[0].train_losses) == 3


def test_a_signal_before_training_stops_the_peer_at_once_and_cleanly(tmp_path):
    async def main():
        peers, transports, _ = _swarm(tmp_path, stages=2)
        peers[1].request_drain("SIGINT")  # its neighbour never comes: it would wait in the handshake
        return await serve_all(peers[1:], transports[1:], timeout_s=30)

    (r1,) = asyncio.run(main())
    assert r1.end == "stopped" and r1.end_note == "stage 1 stopped before training started (SIGINT)", r1


def _leave_with_bye_drain(tmp_path, **net):
    """Stage 2 leaves with BYE "drain" on its own once stage 0 recorded 3 losses."""
    async def main():
        peers, transports, losses = _swarm(tmp_path, **net)
        peers[0].agreement.should_stop = lambda: False

        async def leave():
            await losses.wait()
            peers[2].stop(_clean(peers[2]))  # as after a signal before training: BYE "drain" to its neighbour

        asyncio.get_running_loop().create_task(leave())
        return await serve_all(peers, transports, timeout_s=60), transports

    return asyncio.run(main())


def test_bye_drain_from_downstream_pauses_the_swarm_for_a_replacement(tmp_path):
    """With live rejoin (the default): stage 1, not draining itself, pauses; it tells stage 0 with BYE
    "rejoin" naming stage 2, and both end the session to re-form at run epoch 1 (SPEC "Rejoin")."""
    (r0, r1, r2), transports = _leave_with_bye_drain(tmp_path)
    assert [r.end for r in (r0, r1, r2)] == ["rejoin", "rejoin", "stopped"], (r0, r1, r2)
    assert r0.epoch == r1.epoch == 1
    assert r1.rejoins[0].startswith("stage 1 paused at step ") and "stage 2 at mem://stage2 left the swarm" \
        in r1.rejoins[0], r1.rejoins
    assert "stage 1 re-forms the swarm (stage 2 departed)" in r0.rejoins[0], r0.rejoins
    byes = [m for m in transports[0].net.messages("stage1", "stage0") if m.type.name == "BYE"]
    assert [(m.meta["reason"], m.meta["lost"]) for m in byes] == [("rejoin", 2)]


def test_bye_drain_from_downstream_is_a_planned_departure_passed_upstream(tmp_path):
    """Without live rejoin: stage 2 leaves with BYE "drain" on its own, stage 1 ends cleanly and
    tells stage 0, which ends cleanly too."""
    (r0, r1, r2), _ = _leave_with_bye_drain(tmp_path, rejoin_timeout_s=0.0)
    assert [r.end for r in (r0, r1, r2)] == ["stopped"] * 3, (r0, r1, r2)
    assert r1.end_note.startswith("stage 1 stopped: stage 2 at mem://stage2 left the swarm (drain)")
    assert r0.end_note.startswith("stage 0 stopped: stage 1 at mem://stage1 left the swarm (drain)")


def _clean(peer):
    from mapl_swarm.peer.runtime import _CleanStop

    return _CleanStop("stopped", f"stage {peer.stage} leaves")
