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


def test_a_member_announcing_fresh_records_is_waited_for_once_not_per_record():
    """A certified replica announces itself under a fresh port every 20 s and never comes to a
    round: its stage's rounds waited ``net.timeout_s`` for each record, for ever. The wait is per
    member (its contact's CURVE key, whatever host and port): once past, none of its records
    counts, until it takes part in a round (a replica restarted on another port is waited for
    afresh)."""
    from mapl_swarm.step.members import Members
    from mapl_swarm.step.rounds import ReplicaStep

    key, other = "ab" * 32, "cd" * 32
    me, partner = f"tcp://10.0.0.1:5000#{other}", f"tcp://10.0.0.2:5000#{'ef' * 32}"
    members = Members("stage1", 1, starting=2, timeout_s=120.0)
    members.ranked(ReplicaStep("p1", ("p1", "p2"), {}, {}, 0.0, contacts={"p1": me, "p2": partner}))

    def rogue(port: int) -> str:
        return f"tcp://10.0.0.9:{port}#{key}"

    assert members.expected(me, [me, partner, rogue(1)], now=0.0) == 3  # a joiner, waited for
    assert members.expected(me, [me, partner, rogue(1)], now=100.0) == 3
    assert members.expected(me, [me, partner, rogue(2)], now=110.0) == 3  # the same member, counted once
    assert members.expected(me, [me, partner, rogue(1), rogue(2)], now=119.0) == 3
    for t, port in ((121.0, 3), (140.0, 4), (400.0, 5)):  # past its wait: no fresh record brings it back
        assert members.expected(me, [me, partner, rogue(port)], now=t) == 2
    # it takes part in a round, later restarts on another port: waited for again
    members.ranked(ReplicaStep("p1", ("p1", "p2", "p3"), {}, {}, 0.0,
                               contacts={"p1": me, "p2": partner, "p3": rogue(5)}))
    members.ranked(ReplicaStep("p1", ("p1", "p2"), {}, {}, 0.0, contacts={"p1": me, "p2": partner}))
    assert members.expected(me, [me, partner, rogue(6)], now=500.0) == 3
