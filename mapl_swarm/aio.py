"""Deadlines for awaits that never swallow a cancellation, and waiting for a condition.

``asyncio.wait_for`` of Python 3.11 returns the inner result when the awaited future completes in
the same loop iteration as the task is cancelled, and drops the cancellation: a receive loop then
goes on waiting for its next message although its session has ended (seen as a peer that hangs
while ending a session, with a message arriving as its receive loop was cancelled). Python 3.12
rebuilt ``wait_for`` on ``asyncio.timeout``; :func:`within` is that, for 3.11 too.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import TypeVar

__all__ = ["within", "until"]

T = TypeVar("T")


async def within(aw: Awaitable[T], timeout_s: float | None) -> T:
    """``await aw``, raising :class:`TimeoutError` after ``timeout_s`` (None: no deadline). A
    cancellation of the awaiting task always propagates."""
    async with asyncio.timeout(timeout_s):
        return await aw


async def until(ready: Callable[[], bool], changed: asyncio.Event, timeout_s: float | None) -> bool:
    """Wait until ``ready()``, checked again whenever ``changed`` is set (by whoever changes what it
    reads); False once ``timeout_s`` passed first (None: no deadline)."""
    loop = asyncio.get_running_loop()
    deadline = None if timeout_s is None else loop.time() + timeout_s
    while not ready():
        remaining = None if deadline is None else deadline - loop.time()
        if remaining is not None and remaining <= 0:
            return False
        changed.clear()
        try:
            await within(changed.wait(), remaining)
        except TimeoutError:
            pass
    return True
