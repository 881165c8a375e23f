"""A typed inbox for decoded messages: wait for the next message of some types, in arrival order.

Messages of other types stay queued for whoever asks for them later (e.g. an ACT of the next step
that arrives while the stage still waits for a PROJ_GRAD). A fatal error (a REJECT, a silent
neighbour) wakes every waiter and is raised from :meth:`Mailbox.get`.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Iterable

from mapl_swarm.errors import MaplError
from mapl_swarm.wire import Message, MessageType

__all__ = ["Mailbox"]


class Mailbox:
    def __init__(self, name: str) -> None:
        self.name = name
        self._items: deque[Message] = deque()
        self._changed = asyncio.Event()
        self._error: BaseException | None = None

    def put(self, msg: Message) -> None:
        self._items.append(msg)
        self._changed.set()

    def fail(self, error: BaseException) -> None:
        """Make every current and future :meth:`get` raise ``error`` (first error wins)."""
        if self._error is None:
            self._error = error
        self._changed.set()

    @property
    def error(self) -> BaseException | None:
        return self._error

    def take(self, types: Iterable[MessageType]) -> Message | None:
        """The oldest queued message of one of ``types``, or None; never waits."""
        wanted = set(types)
        for i, msg in enumerate(self._items):
            if msg.type in wanted:
                del self._items[i]
                return msg
        return None

    async def get(self, types: Iterable[MessageType], timeout_s: float, what: str = "") -> Message:
        """Wait for the oldest message of one of ``types``; raise on a fatal error or timeout."""
        types = tuple(types)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while True:
            if self._error is not None:
                raise self._error
            msg = self.take(types)
            if msg is not None:
                return msg
            remaining = deadline - loop.time()
            if remaining <= 0:
                names = "/".join(t.name for t in types)
                raise MaplError(f"{self.name}: no {names} message {what}within {timeout_s:g} s")
            self._changed.clear()
            try:
                await asyncio.wait_for(self._changed.wait(), remaining)
            except asyncio.TimeoutError:
                continue
