"""Neighbours that left, as events: who, where, when last heard from, and whether it was planned.

A neighbour leaves in one of three ways (SPEC §9.5): it goes **silent** (nothing heard past its
liveness deadline, :mod:`mapl_swarm.net.heartbeat`: killed, its host or link down, stopped longer
than the ceiling), it **left** before the end with a BYE from downstream (e.g. a NaN in its own
compute), or it **drained**: BYE with ``reason`` ``"drain"``, a planned departure.

The peer reports each one to :class:`Departures` as a :class:`Departure`. What a departure does is
its ``policy``'s business (:meth:`~.runtime.Peer._on_departure`): during training, with live
rejoin, the peer pauses and the swarm re-forms around a replacement of the stage (SPEC §9.6);
without it the peer ends (an unplanned departure with :class:`NeighbourLost`, exit status 2,
naming the stage, its address and when it was last heard from; a planned one cleanly, exit 0).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

from mapl_swarm.errors import MaplError

__all__ = ["Departure", "Departures", "NeighbourLost", "TakenForGone"]

Kind = Literal["silent", "left", "drain"]


@dataclass(frozen=True)
class Departure:
    """One neighbour's departure, as this peer saw it."""

    stage: int
    endpoint: str | None
    """Its ROUTER endpoint, where this peer dialled it (None: never found)."""
    kind: Kind
    """``silent`` (missed its liveness deadline), ``left`` (BYE before the end), ``drain`` (planned)."""
    last_seen: float
    """Wall-clock time (``time.time()``) it was last heard from."""
    detail: str
    """``silent since 12:03:04 (10.4 s; deadline 10.0 s, round trip 0.3 ms, longest gap 2.0 s)``, or
    the BYE's reason."""
    at: float = field(default_factory=time.time)
    """When this peer noticed."""

    @property
    def planned(self) -> bool:
        return self.kind == "drain"

    def describe(self) -> str:
        """``stage 2 at tcp://10.0.0.3:5001 silent since 12:03:04 (10.4 s; ...)`` and the like."""
        where = f" at {self.endpoint}" if self.endpoint else ""
        if self.kind == "silent":
            return f"stage {self.stage}{where} {self.detail}"
        if self.kind == "drain":
            return f"stage {self.stage}{where} left the swarm (drain)"
        return f"stage {self.stage}{where} left before the end: {self.detail}"


class NeighbourLost(MaplError):
    """An unplanned departure ended this peer (exit status 2)."""

    def __init__(self, name: str, departure: Departure, hint: str = "") -> None:
        """``hint``: what the operator can do, appended to the message."""
        self.departure = departure
        super().__init__(f"{name}: {departure.describe()}{hint}")


class TakenForGone(MaplError):
    """This replica left because the swarm took it for gone (exit status 4): a neighbour stopped
    hearing from it within its liveness deadline, every other member followed that word, and its
    stage went on with its other replicas (SPEC §9.10 item 10)."""

    exit_code = 4

    def __init__(self, name: str, why: str) -> None:
        self.why = why
        super().__init__(f"{name}: the swarm took this replica for gone ({why}), so it left; its stage goes on with "
                         f"its other replicas. On slow or busy links raise net.liveness_floor_s (README "
                         f"\"Liveness\")")


class Departures:
    """Departures in the order noticed; ``policy(departure)`` runs once per stage (a session's
    departures: the next session of the process has its own)."""

    def __init__(self, policy: Callable[[Departure], None]) -> None:
        self.policy = policy
        self.events: list[Departure] = []
        """Every departure reported, oldest first."""
        self._open: dict[int, Departure] = {}

    def report(self, departure: Departure) -> bool:
        """Record ``departure`` and apply the policy; False (nothing done) when that stage's earlier
        departure is still open (e.g. silent, then its BYE arrives late)."""
        if departure.stage in self._open:
            return False
        self._open[departure.stage] = departure
        self.events.append(departure)
        self.policy(departure)
        return True

    def gone(self, stage: int) -> Departure | None:
        """The open departure of ``stage`` (None: it is here)."""
        return self._open.get(stage)
