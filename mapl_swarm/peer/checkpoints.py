"""A peer's side of the run policy: checkpoint agreement (SPEC §5.2), checkpoints, metrics, manifest.

Each stage's checkpoint folder may be on its own host, so a step is *complete* (every stage has it)
only when the peers say so with CHECKPOINT messages:

- training: after stage s saved step N, the last stage sends ``saved N`` upstream; a middle stage
  forwards it once it has also saved N (whichever comes last); stage 0, once it has both, declares
  N complete and sends ``complete N`` downstream, relayed to the last stage. Every stage records
  the complete steps and prunes its own files (:func:`mapl_swarm.pipeline.checkpoint.prune_plan`).
- a step a stage cannot save (a full disk; 1.5, capability ``checkpoint_unsaved``): that stage sends
  ``unsaved N`` upstream with a reason naming it and why, relayed unchanged (or a middle stage's
  own, once per step); stage 0, on it or on its own failed save, records N as never complete
  (:attr:`CheckpointAgreement.unsaved`), so nothing waits for N: the newest complete step stays the
  one before. Stage 0 then sends ``abandoned N`` downstream (1.6, capability
  ``checkpoint_abandoned``), relayed to the last stage, and every stage deletes its own files of N
  once they are durable: no stage can ever need them (a resume takes a step every stage holds),
  so a stage whose disk is full does not make the others keep every later step.
- resume: the last stage offers its usable steps (those whose files verify against their
  manifests, so every stage can load the agreed step) upstream, each stage intersects and forwards,
  stage 0 picks the newest common step (or refuses, with a reason every stage stops with) and
  sends ``resume`` downstream, relayed.

:class:`CheckpointAgreement` is that message logic alone (no sockets: ``send(dst, meta)`` is
injected), so it can be driven by a test in any message order. :class:`PeerRunPolicy` bundles it
with the stage's :class:`~mapl_swarm.pipeline.stage_checkpoints.StageCheckpoints` and metrics records;
the :class:`~.runtime.Peer` calls its few entry points.
"""

from __future__ import annotations

import asyncio
import logging
import shutil
from typing import TYPE_CHECKING, Any, Awaitable, Callable

from mapl_swarm.config import TrainConfig
from mapl_swarm.errors import CheckpointError, MaplError
from mapl_swarm.pipeline import run_policy, run_records, stage_checkpoints
from mapl_swarm.pipeline.run_records import MetricsLog, StepRecords
from mapl_swarm.pipeline.stage_checkpoints import StageCheckpoints
from mapl_swarm.wire import Message
from mapl_swarm.wire.spec import (CHECKPOINT_ABANDONED_CAPABILITY, CHECKPOINT_CAPABILITY, CHECKPOINT_UNSAVED_CAPABILITY,
                                  CHECKPOINT_UPSTREAM_PHASES)

if TYPE_CHECKING:
    from mapl_swarm.data import PreparedData
    from mapl_swarm.peer.compute import ComputeThread
    from mapl_swarm.pipeline.stage import StageRuntime

log = logging.getLogger(__name__)

__all__ = ["CheckpointAgreement", "PeerRunPolicy", "CHECKPOINT_CAPABILITY", "CHECKPOINT_UNSAVED_CAPABILITY"]

Send = Callable[[int, dict[str, Any]], Awaitable[None]]


