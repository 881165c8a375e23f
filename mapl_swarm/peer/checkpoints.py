"""A peer's side of the run policy: the CHECKPOINT protocol (SPEC §5.2), checkpoints, metrics, manifest.

Each stage's checkpoint folder may be on its own host, so a step is *complete* (every stage has it)
only when the peers say so. :class:`CheckpointAgreement` is every phase of CHECKPOINT, in one place:

- training: ``saved N`` travels upstream once every stage below saved N; stage 0 declares N
  complete and ``complete N`` travels down. Every stage records the complete steps and prunes its
  own files (:func:`mapl_swarm.pipeline.checkpoint.prune_plan`).
- a step a stage cannot save (a full disk): ``unsaved N`` with a reason naming it travels up;
  stage 0 records N as never complete (:attr:`CheckpointAgreement.unsaved`) and ``abandoned N``
  travels down, so every stage deletes its files of N: no resume can need them, and a full disk on
  one stage does not make the others keep every later step.
- resume: the stages' usable steps (files that verify against their manifests) are intersected on
  the way up (``offer``); stage 0 picks the newest common step, or refuses with a reason every
  stage stops with (``resume``, relayed down).
- drain (SIGINT/SIGTERM): a stage asked to drain (:meth:`~CheckpointAgreement.request`) sends
  ``drain_request`` up; stage 0 stops at its next step boundary ``D`` (the step in flight is
  finished, never abandoned half-way) and ``drain D`` travels down. Every stage saves ``D`` even
  when no checkpoint is due (``on_drain``), the agreement runs as for every save, and stage 0 sends
  BYE ``"drain"`` once ``D`` is complete: every stage ends with exit status 0, and a ``--resume``
  loses nothing but the step in flight when stage 0 decided.

The agreement is message logic alone (``send(dst, meta)`` is injected), so a test can drive it in
any message order; a neighbour that did not advertise a phase's capability (an older peer) is never
sent it (:meth:`~CheckpointAgreement.takes`). :class:`PeerRunPolicy` bundles it with the stage's
:class:`~mapl_swarm.pipeline.checkpoint.StageCheckpoints` and metrics records.
"""

from __future__ import annotations

import asyncio
import logging
import shutil
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Awaitable, Callable

from mapl_swarm.aio import until
from mapl_swarm.config import TrainConfig
from mapl_swarm.errors import CheckpointError, MaplError, MissingCheckpoints
from mapl_swarm.pipeline import checkpoint, run_policy, run_records
from mapl_swarm.pipeline.checkpoint import StageCheckpoints, rolled_back_note
from mapl_swarm.pipeline.run_records import MetricsLog, StepRecords
from mapl_swarm.wire import Message
from mapl_swarm.wire.spec import (CHECKPOINT_ABANDONED_CAPABILITY, CHECKPOINT_CAPABILITY, CHECKPOINT_UNSAVED_CAPABILITY,
                                  CHECKPOINT_UPSTREAM_PHASES, DRAIN_CAPABILITY, DRAIN_REASON)

if TYPE_CHECKING:
    from mapl_swarm.data import PreparedData
    from mapl_swarm.peer.compute import ComputeThread
    from mapl_swarm.peer.replica_resume import ReplicaResume
    from mapl_swarm.pipeline.stage import StageRuntime

log = logging.getLogger(__name__)

__all__ = ["CheckpointAgreement", "PeerRunPolicy", "checkpoint_note", "CHECKPOINT_CAPABILITY",
           "CHECKPOINT_UNSAVED_CAPABILITY"]

Send = Callable[[int, dict[str, Any]], Awaitable[None]]

_PHASE_CAPABILITY = {"unsaved": CHECKPOINT_UNSAVED_CAPABILITY, "abandoned": CHECKPOINT_ABANDONED_CAPABILITY,
                     "drain": DRAIN_CAPABILITY, "drain_request": DRAIN_CAPABILITY}
