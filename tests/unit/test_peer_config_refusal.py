"""A misconfigured peer is refused naming the settings that differ, and only it stops (SPEC §9.2, 1.6).

Stage 1 of a 3-stage in-memory swarm runs another ``compression.rank``. Stage 0's configuration is
the run's: stage 0 refuses stage 1's HELLO as an *anchored* peer, so stage 1 stops with one error
naming the setting and both values; stage 1's own refusals are not anchored, so stages 0 and 2 keep
waiting for a stage-1 peer of the run's configuration, and when one comes the run finishes.
"""

from __future__ import annotations

import asyncio

import pytest

from mapl_swarm.config import config_summary
from mapl_swarm.peer.link import LinkSettings, config_differences
from mapl_swarm.peer.runtime import Peer, PeerRejected
from mapl_swarm.pipeline.stage import StageRuntime

from mapl_swarm.wire import MessageType

from peer_fakes import FakeNet, peek, sampler, swarm_config


def _cfg(rank: int = 16):
    return swarm_config(pipeline={"num_stages": 3}, compression={"rank": rank},
                        net={"hello_retry_s": 0.1, "timeout_s": 60.0})


def _peer(cfg, stage: int) -> Peer:
    async def resolve(s: int, timeout_s: float) -> str:
        return f"mem://stage{s}"

    async def announce(endpoint: str) -> None:
        return None

    fingerprint = f"fp-rank{cfg.compression.rank}"
    return Peer(cfg, stage, StageRuntime(cfg, stage), fingerprint=fingerprint, resolve=resolve, announce=announce,
                sampler=sampler(cfg) if stage == 0 else None)


def test_only_the_misconfigured_peer_stops_and_the_run_goes_on_with_a_correct_one():
    async def main():
        net, good = FakeNet(), _cfg()
        t0, t1, t2 = (net.transport(f"stage{s}") for s in range(3))
        hellos, both = set(), asyncio.Event()

        def tap(src: str, dst: str, frames: list, reply: bool) -> None:
            msg = peek(frames)
            if dst == "stage1" and msg is not None and msg.type is MessageType.HELLO:
                hellos.add(msg.src)
                if len(hellos) == 2:
                    both.set()

        net.tap = tap
        p0, p2 = _peer(good, 0), _peer(good, 2)
        s0, s2 = asyncio.create_task(p0.serve(t0)), asyncio.create_task(p2.serve(t2))
        await asyncio.wait_for(both.wait(), 30)  # so that stage 1 refuses both before it stops
        with pytest.raises(PeerRejected) as exc:
            await asyncio.wait_for(_peer(_cfg(rank=8), 1).serve(t1), 30)
        text = str(exc.value)
        assert "stage 0 refused stage 1: config differs: compression.rank (stage 1 has 8, stage 0 16)" in text
        assert "stage 0 holds the run's configuration" in text
        refusals = [m for s, d, m, _ in net.log if s.startswith("stage1.") and m.type is MessageType.REJECT]
        assert sorted(m.dst for m in refusals) == [0, 2] and not any(m.meta["anchored"] for m in refusals)
        assert not s0.done() and not s2.done()  # the correct neighbours keep waiting for another stage 1
        replacement = _peer(good, 1)
        results = await asyncio.wait_for(asyncio.gather(s0, replacement.serve(net.transport("stage1")), s2), 60)
        assert [r.end for r in results] == ["finished"] * 3
        assert len(results[0].train_losses) == good.run.steps

    asyncio.run(main())


def test_the_differences_name_each_setting_and_bound_what_a_neighbour_sends():
    mine = config_summary(_cfg())
    theirs = {**mine, "compression.rank": 8, "model.num_layers": "x" * 500, "extra": 1}
    del theirs["run.seed"]
    got = config_differences(mine, theirs, 2, 1)
    assert got[0] == "compression.rank (stage 2 has 8, stage 1 16)"
    assert got[1].startswith("model.num_layers (stage 2 has 'xxxxx") and len(got[1]) < 100
    assert got[2] == "run.seed (stage 2 has none, stage 1 0)"
    many = config_differences(mine, {}, 0, 1)
    assert len(many) == 7 and many[-1] == f"and {len(mine) - 6} more"
    settings = LinkSettings(run_id="r", stage=1, num_stages=3, fingerprint="a", capabilities=(), max_frame_bytes=1,
                            config=mine)
    meta = {**settings.hello_meta(), "fingerprint": "b"}
    assert settings.mismatch(meta, 0) == ("fingerprint_mismatch",
                                          "config fingerprint mismatch: stage 0 has 'b', stage 1 a")
    meta["config"] = {**mine, "model.hidden_size": 32}
    assert settings.mismatch(meta, 0) == ("fingerprint_mismatch",
                                          "config differs: model.hidden_size (stage 0 has 32, stage 1 64)")
    assert settings.mismatch(settings.hello_meta(), 0) is None
    # every stage's 1F1B order follows from stage 0's in-flight count: it must be the same everywhere
    flight = LinkSettings(run_id="r", stage=1, num_stages=3, fingerprint="a", capabilities=(), max_frame_bytes=1,
                          max_in_flight=3)
    assert flight.mismatch({**flight.hello_meta(), "max_in_flight": 5}, 0) == (
        "fingerprint_mismatch", "max_in_flight mismatch: stage 0 has 5, stage 1 3")
    older = flight.hello_meta()
    del older["max_in_flight"]  # a 1.5 peer does not send it: it runs its own (reactive) order
    assert flight.mismatch(older, 0) is None