class CheckpointAgreement:
    """SPEC §5.2 for stage ``stage`` of ``num_stages``; ``store`` holds this stage's files."""

    def __init__(self, store: StageCheckpoints, stage: int, num_stages: int, send: Send | None = None) -> None:
        self.store, self.stage = store, stage
        self.up = stage - 1 if stage > 0 else None
        self.down = stage + 1 if stage < num_stages - 1 else None
        self.send = send
        """``send(dst, meta)``: a CHECKPOINT to a neighbour (set by the peer once its links are up)."""
        self.declared: set[int] = set()
        """Steps this stage learnt are complete across the swarm."""
        self.unsaved: dict[int, str] = {}
        """Steps that will never be complete, and why: this stage could not save them, or (SPEC §5.2
        ``unsaved``) a stage downstream could not; at stage 0, any stage."""
        self._saved: set[int] = set()
        self._downstream_saved: set[int] = set()
        self._passed: set[int] = set()
        self._inbox: dict[str, dict[str, Any]] = {}
        self._changed = asyncio.Event()
        self.enabled = True
        """False when a neighbour does not take part (an older peer): nothing is sent or pruned."""
        self.upstream_takes_unsaved = True
        """False when the upstream neighbour did not advertise ``checkpoint_unsaved`` (a 1.4 peer): no
        ``unsaved`` to it, so stage 0 waits for such a step as before (until its timeout)."""
        self.downstream_takes_abandoned = True
        """False when the downstream neighbour did not advertise ``checkpoint_abandoned`` (a 1.5 peer):
        no ``abandoned`` to it (it keeps its files of such steps, as in 1.5)."""
        self.abandoned: set[int] = set()
        """Steps stage 0 gave up (never complete): this stage's files of them are deleted once durable."""
        self.without_loss: Callable[[set[int]], set[int]] = lambda steps: set()
        """Stage 0: of the given steps, those whose losses the run's metrics history lacks (a
        departure came between stage 0's save of the step and the last stage's REPORT of it); the
        resume decision rolls back past them when it can (:meth:`_prefer_recorded`)."""

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

    async def on_message(self, msg: Message) -> None:
        """A CHECKPOINT from a neighbour (already checked by the frame decoder)."""
        meta, phase = msg.meta, msg.meta["phase"]
        expected = self.down if phase in CHECKPOINT_UPSTREAM_PHASES else self.up
        if msg.src != expected:
            log.warning("stage %d: ignored CHECKPOINT %s from stage %s (expected from stage %s)", self.stage,
                        phase, msg.src, expected)
            return
        if phase == "saved":
            self._downstream_saved.add(meta["step"])
            await self._advance(meta["step"])
        elif phase == "unsaved":
            await self._never_complete(meta["step"], dict(meta), heard=True)
        elif phase == "abandoned":
            self.unsaved.setdefault(meta["step"], str(meta["reason"]))
            await self._abandon(meta["step"], dict(meta))
            self._notify()
        elif phase == "complete":
            self._complete(meta["step"])
            if self.down is not None:
                await self.send(self.down, {"phase": "complete", "step": meta["step"]})
        else:  # offer / resume: awaited by agree_resume
            self._inbox[phase] = dict(meta)
            self._notify()

    async def _never_complete(self, step: int, meta: dict[str, Any], *, heard: bool) -> None:
        """Record ``step`` as never complete, once, and pass ``meta`` upstream: this stage's own
        ``unsaved`` or, ``heard``, the one from downstream, unchanged. Stage 0 warns of a heard one."""
        if step in self.unsaved or step in self.declared:
            return
        self.unsaved[step] = reason = str(meta["reason"])
        if self.up is not None:
            if self.upstream_takes_unsaved:
                await self.send(self.up, meta)
        else:
            if heard:
                newest = max(self.store.complete, default=None)
                log.warning("checkpoint step %d will never be complete (%s); the newest complete checkpoint stays "
                            "%s", step, reason, "none" if newest is None else f"step {newest}")
            await self._abandon(step, {"phase": "abandoned", "step": step, "reason": reason})
        self._notify()

    async def _abandon(self, step: int, meta: dict[str, Any]) -> None:
        """Stage 0 gave ``step`` up: delete this stage's files of it (now if durable, else once its
        save ends) and pass ``meta`` downstream, once."""
        if step in self.abandoned or step in self.declared:
            return
        self.abandoned.add(step)
        if step in self._saved:
            self._delete(step)
        if self.down is not None and self.downstream_takes_abandoned:
            await self.send(self.down, meta)

    def _delete(self, step: int) -> None:
        if self.store.abandon(step):
            log.info("stage %d: deleted checkpoint step %d, which will never be complete", self.stage, step)

    async def _advance(self, step: int) -> None:
        if step in self._passed or step in self.unsaved or not (step in self._saved and step in self._downstream_saved):
            return
        self._passed.add(step)
        if self.up is not None:
            await self.send(self.up, {"phase": "saved", "step": step})
            return
        log.info("checkpoint step %d saved by every stage", step)  # stage 0 decides: once per swarm
        self._complete(step)
        if self.down is not None:
            await self.send(self.down, {"phase": "complete", "step": step})

    def _complete(self, step: int) -> None:
        self.declared.add(step)
        pruned = self.store.mark_complete(step)
        log.debug("stage %d: step %d complete across the swarm; pruned %s", self.stage, step, pruned)
        self._notify()

    def _notify(self) -> None:
        self._changed.set()

    async def _until(self, ready: Callable[[], bool], timeout_s: float, what: str,
                     failed: Callable[[], BaseException | None]) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while not ready():
            error = failed()
            if error is not None:
                raise error
            remaining = deadline - loop.time()
            if remaining <= 0:
                raise MaplError(f"stage {self.stage}: no {what} within {timeout_s:g} s")
            self._changed.clear()
            try:
                await asyncio.wait_for(self._changed.wait(), min(remaining, 1.0))
            except asyncio.TimeoutError:
                pass

    async def wait_complete(self, step: int, timeout_s: float,
                            failed: Callable[[], BaseException | None] = lambda: None) -> bool:
        """Until ``step`` is complete across the swarm (stage 0, before its BYE): True; False as soon
        as it is known never to be (:attr:`unsaved`, its reason logged once when it was heard)."""
        await self._until(lambda: step in self.declared or step in self.unsaved, timeout_s,
                          f"checkpoint agreement on step {step}", failed)
        return step in self.declared

    # ------------------------------------------------------------ resume
    def _usable(self) -> tuple[list[int], str | None]:
        try:
            return self.store.usable_steps(), None
        except CheckpointError as exc:
            return [], str(exc)

    async def agree_resume(self, run_steps: int, timeout_s: float,
                           failed: Callable[[], BaseException | None] = lambda: None, *, epoch: int = 0,
                           rejoin: bool = False) -> tuple[int, int]:
        """The step every stage resumes from and the swarm's run epoch (all stages get the same
        answer or the same error). ``epoch`` is this stage's; the swarm's is the largest of all
        (SPEC "Rejoin"). ``rejoin``: the swarm re-forms after a departure, so no common step means
        step 0 (every stage rebuilt its initial state) rather than a refusal."""
        mine, reason = self._usable()
        if self.down is None:
            offer: dict[str, Any] = {"steps": mine, "have": {}, "epoch": epoch}
        else:
            await self._until(lambda: "offer" in self._inbox, timeout_s, "checkpoint offer from downstream", failed)
            offer = self._inbox.pop("offer")
        have = {**offer.get("have", {}), str(self.stage): mine}
        common = sorted(set(offer["steps"]) & set(mine))
        reasons = "; ".join(r for r in (offer.get("reason"), reason) if r)
        swarm_epoch = max(epoch, int(offer.get("epoch", 0)))
        if self.up is not None:
            await self.send(self.up, {"phase": "offer", "steps": common, "have": have, "epoch": swarm_epoch,
                                      **({"reason": reasons} if reasons else {})})
            await self._until(lambda: "resume" in self._inbox, timeout_s, "resume decision from upstream", failed)
            decision = self._inbox.pop("resume")
            if self.down is not None:
                await self.send(self.down, decision)
            if decision["step"] is None:
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
                step = stage_checkpoints.choose_resume_step(stages, run_steps, "each stage's run.out_dir")
        except CheckpointError as exc:
            if self.down is not None:
                await self.send(self.down, {"phase": "resume", "step": None, "reason": str(exc)})
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
        files = " and ".join(f"checkpoints/step_{n:08d}/stage_{k}.pt, stage_{k}.manifest.json" for k in empty)
        which = f"stage{'s' if len(empty) > 1 else ''} {', '.join(map(str, empty))}"
        raise CheckpointError(f"{which} has no checkpoint of this run, but every stage saved step {n}: copy {files} "
                              f"from the run.out_dir of the host that ran {which} to the run.out_dir of its peer, "
                              f"then start the peers again with --resume (no stage rolled back or deleted a "
                              f"checkpoint)")

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

    ``capabilities`` (HELLO) -> ``on_message`` (every CHECKPOINT) -> ``begin`` (after the handshake:
    the start step, agreed with the other stages on resume, its state loaded on the compute thread)
    -> per step ``step_end`` (metrics record; checkpoint saved on the compute thread, then its
    agreement), ``train_loss`` / ``val_loss`` (stage 0), ``drain_at`` (a drain: that step is saved)
    -> ``finish`` (stage 0, before BYE) -> ``close``.
    It reports what the schedule's :class:`~.schedule.NoRunHooks` describe."""

    def __init__(self, cfg: TrainConfig, stage: int, data: "PreparedData", fingerprint: str, *, resume: bool,
                 runtime: "StageRuntime", compute: "ComputeThread", sampler: Any = None) -> None:
        self.cfg, self.stage, self.data, self.fingerprint, self.resume = cfg, stage, data, fingerprint, resume
        self.rt, self.compute, self.sampler = runtime, compute, sampler
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
        self.drain_step: int | None = None
        """The swarm's drain step (:mod:`~.drain`), once decided: saved even when not due."""
        self.capabilities = [CHECKPOINT_CAPABILITY, CHECKPOINT_UNSAVED_CAPABILITY, CHECKPOINT_ABANDONED_CAPABILITY]
        self.epoch = 0
        """The swarm's run epoch, once :meth:`begin` agreed it (SPEC "Rejoin")."""

    def _new_store(self) -> StageCheckpoints:
        return StageCheckpoints(self.cfg.run.out_dir, self.stage, driver="swarm", fingerprint=self.fingerprint,
                                keep=self.cfg.checkpoint.keep)

    async def on_message(self, msg: Message) -> None:
        await self.agreement.on_message(msg)

    async def begin(self, send: Send, neighbour_caps: dict[int, set[str]],
                    failed: Callable[[], BaseException | None], *, epoch: int = 0, rejoin: bool = False) -> int:
        """After the handshake: the step to start from; opens the metrics stream, writes the manifest.
        ``epoch``: this stage's run epoch; the swarm's, agreed on resume, is then :attr:`epoch`.
        ``rejoin``: the swarm re-forms after a departure (SPEC "Rejoin"): every stage rolls back to
        the newest step all have (step 0 when there is none), within ``net.rejoin_timeout_s``."""
        self.agreement.send = send
        if not self.resume:  # a fresh run owns its folder: only now that the swarm took this peer in
            stage_checkpoints.start_fresh(self.cfg.run.out_dir, [self.stage])
            self.store = self.agreement.store = self._new_store()
        lacking = [s for s, caps in neighbour_caps.items() if CHECKPOINT_CAPABILITY not in caps]
        if lacking:  # an older peer (protocol < 1.3): no CHECKPOINT to it, so no agreement at all
            why = f"neighbour stage(s) {lacking} do not take part in checkpoint agreement (protocol < 1.3)"
            if self.resume:
                raise MaplError(f"stage {self.stage}: cannot agree on a resume step: {why}; upgrade every peer")
            log.warning("stage %d: %s: checkpoints are saved but never pruned", self.stage, why)
            self.agreement.enabled = False
        if self.stage > 0:  # a 1.4 peer upstream rejects CHECKPOINT unsaved
            up_caps = neighbour_caps.get(self.stage - 1, set())
            self.agreement.upstream_takes_unsaved = CHECKPOINT_UNSAVED_CAPABILITY in up_caps
        if self.stage < self.cfg.pipeline.num_stages - 1:  # a 1.5 peer downstream rejects CHECKPOINT abandoned
            down_caps = neighbour_caps.get(self.stage + 1, set())
            self.agreement.downstream_takes_abandoned = CHECKPOINT_ABANDONED_CAPABILITY in down_caps
        start = 0
        self.epoch = epoch
        if self.resume:
            timeout = self.cfg.net.rejoin_timeout_s if rejoin else self.cfg.net.timeout_s
            start, self.epoch = await self.agreement.agree_resume(self.cfg.run.steps, timeout, failed, epoch=epoch,
                                                                  rejoin=rejoin)
            self.store.resumed(start)
            if start > 0:
                await self.compute.run(self._load, start)
            log.info("stage %d %s step %d (agreed by every stage; run epoch %d)", self.stage,
                     "rolled back to" if rejoin else "resumed from", start, self.epoch)
        self._start = self._ended = start
        run_records.write_manifest(self.cfg, self.data, driver="swarm", fingerprint=self.fingerprint,
                                  resumed_from=start, stage=self.stage)
        path = run_records.metrics_path(self.cfg.run.out_dir, self.stage)
        self.records = StepRecords(self.cfg, self.stage, MetricsLog(path, resume_from=start if self.resume else None),
                                   start)
        return start

    def _load(self, step: int) -> None:
        state = self.store.load(step)
        self.rt.load_state_dict(state)
        if self.sampler is not None:
            self.sampler.load_state_dict(state["data"])

    def _save(self, step: int) -> bool:
        state = self.rt.state_dict()
        if self.sampler is not None:
            state["data"] = self.sampler.state_dict()
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
                                        (step == self.drain_step and self.checkpoints_on)):
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
        """The swarm drains at ``step`` (:mod:`~.drain`): saved at this stage's step end ``step``,
        or now when that has passed (the stage waits, idle, for a step that will not come)."""
        self.drain_step = step
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

    async def finish(self, failed: Callable[[], BaseException | None], step: int | None = None) -> None:
        """Stage 0 at the end (``step``: the drain step; None: the run's last): until its checkpoint is
        complete, so every stage hears it before BYE, or known never to be (:meth:`unsaved_reason`:
        a stage could not save it; the newest complete checkpoint stays the one before)."""
        final = self.cfg.run.steps if step is None else step
        if self.saved(final) and self.agreement.enabled:
            await self.agreement.wait_complete(final, self.cfg.net.timeout_s, failed)

    def close(self) -> None:
        if self.records is not None:
            self.records.close()
            self.records = None


def _size(n: int) -> str:
    for unit, size in (("GB", 1 << 30), ("MB", 1 << 20), ("kB", 1 << 10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} bytes"
