"""A swarm peer's live counters for its Prometheus endpoint (:class:`~mapl_swarm.metrics.export.LiveFigures`).

They are read on the exporter's HTTP thread from the current session's peer (``status.peer``, which
the event loop replaces at each re-form, as for the status record): attributes only, and the
dictionaries the event loop fills are copied whole (one C-level copy under the GIL) before they are
read. A counter restarts with a session's peer where the peer keeps it per session (rejects,
averaging bytes); Prometheus takes a counter that goes down for a restart. Transport bytes are the
process's.
"""

from __future__ import annotations

from mapl_swarm.metrics.export import LiveFigures
from mapl_swarm.peer.status import StatusSource

__all__ = ["live_figures"]

def live_figures(status: StatusSource) -> LiveFigures:
    """The counters of ``status.peer`` (nothing before the first session)."""

    def link_bytes() -> list[tuple[str, str, str, int]]:
        peer = status.peer
        if peer is None:
            return []
        rows: list[tuple[str, str, str, int]] = []
        transport = peer.transport
        if transport is not None:
            rows += [(str(r["link"]), str(r["direction"]), str(r["kind"]), int(r["wire_bytes"]))
                     for r in transport.counters.rows()]
        averaging = dict(peer.result.averaging)  # one copy: the event loop adds to it
        if averaging:
            rows += [("averaging", "tx", "averaging", int(averaging.get("sent_bytes", 0))),
                     ("averaging", "rx", "averaging", int(averaging.get("received_bytes", 0)))]
        return rows

    def rejected() -> dict[str, int]:
        peer = status.peer
        return {} if peer is None else {str(k): int(v) for k, v in dict(peer.result.rejects).items()}

    def replicas() -> int | None:
        peer = status.peer
        return int(peer.schedule.live_replicas()) if peer is not None and peer.replicas_on else None

    def redos() -> int:
        peer = status.peer
        return 0 if peer is None else int(peer.schedule.redos)

    return LiveFigures(link_bytes=link_bytes, rejected=rejected, replicas=replicas, redos=redos)
