"""Pipeline messages that reach a peer before its own training started (SPEC §6.1 "Before training
starts"), in memory: real peers with run policies on a FakeNet.

On a resume (and after every rejoin) stage 0 decides the step, sends ``resume`` downstream, loads
its checkpoint and sends step N's PROJ and ACTs at once; a stage still loading its own checkpoint
must hold them, not drop them: the PROJ is sent once, so a dropped one stalls the swarm (found in
the killed-twice rejoin test: stage 2 dropped ``PROJ of step 3, this link accepts steps 0..1``,
then every ACT as ``stale_projector``, and stage 0 waited 60 s for a GRAD).
"""

from __future__ import annotations

import asyncio
import threading

from mapl_swarm.pipeline import checkpoint
from mapl_swarm.wire import MessageType

from deadlines import wait_until
from peer_fakes import peek, policy_swarm, serve_all, swarm_config

MT = MessageType


def _cfg(tmp_path, steps: int):
    return swarm_config(run={"steps": steps, "run_id": "mem", "out_dir": str(tmp_path)},
                        checkpoint={"interval_steps": 2})


def test_a_stage_still_loading_its_checkpoint_holds_the_first_proj_and_acts_and_trains_on(tmp_path):
    async def first_run():
        _, peers, transports = policy_swarm(_cfg(tmp_path, 2))
        return await serve_all(peers, transports, timeout_s=60)

    assert all(r.end == "finished" for r in asyncio.run(first_run()))
    assert checkpoint.complete_steps(tmp_path, 2) == [2]

    arrived = threading.Event()  # stage 0's first ACT of step 2 was delivered to stage 1

    async def resumed_run():
        net, peers, transports = policy_swarm(_cfg(tmp_path, 4), resume=True)

        def tap(src, dst, frames, reply):
            msg = peek(frames)
            if dst == "stage1" and msg is not None and msg.type is MT.ACT and msg.step == 2:
                arrived.set()

        net.tap = tap
        policy = peers[1].run_policy
        load = policy._load

        def slow_load(step):  # on stage 1's compute thread, its event loop receiving meanwhile
            wait_until(lambda: arrived.is_set() and transports[1].inbox.empty(), 30,
                       "stage 0's step-2 ACT taken by stage 1's receive loop")
            load(step)

        policy._load = slow_load
        return peers, await serve_all(peers, transports, timeout_s=60)

    peers, results = asyncio.run(resumed_run())
    assert arrived.is_set()
    assert [getattr(r, "end", r) for r in results] == ["finished", "finished"], results
    assert [r.start_step for r in results] == [2, 2]
    assert len(results[0].train_losses) == 2  # steps 3 and 4
    assert results[1].rejects == {}, results[1].rejects  # nothing dropped: held, then admitted
