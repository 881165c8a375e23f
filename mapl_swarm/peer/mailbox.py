"""An inbox for decoded messages: wait for the oldest one a predicate accepts, in arrival order.

Messages it does not accept stay queued for whoever asks for them later (e.g. an ACT of the next
step that arrives while the stage still waits for a PROJ_GRAD). A failure elsewhere in the peer
stops its session, which cancels the waiter.
"""

from __future__ import annotations

import asyncio
from collections import Counter, deque
from collections.abc import Callable

from mapl_swarm.errors import MaplError
from mapl_swarm.peer.session import Rejected
from mapl_swarm.wire import Message

__all__ = ["Mailbox"]


class Mailbox:
    def __init__(self, name: str, *, max_per_sender: int = 1 << 30) -> None:
        self.name = name
        self.max_per_sender = max_per_sender
        self._items: deque[Message] = deque()
        self._queued: Counter[int] = Counter()
        self._changed = asyncio.Event()

    def put(self, msg: Message) -> None:
        """Queue ``msg``; :class:`~.session.Rejected` ``queue_full`` when its sender has
        ``max_per_sender`` messages waiting."""
        if self._queued[msg.src] >= self.max_per_sender:
            raise Rejected("queue_full", f"{self.max_per_sender} messages of stage {msg.src} already wait")
        self._queued[msg.src] += 1
        self._items.append(msg)
        self._changed.set()

    def queued(self, src: int) -> int:
        """Messages of stage ``src`` waiting."""
        return self._queued[src]

    def take(self, wanted: Callable[[Message], bool]) -> Message | None:
        """The oldest queued message ``wanted`` accepts, or None; never waits."""
        for i, msg in enumerate(self._items):
            if wanted(msg):
                del self._items[i]
                self._queued[msg.src] -= 1
                return msg
        return None

    async def get(self, wanted: Callable[[Message], bool], timeout_s: float, what: str) -> Message:
        """Wait for the oldest message ``wanted`` accepts; raise on a timeout, naming ``what`` was awaited."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while True:
            msg = self.take(wanted)
            if msg is not None:
                return msg
            remaining = deadline - loop.time()
            if remaining <= 0:
                raise MaplError(f"{self.name}: no {what} within {timeout_s:g} s")
            self._changed.clear()
            try:
                await asyncio.wait_for(self._changed.wait(), remaining)
            except asyncio.TimeoutError:
                continue
