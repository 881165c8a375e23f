"""A planted record that answers with a final REJECT does not end the dialer (SPEC §9.2, 1.9).

A member certified for stage 1 (a spare) announces its own record for stage 1, freshest first, and
answers every HELLO with REJECT ``not_certified`` claiming to be anchored. Stage 0 notes the
refusal, HELLOs the stage's other record and trains with the real stage 1; refused by the only
record there is, it still stops, naming the refusal.
"""

from __future__ import annotations

import asyncio

import pytest

from mapl_swarm.peer.control import PeerRejected
from mapl_swarm.wire import Message, MessageType, decode, encode

from peer_fakes import fake_swarm, run_swarm

MT = MessageType


async def _trap(trap) -> None:
    """Answer every HELLO with a final REJECT (the refusal of a spare's planted record)."""
    while True:
        sender, frames = await trap.inbox.get()
        msg = decode(frames)
        if msg.type is MT.HELLO:
            meta = {"code": "not_certified", "reason": "spare says no (revoked)", "anchored": True,
                    "hello_nonce": msg.meta["nonce"]}
            await trap.reply(sender, encode(Message(type=MT.REJECT, run_id=msg.run_id, src=1, dst=0, seq=0,
                                                    meta=meta)))


def _run(records: list[str]):
    async def main():
        async def resolve(stage: int, timeout_s: float):
            return records if stage == 1 else f"mem://stage{stage}"

        net, peers, transports = fake_swarm(linked=False)
        trap = net.transport("trap")
        task = asyncio.get_running_loop().create_task(_trap(trap))
        peers[0].linker.resolve = resolve
        try:
            return await run_swarm(peers, transports, timeout_s=60)
        finally:
            task.cancel()

    return asyncio.run(main())


def test_a_planted_record_refusing_the_dialer_is_passed_over_for_the_stages_other_record():
    results = _run(["mem://trap", "mem://stage1"])
    assert len(results[0].train_losses) == 3 and results[0].end == "finished"


def test_the_only_record_refusing_the_dialer_still_stops_it_naming_the_refusal():
    with pytest.raises(PeerRejected, match=r"stage 1 refused stage 0: spare says no \(revoked\)$"):
        _run(["mem://trap"])
