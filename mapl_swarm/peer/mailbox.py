"""A peer's one inbound queue: every admitted message, in arrival order, until its consumer takes it.

Both receive loops put what they admitted here (:mod:`~.ingress`). The schedule takes pipeline
messages (ACT, GRAD, PROJ, PROJ_GRAD, CODEBOOK_SLICE, the BYE that ends the run): the oldest one a
predicate accepts (:meth:`Mailbox.get`), so an ACT of the next step that comes while the stage
waits for a PROJ_GRAD stays for later. The dispatcher takes control messages in order
(:meth:`Mailbox.next_control`). Bounds: ``max_per_sender`` pipeline messages per neighbour,
``bound`` control messages; beyond, :class:`~.session.Rejected` ``queue_full``. A stop of the
session cancels the waiters.
"""

from __future__ import annotations

import asyncio
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from mapl_swarm.aio import until
from mapl_swarm.errors import MaplError
from mapl_swarm.peer.session import Rejected
from mapl_swarm.wire import Message

if TYPE_CHECKING:
    from mapl_swarm.peer.admission import Admitted, Arrival
    from mapl_swarm.peer.link import PeerLink

__all__ = ["Mailbox"]


@dataclass(frozen=True, eq=False)
class _Item:
    msg: Message | None = None
    """A pipeline message for the schedule."""
    link: PeerLink | None = None
    """The link a pipeline message came on (several per stage with replicas, SPEC §9.10)."""
    control: Admitted | None = None
    """A control message for the dispatcher."""
    arrival: Arrival | None = None
    """How a control message arrived."""


class Mailbox:
    def __init__(self, name: str, *, max_per_sender: int = 1 << 30, bound: int = 1 << 30) -> None:
        self.name = name
        self.max_per_sender, self.bound = max_per_sender, bound
        self._items: deque[_Item] = deque()
        self._queued: Counter[int] = Counter()
        self._controls = 0
        self._changed = asyncio.Event()

    def _append(self, item: _Item) -> None:
        self._items.append(item)
        self._changed.set()


    def put(self, msg: Message, link: PeerLink | None = None) -> None:
        """Queue a pipeline message for the schedule (``link``: the one it came on); ``queue_full``
        when its sender stage has ``max_per_sender`` messages waiting."""
        if self._queued[msg.src] >= self.max_per_sender:
            raise Rejected("queue_full", f"{self.max_per_sender} messages of stage {msg.src} already wait")
        self._queued[msg.src] += 1
        self._append(_Item(msg=msg, link=link))

    def put_control(self, got: Admitted, arrival: Arrival) -> None:
        """Queue a control message for the dispatcher."""
        if self._controls >= self.bound:
            raise Rejected("queue_full", f"{self.bound} control messages wait already")
        self._controls += 1
        self._append(_Item(control=got, arrival=arrival))

    @property
    def waiting(self) -> int:
        """Pipeline messages queued for the schedule, of every sender."""
        return sum(self._queued.values())

    def queued(self, src: int) -> int:
        """Pipeline messages of stage ``src`` waiting."""
        return self._queued[src]

    def take_from(self, wanted: Callable[[Message], bool]) -> tuple[Message, PeerLink | None] | None:
        """The oldest pipeline message ``wanted`` accepts and the link it came on, or None; never waits."""
        for i, item in enumerate(self._items):
            if item.msg is not None and wanted(item.msg):
                del self._items[i]
                self._queued[item.msg.src] -= 1
                return item.msg, item.link
        return None

    def has(self, wanted: Callable[[Message], bool]) -> bool:
        """Whether a queued pipeline message is one ``wanted`` accepts (nothing is taken)."""
        return any(item.msg is not None and wanted(item.msg) for item in self._items)

    @property
    def changed(self) -> asyncio.Event:
        """Set whenever a message is queued or :meth:`poke` is called."""
        return self._changed

    def has_control(self) -> bool:
        """A control message waits for the dispatcher."""
        return any(item.control is not None for item in self._items)

    def take(self, wanted: Callable[[Message], bool]) -> Message | None:
        """The oldest pipeline message ``wanted`` accepts, or None; never waits."""
        got = self.take_from(wanted)
        return None if got is None else got[0]

    def drop(self, unwanted: Callable[[Message], bool]) -> int:
        """Remove every queued pipeline message ``unwanted`` accepts; their number."""
        kept: deque[_Item] = deque()
        for item in self._items:
            if item.msg is not None and unwanted(item.msg):
                self._queued[item.msg.src] -= 1
            else:
                kept.append(item)
        dropped, self._items = len(self._items) - len(kept), kept
        return dropped

    def poke(self) -> None:
        """Wake whoever waits in :meth:`get_from`: what its ``stop`` reads changed."""
        self._changed.set()

    async def get_from(self, wanted: Callable[[Message], bool], timeout_s: float, what: str,
                       stop: Callable[[], bool] | None = None) -> tuple[Message, PeerLink | None] | None:
        """Wait for the oldest pipeline message ``wanted`` accepts (and its link); raise on a
        timeout, naming ``what`` was awaited. None (nothing taken) once ``stop()`` is true, checked
        before each take and after each :meth:`poke`."""
        got: list[tuple[Message, PeerLink | None]] = []

        def arrived() -> bool:
            if stop is not None and stop():
                return True
            item = self.take_from(wanted)
            if item is not None:
                got.append(item)
            return bool(got)

        if not await until(arrived, self._changed, timeout_s):
            raise MaplError(f"{self.name}: no {what} within {timeout_s:g} s")
        return got[0] if got else None

    async def wait_for(self, wanted: Callable[[Message], bool], timeout_s: float,
                       stop: Callable[[], bool] | None = None) -> bool:
        """Wait until a queued pipeline message is one ``wanted`` accepts (nothing is taken) or
        ``stop()`` is true, checked after each message and each :meth:`poke`; False when
        ``timeout_s`` passed first."""
        return await until(lambda: (stop is not None and stop()) or self.has(wanted), self._changed, timeout_s)

    async def get(self, wanted: Callable[[Message], bool], timeout_s: float, what: str) -> Message:
        """Wait for the oldest pipeline message ``wanted`` accepts; raise on a timeout, naming ``what``
        was awaited."""
        got = await self.get_from(wanted, timeout_s, what)
        assert got is not None  # no stop: only a message ends the wait
        return got[0]

    async def next_control(self) -> tuple[Admitted, Arrival]:
        """Wait for the oldest control message (and how it arrived)."""
        found: list[_Item] = []

        def arrived() -> bool:
            for i, item in enumerate(self._items):
                if item.control is not None:
                    del self._items[i]
                    self._controls -= 1
                    found.append(item)
                    return True
            return False

        await until(arrived, self._changed, None)
        return found[0].control, found[0].arrival
