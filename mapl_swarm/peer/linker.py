"""A peer's links to its neighbour stages' peers, and its handshake with them (SPEC §9.2, §9.10 items 1 and 11).

One linker serves every swarm: a chain is a swarm with one peer per stage. A neighbour stage is a
set of links, one per DHT record's contact (:meth:`Linker.link_all`: every record the DHT holds of
it, once it holds one). A record may outlive its peer's process (one killed, or a run that ended
with an error: a peer started again announces a new contact beside its old one) or be planted (an
insider's signed record), so :meth:`Linker.handshake` says HELLO on each link, again every
``net.hello_retry_s`` with a fresh nonce, and reads the records again every second until as many
peers of each neighbour stage as start the run welcomed this peer (:func:`starting_replicas`: one
per stage in a chain; with replicas ``replicas.initial``, or the counts a re-formed swarm keeps).
The links of records whose peer did not are dropped, and a chain keeps one link per stage (one
peer serves a stage; its neighbour refuses the others ``stage_taken``). A REJECT ``stage_taken``
(the neighbour still holds the session of a departed peer of this stage until that times out) and
a configuration refusal by a neighbour that is not anchored (SPEC §9.2: it cannot tell which of
the two is misconfigured) are retried; any other refusal ends that link's HELLOs, and the peer's
:class:`~.control.Control` stops the session once every record of the stage refused it.

With replicas, while training, :meth:`Linker.watch` keeps reading the neighbour stages' records: a
replica announced since (one that joins the running swarm) gets a link and HELLOs until it
welcomes this peer; a record whose replica never does within ``net.timeout_s`` is stale (a replica
that died before anyone linked it) and its link is dropped. A HELLO naming a contact this peer has
no link to (:meth:`Linker.unknown`, from the admission) makes it read the records at once, so a
joining replica is linked within one HELLO retry; the HELLO itself is dropped until then (the
joiner says it again).
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
from mapl_swarm.peer.link import LinkSettings, Links, PeerLink
from mapl_swarm.peer.waiting import WaitingLog

log = logging.getLogger(__name__)

__all__ = ["Linker", "REPLICA_POLL_S", "Reform", "Resolve", "candidates_of", "connect", "starting_replicas"]

REPLICA_POLL_S = 5.0
"""Seconds between two reads of the neighbour stages' records while training (a HELLO from an
unknown replica reads them at once, at most every :data:`_MIN_READ_S`)."""
_MIN_READ_S = 1.0

Resolve = Callable[[int, float], Awaitable["str | list[str]"]]
"""``resolve(stage, timeout_s)``: the stage's endpoint, or all of them freshest first (the DHT's)."""


async def candidates_of(resolve: Resolve, stage: int, timeout_s: float) -> list[str]:
    """Every endpoint ``resolve`` holds for ``stage``, freshest first (it may give just one)."""
    found = await resolve(stage, timeout_s)
    return [found] if isinstance(found, str) else list(found)


async def connect(link: PeerLink, transport: Any, endpoint: str, shaping: LinkConfig) -> None:
    """``link`` to ``endpoint``: the transport's connection of that name is kept when it goes there
    already, replaced when it goes elsewhere."""
    current = transport.endpoint_of(link.name)
    if current is not None and current != endpoint:
        await transport.disconnect(link.name, linger_s=0.0)
    link.connect(transport, endpoint, shaping)


def refusals_of(missing: list[PeerLink]) -> str:
    """``"; "`` and why the neighbours of ``missing`` links refused this peer or its HELLO ("" if
    none did): a neighbour that refused this peer's configuration may have left before answering
    its HELLO, and what its own HELLO was refused for names both configurations."""
    refused = "; ".join([*(f"stage {link.stage}'s HELLO was refused ({link.refused_hello})"
                           for link in missing if link.refused_hello),
                         *(f"stage {link.stage} at {link.endpoint} refused this peer: {link.refusal}"
                           for link in missing if link.refusal is not None)])
    return f"; {refused}" if refused else ""


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


class Linker:
    """Peer ``name``'s links to its neighbour stages' peers (module docstring). ``one_per_stage``:
    a chain (a stage's other peers are refused, no replica joins). ``gone()``: the contacts of
    replicas known to have left (never linked again); ``epoch()``: the run epoch a new link carries
    from the start; ``prepare(link)``: what a new link gets before it connects (mapl_vq: its side
    of the codebook streams)."""

    def __init__(self, name: str, links: Links, settings: LinkSettings, *, resolve: Resolve, shaping: LinkConfig,
                 timeout_s: float, hello_retry_s: float, waits: WaitingLog, on_bad_frame: Callable[[str, str], None],
                 gone: Callable[[], set[str]], epoch: Callable[[], int], one_per_stage: bool,
                 prepare: Callable[[PeerLink], None] = lambda link: None) -> None:
        self.name, self.links, self.settings, self.resolve = name, links, settings, resolve
        self.shaping, self.timeout_s, self.hello_retry_s, self.waits = shaping, timeout_s, hello_retry_s, waits
        self._on_bad_frame, self._gone, self._epoch, self._prepare = on_bad_frame, gone, epoch, prepare
        self.one_per_stage = one_per_stage
        self.local_contact: str | None = None
        """This peer's own contact (its record's value), named in its HELLO/WELCOME."""
        self.stale: set[str] = set()
        """Contacts whose peer never welcomed this peer: not linked again."""
        self._read = asyncio.Event()
        self._welcomed = asyncio.Event()

    async def link_all(self, transport: Any, endpoint: str, *, fresh: bool = False, timeout_s: float | None = None,
                       why: str = "net.timeout_s", joining: bool = False) -> None:
        """At the start: a link to every record of each neighbour stage, once the DHT holds one
        (within ``timeout_s``, default ``net.timeout_s``, the setting ``why`` names; the handshake
        links those announced later). ``fresh``: a session that re-forms the swarm connects anew,
        under the transport's new routing id: the previous session's connections (a departed peer's
        among them) are closed first, what they still queue getting a second to leave. ``joining``:
        a replica joining a running swarm (its error says the swarm is not running)."""
        wait_s = self.timeout_s if timeout_s is None else timeout_s
        self.local_contact = endpoint
        if fresh:
            for name in transport.links():
                await transport.disconnect(name, linger_s=1.0)
        for stage in self.links.stages_expected:
            async def announced(stage: int = stage) -> list[str]:
                try:
                    return await candidates_of(self.resolve, stage, wait_s)
                except MaplError as exc:
                    if joining:
                        raise MaplError(f"{self.name}: {exc} ({why}): no swarm of run {self.settings.run_id!r} "
                                        f"runs to join (it ended, or has not started: start its peers, or with "
                                        f"--resume on every one to go on from their checkpoints)") from None
                    raise MaplError(f"{self.name}: {exc} ({why}): start every peer of the run (with --resume on "
                                    f"each when it resumes; a replica joining a running swarm: --join)") from None

            for contact in await self.waits.wait(announced(), lambda stage=stage: [_InDht(stage)]):
                await self._add(transport, stage, contact)

    def new_link(self, stage: int, contact: str) -> PeerLink:
        """A link to the peer of neighbour ``stage`` at ``contact``, not connected yet."""
        link = self.links.add(PeerLink(self.settings, stage, on_bad_frame=self._on_bad_frame, contact=contact))
        link.local_contact = self.local_contact
        link.epoch = self._epoch()
        self._prepare(link)
        return link

    async def _add(self, transport: Any, stage: int, contact: str) -> PeerLink:
        link = self.links.by_contact(stage, contact) or self.new_link(stage, contact)
        link.local_contact = self.local_contact
        await connect(link, transport, contact, self.shaping)
        log.info("%s: link %s to stage %d at %s", self.name, link.name, stage, contact)
        return link

    async def handshake(self, transport: Any, want: Callable[[int], int], *, timeout_s: float,
                        why: str = "net.timeout_s") -> None:
        """A starting peer's handshake (module docstring): until ``want(stage)`` peers of each
        neighbour stage welcomed this peer, within ``timeout_s`` (the setting ``why`` names); the
        links of records whose peer did not are dropped (with replicas :meth:`watch` links them
        again if they come later)."""
        def short() -> list[int]:
            return [stage for stage in self.links.stages_expected
                    if sum(link.welcomed for link in self.links.of_stage(stage)) < want(stage)]

        async def until_welcomed() -> None:
            while short():
                for link in self.links:
                    if not link.welcomed and link.refusal is None \
                            and time.monotonic() - (link.hello_at or 0.0) >= self.hello_retry_s:
                        await link.send_hello(anchored=self.links.anchored)
                self._welcomed.clear()
                if not short():
                    return
                try:  # the records are read again every second meanwhile
                    await within(self._welcomed.wait(), _MIN_READ_S)
                except TimeoutError:
                    pass
                for stage in short():  # a peer started since, or one's new contact beside its stale record
                    await self._link_new(transport, stage, self._add)

        try:
            await self.waits.wait(within(until_welcomed(), timeout_s),
                                  lambda: [link for link in self.links if not link.welcomed])
        except TimeoutError:
            raise MaplError(f"{self.name}: handshake not completed within {timeout_s:g} s ({why}): "
                            + "; ".join(self._short_of(stage, want(stage)) for stage in short())
                            + refusals_of([link for link in self.links if not link.welcomed])) from None
        for link in self._unused():
            self.links.remove(link)
            await transport.disconnect(link.name, linger_s=0.0)
            log.info("%s: the peer of stage %d at %s %s; not linked", self.name, link.stage, link.contact,
                     "did not welcome this peer: its record is stale" if not link.welcomed else
                     "welcomed this peer, but its stage has one peer, which another record's holds")
        for link in self.links:  # raises if the neighbour cannot take the codebook slices this link sends
            if link.codebooks is not None:
                link.codebooks.check_capabilities()
        log.info("%s: handshake done with stage(s) %s", self.name, self.links.stages)

    def _short_of(self, stage: int, want: int) -> str:
        welcomed = sum(link.welcomed for link in self.links.of_stage(stage))
        if self.one_per_stage:
            return f"no peer of stage {stage} welcomed this peer"
        return (f"{welcomed} of stage {stage}'s {want} replicas (replicas.initial, or those a re-formed swarm "
                f"keeps) welcomed this peer: start the missing ones; a replica whose host is gone for good is not "
                f"waited for once replicas.initial of stage {stage} is lowered on every host (add a host later "
                f"with --join)")

    def _unused(self) -> list[PeerLink]:
        """After the handshake, the links dropped: those not welcomed, and in a chain every link of a
        stage but one (the one whose peer this peer is in session with both ways, else the first
        welcomed)."""
        unused = [link for link in self.links if not link.welcomed]
        if self.one_per_stage:
            for stage in self.links.stages_expected:
                welcomed = [link for link in self.links.of_stage(stage) if link.welcomed]
                keep = next((link for link in welcomed if link.rx is not None), welcomed[0] if welcomed else None)
                unused += [link for link in welcomed if link is not keep]
        return unused

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

    def unknown(self, stage: int) -> None:
        """A HELLO came from a peer of neighbour ``stage`` this peer has no link to: read the
        records now."""
        self._read.set()

    def welcomed(self) -> None:
        """A neighbour welcomed this peer (a new link may wait for it)."""
        self._welcomed.set()

    async def watch(self, transport: Any, spawn: Callable[[Any], Any]) -> None:
        """With replicas, while training: link every replica of a neighbour stage announced since
        (module docstring)."""
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
        """HELLO to a new link's replica until it welcomes this peer; dropped after ``net.timeout_s``
        or a refusal."""
        deadline = time.monotonic() + self.timeout_s
        while not link.welcomed:
            left = deadline - time.monotonic()
            if left <= 0 or link.refusal is not None:
                self.stale.add(link.contact or "")
                self.links.remove(link)
                await transport.disconnect(link.name, linger_s=0.0)
                log.warning("%s: the replica of stage %d at %s %s; not linked", self.name, link.stage, link.contact,
                            f"refused this peer ({link.refusal})" if link.refusal is not None else
                            f"did not welcome this peer within {self.timeout_s:g} s: its record is stale")
                return
            await link.send_hello(anchored=self.links.anchored)
            self._welcomed.clear()
            try:
                await within(self._welcomed.wait(), min(self.hello_retry_s, left))
            except TimeoutError:
                pass
