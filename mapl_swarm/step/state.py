"""What a peer knows of the step it works on (SPEC §9.7, §9.10): routing, what it computed, held or re-ran.

One :class:`StepState` per attempt of a step (a redo starts a fresh one). Links are named by their
transport names; payloads and gradients are the driver's objects, kept to send again.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

__all__ = ["StepState"]


@dataclass
class StepState:
    """The step ``step`` as this peer serves it."""

    step: int
    members: frozenset[str] = frozenset()
    """Neighbour links live when the step began: those whose REPORT (downstream) or ``commit``
    (stage 1, from stage 0) the step's commit waits for. A replica that joins mid-step counts
    from the next one."""
    gone_before: frozenset[str] = frozenset()
    """Contacts known gone when this attempt of the step began (its work never went through them)."""
    started: bool = False
    """The step's start (the projector, readies, stage 0's share) is done: serving it again after a
    reopen skips it."""

    # ---------------------------------------------------------------- upstream: what comes in
    readied: set[str] = field(default_factory=set)
    """Upstream links told ``ready`` (a chain's one link: at the start, without a message)."""
    announced: dict[str, int] = field(default_factory=dict)
    """Upstream link -> the train ACTs its ``end`` announced (a chain's: M, at the start)."""
    received: Counter[str] = field(default_factory=Counter)
    """Upstream link -> train ACTs taken."""
    origin: dict[int, str] = field(default_factory=dict)
    """Micro-batch -> the upstream link its ACT came on (set when its forward is asked)."""
    forwarded: int = 0
    """Train micro-batches computed forward here."""
    digests: dict[int, bytes] = field(default_factory=dict)
    """Micro-batch -> the digest of its train ACT (a re-run must bring the same bytes)."""
    grads: dict[int, Any] = field(default_factory=dict)
    """Micro-batch -> the GRAD payload its backward gave here (kept while the upstream stage may
    have several replicas: given again to the replica that re-runs a micro-batch whose origin left)."""
    held: set[int] = field(default_factory=set)
    """Micro-batches taken from an upstream replica that left, whose re-run has not come yet."""
    held_from: set[str] = field(default_factory=set)
    """Gone upstream links whose micro-batches this replica holds (their part of the inbound
    projector's gradient goes to a live one)."""
    awaited: set[str] = field(default_factory=set)
    """Contacts of upstream replicas that left while this replica was active in the step: what they
    had not passed on may come again through their partners, to any ready link, so every live
    upstream link says ``gone`` or ``reopen`` of them before this replica counts its ACTs of the
    step as all in."""
    answered: dict[str, set[str]] = field(default_factory=dict)
    """Upstream link -> the contacts it said ``gone`` or ``reopen`` of in the step (a ``reopen``
    naming no one, passed on by a partner that was told one, is not its word on anyone)."""
    proj_sent: dict[str, tuple[int, Any]] = field(default_factory=dict)
    """Upstream link -> the ACTs and inbound projector gradient its PROJ_GRAD covered (a flush after
    a reopen sends the sum over all of them)."""
    losses: list[Any] = field(default_factory=list)
    """The last stage: its micro-batches' losses (the driver's, on the device)."""
    tokens: int = 0
    """The last stage: tokens of its micro-batches."""

    # ---------------------------------------------------------------- downstream: what goes out
    ready: list[str] = field(default_factory=list)
    """Downstream links that said ``ready`` in time to be routed to (a chain's one link: at once)."""
    replayed_to: set[str] = field(default_factory=set)
    """Downstream links a replica whose round was whole sent ACTs again on (:meth:`~.repair.Repair.replay`)."""
    ready_late: list[str] = field(default_factory=list)
    """Downstream links that said ``ready`` once this replica had ended the step (answered ``end``
    with 0 ACTs): a reopen routes to them too."""
    sent: Counter[str] = field(default_factory=Counter)
    """Downstream link -> train ACTs sent."""
    dest: dict[int, tuple[str, float]] = field(default_factory=dict)
    """Micro-batch awaiting its GRAD -> the link it went on, and when."""
    via: dict[int, str] = field(default_factory=dict)
    """Micro-batch -> the downstream link its train ACT went on last."""
    waiting: list[tuple[int, Any]] = field(default_factory=list)
    """Computed train ACTs waiting for a ready downstream link: (micro-batch, payload)."""
    payloads: dict[int, Any] = field(default_factory=dict)
    """Micro-batch -> the ACT payload sent (kept while the downstream stage has several replicas:
    what went to one that leaves is sent again)."""
    ended: bool = False
    """ROUTE ``end`` went to every ready link (later ``ready``s get ``end`` 0 at once)."""
    done: list[int] = field(default_factory=list)
    """Micro-batches whose backward ran here: what this replica's gradients hold."""
    replayed: set[int] = field(default_factory=set)
    """Micro-batches sent again whose backward ran here already: their GRAD is not awaited (dropped)."""
    rerun: set[int] = field(default_factory=set)
    """Micro-batches sent again whose GRAD this stage still needs (it went with the replica that left):
    if it does not come within the repair's deadline (the next stage's replicas counted it in a
    whole round already) the step is redone."""
    notices: list[str] = field(default_factory=list)
    """Contacts of downstream replicas gone: ROUTE ``reopen`` names them to their partners before
    the re-sends."""
    resend: list[tuple[int, Any]] = field(default_factory=list)
    """ACTs to send again (their replica left), once the notices and any ``reopen`` went."""
    reopen: bool = False
    """ROUTE ``reopen`` goes on the ready links first: more ACTs follow the ``end`` they had."""
    reopened: set[str] = field(default_factory=set)
    """Downstream links told ``reopen``: a PROJ_GRAD over fewer ACTs than they carried is superseded."""
    proj_added: dict[str, tuple[int, Any]] = field(default_factory=dict)
    """Downstream link -> the ACTs and PROJ_GRAD message added to the outbound projector's gradient."""
    untake: set[str] = field(default_factory=set)
    """Downstream links gone whose ACTs went again: a PROJ_GRAD of theirs added is taken back."""
    partners_gone: set[str] = field(default_factory=set)
    """Contacts of this stage's replicas gone during the step (ROUTE ``gone`` from a neighbour)."""
    told: dict[str, set[str]] = field(default_factory=dict)
    """Downstream link -> the gone replicas of this stage it said which micro-batches it holds of."""
    hold_at: dict[int, str] = field(default_factory=dict)
    """Micro-batch -> the downstream link that holds it (its re-run goes there)."""
    answered_down: set[str] = field(default_factory=set)
    """Partners gone that this replica said ``gone`` of downstream."""
    asked: set[str] = field(default_factory=set)
    """Partners a downstream link said ``gone`` of in the step (gone before it or not): it waits
    for this replica's word on them."""
    repair_by: float = 0.0
    """When the wait for a repair (re-runs, upstream word, downstream ``held``) gives up and the
    step is redone (0: none awaited)."""

    # ---------------------------------------------------------------- the order of the work
    todo: list[int] = field(default_factory=list)
    """Stage 0: micro-batches of its share not computed yet."""
    action: int = 0
    """A chain: the index of the next action of the step's 1F1B list."""
    computing: set[int] = field(default_factory=set)
    """Micro-batches whose forward or backward is being computed (asked, no answer yet)."""

    @property
    def taken(self) -> int:
        """Train ACTs taken, over every upstream link."""
        return sum(self.received.values())
