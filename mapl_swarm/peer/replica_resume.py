"""The step a run with replicas resumes from (SPEC §9.10 item 13).

Each replica saves its own checkpoints, in its own folder, at the steps it took; the replicas of a
run may hold different steps (one joined late, one lost a file). Resuming, every replica of every
stage must load the same step, one each of them holds, and a stage's replicas see each other only
through their averaging, its neighbours only through links. So:

1. each stage's starting replicas gather in one round (:meth:`~mapl_swarm.replicas.gradients.ReplicaGradients.resume_round`)
   the steps each may use, and why one can use none: every replica of the stage then holds the
   same **stage steps** (those every current replica holds, :func:`stage_steps`) and reasons;
2. §5.2's ``offer`` goes upstream per link: a replica waits for one from every downstream link,
   intersects their ``steps`` and ``have`` with its stage's, and sends the same offer on every
   upstream link, so every stage-0 replica holds the same offers and makes the same decision;
3. ``resume`` goes downstream: a replica takes it once every upstream link sent one, all alike
   (else it stops, naming them), and passes it on.

Every replica then loads its own file of that step, but one behind its stage (it holds no such
file), which takes a partner's state in the stage's sync round, where the digests are compared.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from mapl_swarm.aio import until
from mapl_swarm.errors import CheckpointError, MaplError, MissingCheckpoints
from mapl_swarm.peer.link import Links, PeerLink
from mapl_swarm.pipeline import checkpoint
from mapl_swarm.wire import Message

log = logging.getLogger(__name__)

__all__ = ["ReplicaResume"]

StageRound = Callable[[Sequence[int], str], Awaitable[dict[str, tuple[list[int], str]]]]
"""``stage_round(saved, reason)``: each starting replica of the stage's usable steps and reason, by a
name that shows its contact."""
Send = Callable[[PeerLink, dict[str, Any]], Awaitable[None]]


def _refuse_stages_without_files(stages: dict[int, list[int]]) -> None:
    """A stage whose replicas hold no step in common at all while the other stages share one: one of
    them came without the stage's files (the replacement of a stage's lost last replica on a fresh
    host). Refused naming the files to copy, rather than making every replica give up: after a
    re-form the others wait for another replacement (SPEC §5.2 "On resume", §9.10 item 13)."""
    empty = sorted(k for k, v in stages.items() if not v)
    full = [set(v) for v in stages.values() if v]
    common = set.intersection(*full) if full else set()
    if not empty or not common:
        return
    n = max(common)
    raise checkpoint.missing_files(empty, n, source="a replica of {which}", target="the replica that lacks them",
                                   why=f"holds no checkpoint of this run in every replica's folder, but every other "
                                       f"stage holds step {n}")


def stage_steps(name: str, stage: int, saved: dict[str, list[int]]) -> list[int]:
    """The steps replica ``name``'s stage may resume from, given each starting replica's usable steps
    (``saved``, by name; every replica computes the same): those every **current** replica holds,
    the replicas whose newest step is the stage's newest. A replica behind them (it left, was
    stopped or could not save; a fresh host without the stage's files) does not hold the swarm
    back: it loads a current replica's state in the sync round (SPEC §9.10 item 13); one WARNING
    line says so."""
    newest = {peer: max(steps, default=-1) for peer, steps in saved.items()}
    top = max(newest.values(), default=-1)
    current = [set(saved[peer]) for peer, n in newest.items() if n == top]
    behind = sorted(peer for peer, n in newest.items() if n != top)
    if behind:
        log.warning("%s: replica(s) %s of stage %d hold no checkpoint newer than step %s, the stage's current "
                    "replica(s) hold step %d: the swarm does not roll back to them; they take a current replica's "
                    "state when the run starts (their own files are kept)", name,
                    ", ".join(behind), stage,
                    " / ".join(str(newest[p]) if newest[p] >= 0 else "none" for p in behind), top)
    return sorted(set.intersection(*current)) if current else []


class ReplicaResume:
    """The resume agreement of replica ``name`` of stage ``stage`` over ``links`` (module docstring);
    ``send(link, meta)`` sends a CHECKPOINT on one link; ``stage_round`` is the stage's gather."""

    def __init__(self, name: str, stage: int, links: Links, send: Send, stage_round: StageRound) -> None:
        self.name, self.stage, self.links, self.send, self.stage_round = name, stage, links, send, stage_round
        self._inbox: dict[str, dict[str, dict[str, Any]]] = {"offer": {}, "resume": {}}
        """Per phase, the first CHECKPOINT of it from each link (by link name)."""
        self._changed = asyncio.Event()

    def on_message(self, msg: Message, link: PeerLink) -> str | None:
        """A CHECKPOINT ``offer`` (from a downstream link) or ``resume`` (from upstream); why it is not
        taken, or None."""
        phase = msg.meta["phase"]
        expected = self.links.down if phase == "offer" else self.links.up if phase == "resume" else None
        if expected is None or link.stage != expected:
            return f"CHECKPOINT {phase} from stage {link.stage} in a run with replicas (SPEC §9.10 item 13)"
        self._inbox[phase].setdefault(link.name, dict(msg.meta))
        self._changed.set()
        return None

    async def _from_every(self, phase: str, stage: int | None, timeout_s: float) -> list[dict[str, Any]]:
        """The ``phase`` of every link of neighbour ``stage`` (the links the handshake made)."""
        names = [link.name for link in self.links.of_stage(stage)]
        if not await until(lambda: all(n in self._inbox[phase] for n in names), self._changed, timeout_s):
            missing = [n for n in names if n not in self._inbox[phase]]
            raise MaplError(f"{self.name}: no checkpoint {phase} from {', '.join(missing)} within {timeout_s:g} s")
        return [self._inbox[phase][n] for n in names]

    async def agree(self, saved: Sequence[int], reason: str | None, *, run_steps: int, epoch: int,
                    timeout_s: float) -> tuple[int, int]:
        """The step every replica resumes from and the run epoch (the largest of all), given this
        replica's usable steps ``saved`` (and why it has none, ``reason``); raises
        :class:`CheckpointError` with the same reason at every replica when there is none."""
        by_peer = await self.stage_round(list(saved), reason or "")
        mine = stage_steps(self.name, self.stage, {peer: steps for peer, (steps, _) in by_peer.items()})
        reasons = sorted({why for _, why in by_peer.values() if why})
        have: dict[str, list[int]] = {str(self.stage): mine}
        steps, swarm_epoch = set(mine), epoch
        for offer in await self._from_every("offer", self.links.down, timeout_s):
            steps &= set(offer["steps"])
            for k, v in offer.get("have", {}).items():
                have[k] = sorted(set(have.get(k, v)) & set(v))
            swarm_epoch = max(swarm_epoch, int(offer.get("epoch", 0)))
            reasons += [r for r in [offer.get("reason")] if r and r not in reasons]
        why = "; ".join(reasons)
        if self.links.up is not None:
            offer = {"phase": "offer", "steps": sorted(steps), "have": have, "epoch": swarm_epoch,
                     **({"reason": why} if why else {})}
            await asyncio.gather(*(self.send(link, offer) for link in self.links.of_stage(self.links.up)))
            decisions = await self._from_every("resume", self.links.up, timeout_s)
            decision = decisions[0]
            if any((d["step"], d.get("epoch", 0)) != (decision["step"], decision.get("epoch", 0)) for d in decisions):
                told = sorted({str(d["step"]) for d in decisions})
                decision = {"phase": "resume", "step": None,
                            "reason": f"the replicas of stage {self.links.up} decided different resume steps ({told})"}
            await self._tell_down(decision)
            if decision["step"] is None:
                if decision.get("missing"):  # stages that lost their files (SPEC §5.2 "On resume")
                    raise MissingCheckpoints(decision.get("reason") or "resume refused", list(decision["missing"]))
                raise CheckpointError(decision.get("reason") or "resume refused")
            return int(decision["step"]), int(decision.get("epoch", 0))
        try:  # a stage-0 replica decides from what every stage-0 replica holds alike
            stages = {int(k): v for k, v in have.items()}
            _refuse_stages_without_files(stages)
            if why:
                raise CheckpointError(why)
            step = checkpoint.choose_resume_step(stages, run_steps, "each replica's run.out_dir")
        except CheckpointError as exc:
            missing = {"missing": exc.stages} if isinstance(exc, MissingCheckpoints) else {}
            await self._tell_down({"phase": "resume", "step": None, "reason": str(exc), **missing})
            raise
        await self._tell_down({"phase": "resume", "step": step, "epoch": swarm_epoch})
        return step, swarm_epoch

    async def _tell_down(self, decision: dict[str, Any]) -> None:
        await asyncio.gather(*(self.send(link, decision) for link in self.links.of_stage(self.links.down)))
