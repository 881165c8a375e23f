"""Graceful drain: on SIGINT or SIGTERM every stage stops after the same step, checkpoints it, exits 0.

Ctrl-C in a terminal reaches every process of a local swarm at once; ``docker stop`` or a
scheduler's SIGTERM may reach one peer only. Either way the swarm agrees on one step ``D`` and
every stage saves step ``D`` (even when the checkpoint interval is not due), so a ``--resume``
continues from there with nothing lost but the step in flight when stage 0 decided (SPEC §5.2,
"Drain"; capability ``drain``):

1. A stage asked to drain (:meth:`Drain.request`) that is not stage 0 sends CHECKPOINT
   ``drain_request`` upstream; a middle stage relays the first request it hears (or sends its own),
   so stage 0 hears of it.
2. Stage 0, asked by a signal or a request, decides at its next step boundary: ``D`` = the steps it
   has completed (the step in flight is finished, never abandoned half-way — some stages may already
   have taken its optimizer step). :meth:`Drain.decide` sends CHECKPOINT ``drain`` with ``step``
   ``D`` downstream; every stage relays it.
3. Every stage saves step ``D``: at its step end ``D``, or at once if it has passed it
   (``on_decided``, the run policy's :meth:`~.checkpoints.PeerRunPolicy.drain_at`); checkpoint
   agreement then runs as for every save. Stage 0 waits until ``D`` is complete and sends BYE with
   ``reason`` ``"drain"`` (header ``step`` ``D``); every stage relays it and ends, exit status 0.

A second signal stops a peer at once (:class:`Interrupted`, exit status 130): the step in flight
is lost, the newest complete checkpoint stays. :class:`DrainSignals` installs the handlers on the
peer's event loop, so a signal never raises inside it.

A BYE ``"drain"`` is a *planned* departure: a peer that receives one ends cleanly (exit 0) even if
it was not asked to drain itself. From downstream (a neighbour that left on its own) it is a departure
(:mod:`~.departures`): with live rejoin the swarm re-forms around a replacement, without it this peer ends.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from mapl_swarm.errors import MaplError
from mapl_swarm.wire import Message
from mapl_swarm.wire.spec import DRAIN_CAPABILITY, DRAIN_PHASES

if TYPE_CHECKING:
    from mapl_swarm.peer.checkpoints import PeerRunPolicy

log = logging.getLogger(__name__)

__all__ = ["Drain", "DrainSignals", "Interrupted", "drained_at", "checkpoint_note", "DRAIN_CAPABILITY", "DRAIN_PHASES",
           "DRAIN_REASON"]

DRAIN_REASON = "drain"
"""BYE ``reason`` of a planned departure (SPEC §9.5)."""

Send = Callable[[int, dict[str, Any]], Awaitable[None]]


class Interrupted(MaplError):
    """Stopped at once by a second signal: the step in flight is lost. Exit status 130."""

    exit_code = 130
    label = "stopped"


class Drain:
    """Stage ``stage``'s side of the drain protocol (no sockets: ``send(dst, meta)`` sends a
    CHECKPOINT to a neighbour, ``can_send(dst)`` says whether that neighbour takes part).
    ``on_decided(step)`` runs once the swarm's drain step is known here (the run policy saves it)."""

    def __init__(self, stage: int, num_stages: int, *, send: Send | None = None,
                 can_send: Callable[[int], bool] = lambda dst: True,
                 on_decided: Callable[[int], Awaitable[None]] | None = None) -> None:
        self.stage = stage
        self.up = stage - 1 if stage > 0 else None
        self.down = stage + 1 if stage < num_stages - 1 else None
        self.send = send
        self.can_send = can_send
        self.on_decided = on_decided
        self.requested: str | None = None
        """Why this stage was asked to drain (``"SIGINT at stage 2"``); None: not asked."""
        self.step: int | None = None
        """The swarm's drain step, once stage 0 decided it."""
        self.reason: str | None = None
        """The reason stage 0 announced with it."""
        self._asked_upstream = False

    @property
    def active(self) -> bool:
        """Asked to drain, or a drain step is decided."""
        return self.requested is not None or self.step is not None

    async def request(self, reason: str) -> None:
        """Drain this stage (a signal): stage 0 stops at its next step boundary; any other stage asks
        stage 0 through its upstream neighbour. Raises :class:`MaplError` when that neighbour does
        not take part in drains (an older peer)."""
        if self.requested is None:
            self.requested = reason
        if self.up is not None and self.step is None:
            await self._ask_upstream(reason)

    async def _ask_upstream(self, reason: str) -> None:
        if self._asked_upstream:
            return
        if self.send is None or not self.can_send(self.up):
            raise MaplError(f"stage {self.stage}: cannot drain: stage {self.up} does not take part in drains "
                            f"(capability {DRAIN_CAPABILITY!r})")
        self._asked_upstream = True
        log.info("stage %d: asking stage 0 to drain the swarm (%s)", self.stage, reason)
        await self.send(self.up, {"phase": "drain_request", "reason": reason})

    async def on_message(self, msg: Message) -> None:
        """A CHECKPOINT ``drain_request`` (from downstream) or ``drain`` (from upstream)."""
        phase, meta = msg.meta["phase"], msg.meta
        if phase == "drain_request":
            if msg.src != self.down:
                log.warning("stage %d: ignored a drain request from stage %s", self.stage, msg.src)
                return
            reason = str(meta.get("reason") or f"asked by stage {msg.src}")
            if self.step is not None:
                return  # decided already
            if self.up is None:
                if self.requested is None:
                    self.requested = reason
                    log.info("stage 0: drain requested (%s): stopping at the next step boundary", reason)
                return
            if self.requested is None:
                self.requested = reason
            try:
                await self._ask_upstream(reason)
            except MaplError as exc:
                log.warning("%s", exc)
            return
        if msg.src != self.up:
            log.warning("stage %d: ignored a drain decision from stage %s", self.stage, msg.src)
            return
        await self._decided(int(meta["step"]), str(meta.get("reason") or ""))

    def should_stop(self) -> bool:
        """Stage 0, at a step boundary: whether to stop here."""
        return self.requested is not None

    async def decide(self, step: int) -> None:
        """Stage 0: the swarm drains at ``step`` (the steps completed); tell every stage."""
        await self._decided(step, self.requested or "")

    async def _decided(self, step: int, reason: str) -> None:
        if self.step is not None:
            return
        self.step, self.reason = step, reason
        log.info("stage %d: the swarm drains at step %d (%s)", self.stage, step, reason or "no reason given")
        if self.down is not None and self.send is not None and self.can_send(self.down):
            await self.send(self.down, {"phase": "drain", "step": step, **({"reason": reason} if reason else {})})
        if self.on_decided is not None:
            await self.on_decided(step)


def drained_at(drain: Drain, bye: Message | None) -> int | None:
    """The step this stage drained at, once its schedule ended: the decided one, or the step of a BYE
    ``"drain"`` from upstream; None when the run was not drained."""
    if drain.step is not None:
        return drain.step
    if bye is not None and bye.meta.get("reason") == DRAIN_REASON:
        return bye.step
    return None


def checkpoint_note(policy: PeerRunPolicy | None, step: int, start_step: int) -> str:
    """What became of a drain step's (or the last step's) checkpoint at this stage, in words."""
    if policy is None:
        return "this peer keeps no checkpoints"
    if not policy.checkpoints_on:
        return "no checkpoint saved (checkpoint.interval_steps = 0)"
    if step <= start_step:
        return f"nothing trained since step {step}, where this run started"
    if step in policy.agreement.declared:
        return f"checkpoint of step {step} saved by every stage; continue with --resume"
    reason = policy.unsaved_reason(step)
    if reason is not None:
        return (f"checkpoint of step {step} is not complete ({reason}); the newest complete checkpoint is step "
                f"{policy.newest_complete}")
    if policy.saved(step):
        return f"checkpoint of step {step} saved here (not confirmed by every stage)"
    return f"no checkpoint of step {step} here"


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
