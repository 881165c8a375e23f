"""Which stage a replica started without ``--stage`` joins (SWARM's rebalancing, SPEC §9.10 item 11).

Every peer publishes its capacity in its status record: the tokens it trains per second of compute
(:mod:`~mapl_swarm.peer.status`). Every stage of a pipeline trains every token, and a micro-batch
goes to any replica of the next stage, so a stage trains as fast as the sum of its replicas'
capacities and the swarm as fast as its slowest stage: a new replica adds most to the stage of
least total capacity. A replica that published no capacity yet (it just started) counts as the
mean of those that did; ties go to the stage with fewer replicas, then the lower stage. Only
stages the caller may join are weighed (its certificate's, whose replicas average), and only those
with a live replica (one to download the state from).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

__all__ = ["StageLoad", "pick_stage"]


class _Peer(Protocol):
    contact: str
    status: dict[str, Any]


@dataclass(frozen=True)
class StageLoad:
    """A stage as the picker weighs it."""

    stage: int
    replicas: int
    capacity: float
    """Tokens per second its replicas can train, summed (unknown ones counted at the mean)."""


def pick_stage(peers: Mapping[int, Sequence[_Peer]], candidates: Iterable[int]) -> tuple[int | None, list[StageLoad]]:
    """The stage of ``candidates`` to join (module docstring) given each stage's peers as the DHT
    shows them (:meth:`~mapl_swarm.net.discovery.Discovery.stage_peers`), and every candidate's
    load; None when no candidate has a live replica."""
    live = {k: [p for p in peers.get(k, ()) if p.contact] for k in candidates}
    known = [float(p.status.get("capacity", 0.0)) for ps in live.values() for p in ps
             if float(p.status.get("capacity", 0.0)) > 0.0]
    mean = sum(known) / len(known) if known else 1.0
    loads = [StageLoad(k, len(ps), sum(float(p.status.get("capacity", 0.0)) or mean for p in ps))
             for k, ps in sorted(live.items()) if ps]
    if not loads:
        return None, []
    best = min(loads, key=lambda s: (s.capacity, s.replicas, s.stage))
    return best.stage, loads