"""The capability a neighbour advertises to take a phase; every other phase: ``checkpoint_agreement``."""
DRAIN_PROOF = ("cert", "sig")
"""CHECKPOINT ``drain`` fields that prove stage 0 decided it (certified runs, SPEC §5.2), passed on as they came."""


class CheckpointAgreement:
    """SPEC §5.2 for stage ``stage`` of ``num_stages``; ``store`` holds this stage's files (None:
    this peer keeps none, so only the drain takes part). ``on_drain(step)`` runs once the swarm's
    drain step is known here (the run policy saves it)."""

    def __init__(self, store: StageCheckpoints | None, stage: int, num_stages: int, send: Send | None = None, *,
                 on_drain: Callable[[int], Awaitable[None]] | None = None) -> None:
        self.store, self.stage = store, stage
        self.up = stage - 1 if stage > 0 else None
        self.down = stage + 1 if stage < num_stages - 1 else None
        self.send = send
        """``send(dst, meta)``: a CHECKPOINT to a neighbour (set by the peer)."""
        self.on_drain = on_drain
        self.prove: Callable[[int], dict[str, Any]] | None = None
        """Stage 0 of a certified run: ``prove(step)``, its signed proof of a drain decided at ``step``."""
        self.caps: dict[int, frozenset[str]] | None = None
        """Each neighbour's capabilities, once its handshake is done (None: not known, all assumed)."""
        self.capabilities = [*((CHECKPOINT_CAPABILITY, CHECKPOINT_UNSAVED_CAPABILITY, CHECKPOINT_ABANDONED_CAPABILITY)
                               if store is not None else ()), DRAIN_CAPABILITY]
        """What this stage advertises in its HELLO."""
        self.declared: set[int] = set()
        """Steps this stage learnt are complete across the swarm."""
        self.unsaved: dict[int, str] = {}
        """Steps that will never be complete, and why: this stage could not save them, or (SPEC §5.2
        ``unsaved``) a stage downstream could not; at stage 0, any stage."""
        self.abandoned: set[int] = set()
        """Steps stage 0 gave up (never complete): this stage's files of them are deleted once durable."""
        self.without_loss: Callable[[set[int]], set[int]] = lambda steps: set()
        """Stage 0: of the given steps, those whose losses the run's metrics history lacks (a
        departure came between stage 0's save of the step and the last stage's REPORT of it); the
        resume decision rolls back past them when it can (:meth:`_prefer_recorded`)."""
        self.requested: str | None = None
        """Why this stage was asked to drain (``"SIGINT at stage 2"``); None: not asked."""
        self.drain_step: int | None = None
        """The swarm's drain step, once stage 0 decided it."""
        self.drain_reason: str | None = None
        """The reason stage 0 announced with it."""
        self._asked_upstream = False
        self._saved: set[int] = set()
        self._downstream_saved: set[int] = set()
        self._passed: set[int] = set()
        self._inbox: dict[str, dict[str, Any]] = {}
        self._changed = asyncio.Event()

    def neighbours(self, caps: Mapping[int, Iterable[str]]) -> None:
        """The neighbours' advertised capabilities (after the handshake)."""
        self.caps = {stage: frozenset(c) for stage, c in caps.items()}

    def takes(self, dst: int | None, phase: str) -> bool:
        """Neighbour ``dst`` takes CHECKPOINT ``phase`` (advertised its capability)."""
        if dst is None or self.send is None:
            return False
        return self.caps is None or _PHASE_CAPABILITY.get(phase, CHECKPOINT_CAPABILITY) in self.caps.get(dst, ())

    @property
    def enabled(self) -> bool:
        """This stage keeps checkpoints and every neighbour takes part in the agreement (else
        nothing is sent or pruned)."""
        return self.store is not None and all(self.takes(n, "saved") for n in (self.up, self.down) if n is not None)

    async def _tell(self, dst: int | None, meta: dict[str, Any]) -> None:
        if self.takes(dst, meta["phase"]):
            await self.send(dst, meta)

    async def on_message(self, msg: Message) -> None:
        """A CHECKPOINT from a neighbour (already checked by the frame decoder)."""
        meta, phase = msg.meta, msg.meta["phase"]
        expected = self.down if phase in CHECKPOINT_UPSTREAM_PHASES else self.up
        if msg.src != expected:
            log.warning("stage %d: ignored CHECKPOINT %s from stage %s (expected from stage %s)", self.stage,
                        phase, msg.src, expected)
            return
        if phase == "drain_request":
            reason = str(meta.get("reason") or f"asked by stage {msg.src}")
            if self.up is None and not self.draining:
                log.info("stage 0: drain requested (%s): stopping at the next step boundary", reason)
            if self.drain_step is None:  # else decided already
                try:
                    await self.request(reason)
                except MaplError as exc:  # the upstream neighbour does not take part in drains
                    log.warning("%s", exc)
        elif phase == "drain":
            await self.decide(int(meta["step"]), str(meta.get("reason") or ""),
                              {k: meta[k] for k in DRAIN_PROOF if k in meta})
        elif phase == "saved":
            self._downstream_saved.add(meta["step"])
            await self._advance(meta["step"])
        elif phase == "unsaved":
            await self._never_complete(meta["step"], dict(meta), heard=True)
        elif phase == "abandoned":
            self.unsaved.setdefault(meta["step"], str(meta["reason"]))
            await self._abandon(meta["step"], dict(meta))
            self._changed.set()
        elif phase == "complete":
            self._complete(meta["step"])
            await self._tell(self.down, {"phase": "complete", "step": meta["step"]})
        else:  # offer / resume: awaited by agree_resume
            self._inbox[phase] = dict(meta)
            self._changed.set()

    # ------------------------------------------------------------ training
    async def on_saved(self, step: int) -> None:
        """This stage's file of ``step`` is durable."""
        if not self.enabled:
            return
        self._saved.add(step)
        if step in self.abandoned:  # given up while this stage was still saving it
            self._delete(step)
            return
        if self.down is None:
            self._downstream_saved.add(step)  # nothing below the last stage
        await self._advance(step)

    async def on_unsaved(self, step: int, reason: str) -> None:
        """This stage could not save ``step`` (``reason``: the stage and why; its save warned already):
        the step never completes."""
        if self.enabled:
            await self._never_complete(step, {"phase": "unsaved", "step": step, "reason": reason}, heard=False)

    async def _never_complete(self, step: int, meta: dict[str, Any], *, heard: bool) -> None:
        """Record ``step`` as never complete, once, and pass ``meta`` upstream: this stage's own
        ``unsaved`` or, ``heard``, the one from downstream, unchanged. Stage 0 warns of a heard one."""
        if step in self.unsaved or step in self.declared:
            return
        self.unsaved[step] = reason = str(meta["reason"])
        if self.up is not None:
            await self._tell(self.up, meta)
        else:
            if heard:
                newest = max(self.store.complete, default=None)
                log.warning("checkpoint step %d will never be complete (%s); the newest complete checkpoint stays "
                            "%s", step, reason, "none" if newest is None else f"step {newest}")
            await self._abandon(step, {"phase": "abandoned", "step": step, "reason": reason})
        self._changed.set()

    async def _abandon(self, step: int, meta: dict[str, Any]) -> None:
        """Stage 0 gave ``step`` up: delete this stage's files of it (now if durable, else once its
        save ends) and pass ``meta`` downstream, once."""
        if step in self.abandoned or step in self.declared:
            return
        self.abandoned.add(step)
        if step in self._saved:
            self._delete(step)
        await self._tell(self.down, meta)

    def _delete(self, step: int) -> None:
        if self.store.abandon(step):
            log.info("stage %d: deleted checkpoint step %d, which will never be complete", self.stage, step)

    async def _until(self, ready: Callable[[], bool], timeout_s: float, what: str) -> None:
        if not await until(ready, self._changed, timeout_s):
            raise MaplError(f"stage {self.stage}: no {what} within {timeout_s:g} s")

    async def _advance(self, step: int) -> None:
        if step in self._passed or step in self.unsaved or not (step in self._saved and step in self._downstream_saved):
            return
        self._passed.add(step)
        if self.up is not None:
            await self._tell(self.up, {"phase": "saved", "step": step})
            return
        log.info("checkpoint step %d saved by every stage", step)  # stage 0 decides: once per swarm
        self._complete(step)
        await self._tell(self.down, {"phase": "complete", "step": step})

    def _complete(self, step: int) -> None:
        self.declared.add(step)
        pruned = self.store.mark_complete(step)
        log.debug("stage %d: step %d complete across the swarm; pruned %s", self.stage, step, pruned)
        self._changed.set()

    async def wait_complete(self, step: int, timeout_s: float) -> bool:
        """Until ``step`` is complete across the swarm (stage 0, before its BYE): True; False as soon
        as it is known never to be (:attr:`unsaved`, its reason logged once when it was heard)."""
        await self._until(lambda: step in self.declared or step in self.unsaved, timeout_s,
                          f"checkpoint agreement on step {step}")
        return step in self.declared

    # ------------------------------------------------------------ drain
    @property
    def draining(self) -> bool:
        """Asked to drain, or a drain step is decided."""
        return self.requested is not None or self.drain_step is not None

    async def request(self, reason: str) -> None:
        """Drain this stage (a signal): stage 0 stops at its next step boundary; any other stage asks
        stage 0 through its upstream neighbour. Raises :class:`MaplError` when that neighbour does
        not take part in drains (an older peer)."""
        if self.requested is None:
            self.requested = reason
        if self.up is None or self.drain_step is not None or self._asked_upstream:
            return
        if not self.takes(self.up, "drain_request"):
            raise MaplError(f"stage {self.stage}: cannot drain: stage {self.up} does not take part in drains "
                            f"(capability {DRAIN_CAPABILITY!r})")
        self._asked_upstream = True
        log.info("stage %d: asking stage 0 to drain the swarm (%s)", self.stage, reason)
        await self.send(self.up, {"phase": "drain_request", "reason": reason})

    def should_stop(self) -> bool:
        """Stage 0, at a step boundary: whether to stop here."""
        return self.requested is not None

    async def decide(self, step: int, reason: str | None = None, proof: dict[str, Any] | None = None) -> None:
        """The swarm drains at ``step`` (stage 0: the steps completed, for the reason it was asked,
        signed by :attr:`prove`; another stage: told by upstream with stage 0's ``proof``), once;
        tell the stages downstream."""
        if self.drain_step is not None:
            return
        reason = (self.requested or "") if reason is None else reason
        if self.up is None and self.prove is not None:
            proof = self.prove(step)
        self.drain_step, self.drain_reason = step, reason
        log.info("stage %d: the swarm drains at step %d (%s)", self.stage, step, reason or "no reason given")
        await self._tell(self.down, {"phase": "drain", "step": step, **({"reason": reason} if reason else {}),
                                     **(proof or {})})
        if self.on_drain is not None:
            await self.on_drain(step)

    def drained(self, step: int, reason: str) -> None:
        """With replicas: the swarm drained at ``step`` (its stage 0 decided in an averaging round,
        SPEC §9.10 item 14): recorded here, so that this stage saves the step and says so."""
        if self.drain_step is None:
            self.drain_step, self.drain_reason = step, reason

    def drained_at(self, bye: Message | None) -> int | None:
        """The step this stage drained at, once its schedule ended: the decided one, or the step of a
        BYE ``"drain"`` from upstream; None when the run was not drained."""
        if self.drain_step is not None:
            return self.drain_step
        if bye is not None and bye.meta.get("reason") == DRAIN_REASON:
            return bye.step
        return None

    # ------------------------------------------------------------ resume
    def usable(self) -> tuple[list[int], str | None]:
        """This stage's usable checkpoint steps, and why there are none when its files are unusable."""
        try:
            return self.store.usable_steps(), None
        except CheckpointError as exc:
            return [], str(exc)

    async def agree_resume(self, run_steps: int, timeout_s: float, *, epoch: int = 0,
                           rejoin: bool = False) -> tuple[int, int]:
        """The step every stage resumes from and the swarm's run epoch (all stages get the same
        answer or the same error). ``epoch`` is this stage's; the swarm's is the largest of all
        (SPEC "Rejoin"). ``rejoin``: the swarm re-forms after a departure, so no common step means
        step 0 (every stage rebuilt its initial state) rather than a refusal."""
        mine, reason = self.usable()
        if self.down is None:
            offer: dict[str, Any] = {"steps": mine, "have": {}, "epoch": epoch}
        else:
            await self._until(lambda: "offer" in self._inbox, timeout_s, "checkpoint offer from downstream")
            offer = self._inbox.pop("offer")
        have = {**offer.get("have", {}), str(self.stage): mine}
        common = sorted(set(offer["steps"]) & set(mine))
        reasons = "; ".join(r for r in (offer.get("reason"), reason) if r)
        swarm_epoch = max(epoch, int(offer.get("epoch", 0)))
        if self.up is not None:
            await self.send(self.up, {"phase": "offer", "steps": common, "have": have, "epoch": swarm_epoch,
                                      **({"reason": reasons} if reasons else {})})
            await self._until(lambda: "resume" in self._inbox, timeout_s, "resume decision from upstream")
            decision = self._inbox.pop("resume")
            if self.down is not None:
                await self.send(self.down, decision)
            if decision["step"] is None:
                missing = decision.get("missing")
                if missing:  # a stage lost its files: SPEC §5.2 "On resume"
                    raise MissingCheckpoints(decision.get("reason") or "resume refused", list(missing))
                raise CheckpointError(decision.get("reason") or "resume refused")
            return int(decision["step"]), int(decision.get("epoch", 0))
        try:  # stage 0 decides
            if reasons:
                raise CheckpointError(reasons)
            stages = {int(k): v for k, v in have.items()}
            self._refuse_stages_without_files(stages)
            if rejoin and not set.intersection(*(set(v) for v in stages.values())):
                step = 0
                log.warning("re-forming the swarm with no checkpoint step every stage has (%s): every stage "
                            "starts again from step 0", ", ".join(f"stage {k}: {v}" for k, v in sorted(stages.items())))
            else:
                stages[self.stage] = self._prefer_recorded(stages)
                step = checkpoint.choose_resume_step(stages, run_steps, "each stage's run.out_dir")
        except CheckpointError as exc:
            if self.down is not None:
                missing = {"missing": exc.stages} if isinstance(exc, MissingCheckpoints) else {}
                await self.send(self.down, {"phase": "resume", "step": None, "reason": str(exc), **missing})
            raise
        if self.down is not None:
            await self.send(self.down, {"phase": "resume", "step": step, "epoch": swarm_epoch})
        return step, swarm_epoch

    def _refuse_stages_without_files(self, stages: dict[int, list[int]]) -> None:
        """Stage 0: a stage that offers no step at all while stage 0 knows a step every stage saved
        (complete, and stage 0 can load it) lost its files (a replacement on a fresh host): refused,
        naming the step and the files to copy, rather than rolling every stage back to step 0, which
        would discard the others' checkpoints."""
        complete = sorted(set(self.store.complete) & set(stages[self.stage]))
        empty = sorted(k for k, v in stages.items() if not v)
        if not complete or not empty:
            return
        n = max(complete)
        raise checkpoint.missing_files(empty, n, why=f"has no checkpoint of this run, but every stage saved step {n}",
                                       source="the host that ran {which}", target="its peer")

    def _prefer_recorded(self, stages: dict[int, list[int]]) -> list[int]:
        """Stage 0's usable steps less those whose losses the history lacks (:attr:`without_loss`),
        so that a resume from the newest remaining common step leaves no hole in the loss history;
        all of them when every common step lacks its losses (the run goes on, the hole is logged)."""
        mine = stages[self.stage]
        common = set.intersection(*(set(v) for v in stages.values()))
        lacking = self.without_loss(common) if common else set()
        if not lacking:
            return mine
        newest = max(common)
        if lacking == common:
            log.warning("the metrics history has no train loss of checkpoint step(s) %s; resuming from step %d "
                        "anyway (its loss stays missing from the history)", sorted(lacking), newest)
            return mine
        if newest in lacking:
            log.warning("checkpoint step %d is complete but its train loss never reached stage 0 (a departure "
                        "before the last stage's REPORT): resuming from step %d instead, so no loss is missing",
                        newest, max(common - lacking))
        return [s for s in mine if s not in lacking]


