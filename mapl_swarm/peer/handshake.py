"""A peer's handshake with its neighbours: HELLO until every one welcomed it (SPEC §9.2, §9.6 item 4).

A neighbour's DHT records may be stale (a departed peer's outlives it) or planted (an insider's
signed record), so one unanswered HELLO must not end the peer: :class:`Handshake` sends HELLO
again, with a fresh nonce, every ``net.hello_retry_s`` until WELCOME answers the newest one, each
time to the stage's next record (freshest first, looked up again every round), and retries a
REJECT ``stage_taken`` (the neighbour still holds the session of a departed peer of this stage
until that times out) and a configuration refusal by a neighbour that is not anchored (SPEC
§9.2: it cannot tell which of the two is misconfigured). Any other REJECT, or a WELCOME of another
configuration, ends it (the peer's :class:`~.control.Control` stops the session, which cancels
the handshake).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from mapl_swarm.aio import within
from mapl_swarm.errors import MaplError
from mapl_swarm.net.emulator import LinkConfig
from mapl_swarm.peer.link import Links, PeerLink
from mapl_swarm.peer.waiting import WaitingLog

log = logging.getLogger(__name__)

__all__ = ["Handshake", "candidates_of", "connect", "refusals_of"]

Resolve = Callable[[int, float], Awaitable["str | list[str]"]]
"""``resolve(stage, timeout_s)``: the stage's endpoint, or all of them freshest first (the DHT's)."""


async def candidates_of(resolve: Resolve, stage: int, timeout_s: float) -> list[str]:
    """Every endpoint ``resolve`` holds for ``stage``, freshest first (it may give just one)."""
    found = await resolve(stage, timeout_s)
    return [found] if isinstance(found, str) else list(found)


async def connect(link: PeerLink, transport: Any, endpoint: str, shaping: LinkConfig, *, fresh: bool = False) -> None:
    """``link`` to ``endpoint``: the transport's connection to that stage is kept when it goes there
    already, replaced when it goes elsewhere or when ``fresh`` (the first connection of a session
    that re-forms the swarm, under the transport's new routing id; what the old one still queues
    gets a second to leave)."""
    current = transport.endpoint_of(link.name)
    if current is not None and (fresh or current != endpoint):
        await transport.disconnect(link.name, linger_s=1.0 if fresh else 0.0)
    link.connect(transport, endpoint, shaping)


def refusals_of(missing: list[PeerLink]) -> str:
    """``"; "`` and why the neighbours of ``missing`` links refused this peer or its HELLO ("" if
    none did): a neighbour that refused this peer's configuration may have left before answering
    its HELLO, and what its own HELLO was refused for names both configurations."""
    refused = "; ".join([*(f"stage {link.stage}'s HELLO was refused ({link.refused_hello})"
                           for link in missing if link.refused_hello),
                         *(f"stage {link.stage} at {where} refused this peer: {why}"
                           for link in missing for where, why in link.refusals.items())])
    return f"; {refused}" if refused else ""


class Handshake:
    """Peer ``name``'s handshake over ``links`` (see the module docstring). ``welcomed`` is set by the
    peer's WELCOME handler once every neighbour welcomed it."""

    def __init__(self, name: str, links: Links, *, resolve: Resolve, retry_s: float, waits: WaitingLog,
                 welcomed: asyncio.Event) -> None:
        self.name, self.links, self.resolve, self.retry_s = name, links, resolve, retry_s
        self.waits, self.welcomed = waits, welcomed
        self._tries = dict.fromkeys(links.stages, 0)

    async def run(self, transport: Any, shaping: LinkConfig, *, timeout_s: float, rejoining: bool) -> None:
        """Until every neighbour welcomed this peer, within ``timeout_s``; ``rejoining``: the wait is
        for the replacement of a departed stage (``net.rejoin_timeout_s``), said so in the log."""
        for link in self.links:
            await link.send_hello(anchored=self.links.anchored)
        try:
            await self.waits.wait(within(self._until_welcomed(transport, shaping, timeout_s), timeout_s),
                                  lambda: [link for link in self.links if not link.welcomed],
                                  rejoin_timeout_s=timeout_s if rejoining else None)
        except asyncio.TimeoutError:
            missing = [link for link in self.links if not link.welcomed]
            if rejoining:
                raise MaplError(f"{self.name}: no stage {', '.join(str(link.stage) for link in missing)} peer "
                                f"rejoined within {timeout_s:g} s (net.rejoin_timeout_s); start one with --resume "
                                f"on a host with its checkpoints") from None
            raise MaplError(f"{self.name}: handshake with stages {self.links.stages} not completed within "
                            f"{timeout_s:g} s" + refusals_of(missing)) from None
        for link in self.links:  # raises if the neighbour cannot take the codebook slices this link sends
            if link.codebooks is not None:
                link.codebooks.check_capabilities()

    async def _until_welcomed(self, transport: Any, shaping: LinkConfig, timeout_s: float) -> None:
        while not self.links.all_welcomed:
            now = time.monotonic()
            due = [link for link in self.links if not link.welcomed and now - (link.hello_at or 0.0) >= self.retry_s]
            for link in due:
                await self._again(link, transport, shaping, timeout_s)
            self.welcomed.clear()
            if self.links.all_welcomed:
                return
            sent = min((link.hello_at or 0.0 for link in self.links if not link.welcomed), default=now)
            try:
                await within(self.welcomed.wait(), max(0.05, sent + self.retry_s - time.monotonic()))
            except asyncio.TimeoutError:
                pass

    async def _again(self, link: PeerLink, transport: Any, shaping: LinkConfig, timeout_s: float) -> None:
        """HELLO again to ``link``'s stage, at its next DHT record (a replica's link: to its own contact)."""
        if link.contact is not None:
            await link.send_hello(anchored=self.links.anchored)
            return
        self._tries[link.stage] += 1
        candidates = link.candidates = await candidates_of(self.resolve, link.stage, timeout_s)
        endpoint = candidates[self._tries[link.stage] % len(candidates)]
        if endpoint != link.endpoint:
            log.info("%s: HELLO to stage %d at %s (another of its %d DHT record(s))", self.name, link.stage,
                     endpoint, len(candidates))
        await connect(link, transport, endpoint, shaping)
        await link.send_hello(anchored=self.links.anchored)
