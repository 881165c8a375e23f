"""Waiting on another process's state (a file it writes, a pid it holds) against a deadline.

Such state has no event this process can wait on, so it is polled; every other wait in the tests
waits on an event (a line of output, a condition, a future)."""

from __future__ import annotations

import asyncio
import time
from typing import Callable

POLL_S = 0.05


def wait_until(cond: Callable[[], object], timeout_s: float, what: str | Callable[[], str]) -> None:
    """Until ``cond()`` is true, or an AssertionError naming ``what`` (a callable: what it says at
    the deadline) after ``timeout_s`` seconds. ``cond`` may itself fail (e.g. when a process it
    watches exited early)."""
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what() if callable(what) else what}: not within {timeout_s:g} s")
        time.sleep(POLL_S)


async def until(cond: Callable[[], object], timeout_s: float, what: str) -> None:
    """:func:`wait_until` for the event loop: state of an object under test that sets no event
    (a relay's bookkeeping after a connection ends), polled without blocking the loop."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not cond():
        if loop.time() > deadline:
            raise AssertionError(f"{what}: not within {timeout_s:g} s")
        await asyncio.sleep(POLL_S)
