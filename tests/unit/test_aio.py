"""Deadlines that never swallow a cancellation (:func:`mapl_swarm.aio.within`)."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

import pytest

from mapl_swarm.aio import within

PACKAGE = Path(__file__).resolve().parents[2] / "mapl_swarm"


async def _cancel_as_the_result_arrives(wait) -> asyncio.Task:
    """A task awaiting ``wait(fut)``, cancelled in the loop iteration where ``fut`` gets its result
    (a receive loop cancelled as a message arrives)."""
    fut = asyncio.get_running_loop().create_future()
    task = asyncio.create_task(wait(fut))
    await asyncio.sleep(0)  # one iteration: the task now waits on fut
    fut.set_result("message")
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    return task


@pytest.mark.asyncio
async def test_a_cancellation_as_the_result_arrives_propagates():
    task = await _cancel_as_the_result_arrives(lambda fut: within(fut, 10.0))
    assert task.cancelled()


@pytest.mark.asyncio
async def test_the_fault_within_avoids_is_real_on_this_python():
    """On Python 3.11 ``asyncio.wait_for`` returns the result and drops the cancellation (a loop
    around it then never ends); 3.12+ propagate it like :func:`within`."""
    import sys

    task = await _cancel_as_the_result_arrives(lambda fut: asyncio.wait_for(fut, 10.0))
    assert task.cancelled() is (sys.version_info >= (3, 12))


@pytest.mark.asyncio
async def test_a_deadline_raises_timeout_error_and_no_deadline_waits():
    with pytest.raises(TimeoutError):
        await within(asyncio.Event().wait(), 0.01)
    assert await within(asyncio.sleep(0, "done"), None) == "done"


def test_the_package_awaits_with_deadlines_only_through_within():
    users = sorted(str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*.py")
                   if re.search(r"\basyncio\.wait_for\(", p.read_text()))
    assert users == []
