"""The step window of a stage peer: what its receive path lets in on the header (SPEC §6.1 rules 4-5, §9.6).

Admission asks :meth:`StepWindow.of` before any tensor is decoded (the wire's :class:`~mapl_swarm.wire.Window`:
the steps admitted from a neighbour and the link's projector version) and reads the run epoch floor;
whether a decoded message is due now is the step core's (:mod:`~.flow`).
"""

from __future__ import annotations

from typing import Protocol

from mapl_swarm.wire import Window

__all__ = ["StepWindow", "Projectors"]


class Projectors(Protocol):
    """The stage's boundary projectors as the step's bookkeeping sees them (the runtime's, read only)."""

    @property
    def takes(self) -> bool:
        """The stage has a trainable inbound projector (its upstream sender's)."""

    @property
    def owns(self) -> bool:
        """The stage owns and steps a trainable outbound projector."""

    @property
    def inbound_pver(self) -> int:
        """The inbound projector's version: what the ACTs this stage takes must be made with."""

    @property
    def outbound_pver(self) -> int:
        """The outbound projector's version: what this stage's ACTs are made with."""


class StepWindow:
    """Stage ``stage``'s window over a run of ``steps`` steps. ``upstream_lag``: steps before the
    current one still admitted from upstream (with replicas 1: the other upstream replicas' copies
    of a ``commit`` or PROJ this stage took already)."""

    def __init__(self, projectors: Projectors, *, stage: int, steps: int, start_step: int,
                 upstream_lag: int = 0) -> None:
        self.projectors, self.stage, self.steps, self.upstream_lag = projectors, stage, steps, upstream_lag
        self.start_step = self.step = start_step
        """Where training started, and the step this stage works on (the next one to flush)."""
        self.epoch = 0
        """The lowest run epoch a message may carry (SPEC "Rejoin"): the swarm's once training runs."""
        self.link_pver: dict[int, int] = {}
        """Per neighbour stage, the link's projector version (SPEC §9.6): of the last PROJ admitted
        from upstream or sent downstream; before any, the boundary's own."""
        self.joining = False
        """A replica that joins a running swarm, before its state came: any step of the run is
        admitted (what its neighbours send it of the step it joins at comes before it knows it)."""
        self.behind = False
        """A replica that resumed behind its stage, before a partner's state came (SPEC §9.10 item
        13): its own projector versions are not the stage's, so they are not checked."""

    def begin(self, start_step: int, epoch: int) -> None:
        """Training starts at ``start_step`` in run epoch ``epoch``: the window follows them."""
        self.start_step = self.step = start_step
        self.epoch = epoch

    def projector(self, stage: int, pver: int) -> None:
        """The link to ``stage`` moved to projector version ``pver`` (a PROJ admitted or sent)."""
        self.link_pver[stage] = pver

    def of(self, stage: int) -> Window:
        """What the receive path accepts from neighbour ``stage`` now: the current step and the next;
        from downstream also the previous one (its REPORT may come after this stage moved on), from
        upstream the ``upstream_lag`` previous ones. ``pver``: the link's projector version (None:
        no trainable one)."""
        upstream = stage < self.stage
        trainable = self.projectors.takes if upstream else self.projectors.owns
        pver = None
        if trainable and not self.behind:
            own = self.projectors.inbound_pver if upstream else self.projectors.outbound_pver
            pver = self.link_pver.get(stage, own)
        if self.joining:
            return Window(low=0, high=max(self.steps - 1, 0), pver=pver)
        low = max(self.start_step, self.step - (self.upstream_lag if upstream else 1))
        return Window(low=low, high=self.step + 1, pver=pver)
