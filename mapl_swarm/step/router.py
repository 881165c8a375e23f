"""Which downstream replica each train micro-batch goes to (SPEC §9.10 item 4)."""

from __future__ import annotations

import hashlib
from collections import Counter
from collections.abc import Sequence

__all__ = ["Router"]

_EMA = 0.3
"""Weight of the newest round trip in a link's mean."""


class Router:
    """Draws the downstream link of each train micro-batch: ``uniform``, or ``throughput``: weighted
    by ``1 / (mean round trip × (1 + ACTs in flight))`` of each link (SWARM's stochastic wiring: a
    faster, less loaded replica gets more); a link without a measured round trip counts as a
    typical one. The draw of micro-batch m of step s at stage k is a function of (``seed``, k, s, m)
    and the weights, so runs with the same weights route the same way. Links are named (their
    transport names); times are what the caller's clock says."""

    def __init__(self, *, routing: str, seed: int, stage: int) -> None:
        self.routing, self.seed, self.stage = routing, seed, stage
        self.mean_s: dict[str, float] = {}
        """Per link name: the mean seconds from an ACT's send to its GRAD."""
        self.in_flight: Counter[str] = Counter()

    def draw(self, step: int, micro: int) -> float:
        """The uniform number in [0, 1) of micro-batch ``micro`` of ``step``."""
        h = hashlib.sha256(f"route/{self.seed}/{self.stage}/{step}/{micro}".encode()).digest()
        return int.from_bytes(h[:8], "big") / 2 ** 64

    def weights(self, links: Sequence[str]) -> list[float]:
        if self.routing == "uniform":
            return [1.0] * len(links)
        known = [self.mean_s[name] for name in links if name in self.mean_s]
        typical = sum(known) / len(known) if known else 1.0
        return [1.0 / (self.mean_s.get(name, typical) * (1 + self.in_flight[name])) for name in links]

    def pick(self, links: Sequence[str], step: int, micro: int) -> str:
        """The link micro-batch ``micro`` of ``step`` goes on, of ``links`` (in contact order)."""
        weights = self.weights(links)
        x = self.draw(step, micro) * sum(weights)
        for name, w in zip(links, weights):
            if x < w:
                return name
            x -= w
        return links[-1]

    def sent(self, link: str) -> None:
        self.in_flight[link] += 1

    def returned(self, link: str, seconds: float) -> None:
        self.in_flight[link] -= 1
        old = self.mean_s.get(link)
        self.mean_s[link] = seconds if old is None else (1 - _EMA) * old + _EMA * seconds

    def forget(self, link: str) -> None:
        """``link`` is gone: what was in flight on it is not coming back."""
        self.in_flight.pop(link, None)
