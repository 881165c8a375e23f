"""A replica's links to the replicas of its neighbour stages (SPEC §9.10 items 1 and 11).

At the start a peer links to every replica of each neighbour stage that the DHT holds, once it holds
one. :meth:`ReplicaLinker.handshake` then says HELLO on each link and reads the records again until
as many replicas of each neighbour stage as start the run welcomed this peer
(:func:`starting_replicas`: ``replicas.initial``, or the counts a re-formed swarm keeps); a record
may outlive its replica's process (one killed, or a run that ended with an error: a replica started
again announces a new contact beside its old one), so a link that has not welcomed this peer by then
is dropped. While training,
:meth:`ReplicaLinker.watch` keeps reading the neighbour stages' records: a replica announced since
(one that joins the running swarm) gets a link and HELLOs until it welcomes this peer; a record
whose replica never does within ``net.timeout_s`` is stale (a replica that died before anyone
linked it) and its link is dropped. A HELLO from a replica this peer has no link to yet
(:meth:`ReplicaLinker.unknown`, from the admission) makes it read the records at once, so a joining
replica is linked within one HELLO retry; the HELLO itself is refused until then (the joiner says
it again).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from mapl_swarm.aio import within
from mapl_swarm.errors import MaplError
from mapl_swarm.net.emulator import LinkConfig
from mapl_swarm.peer.handshake import Resolve, candidates_of, connect, refusals_of
from mapl_swarm.peer.link import LinkSettings, Links, PeerLink
from mapl_swarm.peer.waiting import WaitingLog

log = logging.getLogger(__name__)

__all__ = ["ReplicaLinker", "REPLICA_POLL_S", "Reform", "starting_replicas"]

REPLICA_POLL_S = 5.0
"""Seconds between two reads of the neighbour stages' records while training (a HELLO from an
unknown replica reads them at once, at most every :data:`_MIN_READ_S`)."""
_MIN_READ_S = 1.0


@dataclass(frozen=True)
class Reform:
    """A session that re-forms a swarm with replicas after a stage lost its last replica (SPEC
    §9.10 item 10), as this peer knows it from its pause: the replicas of its stage that start the
    session (those live at the pause, itself included) and the stage that lost its last replica
    (one replacement of it comes; None: not known here, a neighbour's HELLO told this peer)."""

    replicas: int
    lost: int | None


def starting_replicas(stage: int, *, own_stage: int, initial: int, reform: Reform | None, links: Links) -> int:
    """The replicas of ``stage`` that start this session together (its handshake and first round
    wait for them): ``initial`` (``replicas.initial``), unless the swarm re-forms: this peer's own
    stage as its :class:`Reform` says, a neighbour stage as its replicas' WELCOMEs say
    (``stage_replicas``, the most any says), the stage that lost its last replica one replacement
    (as this peer's pause, or a neighbour's WELCOME ``lost``, names it: a replacement learns so that
    it starts its stage alone)."""
    if stage == own_stage and reform is not None:
        return reform.replicas
    welcomes = [link for link in links if link.welcomed]
    said = [link.reform_replicas for link in welcomes if link.stage == stage and link.reform_replicas]
    if said:
        return max(said)
    lost = {link.reform_lost for link in welcomes} | {reform.lost if reform is not None else None}
    return 1 if stage in lost else initial


class _InDht:
    """A neighbour stage whose records a waiting line says this peer waits for."""

    def __init__(self, stage: int) -> None:
        self.stage, self.endpoint = stage, None


class ReplicaLinker:
    """Peer ``name``'s links to neighbour replicas (module docstring). ``gone()``: the contacts of
    replicas known to have left (never linked again); ``epoch()`` and ``local_contact()``: what a
    new link carries from the start; ``prepare(link)``: what a new link gets before it connects
    (mapl_vq: its side of the codebook streams)."""

    def __init__(self, name: str, links: Links, settings: LinkSettings, *, resolve: Resolve, shaping: LinkConfig,
                 timeout_s: float, hello_retry_s: float, waits: WaitingLog, on_bad_frame: Callable[[str, str], None],
                 gone: Callable[[], set[str]], epoch: Callable[[], int],
                 prepare: Callable[[PeerLink], None] = lambda link: None) -> None:
        self.name, self.links, self.settings, self.resolve = name, links, settings, resolve
        self.shaping, self.timeout_s, self.hello_retry_s, self.waits = shaping, timeout_s, hello_retry_s, waits
        self._on_bad_frame, self._gone, self._epoch, self._prepare = on_bad_frame, gone, epoch, prepare
        self.local_contact: str | None = None
        self.stale: set[str] = set()
        """Contacts whose replica never welcomed this peer: not linked again."""
        self._read = asyncio.Event()
        self._welcomed = asyncio.Event()
        self._fresh = False

    async def link_all(self, transport: Any, endpoint: str, *, fresh: bool = False) -> None:
        """At the start: a link to every replica of each neighbour stage, once the DHT holds one of
        its records (within ``net.timeout_s``; the handshake links those announced later).
        ``fresh``: a session that re-forms the swarm connects anew (:func:`~.handshake.connect`)."""
        self.local_contact = endpoint
        self._fresh = fresh
        for stage in self.links.stages_expected:
            async def announced(stage: int = stage) -> list[str]:
                try:
                    return await candidates_of(self.resolve, stage, self.timeout_s)
                except MaplError as exc:
                    raise MaplError(f"{self.name}: {exc} (net.timeout_s): start every replica of the run (with "
                                    f"--resume on each when it resumes; a replica joining a running swarm: --join)"
                                    ) from None

            for contact in await self.waits.wait(announced(), lambda stage=stage: [_InDht(stage)]):
                await self._add(transport, stage, contact)

    async def handshake(self, transport: Any, want: Callable[[int], int], *, timeout_s: float,
                        why: str = "net.timeout_s") -> None:
        """A starting replica's handshake (module docstring): until ``want(stage)`` replicas of each
        neighbour stage welcomed this peer, within ``timeout_s`` (the setting ``why`` names); the
        links of records whose replica did not are dropped (:meth:`watch` links them again if they
        come later)."""
        def short() -> list[int]:
            return [stage for stage in self.links.stages_expected
                    if sum(link.welcomed for link in self.links.of_stage(stage)) < want(stage)]

        async def until_welcomed() -> None:
            while short():
                for link in self.links:
                    if not link.welcomed and time.monotonic() - (link.hello_at or 0.0) >= self.hello_retry_s:
                        await link.send_hello(anchored=self.links.anchored)
                self._welcomed.clear()
                if not short():
                    return
                try:  # the records are read again every second meanwhile
                    await within(self._welcomed.wait(), _MIN_READ_S)
                except TimeoutError:
                    pass
                for stage in short():  # a replica started since, or one's new contact beside its stale record
                    await self._link_new(transport, stage, self._add)

        try:
            await self.waits.wait(within(until_welcomed(), timeout_s),
                                  lambda: [link for link in self.links if not link.welcomed])
        except TimeoutError:
            raise MaplError(f"{self.name}: handshake not completed within {timeout_s:g} s ({why}): "
                            + "; ".join(f"{sum(link.welcomed for link in self.links.of_stage(stage))} of stage "
                                        f"{stage}'s {want(stage)} replicas (replicas.initial, or those a re-formed "
                                        f"swarm keeps) welcomed this peer"
                                        for stage in short())
                            + refusals_of([link for link in self.links if not link.welcomed])) from None
        for link in [link for link in self.links if not link.welcomed]:
            self.links.remove(link)
            await transport.disconnect(link.name, linger_s=0.0)
            log.info("%s: the replica of stage %d at %s did not welcome this peer: its record is stale (its stage's "
                     "other replicas did); not linked", self.name, link.stage, link.contact)
        for link in self.links:  # raises if the neighbour cannot take the codebook slices this link sends
            if link.codebooks is not None:
                link.codebooks.check_capabilities()

    async def _link_new(self, transport: Any, stage: int, add: Callable[[Any, int, str], Awaitable[Any]]) -> None:
        """``add`` a link to every contact of ``stage``'s records not linked, gone or stale yet."""
        try:
            contacts = await candidates_of(self.resolve, stage, self.timeout_s)
        except MaplError as exc:  # no record now: the stage's links stay as they are
            log.debug("%s: no records of stage %d: %s", self.name, stage, exc)
            return
        gone = self._gone()
        for contact in contacts:
            if contact and contact not in gone and contact not in self.stale \
                    and self.links.by_contact(stage, contact) is None:
                await add(transport, stage, contact)

    async def greet_all(self, transport: Any) -> None:
        """A joining replica's handshake: HELLO to every linked replica until it welcomes this peer;
        a stale record's link is dropped (:meth:`_greet`), but each neighbour stage must keep one."""
        await asyncio.gather(*(self._greet(transport, link) for link in list(self.links)))
        missing = [stage for stage in self.links.stages_expected
                   if not any(link.welcomed for link in self.links.of_stage(stage))]
        if missing:
            raise MaplError(f"{self.name}: no replica of stage(s) {missing} welcomed this joining replica within "
                            f"{self.timeout_s:g} s (net.timeout_s)")

    async def _add(self, transport: Any, stage: int, contact: str) -> PeerLink:
        link = self.links.add(PeerLink(self.settings, stage, on_bad_frame=self._on_bad_frame, contact=contact))
        link.candidates = [contact]
        link.local_contact = self.local_contact
        link.epoch = self._epoch()
        self._prepare(link)
        await connect(link, transport, contact, self.shaping, fresh=self._fresh)
        log.info("%s: link %s to a replica of stage %d at %s", self.name, link.name, stage, contact)
        return link

    def unknown(self, stage: int) -> None:
        """A HELLO came from a replica of neighbour ``stage`` this peer has no link to: read the
        records now."""
        self._read.set()

    def welcomed(self) -> None:
        """A neighbour welcomed this peer (a new link may wait for it)."""
        self._welcomed.set()

    async def watch(self, transport: Any, spawn: Callable[[Any], Any]) -> None:
        """While training: link every replica of a neighbour stage announced since (module docstring)."""
        async def add_and_greet(transport: Any, stage: int, contact: str) -> None:
            spawn(self._greet(transport, await self._add(transport, stage, contact)))

        while True:
            for stage in self.links.stages_expected:
                await self._link_new(transport, stage, add_and_greet)
            self._read.clear()
            try:
                await within(self._read.wait(), REPLICA_POLL_S)
                await asyncio.sleep(_MIN_READ_S)  # a burst of unknown HELLOs costs one read
            except TimeoutError:
                pass

    async def _greet(self, transport: Any, link: PeerLink) -> None:
        """HELLO to a new link's replica until it welcomes this peer; dropped after ``net.timeout_s``."""
        deadline = time.monotonic() + self.timeout_s
        while not link.welcomed:
            left = deadline - time.monotonic()
            if left <= 0:
                self.stale.add(link.contact or "")
                self.links.remove(link)
                await transport.disconnect(link.name, linger_s=0.0)
                log.warning("%s: the replica of stage %d at %s did not welcome this peer within %g s: its record is "
                            "stale; not linked", self.name, link.stage, link.contact, self.timeout_s)
                return
            await link.send_hello(anchored=self.links.anchored)
            self._welcomed.clear()
            try:
                await within(self._welcomed.wait(), min(self.hello_retry_s, left))
            except TimeoutError:
                pass
