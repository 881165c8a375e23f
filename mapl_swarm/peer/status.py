"""What a peer publishes about itself in the DHT: its status record (SPEC §9.1 "Status records").

``mapl-swarm status`` reads the records of every stage: each peer (each replica of a stage) with
its lifecycle state, its step, the tokens per second it trains (its own micro-batches: with
replicas only those routed to it), the pipeline messages waiting in its queue and its capacity: the
tokens it trains per second of compute (what it would train were it never waiting), which a peer
that picks its stage reads (:mod:`~mapl_swarm.replicas.rebalance`). The record is
informational: nothing of the run's control flow reads it (a peer that picks its stage weighs it).

:class:`StatusSource` is called on the DHT refresh thread (:meth:`~mapl_swarm.net.discovery.Discovery.publish_status`)
and reads the current session's peer, which the event loop replaces at each re-form: it reads a
few attributes and never calls into the loop.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Any

from mapl_swarm.net.discovery import MAX_STATUS_CODES, MAX_STATUS_LINKS

__all__ = ["StatusSource"]


class StatusSource:
    """``source()`` -> the status record of the peer in ``source.peer`` (None before the first
    session: state ``starting``); tokens per second over the last ``window_s`` seconds of calls."""

    def __init__(self, window_s: float = 20.0) -> None:
        self.peer: Any = None
        self.window_s = window_s
        self._samples: deque[tuple[float, int, float]] = deque()  # (monotonic time, tokens, compute s) per call
        self._link_totals: tuple[float, dict[str, list[int]]] | None = None  # (time, link -> [tx, rx] bytes)

    def __call__(self) -> dict[str, Any]:
        peer = self.peer
        if peer is None:
            return {"state": "starting", "step": 0, "tokens_per_s": 0.0, "queue": 0, "capacity": 0.0}
        now, tokens, busy = time.monotonic(), peer.rt.tokens_trained, peer.compute.busy_s
        if self._samples and tokens < self._samples[-1][1]:  # another stage runtime (a re-formed session)
            self._samples.clear()
        self._samples.append((now, tokens, busy))
        while len(self._samples) > 2 and now - self._samples[1][0] >= self.window_s:
            self._samples.popleft()
        then, before, busy_before = self._samples[0]
        rate = (tokens - before) / (now - then) if now > then else 0.0
        capacity = (tokens - before) / (busy - busy_before) if busy > busy_before else 0.0
        averaging = getattr(peer.schedule, "replicas", None)
        return {"state": peer.state.value, "step": int(peer.schedule.step), "tokens_per_s": round(rate, 1),
                "queue": peer.mailbox.waiting, "capacity": round(capacity, 1),
                **({"averaging": averaging.scheme, "averaging_bytes": int(averaging.last_sent)}
                   if averaging is not None else {}),
                **({"relayed_bytes": int(peer.transport.relay.bytes)}
                   if getattr(peer.transport, "relay", None) is not None else {}),
                "links": self._links(peer, now),
                "rejects": dict(sorted(dict(peer.result.rejects).items())[:MAX_STATUS_CODES])}

    def _links(self, peer: Any, now: float) -> list[dict[str, Any]]:
        """Per neighbour link: bytes per second each way since the previous record (on the wire,
        headers included), the link's emulated rate (0: not shaped here) and, for a link this peer
        watches (the one it dialed, ``stage2@<contact hash>``), round trip and silence. The
        transport counts what it receives under the sender's stage name (``stage2``: from every
        replica of stage 2 together), and the replies it sends there: those are entries of their own."""
        totals: dict[str, list[int]] = {}
        if peer.transport is not None:
            for row in peer.transport.counters.rows():
                totals.setdefault(str(row["link"]), [0, 0])[row["direction"] == "rx"] += int(row["wire_bytes"])
        then, self._link_totals = self._link_totals, (now, totals)
        dt = now - then[0] if then is not None else 0.0
        rate_bps = peer.cfg.net.bandwidth_mbps * 1e6 / 8
        watched = peer.monitor.figures()
        out = []
        for name in sorted({*watched, *totals})[:MAX_STATUS_LINKS]:
            tx, rx = totals.get(name, [0, 0])
            before = then[1].get(name, [tx, rx]) if then is not None else [tx, rx]
            link = {"peer": name[:64], "tx_bps": round((tx - before[0]) / dt, 1) if dt > 0 else 0.0,
                    "rx_bps": round((rx - before[1]) / dt, 1) if dt > 0 else 0.0, "rate_bps": rate_bps}
            if name in watched:
                rtt_s, heard_s = watched[name]
                link["heard_s"] = round(heard_s, 2)
                if rtt_s is not None:
                    link["rtt_s"] = round(rtt_s, 4)
            out.append(link)
        return out