class PeerRunPolicy:
    """What a stage peer asks of the run policy, in the order it asks:

    ``begin`` (after the handshake, once the peer gave :attr:`agreement` its ``send`` and the
    neighbours' capabilities: the start step, agreed with the other stages on resume, its state
    loaded on the compute thread) -> per step ``step_end`` (metrics record; checkpoint saved on the
    compute thread, then its agreement), ``train_loss`` / ``val_loss`` (stage 0), ``drain_at`` (a
    drain: that step is saved) -> ``finish`` (stage 0, before BYE) -> ``close``.
    It reports what the schedule's :class:`~.schedule.NoRunHooks` describe."""

    def __init__(self, cfg: TrainConfig, stage: int, data: "PreparedData", fingerprint: str, *, resume: bool,
                 runtime: "StageRuntime", compute: "ComputeThread", sampler: Any = None, averaging: Any = None,
                 exporters: Sequence[Any] = ()) -> None:
        self.cfg, self.stage, self.data, self.fingerprint, self.resume = cfg, stage, data, fingerprint, resume
        self.exporters = exporters
        """The process's metrics exporters (:mod:`mapl_swarm.metrics.export`), fed every record."""
        self.rt, self.compute, self.sampler = runtime, compute, sampler
        self.averaging = averaging
        """With replicas: the replica's averaging, whose own state (its error feedback, PowerSGD's
        factors: :meth:`~mapl_swarm.replicas.gradients.ReplicaGradients.own_state`) is saved with
        each checkpoint."""
        self.store = self._new_store()
        self.agreement = CheckpointAgreement(self.store, stage, cfg.pipeline.num_stages)
        if stage == 0 and cfg.pipeline.num_stages > 1:  # its losses come from the last stage (REPORT)
            path = run_records.metrics_path(cfg.run.out_dir, stage)
            self.agreement.without_loss = lambda steps: run_records.steps_without_loss(cfg, path, steps)
        self.records: StepRecords | None = None
        self._unsaved: dict[int, str] = {}
        """Steps this stage could not save (a full disk), and why: never complete."""
        self._saving: set[int] = set()
        """Steps this stage saves or saved in this run (never twice)."""
        self._start = 0
        self._ended = 0
        """The steps done at this stage's latest step end (the start step before any)."""
        self.epoch = 0
        """The swarm's run epoch, once :meth:`begin` agreed it (SPEC "Rejoin")."""
        self.behind = False
        """With replicas: this replica holds no file of the agreed resume step (it loads a partner's
        state in its stage's sync round, SPEC §9.10 item 13)."""
        self.replica_resume: ReplicaResume | None = None
        """With replicas: the resume agreement over the peer's links (set by the peer, SPEC §9.10 item 13)."""

    def _new_store(self) -> StageCheckpoints:
        return StageCheckpoints(self.cfg.run.out_dir, self.stage, driver="swarm", fingerprint=self.fingerprint,
                                keep=self.cfg.checkpoint.keep)

    async def begin(self, *, epoch: int = 0, rejoin: bool = False) -> int:
        """After the handshake: the step to start from; opens the metrics stream, writes the manifest.
        ``epoch``: this stage's run epoch; the swarm's, agreed on resume, is then :attr:`epoch`.
        ``rejoin``: the swarm re-forms after a departure (SPEC "Rejoin"): every stage rolls back to
        the newest step all have (step 0 when there is none), within ``net.rejoin_timeout_s``."""
        if not self.resume:  # a fresh run owns its folder: only now that the swarm took this peer in
            checkpoint.start_fresh(self.cfg.run.out_dir, [self.stage])
            self.store = self.agreement.store = self._new_store()
        lacking = [s for s in (self.agreement.up, self.agreement.down) if s is not None
                   and not self.agreement.takes(s, "saved")]
        if self.cfg.replicas.enabled:  # SPEC §9.10: agreed on resume only (item 13)
            log.info("stage %d: with replicas each one saves its own checkpoints under %s; they are agreed on when "
                     "the run resumes, never pruned", self.stage, self.cfg.run.out_dir)
        elif lacking:  # an older peer (protocol < 1.3): no CHECKPOINT to it, so no agreement at all
            why = f"neighbour stage(s) {lacking} do not take part in checkpoint agreement (protocol < 1.3)"
            if self.resume:
                raise MaplError(f"stage {self.stage}: cannot agree on a resume step: {why}; upgrade every peer")
            log.warning("stage %d: %s: checkpoints are saved but never pruned", self.stage, why)
        start = 0
        self.epoch = epoch
        if self.resume:
            timeout = self.cfg.net.rejoin_timeout_s if rejoin else self.cfg.net.timeout_s
            if self.cfg.replicas.enabled:
                if self.replica_resume is None:
                    raise MaplError(f"stage {self.stage}: a replica resumes only with its links (replica_resume)")
                saved, why = self.agreement.usable()
                start, self.epoch = await self.replica_resume.agree(saved, why, run_steps=self.cfg.run.steps,
                                                                    epoch=epoch, timeout_s=timeout)
                self.behind = start > 0 and start not in saved  # a current partner's state, in the sync round
            else:
                start, self.epoch = await self.agreement.agree_resume(self.cfg.run.steps, timeout, epoch=epoch,
                                                                      rejoin=rejoin)
            later = self.store.resumed(start)
            if later:
                log.warning("%s", rolled_back_note(self.cfg.run.out_dir, start, later, f"stage {self.stage}"))
            if start > 0 and not self.behind:
                await self.compute.run(self._load, start)
            log.info("stage %d %s step %d (agreed by every stage; run epoch %d)", self.stage,
                     "rolled back to" if rejoin else "resumed from", start, self.epoch)
        self._start = self._ended = start
        run_records.write_manifest(self.cfg, self.data, driver="swarm", fingerprint=self.fingerprint,
                                  resumed_from=start, stage=self.stage, exporters=self.exporters)
        path = run_records.metrics_path(self.cfg.run.out_dir, self.stage)
        self.records = StepRecords(self.cfg, self.stage, MetricsLog(path, resume_from=start if self.resume else None,
                                                                    exporters=self.exporters), start)
        return start

    def _load(self, step: int) -> None:
        state = self.store.load(step)
        self.rt.load_state_dict(state)
        if self.sampler is not None:
            self.sampler.load_state_dict(state["data"])
        if self.averaging is not None:
            self.averaging.load_own_state(state.get("averaging"))

    def _save(self, step: int) -> bool:
        state = self.rt.state_dict()
        if self.sampler is not None:
            state["data"] = self.sampler.state_dict()
        if self.averaging is not None:
            state["averaging"] = self.averaging.own_state()
        saved = self.store.save(step, state)  # False: a full disk (warned); the step never completes
        if not saved:
            self._unsaved[step] = self._why_unsaved(step)
        return saved

    def _why_unsaved(self, step: int) -> str:
        """The ``reason`` of CHECKPOINT ``unsaved``: this stage, the step, where, and the space left
        there (this stage's log has the save's own warning)."""
        root = self.store.root
        try:
            usage = shutil.disk_usage(root)
            space = f" ({_size(usage.free)} free of {_size(usage.total)} there)"
        except OSError:
            space = ""
        return f"stage {self.stage}: checkpoint step {step} not saved under {root}{space}"

    def checkpoint_due(self, step: int) -> bool:
        return run_policy.checkpoint_due(self.cfg, step)

    @property
    def checkpoints_on(self) -> bool:
        """Checkpoints are saved at all (``checkpoint.interval_steps`` > 0)."""
        return self.cfg.checkpoint.interval_steps > 0

    def _claim_save(self, step: int) -> bool:
        """Whether to save ``step`` now: due, or the drain step (with checkpoints on), and not saved
        yet. Claims it (no await between the check and the claim, so never twice)."""
        if step in self._saving or not (self.checkpoint_due(step) or
                                        (step == self.agreement.drain_step and self.checkpoints_on)):
            return False
        self._saving.add(step)
        return True

    async def _save_and_agree(self, step: int) -> None:
        if await self.compute.run(self._save, step):
            await self.agreement.on_saved(step)
        else:
            await self.agreement.on_unsaved(step, self._unsaved[step])

    async def step_end(self, step: int, metrics: dict[str, float]) -> None:
        """After optimizer step ``step``: its metrics record; a checkpoint when due (or the drain
        step), then its agreement."""
        if self.records is not None:
            self.records.stage_step(step, metrics)
        self._ended = step
        if self._claim_save(step):
            await self._save_and_agree(step)

    async def drain_at(self, step: int) -> None:
        """The swarm drains at ``step`` (:attr:`CheckpointAgreement.drain_step`): saved at this
        stage's step end ``step``, or now when that has passed (the stage waits, idle, for a step
        that will not come)."""
        if self._ended == step > self._start and self._claim_save(step):
            await self._save_and_agree(step)

    def saved(self, step: int) -> bool:
        """This stage saved ``step`` in this run (claimed and written)."""
        return step in self._saving and step not in self._unsaved

    def unsaved_reason(self, step: int) -> str | None:
        """Why ``step`` will never be complete, as far as this stage knows: its own failed save or,
        from downstream, CHECKPOINT ``unsaved`` (at stage 0: any stage's), e.g. ``"stage 2:
        checkpoint step 40 not saved under /data/run (1.2 MB free of 20.0 GB there)"``; None when
        nothing says so (the step may be complete, pending, or not a checkpoint step)."""
        return self.agreement.unsaved.get(step) or self._unsaved.get(step)

    @property
    def newest_complete(self) -> int | None:
        """The newest step complete across the swarm that this stage keeps (None: none yet)."""
        return max(self.store.complete, default=None)

    def train_loss(self, step: int, loss: float, tokens: int) -> None:
        if self.records is not None:
            self.records.train_loss(step, loss, tokens)

    def val_loss(self, step: int, loss: float) -> None:
        if self.records is not None:
            self.records.val_loss(step, loss)

    async def finish(self, step: int | None = None) -> None:
        """Stage 0 at the end (``step``: the drain step; None: the run's last): until its checkpoint is
        complete, so every stage hears it before BYE, or known never to be (:meth:`unsaved_reason`:
        a stage could not save it; the newest complete checkpoint stays the one before)."""
        final = self.cfg.run.steps if step is None else step
        if self.saved(final) and self.agreement.enabled:
            await self.agreement.wait_complete(final, self.cfg.net.timeout_s)

    def close(self) -> None:
        if self.records is not None:
            self.records.close()
            self.records = None


def checkpoint_note(policy: PeerRunPolicy | None, step: int, start_step: int) -> str:
    """What became of a drain step's (or the last step's) checkpoint at this stage, in words."""
    if policy is None:
        return "this peer keeps no checkpoints"
    if policy.cfg.replicas.enabled and policy.saved(step):  # each replica saves its own (SPEC §9.10 item 14)
        return f"checkpoint of step {step} saved by this replica; continue with --resume on every replica"
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


def _size(n: int) -> str:
    for unit, size in (("GB", 1 << 30), ("MB", 1 << 20), ("kB", 1 << 10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} bytes"
