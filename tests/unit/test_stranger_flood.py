"""A stranger's flood of well-formed messages (found by attacking a live certified swarm: 150,000
certificate-less HELLOs or HEARTBEATs stalled stage 0 past its neighbour's liveness deadline).

A connection without a session may send a burst of 64 messages, then 16 a second; beyond, each is
dropped before it is decoded (``queue_full``), and the receive loop lets the peer's other tasks run
every 64 messages. The swarm trains exactly as without the flood.
"""

from __future__ import annotations

import asyncio

from mapl_swarm.peer.ingress import STRANGER_BURST, STRANGER_RATE_PER_S, StrangerBudget
from mapl_swarm.wire import Message, MessageType, encode

from peer_fakes import fake_swarm, on_first, run_swarm

MT = MessageType
FLOOD = 5000


def test_a_connection_without_a_session_gets_a_burst_then_a_rate():
    now = [0.0]
    budget = StrangerBudget(lambda: now[0])
    assert all(budget.allow("x") for _ in range(STRANGER_BURST)) and not budget.allow("x")
    assert budget.allow("y")  # each connection its own budget
    now[0] += 1.0
    assert sum(budget.allow("x") for _ in range(100)) == int(STRANGER_RATE_PER_S)


def _run(flood: bool):
    async def main():
        net, peers, transports = fake_swarm()
        if flood:
            beat = [bytes(f) for f in encode(Message(type=MT.HEARTBEAT, run_id="mem", src=1, dst=0, seq=1))]
            on_first(net, "stage1", MT.GRAD, lambda _: [net.inject("stage0", "stage1.0badc0de", beat)
                                                        for _ in range(FLOOD)])
        return await run_swarm(peers, transports)

    return asyncio.run(main())


def test_a_flood_from_a_stranger_is_dropped_before_decoding_and_training_is_unchanged():
    clean, flooded = _run(False), _run(True)
    assert flooded[0].train_losses == clean[0].train_losses
    rejects = flooded[0].rejects
    assert rejects["queue_full"] >= FLOOD - STRANGER_BURST - 2 * STRANGER_RATE_PER_S, rejects
    assert rejects["queue_full"] + rejects.get("wrong_session", 0) == FLOOD, rejects  # each counted once
