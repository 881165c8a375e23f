"""SIGINT and SIGTERM of a peer: the first drains the swarm, a second stops the peer at once.

Ctrl-C in a terminal reaches every process of a local swarm at once; ``docker stop`` or a
scheduler's SIGTERM may reach one peer only. Either way the first signal drains the swarm (every
stage stops after the same step and saves it: :class:`~.checkpoints.CheckpointAgreement`, SPEC
§5.2 "Drain"). A second signal stops a peer at once (:class:`Interrupted`, exit status 130): the
step in flight is lost, the newest complete checkpoint stays. :class:`DrainSignals` installs the
handlers on the peer's event loop, so a signal never raises inside it.
"""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Callable
from typing import Any

from mapl_swarm.errors import MaplError

__all__ = ["DrainSignals", "Interrupted"]


class Interrupted(MaplError):
    """Stopped at once by a second signal: the step in flight is lost. Exit status 130."""

    exit_code = 130
    label = "stopped"


class DrainSignals:
    """While open, SIGINT and SIGTERM call ``drain(reason)`` the first time and ``abort(reason)``
    after that, as callbacks of ``loop`` (never raising inside it). The previous handlers come back
    on exit."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self, loop: asyncio.AbstractEventLoop, *, drain: Callable[[str], None],
                 abort: Callable[[str], None]) -> None:
        self.loop = loop
        self.drain, self.abort = drain, abort
        self.received: list[str] = []
        self._previous: dict[int, Any] = {}

    def _on_signal(self, sig: signal.Signals) -> None:
        self.received.append(sig.name)
        (self.drain if len(self.received) == 1 else self.abort)(sig.name)

    def __enter__(self) -> "DrainSignals":
        for sig in self.SIGNALS:
            self._previous[sig] = signal.getsignal(sig)
            self.loop.add_signal_handler(sig, self._on_signal, sig)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, previous in self._previous.items():
            self.loop.remove_signal_handler(sig)
            signal.signal(sig, previous if previous is not None else signal.SIG_DFL)
