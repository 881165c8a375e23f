"""While a peer waits for a neighbour it says so: "stage{S}: waiting for stage K at ADDR (n s)"."""

import asyncio
import dataclasses
import logging
import re
from types import SimpleNamespace

import pytest
import zmq

from mapl_swarm.config import TrainConfig
from mapl_swarm.peer.runtime import Peer
from mapl_swarm.peer.waiting import WaitingLog

DEADLINE_S = 20.0


class Lines(logging.Handler):
    """Collects the waiting lines and wakes a waiter once ``count`` of them match ``pattern``."""

    def __init__(self, pattern: str, count: int) -> None:
        super().__init__(logging.INFO)
        self.rx, self.count = re.compile(pattern), count
        self.lines: list[str] = []
        self.enough = asyncio.Event()

    def emit(self, record: logging.LogRecord) -> None:
        line = record.getMessage()
        if self.rx.fullmatch(line):
            self.lines.append(line)
            if len(self.lines) >= self.count:
                self.enough.set()


@pytest.fixture
def waiting_lines(caplog):
    caplog.set_level(logging.INFO, logger="mapl_swarm.peer.waiting")
    logger = logging.getLogger("mapl_swarm.peer.waiting")
    handlers = []

    def attach(pattern: str, count: int) -> Lines:
        h = Lines(pattern, count)
        logger.addHandler(h)
        handlers.append(h)
        return h

    yield attach
    for h in handlers:
        logger.removeHandler(h)


def test_waiting_log_repeats_until_the_wait_ends(waiting_lines):
    lines = waiting_lines(r"stage2: waiting for stage (1 at tcp://h:1|3 in the DHT) \(\d+ s\)", 4)
    waits = WaitingLog("stage2", interval_s=0.01)
    neighbours = [SimpleNamespace(stage=1, endpoint="tcp://h:1"), SimpleNamespace(stage=3, endpoint=None)]

    async def scenario():
        done = asyncio.Event()
        waited = asyncio.create_task(waits.wait(done.wait(), lambda: neighbours))
        await asyncio.wait_for(lines.enough.wait(), DEADLINE_S)
        done.set()
        assert await asyncio.wait_for(waited, DEADLINE_S) is True
        quiet = len(lines.lines)
        assert await waits.wait(asyncio.sleep(0, "fast"), lambda: neighbours) == "fast"  # a short wait: no line
        return quiet

    quiet = asyncio.run(scenario())
    assert len(lines.lines) == quiet
    assert "stage2: waiting for stage 1 at tcp://h:1 (0 s)" in lines.lines
    assert "stage2: waiting for stage 3 in the DHT (0 s)" in lines.lines


def _peer(resolve) -> Peer:
    async def announce(endpoint: str) -> None:
        pass

    base = TrainConfig()
    cfg = dataclasses.replace(base, pipeline=dataclasses.replace(base.pipeline, num_stages=2))  # stage 1 waits for stage 0
    return Peer(cfg, 1, SimpleNamespace(vq=None), fingerprint="f", resolve=resolve, announce=announce,
                wait_log_interval_s=0.02)


async def _run_until(peer: Peer, lines: Lines) -> None:
    """Run ``peer`` until ``lines`` saw enough waiting lines, then stop it."""
    task = asyncio.create_task(peer.run())
    try:
        await asyncio.wait_for(lines.enough.wait(), DEADLINE_S)
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


def test_a_peer_says_it_waits_for_a_neighbour_in_the_dht(waiting_lines):
    lines = waiting_lines(r"stage1: waiting for stage 0 in the DHT \(\d+ s\)", 2)

    async def never(stage: int, timeout_s: float) -> str:
        await asyncio.Event().wait()  # the DHT never knows stage 0
        raise AssertionError("unreachable")

    asyncio.run(_run_until(_peer(never), lines))
    assert len(lines.lines) >= 2


def test_a_peer_says_it_waits_for_a_silent_neighbour_at_its_address(waiting_lines):
    ctx = zmq.Context()
    silent = ctx.socket(zmq.ROUTER)  # stage 0 is up but never answers the HELLO
    silent.setsockopt(zmq.LINGER, 0)
    port = silent.bind_to_random_port("tcp://127.0.0.1")
    endpoint = f"tcp://127.0.0.1:{port}"
    lines = waiting_lines(rf"stage1: waiting for stage 0 at {re.escape(endpoint)} \(\d+ s\)", 2)

    async def resolve(stage: int, timeout_s: float) -> str:
        assert stage == 0
        return endpoint

    try:
        asyncio.run(_run_until(_peer(resolve), lines))
    finally:
        silent.close(linger=0)
        ctx.term()
    assert len(lines.lines) >= 2
