"""What a stage peer measured, and its result file (``peer_stage{S}.json``, read by ``launch``)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from collections.abc import Iterable
from typing import Any

__all__ = ["PeerResult", "collect", "write_result", "peak_rss_mb"]


@dataclass
class PeerResult:
    """What a peer measured; stage 0 also holds the swarm's losses."""

    stage: int
    train_losses: list[float] = field(default_factory=list)
    report_times_s: list[float] = field(default_factory=list)
    """Seconds since the handshake at which each step's REPORT reached stage 0."""
    val_history: list[tuple[int, float]] = field(default_factory=list)
    tokens: int = 0
    wall_s: float = 0.0
    bad_frames: int = 0
    """Received messages dropped, whatever the reason (the sum of ``rejects``)."""
    rejects: dict[str, int] = field(default_factory=dict)
    """Received messages dropped, by code: wire errors (``malformed_header``, ``version_mismatch``...),
    who-may-say-what and session rules (``not_allowed``, ``wrong_session``, ``replay``,
    ``stage_taken``...), content errors (``wrong_shape``, ``non_finite``, ``out_of_window``...) and
    ``queue_full`` (SPEC §6)."""
    errors: dict[str, int] = field(default_factory=dict)
    """ERROR messages received from neighbours, by code (informational, SPEC §9.5)."""
    payload_tx: dict[str, dict[str, int]] = field(default_factory=dict)
    """Payload bytes sent per link and kind (:class:`~mapl_swarm.pipeline.payload.LinkKind` values)."""
    wire_tx: dict[str, dict[str, int]] = field(default_factory=dict)
    """Bytes handed to ZeroMQ per link and message type (headers included)."""
    shaper: dict[str, dict[str, float]] = field(default_factory=dict)
    """Per outbound link: shaped bytes sent and seconds the emulated link spent transmitting."""
    averaging: dict[str, int] = field(default_factory=dict)
    """With replicas (SPEC §9.10): this replica's averaging rounds and the tensor bytes their
    all-reduces sent and received (``rounds``, ``sent_bytes``, ``received_bytes``)."""
    checking: dict[str, Any] = field(default_factory=dict)
    """With ``replicas.check_fraction`` (SPEC §9.10 item 15): what checking the partners' work cost
    and found (:attr:`~mapl_swarm.replicas.checker.ShareChecker.counters`: shares checked and found
    wrong, micro-batches recomputed, seconds, inputs' bytes received and served) and the members
    the stage's rounds excluded (``excluded``: contact, step)."""
    codebooks: dict[str, Any] = field(default_factory=dict)
    """mapl_vq: slices applied/ignored/rejected (by error code), RESYNCs, versions and digests."""
    end: str = "finished"
    """How the peer ended (exit status 0 each): ``finished`` (the run's last step), ``drained`` (a
    graceful drain: every stage stopped after ``drained_at``), ``stopped`` (a signal before training
    started, or a neighbour's planned departure); ``rejoin`` only between two sessions of one
    process (:mod:`~.sessions`), never in a result file."""
    end_note: str = ""
    """For an end other than ``finished``: the one line to print."""
    drained_at: int | None = None
    """``drained``: the step every stage stopped after (and checkpointed, with checkpoints on)."""
    checkpoint_note: str = ""
    """``drained``: what became of that step's checkpoint (saved by every stage, not saved...);
    ``finished``: set only when the last step's checkpoint will never be complete (a stage could not
    save it: SPEC §5.2 ``unsaved``)."""
    start_step: int = 0
    """The step this peer's (last) session started from: 0, a resume's, or a rollback's."""
    epoch: int = 0
    """The swarm's run epoch at the end: how many times it re-formed after a departure (SPEC "Rejoin")."""
    rejoins: list[str] = field(default_factory=list)
    """One line per time this peer paused and the swarm re-formed (why, and the step it rolled back to)."""
    peak_rss_mb: float = 0.0
    """The peer process's peak resident set size (``VmHWM``) in MiB, read when it finished (0: not
    measured, e.g. a peer driven in-process)."""


def collect(result: PeerResult, transport: Any, links: Iterable[Any], rejects: Any,
            codebooks: dict[str, Any] | None) -> None:
    """The links' and transport's counters (and mapl_vq's codebook summary) into ``result``."""
    result.bad_frames = rejects.total
    rows = transport.counters.rows()
    for link in links:
        result.payload_tx[link.name] = {str(k): v for k, v in link.counter.bytes.items()}
        result.wire_tx[link.name] = {r["kind"]: r["wire_bytes"] for r in rows
                                     if r["link"] == link.name and r["direction"] == "tx"}
        st = transport.shaper(link.name).stats()
        result.shaper[link.name] = {"bytes_sent": st.bytes_sent, "busy_s": st.busy_s, "messages": st.messages_sent}
    if codebooks is not None:
        result.codebooks = codebooks


def peak_rss_mb() -> float:
    """This process's peak resident set size so far (``VmHWM`` of ``/proc/self/status``), in MiB;
    0.0 where that file does not exist."""
    try:
        with open("/proc/self/status", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024  # kB
    except OSError:
        pass
    return 0.0


def write_result(result: PeerResult, out_dir: str | Path) -> Path:
    path = Path(out_dir) / f"peer_stage{result.stage}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result.__dict__, indent=2))
    return path
