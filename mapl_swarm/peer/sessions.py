"""A peer process across sessions: live rejoin without restarting the surviving peers.

A *session* is one :class:`~.runtime.Peer`: discovery, handshake, start-step agreement, training.
When a neighbour departs during training (or a neighbour says the swarm re-forms), the session
ends with ``result.end == "rejoin"`` (SPEC "Rejoin"); :func:`serve_sessions` then starts the next
one in the same process, on the same transport (its ROUTER, endpoint and routing id stay, so the
DHT record and the connections to the neighbours that stayed remain valid):

- the stage is built afresh from the config (its initial state from the run's seed), so the
  rollback is exactly a resume: the newest step every stage has complete is agreed by messages
  and loaded (data cursor included), or step 0 when no step is common;
- ``epoch`` is the run epoch the session re-forms at; the agreement makes it the swarm's;
- it waits up to ``net.rejoin_timeout_s`` for a replacement of the departed stage (``mapl-swarm
  peer --stage K --resume`` on any host with that stage's checkpoints and a certificate for it), logging
  ``waiting for a stage K peer``.

The result returned is the whole process's (:func:`merge`): the losses of the steps kept after
each rollback, counters summed over the sessions, and one line per rejoin.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from mapl_swarm.config import TrainConfig
from mapl_swarm.net.transport import Transport, peer_transport
from mapl_swarm.peer.link import stage_name
from mapl_swarm.peer.credits import Credits
from mapl_swarm.peer.result import PeerResult

if TYPE_CHECKING:
    from mapl_swarm.net.transport import Membership
    from mapl_swarm.peer.runtime import Peer

log = logging.getLogger(__name__)

__all__ = ["serve_sessions", "serve_until_signalled", "merge", "REJOIN_END", "REFORM_BACKOFF_S", "REFORM_BACKOFF_MAX_S",
           "reform_wait_s"]

REJOIN_END = "rejoin"
"""``PeerResult.end`` of a session that ended so that the swarm re-forms."""

REFORM_BACKOFF_S = 1.0
"""The wait before a session that re-forms the swarm when the session before it trained no step,
doubling with each such re-form in a row up to :data:`REFORM_BACKOFF_MAX_S`: a neighbour that keeps
re-forming (a fault, or a member's abuse) costs a bounded rate of rollbacks, not a busy loop."""
REFORM_BACKOFF_MAX_S = 8.0


def reform_wait_s(idle: int) -> float:
    """The wait before the next session after ``idle`` re-forms in a row without a step trained."""
    return 0.0 if idle <= 0 else min(REFORM_BACKOFF_S * 2 ** (idle - 1), REFORM_BACKOFF_MAX_S)

_LAST_WORDS_S = 1.0
"""After the last session, how long ZeroMQ may take to send what it still queues (a BYE)."""

def _sum_counts(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    """Counters by key, summed (nested dicts by key too)."""
    out = dict(a)
    for key, value in b.items():
        if isinstance(value, dict):
            out[key] = _sum_counts(out.get(key, {}), value)
        else:
            out[key] = out.get(key, 0) + value
    return out


def merge(before: PeerResult | None, after: PeerResult) -> PeerResult:
    """The process's result so far: ``before`` (the earlier sessions) then ``after`` (the next one,
    which started at ``after.start_step``). Losses after that step were rolled back (trained
    again in ``after``), so they are dropped; counters add up; the end is ``after``'s."""
    if before is None:
        return after
    keep = max(0, after.start_step - before.start_step)
    merged = PeerResult(after.stage)
    merged.__dict__.update(after.__dict__)
    merged.start_step = before.start_step
    merged.train_losses = before.train_losses[:keep] + after.train_losses
    merged.report_times_s = before.report_times_s[:keep] + after.report_times_s
    merged.val_history = [v for v in before.val_history if v[0] <= after.start_step] + after.val_history
    merged.tokens, merged.wall_s = before.tokens + after.tokens, before.wall_s + after.wall_s
    merged.bad_frames = before.bad_frames + after.bad_frames
    merged.rejects = _sum_counts(before.rejects, after.rejects)
    merged.errors = _sum_counts(before.errors, after.errors)
    merged.payload_tx = _sum_counts(before.payload_tx, after.payload_tx)
    merged.averaging = _sum_counts(before.averaging, after.averaging)
    merged.rejoins = before.rejoins + after.rejoins
    return merged  # wire_tx and shaper: the transport's counters, already over every session


async def serve_until_signalled(peer: Peer, transport: Transport | None = None) -> PeerResult:
    """``peer.run(transport)`` with SIGINT/SIGTERM handled on its event loop
    (:class:`~.signals.DrainSignals`): the first drains the swarm (:meth:`~.runtime.Peer.request_drain`),
    a second stops at once."""
    from mapl_swarm.peer.signals import DrainSignals

    with DrainSignals(asyncio.get_running_loop(), drain=peer.request_drain, abort=peer.abort):
        return await peer.run(transport)


async def serve_sessions(new_session: Callable[..., Peer], cfg: TrainConfig, stage: int, *,
                         membership: Membership | None, resume: bool) -> PeerResult:
    """Run sessions of stage ``stage`` on one transport until one ends otherwise than by a rejoin
    (see the module docstring); ``new_session(resume=, epoch=, rejoining=, reform=, credits=)``
    builds each one's peer (``reform``: with replicas, what the session before knew at its pause;
    ``credits``: each member's credit of re-forms and redos, the process's, :mod:`~.credits`).
    SIGINT/SIGTERM drain the swarm as in a single session."""
    result: PeerResult | None = None
    epoch, rejoining, idle, reform = 0, False, 0, None
    credits = Credits.of(cfg)
    async with peer_transport(stage_name(stage), cfg, membership) as transport:
        while True:
            peer = new_session(resume=resume or rejoining, epoch=epoch, rejoining=rejoining, reform=reform,
                               credits=credits)
            session = await serve_until_signalled(peer, transport)
            result = merge(result, session)
            if result.end != REJOIN_END:
                break
            epoch, rejoining, reform = result.epoch, True, peer.next_reform
            idle = 0 if peer.schedule.step > session.start_step else idle + 1
            log.warning("stage %d: %s; re-forming the swarm (run epoch %d, waiting up to %g s for the other stages)",
                        stage, result.rejoins[-1], epoch, cfg.net.rejoin_timeout_s)
            if idle:  # re-forms without a step trained in between: rate-limited (SPEC §7.2 item 9)
                log.warning("stage %d: %d re-form(s) in a row without a step trained; the next one starts in %g s",
                            stage, idle, reform_wait_s(idle))
                await asyncio.sleep(reform_wait_s(idle))
        # a clean end: what is still queued (the last BYE) gets up to a second to leave
        await transport.aclose(linger_s=_LAST_WORDS_S)
    return result
