"""Progress lines while a peer waits for a neighbour: ``stage{S}: waiting for stage K at ADDR (n s)``.

A swarm takes tens of seconds to start (DHT lookups, neighbours loading data and building their
stage), and a stalled neighbour stops the pipeline. :meth:`WaitingLog.wait` awaits something and,
every ``interval_s`` while it is still pending, logs one INFO line per neighbour it waits for:
``at ADDR`` once the neighbour's endpoint is known, ``in the DHT`` before.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Iterable
from typing import Protocol, TypeVar

log = logging.getLogger(__name__)

__all__ = ["WaitingLog", "Awaited", "WAIT_LOG_INTERVAL_S"]

T = TypeVar("T")

WAIT_LOG_INTERVAL_S = 5.0
"""Seconds between two waiting lines (the first comes after this long)."""


class Awaited(Protocol):
    """A neighbour as a waiting line names it."""

    @property
    def stage(self) -> int: ...

    @property
    def endpoint(self) -> str | None: ...


class WaitingLog:
    """Logs, for peer ``name``, which neighbours a long wait is for."""

    def __init__(self, name: str, interval_s: float = WAIT_LOG_INTERVAL_S) -> None:
        if interval_s <= 0:
            raise ValueError(f"waiting-line interval must be > 0 s, got {interval_s}")
        self.name = name
        self.interval_s = interval_s

    async def wait(self, aw: Awaitable[T], waiting_for: Callable[[], Iterable[Awaited]], *,
                   rejoin_timeout_s: float | None = None) -> T:
        """The result of ``aw``; every ``interval_s`` until then, one line per ``waiting_for()``.
        ``rejoin_timeout_s``: the wait is for a replacement of a departed stage (SPEC "Rejoin"):
        ``waiting for a stage K peer (n s of T s)``."""
        task = asyncio.ensure_future(aw)
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=self.interval_s)
                if done:
                    return task.result()
                elapsed = loop.time() - t0
                for n in waiting_for():
                    if rejoin_timeout_s is not None:
                        log.warning("%s: waiting for a stage %d peer (%.0f s of %g s; newest record %s)", self.name,
                                    n.stage, elapsed, rejoin_timeout_s, n.endpoint or "none")
                        continue
                    where = f"at {n.endpoint}" if n.endpoint else "in the DHT"
                    log.info("%s: waiting for stage %d %s (%.0f s)", self.name, n.stage, where, elapsed)
        finally:
            if not task.done():
                task.cancel()
            elif not task.cancelled():
                task.exception()  # retrieved: a failure seen by no one (this wait was cancelled) is not logged
