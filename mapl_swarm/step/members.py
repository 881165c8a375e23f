"""A stage's replicas as one of them knows them (SPEC §9.10 items 2, 3, 6, 10, 11): who is live, who left,
its rank, and how many a round of its stage must wait for."""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence

from mapl_swarm.step.rounds import ReplicaStep

log = logging.getLogger(__name__)

__all__ = ["Members", "MAX_GONE", "MAX_CONTACT"]

MAX_GONE = 64
MAX_CONTACT = 512
"""Bounds on a ROUTE ``gone`` list a neighbour sends, and on a downloaded list of contacts (entries
beyond them are not read)."""


def member_of(contact: str) -> str:
    """Who announced ``contact``: a certified peer's contact ends in its certificate's CURVE key
    (``#`` and 64 hex digits), the same whatever host and port it serves on; an insecure one is
    known by its contact only."""
    return contact.rpartition("#")[2] or contact


class Members:
    """The replicas of this peer's stage (``starting``: how many start together) and every replica of
    any stage known gone, by contact. ``timeout_s``: how long a replica announced in the DHT is
    waited for in rounds before it came to one (``net.timeout_s``)."""

    def __init__(self, name: str, stage: int, *, starting: int, timeout_s: float) -> None:
        self.name, self.stage, self.timeout_s = name, stage, timeout_s
        self.starting = starting
        """The replicas of this stage that start together (their first round's size)."""
        self.gone: set[str] = set()
        """Contacts of the replicas (of any stage) known to have left the run."""
        self.round: ReplicaStep | None = None
        """This stage's last averaging round: its members, ranks and contacts."""
        self.rank, self.count = 0, 1
        """This replica's rank among the stage's live replicas, and their number (stage 0 splits
        the data by them)."""
        self.hint: list[str] = []
        """A joining replica's partners before its first round: the contacts its state's sender named."""
        self.announced: dict[str, float] = {}
        """Members (:func:`member_of` their contacts) of this stage's DHT records not in a round yet:
        when this replica first saw one of the member's records (-1 once it stopped waiting for it)."""
        self.members_text = ""
        self.gone_text = ""
        """The stage's live replicas and those gone (contacts, one per line), for a joiner's download
        (read in another thread: replaced whole, never changed in place)."""

    # ------------------------------------------------------------------ the round's view
    def live(self) -> list[str]:
        """The peer ids of this stage's live replicas, this one included, in rank order (the last
        round's, less those gone)."""
        r = self.round
        if r is None:
            return []
        return [p for p in r.group if p == r.me or r.contacts.get(p) not in self.gone]

    def ranked(self, round_: ReplicaStep) -> None:
        """``round_`` ranks the stage's replicas for the next step; its members' records are waited
        for afresh should they announce new ones later (a replica restarted on another port)."""
        self.round = round_
        self.rerank()
        for contact in round_.contacts.values():
            self.announced.pop(member_of(contact), None)
        self.members_text = "\n".join(round_.contacts.get(p, "") for p in self.live())

    def rerank(self) -> None:
        live = self.live()
        if live:
            self.rank, self.count = live.index(self.round.me), len(live)

    def live_count(self) -> int:
        """The live replicas of this stage, this one included (before its first round: those that
        start with it)."""
        return len(self.live()) or self.starting

    def in_round(self, contact: str | None) -> bool:
        """``contact`` is a member of this stage's last round."""
        return self.round is not None and contact in self.round.contacts.values()

    # ------------------------------------------------------------------ departures
    def learn_gone(self, contacts: Iterable[str]) -> list[str]:
        """Note replicas at ``contacts`` gone; the ones that were not known gone before."""
        fresh = [c for c in contacts if c not in self.gone]
        if fresh:
            self.gone.update(fresh)
            self.gone_text = "\n".join(sorted(self.gone))
        return fresh

    @staticmethod
    def named(contacts: object, own: set[str]) -> list[str]:
        """The contacts a neighbour's ROUTE names (bounded, strings only), but ``own`` (this peer's and
        its links': of its own links its liveness deadline and their BYEs decide)."""
        if not isinstance(contacts, list):
            return []
        return [c for c in contacts[:MAX_GONE]
                if isinstance(c, str) and c and len(c) <= MAX_CONTACT and c not in own]

    def joined(self, members: str, gone: str) -> None:
        """A joining replica's download named the stage's live replicas and those gone."""
        self.learn_gone([c for c in gone.split("\n")[:MAX_GONE] if c and len(c) <= MAX_CONTACT])
        self.hint = [c for c in members.split("\n")[:MAX_GONE] if c and len(c) <= MAX_CONTACT]

    # ------------------------------------------------------------------ a round's size
    def expected(self, contact: str, announced: Sequence[str], now: float) -> int:
        """How many replicas this stage's round needs (SPEC §9.10 items 6, 11), counted by contact:
        its live ones (the last round's, or a joining replica's partners as its state's sender named
        them, less those gone) and any replica of the stage ``announced`` in the DHT since (one that
        joins), for ``timeout_s`` from when this replica first saw a record of that member: one
        that has not come to a round by then (a stale record, or a member that announces itself and
        never joins) is not waited for any longer, whatever new records (other ports) it announces,
        until it takes part in a round."""
        r = self.round
        live = {r.contacts.get(p, p) for p in self.live()} if r is not None else {*self.hint, contact} - self.gone
        members = {member_of(c) for c in live}
        for c in announced:
            member = member_of(c)
            if c and c not in self.gone and member not in members:
                since = self.announced.setdefault(member, now)
                if now - since <= self.timeout_s:
                    live.add(c)
                    members.add(member)
                elif since > 0:
                    self.announced[member] = -1.0  # said once
                    log.warning("%s: the replica of stage %d at %s announced itself %.0f s ago and has not come to "
                                "a round: not waited for", self.name, self.stage, c, now - since)
        return len(live)
