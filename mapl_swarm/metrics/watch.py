"""``mapl-swarm status --watch``: a live terminal table of every stage's peers, from their status
records (SPEC §9.1), redrawn every few seconds with ``rich``.

One row per peer (each replica of each stage): its lifecycle state, step, tokens per second, queue,
per neighbour link the bytes per second sent and received against the link's emulated rate, the
round trip and how long ago the neighbour was last heard, the messages it rejected by code, and
how old its record is (a peer that stopped storing records shows as silent).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["status_table", "watch"]


def _mb(bps: float) -> str:
    return f"{bps / 1e6:.2f}"


def _link_line(link: dict[str, Any]) -> str:
    rate = f"/{_mb(link['rate_bps'])}" if link.get("rate_bps") else ""
    rtt = f" rtt {1000 * link['rtt_s']:.0f} ms" if "rtt_s" in link else ""
    heard = f" heard {link['heard_s']:.1f} s ago" if "heard_s" in link else ""
    return (f"{link['peer']}: ↑{_mb(link.get('tx_bps', 0.0))}{rate} ↓{_mb(link.get('rx_bps', 0.0))} MB/s"
            f"{rtt}{heard}")


def status_table(run_id: str, stages: Sequence[Sequence[Any]], status_s: float) -> Any:
    """The table of ``stages`` (per stage, its :class:`~mapl_swarm.net.discovery.StagePeer` list)."""
    from rich.table import Table

    serving = sum(1 for peers in stages for p in peers if p.contact and not p.silent(status_s))
    table = Table(title=f"run {run_id!r}: {len(stages)} stages, {serving} peers serving "
                        f"({time.strftime('%H:%M:%S')})", expand=False)
    for name, justify in (("stage", "right"), ("peer", "left"), ("state", "left"), ("step", "right"),
                          ("tok/s", "right"), ("queue", "right"), ("links: sent/rate, received", "left"),
                          ("rejects", "left"), ("record", "left")):
        table.add_column(name, justify=justify)  # type: ignore[arg-type]
    for k, peers in enumerate(stages):
        if not peers:
            table.add_row(str(k), "[red]no peer[/red]", "", "", "", "", "", "", "")
            continue
        for p in peers:
            st = p.status
            silent = p.silent(status_s)
            heard = (f"[red]SILENT {p.heard_s:.0f} s[/red]" if silent else
                     f"{p.heard_s:.1f} s ago" if p.heard_s is not None else "never")
            rejects = ", ".join(f"{code} {n}" for code, n in sorted(st.get("rejects", {}).items())) or "-"
            table.add_row(str(k), f"{p.peer_id[:8]}…{p.peer_id[-6:]}", st.get("state", "?"), str(st.get("step", "")),
                          f"{st['tokens_per_s']:,.0f}" if "tokens_per_s" in st else "", str(st.get("queue", "")),
                          "\n".join(_link_line(link) for link in st.get("links", [])) or "-", rejects, heard)
    return table


def watch(read: Callable[[], Sequence[Sequence[Any]]], *, run_id: str, status_s: float, every_s: float,
          count: int | None, console: Any = None) -> None:
    """Redraw :func:`status_table` of ``read()`` every ``every_s`` seconds, ``count`` times (None:
    until interrupted)."""
    from rich.console import Console
    from rich.live import Live

    console = console or Console()
    shown = 0
    with Live(console=console, auto_refresh=False) as live:
        while count is None or shown < count:
            started = time.monotonic()
            live.update(status_table(run_id, read(), status_s), refresh=True)
            shown += 1
            if count is None or shown < count:
                time.sleep(max(0.0, every_s - (time.monotonic() - started)))
