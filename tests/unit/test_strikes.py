"""A member whose messages keep failing the content checks is cut off (issue 46 item 1, SPEC §7.2
item 10): counted per member, only for codes no honest peer causes, once."""

from __future__ import annotations

import asyncio

import pytest
import torch

from mapl_swarm.errors import MaplError
from mapl_swarm.peer.strikes import STRIKE_CODES, STRIKES, Strikes
from mapl_swarm.wire import MessageType

from peer_fakes import fake_swarm, swarm_config

MT = MessageType


def test_only_codes_no_honest_peer_causes_count_and_a_member_is_cut_off_once():
    cut = []
    strikes = Strikes(lambda member, why: cut.append((member, why)), limit=3)
    for code in ("stale_projector", "out_of_window", "implausible", "queue_full", "replay"):  # honest races
        for _ in range(5):
            strikes.count("a", code, "race")
    assert cut == [] and "implausible" not in STRIKE_CODES
    for _ in range(2):
        strikes.count("a", "non_finite", "NaN")
        strikes.count("b", "wrong_shape", "shape")
    assert cut == []
    strikes.count("a", "id_out_of_range", "ids")
    strikes.count("a", "non_finite", "NaN")  # past the limit: no second cut
    assert cut == [("a", "3 of its messages failed the content checks (the last: id_out_of_range: ids)")]


@pytest.mark.parametrize("poison, code", [(float("nan"), "non_finite"), (1e30, "value_out_of_range")])
def test_a_member_that_keeps_sending_bad_acts_is_cut_off_before_the_run_ends(poison, code):
    """Stage 0, a certified member running modified code, sends ACTs of NaNs, or of finite values
    around 1e30 (which used to overflow the receiver's own step and stop it), through its real
    session: each is dropped before compute (``non_finite``, ``value_out_of_range``), and at
    :data:`STRIKES` stage 1 cuts it off as a departure naming why (here, a chain without rejoin:
    stage 1 ends saying so) instead of waiting for what it owes."""
    cfg = swarm_config(run={"steps": 40, "run_id": "mem"})
    B, T, r = cfg.pipeline.micro_batch_size, cfg.model.context_length, cfg.compression.rank
    ids = torch.zeros((B, T + 1), dtype=torch.uint16)

    async def main():
        net, peers, transports = fake_swarm(cfg)
        down = peers[0].links.downstream
        send_act = down.send_act

        async def act(step, micro, payload, *, eval_mode, pver):
            if step >= 1:  # from the second step on, every ACT goes with a NaN one
                await down.send(MT.ACT, step=step, micro=micro, pver=pver, meta={"mode": "train"},
                                tensors={"z": torch.full((B, T, r), poison, dtype=torch.bfloat16), "ids": ids},
                                kinds={"z": "act", "ids": "act"})
            await send_act(step, micro, payload, eval_mode=eval_mode, pver=pver)

        down.send_act = act
        return await asyncio.wait_for(asyncio.gather(*(p.serve(t) for p, t in zip(peers, transports)),
                                                     return_exceptions=True), 120), peers

    (r0, r1), peers = asyncio.run(main())
    assert isinstance(r1, MaplError) and f"{STRIKES} of its messages failed the content checks" in str(r1), r1
    assert peers[1].result.rejects[code] == STRIKES
    assert peers[1].rt.step_count < cfg.run.steps  # cut off mid-run, not at the end


def test_a_struck_out_members_certificate_is_refused_from_then_on_as_if_revoked():
    from types import SimpleNamespace

    from mapl_swarm.peer.runtime import Peer

    link = SimpleNamespace(name="stage0@x", peer_certificate=SimpleNamespace(serial=42))
    revoked: set[int] = set()
    cut = []
    peer = SimpleNamespace(links=SimpleNamespace(named=lambda name: link if name == link.name else None),
                           admission=SimpleNamespace(s=SimpleNamespace(identity=SimpleNamespace(revoked=revoked))),
                           cut_off=lambda lk, why: cut.append((lk.name, why)))
    peer.exclude = lambda lk, why: Peer.exclude(peer, lk, why)
    Peer._struck_out(peer, "stage0@x", "8 of its messages failed the content checks")
    Peer._struck_out(peer, "gone@y", "a link no longer there")
    assert revoked == {42} and cut == [("stage0@x", "8 of its messages failed the content checks")]
