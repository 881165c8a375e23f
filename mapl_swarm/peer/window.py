"""The step window of a stage peer: which pipeline message it can take next, and why another is dropped.

One :class:`StepWindow` per peer, owned by its schedule, holds everything that decides whether a
received pipeline message is due: the run epoch, the current ``step`` (the next one to flush),
the micro-batches of it already taken, the train ACTs whose GRAD is due, the REPORTs seen, the
validations taken part in, and each link's projector version (SPEC §9.6: of the last PROJ admitted
from upstream, or sent downstream). Admission asks it for the coarse header check (:meth:`of`,
before any tensor is decoded: ``wire.Window`` and the lowest epoch); the schedule asks it whether
a decoded message is due (``*_due``). A message that is not is dropped, counted and logged through
``reject`` with its code (``out_of_window``, ``stale_projector``) and the rule that dropped it,
and never reaches the runtime.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from mapl_swarm.wire import Message, Window

if TYPE_CHECKING:
    from mapl_swarm.pipeline.stage import StageRuntime

__all__ = ["StepWindow"]


class StepWindow:
    """Stage ``stage``'s window over a run of ``steps`` steps of ``M`` micro-batches with
    ``val_batches`` eval micro-batches per validation; ``reject(code, sender, text)`` counts a drop."""

    def __init__(self, runtime: StageRuntime, *, stage: int, M: int, val_batches: int, steps: int, start_step: int,
                 reject: Callable[[str, str, str], None], upstream_lag: int = 0) -> None:
        self.rt, self.stage, self.M, self.val_batches, self.steps = runtime, stage, M, val_batches, steps
        self.reject = reject
        self.upstream_lag = upstream_lag
        """Steps before the current one still admitted from upstream: with replicas, 1 (the other
        upstream replicas' copies of a ``commit`` or PROJ this stage took already)."""
        self.start_step = self.step = start_step
        self.epoch = 0
        """The lowest run epoch a message may carry (SPEC "Rejoin"): the swarm's once training runs."""
        self.awaiting: set[int] = set()
        """Micro-batches of the train ACTs sent downstream whose GRAD is due."""
        self.taken: set[tuple[str, int]] = set()
        """(mode, micro) of the ACTs of ``step`` taken, and ("proj", step) once its PROJ is."""
        self.reported: set[tuple[str, int]] = set()
        """(mode, step) of the REPORTs recorded or relayed."""
        self.eval_steps: set[int] = set()
        """Steps of the validations this stage sent or served eval ACTs of."""
        self.link_pver: dict[int, int] = {}
        """Per neighbour stage, the link's projector version (SPEC §9.6): of the last PROJ admitted from
        upstream or sent downstream; before any, the boundary's own."""

    # ------------------------------------------------------------------ moving
    joining = False
    """A replica that joins a running swarm, before its state came: any step of the run is admitted
    (what its neighbours send it of the step it will join at comes before it knows that step)."""

    def begin(self, start_step: int, epoch: int) -> None:
        """Training starts at ``start_step`` in run epoch ``epoch``: the window follows them."""
        self.start_step = self.step = start_step
        self.epoch = epoch

    def advance(self) -> None:
        """The step is flushed: the window moves on."""
        self.step += 1
        self.taken.clear()

    def projector(self, stage: int, pver: int) -> None:
        """The link to ``stage`` moved to projector version ``pver`` (a PROJ admitted or sent)."""
        self.link_pver[stage] = pver

    @property
    def outbound_pver(self) -> int:
        """The outbound projector's version: what this stage's ACTs are made with."""
        return self.rt.outbound.version if self.rt.outbound is not None else 0

    @property
    def inbound_pver(self) -> int:
        """The inbound projector's version: what the ACTs this stage takes must be made with."""
        return self.rt.inbound.version if self.rt.inbound is not None else 0

    # ------------------------------------------------------------------ the receive path
    def of(self, stage: int) -> Window:
        """What the receive path accepts from neighbour ``stage`` now (SPEC §9.6 step window, §6.1
        rules 4-5): the current step and the next; from downstream also the previous one (its REPORT
        may come after this stage moved on), from upstream the ``upstream_lag`` previous ones. ``pver``: the link's projector version (None: no
        trainable one)."""
        upstream = stage < self.stage
        boundary = self.rt.inbound if upstream else self.rt.outbound
        pver = None
        if boundary is not None and boundary.trainable:
            pver = self.link_pver.get(stage, boundary.version)
        if self.joining:
            return Window(low=0, high=max(self.steps - 1, 0), pver=pver)
        low = max(self.start_step, self.step - (self.upstream_lag if upstream else 1))
        return Window(low=low, high=self.step + 1, pver=pver)

    # ------------------------------------------------------------------ the schedule
    def _drop(self, code: str, rule: str, msg: Message, text: str) -> bool:
        self.reject(code, f"stage{msg.src}", f"{msg.type.name} step {msg.step} micro-batch {msg.micro} dropped by "
                                             f"the step window ({rule}): {text}")
        return False

    def act_due(self, msg: Message) -> bool:
        """An ACT of this step for a micro-batch not taken yet, made with the inbound projector."""
        mode = msg.meta.get("mode", "train")
        count = self.M if mode == "train" else self.val_batches
        if msg.step != self.step or not 0 <= msg.micro < count or (mode, msg.micro) in self.taken:
            return self._drop("out_of_window", "one ACT per micro-batch of the current step", msg,
                              f"{mode} ACT outside step {self.step}'s {count} micro-batches or taken already")
        if msg.pver != self.inbound_pver:
            return self._drop("stale_projector", "ACTs use the projector this stage holds", msg,
                              f"made with projector v{msg.pver}, this stage holds v{self.inbound_pver}")
        return True

    def grad_due(self, msg: Message) -> bool:
        """A GRAD answers a train ACT of this step whose GRAD is still due, made with this projector."""
        if msg.step != self.step or msg.micro not in self.awaiting:
            return self._drop("out_of_window", "a GRAD answers a train ACT sent", msg,
                              f"no GRAD due for it (step {self.step}, due {sorted(self.awaiting)})")
        if msg.pver != self.outbound_pver:
            return self._drop("stale_projector", "GRADs come from ACTs of the projector this stage holds", msg,
                              f"made with projector v{msg.pver}, this stage holds v{self.outbound_pver}")
        return True

    def proj_due(self, msg: Message) -> bool:
        """The projector after the upstream stage's last step (at the start: its current one)."""
        if msg.step != self.step or ("proj", msg.step) in self.taken:
            return self._drop("out_of_window", "one PROJ per step, before its ACTs", msg,
                              f"PROJ for step {msg.step} at step {self.step} (or a second one)")
        if msg.pver < self.inbound_pver:
            return self._drop("stale_projector", "a PROJ moves the projector forward", msg,
                              f"projector v{msg.pver}, this stage holds v{self.inbound_pver}")
        return True

    def proj_grad_due(self, msg: Message, step: int) -> bool:
        """The downstream stage's PROJ_GRAD of ``step``, at this projector's version, over M micro-batches."""
        if msg.step != step or msg.meta.get("micro_batches", self.M) != self.M:
            return self._drop("out_of_window", "one PROJ_GRAD of the step being finished, over M micro-batches",
                              msg, f"PROJ_GRAD of {msg.meta.get('micro_batches')} micro-batches while finishing "
                                   f"step {step} of {self.M}")
        if msg.pver != self.outbound_pver:
            return self._drop("stale_projector", "PROJ_GRAD of the projector this stage holds", msg,
                              f"computed at projector v{msg.pver}, this stage holds v{self.outbound_pver}")
        return True

    def report_due(self, msg: Message) -> bool:
        """One train REPORT per step this stage has reached, one eval REPORT per validation it took
        part in."""
        mode = msg.meta.get("mode", "train")
        if (mode, msg.step) in self.reported:
            return self._drop("out_of_window", "one REPORT per step", msg, f"a second {mode} REPORT of step {msg.step}")
        if (mode == "train" and not self.start_step <= msg.step <= min(self.step, self.steps - 1)) or \
                (mode == "eval" and msg.step not in self.eval_steps):
            return self._drop("out_of_window", "REPORTs of steps this stage reached", msg,
                              f"{mode} REPORT of step {msg.step} (this stage is at step {self.step})")
        self.reported.add((mode, msg.step))
        return True
