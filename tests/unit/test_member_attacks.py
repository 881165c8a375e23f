"""Attacks of issue 46 by a certified member running modified peer code, each through its real
session against honest peers (:mod:`peer_fakes`): what the member may say is checked against the
run before it changes anything."""

from __future__ import annotations

import asyncio

from mapl_swarm.errors import MaplError
from mapl_swarm.wire.spec import FINISHED_REASON

from peer_fakes import fake_swarm, swarm_config


def test_a_bye_saying_the_training_finished_before_the_runs_last_step_is_a_departure_not_the_end():
    """Stage 0 says BYE "training finished" at step 2 of a 20-step run (and goes on): stage 1 used
    to end there as finished, leaving the swarm waiting for it. Only the run's last step ends the
    run: stage 1 drops it as ``implausible`` and takes it as stage 0's departure (here, a chain
    without rejoin: it ends saying so)."""
    cfg = swarm_config(run={"steps": 20, "run_id": "mem"})

    async def main():
        net, peers, transports = fake_swarm(cfg)
        down = peers[0].links.downstream
        send_act = down.send_act
        said = []

        async def act(step, micro, payload, *, eval_mode, pver):
            if step == 2 and not said:
                said.append(step)
                await down.send_bye({"reason": FINISHED_REASON}, step=step)
            await send_act(step, micro, payload, eval_mode=eval_mode, pver=pver)

        down.send_act = act
        return await asyncio.wait_for(asyncio.gather(*(p.serve(t) for p, t in zip(peers, transports)),
                                                     return_exceptions=True), 120), peers

    (_, r1), peers = asyncio.run(main())
    assert isinstance(r1, MaplError) and "said the training finished at step 2" in str(r1), r1
    assert peers[1].result.rejects["implausible"] == 1  # and no "finished": it raised, naming the departure
    assert peers[1].rt.step_count < cfg.run.steps
