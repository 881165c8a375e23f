"""A member whose all-reduce broke takes a partner's kept result (:mod:`mapl_swarm.replicas.kept_round`):
the keeping side's record (which group, which asker, until when) and the answer's stream, read
with its shapes and size checked. The RPC between real averagers: tests/integration/test_replica_averaging.py."""

from __future__ import annotations

import asyncio

import pytest
import torch
from hivemind.p2p import PeerID
from hivemind.proto import averaging_pb2
from hivemind.utils.asyncio import as_aiter

from mapl_swarm.replicas.kept_round import (CHUNK_BYTES, FAILED_TOO, KEPT_GROUPS, FailedToo, Outcome, Outcomes,
                                             agreed, paced, parts, take)

pytestmark = pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated:DeprecationWarning")

A, B, C = (PeerID(bytes([i]) * 34) for i in (1, 2, 3))


@pytest.mark.asyncio
async def test_a_kept_round_is_served_to_its_own_members_once_it_ended_and_only_then():
    outcomes = Outcomes()
    outcomes.began(b"g1", [A, B])
    assert outcomes.ran(b"g1") and not outcomes.ran(b"g0")
    assert await outcomes.outcome(b"g1", B, timeout=0.01) is None  # not ended yet: nothing within the wait
    waiting = asyncio.ensure_future(outcomes.outcome(b"g1", B, timeout=5))
    await asyncio.sleep(0)
    outcomes.ended(b"g1", kept=True, fill=7)
    assert await waiting == Outcome(True, 7)
    assert await outcomes.outcome(b"g1", C, timeout=1) is None  # a member of another group
    # a group whose all-reduce never began here (its matchmaking gave up first) was not kept here,
    # once it did not begin within the wait; one that begins meanwhile is waited for
    assert await outcomes.outcome(b"g0", B, timeout=1, unknown_s=0.01) == Outcome(False, -1)
    late = asyncio.ensure_future(outcomes.outcome(b"g3", B, timeout=5, unknown_s=5))
    await asyncio.sleep(0)
    outcomes.began(b"g3", [A, B])
    outcomes.ended(b"g3", kept=True, fill=8)
    assert await late == Outcome(True, 8)
    outcomes.began(b"g2", [A, B])
    outcomes.ended(b"g2", kept=False)
    assert await outcomes.outcome(b"g2", B, timeout=1) == Outcome(False, -1)  # it failed here too
    outcomes.ended(b"g2", kept=True, fill=9)  # an outcome is final
    assert await outcomes.outcome(b"g2", B, timeout=1) == Outcome(False, -1)


@pytest.mark.asyncio
async def test_only_the_last_groups_are_remembered():
    outcomes = Outcomes()
    for i in range(KEPT_GROUPS + 2):
        outcomes.began(bytes([i]), [A, B])
        outcomes.ended(bytes([i]), kept=True, fill=i)
    assert not outcomes.ran(bytes([0])) and not outcomes.ran(bytes([1]))
    assert await outcomes.outcome(bytes([KEPT_GROUPS + 1]), A, timeout=1) == Outcome(True, KEPT_GROUPS + 1)


@pytest.mark.asyncio
async def test_an_answer_gives_back_the_same_bytes_and_a_wrong_one_gives_nothing():
    torch.manual_seed(0)
    tensors = [torch.randn(3, 5), torch.randn(CHUNK_BYTES // 2), torch.randn(7)]  # one tensor in two chunks
    answer = list(parts(tensors))
    assert len(answer) == 4
    got = await take(as_aiter(*answer), tensors)
    assert got is not None and all(torch.equal(g, t) for g, t in zip(got, tensors))
    # shapes that differ, a missing tensor, a refusal, or more bytes than the tensors hold
    assert await take(as_aiter(*answer), [torch.zeros(5, 3), *tensors[1:]]) is None
    assert await take(as_aiter(*answer), tensors[:2]) is None
    assert await take(as_aiter(*answer[:-1]), tensors) is None
    assert await take(as_aiter(averaging_pb2.AveragingData(code=averaging_pb2.CANCELLED)), tensors) is None
    assert await take(as_aiter(*parts([torch.zeros(CHUNK_BYTES)])), [torch.zeros(4)]) is None
    # "failed too" is an answer of its own (nobody may have kept the round), only as the first message
    with pytest.raises(FailedToo):
        await take(as_aiter(averaging_pb2.AveragingData(code=FAILED_TOO)), tensors)
    assert await take(as_aiter(answer[0], averaging_pb2.AveragingData(code=FAILED_TOO)), tensors) is None


def test_with_three_members_a_kept_result_is_taken_only_when_two_partners_give_the_same_bytes() -> None:
    """A member that broke a partner's all-reduce on purpose could hand it any "kept" result: with
    3 members or more two partners must agree (SPEC §9.10 item 6); with 2 the only partner's is taken."""
    honest, forged = [torch.ones(3), torch.zeros(2)], [torch.full((3,), 9.0), torch.zeros(2)]
    assert agreed([], 3) is None
    assert agreed([("d", forged)], 2) == ["d"]
    assert agreed([("d", forged)], 3) is None
    assert agreed([("d", forged), ("b", honest)], 3) is None
    assert agreed([("d", forged), ("b", honest), ("c", [t.clone() for t in honest])], 4) == ["b", "c"]
    assert agreed([("b", honest), ("c", honest[:1])], 3) is None


@pytest.mark.asyncio
async def test_an_answer_may_wait_long_for_its_first_message_and_not_between_the_next():
    """The asked member waits for its own all-reduce to end before it answers; then a stalled answer
    fails at the next message's timeout however long the first took."""
    async def answer(gaps):
        for gap in gaps:
            await asyncio.sleep(gap)  # the asked side's pace (this is the input, not a synchronisation)
            yield averaging_pb2.AveragingData(code=averaging_pb2.AVERAGED_PART)

    assert len([m async for m in paced(answer([0.2, 0.0, 0.0]), first_s=1.0, next_s=0.1)]) == 3
    with pytest.raises(TimeoutError):
        [m async for m in paced(answer([0.0, 0.5]), first_s=1.0, next_s=0.1)]
    with pytest.raises(TimeoutError):
        [m async for m in paced(answer([0.5]), first_s=0.1, next_s=1.0)]
