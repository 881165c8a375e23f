"""What the step core asks its driver to do (SPEC §9.7, §9.10): sends, computes, rounds, records, waits.

The core (:class:`~.core.StepCore`) never does any of it: it returns these, one at a time from
:meth:`~.core.StepCore.next` (the step's work, in order) or in lists from the methods that take a
control message (sent at once). Links are named by their transport names; payloads, gradients and
losses are the driver's own objects, kept and handed back unread. An intent that computes is
answered by the core method its docstring names, with the intent's ``token`` (the step and run
epoch it was asked in: a result that comes after a redo is dropped).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from mapl_swarm.wire import Message

__all__ = [
    "Intent", "Token", "SendAct", "SendGrad", "SendRoute", "SendReport", "SendBye", "SendProjector",
    "SendProjectorGrad", "Feed", "Forward", "Backward", "EvalFeed", "EvalForward", "ApplySlice",
    "LoadProjector", "AddProjectorGrad", "SumLosses", "MeanLoss", "Sync", "Average", "CancelRound", "Download",
    "SetEpoch", "TakeStep", "Abandon", "Redo", "AskDrain", "RecordTrain", "RecordVal", "StepEnd", "Finish",
    "Boundary", "Wait", "Done", "Leave",
]


@dataclass(frozen=True)
class Token:
    """When a compute was asked: the step and run epoch (its result counts only in them)."""

    step: int
    epoch: int


class Intent:
    """Something the driver carries out."""


# ---------------------------------------------------------------------- sends
@dataclass(frozen=True)
class SendAct(Intent):
    link: str
    step: int
    micro: int
    payload: Any
    eval_mode: bool
    pver: int


@dataclass(frozen=True)
class SendGrad(Intent):
    link: str
    step: int
    micro: int
    payload: Any
    pver: int


@dataclass(frozen=True)
class SendRoute(Intent):
    """ROUTE ``phase`` (SPEC §9.10): ``acts`` with ``end``, ``gone`` contacts with ``gone``,
    ``reopen`` and ``redo``, ``held`` micro-batches with ``gone`` upstream; ``epoch`` None: the link's.
    ``proof``: a relayed ``redo``'s (its maker's ``cert`` and ``sig``, passed on unchanged); None:
    this peer's own decision (a certified peer signs it). ``best_effort``: to a link that may be
    dead (a replica just dropped): sent beside the other intents, given up after a few seconds."""

    link: str
    step: int
    phase: str
    acts: int | None = None
    gone: tuple[str, ...] | None = None
    held: tuple[int, ...] | None = None
    epoch: int | None = None
    proof: tuple[bytes, bytes] | None = None
    best_effort: bool = False


@dataclass(frozen=True)
class SendReport(Intent):
    link: str
    step: int
    meta: dict


@dataclass(frozen=True)
class SendBye(Intent):
    link: str
    step: int
    meta: dict


@dataclass(frozen=True)
class SendProjector(Intent):
    """The outbound projector (as it is now) as the PROJ of ``step`` on ``links``; answered by
    :meth:`~.core.StepCore.answer` with its version (:meth:`~.projector.ProjectorExchange.sent`)."""

    step: int
    links: tuple[str, ...]


@dataclass(frozen=True)
class SendProjectorGrad(Intent):
    """PROJ_GRAD of ``step`` on ``link`` over ``micro_batches`` ACTs: the inbound projector's
    gradient of the micro-batches that came from ``origins`` (link names; None: all of the step's,
    no origin kept apart) plus ``parts`` (gradients sent before, handed back); answered by
    :meth:`~.core.StepCore.answer` with the gradient sent (:meth:`~.projector.ProjectorExchange.grad_sent`)."""

    link: str
    step: int
    micro_batches: int
    pver: int
    origins: tuple[str, ...] | None
    parts: tuple[Any, ...] = ()


# ---------------------------------------------------------------------- compute
@dataclass(frozen=True)
class Feed(Intent):
    """Stage 0: the forward of the data of micro-batch ``micro`` of ``step`` (global index
    ``step · M + micro``); :meth:`~.core.StepCore.answer` (:meth:`~.flow.Flow.forwarded`)."""

    token: Token
    micro: int


@dataclass(frozen=True)
class Forward(Intent):
    """The forward of a received train ACT; :meth:`~.core.StepCore.answer` (:meth:`~.flow.Flow.forwarded`), or
    :meth:`~.core.StepCore.failed` when its codes need a retransmission."""

    token: Token
    msg: Message
    link: str


@dataclass(frozen=True)
class Backward(Intent):
    """The backward of ``micro`` (``msg``: its GRAD from ``link``; None: the last stage's own loss),
    its inbound projector part kept for ``origin`` (None: not kept apart);
    :meth:`~.core.StepCore.answer` (:meth:`~.flow.Flow.backwarded`) or :meth:`~.core.StepCore.failed`."""

    token: Token
    micro: int
    msg: Message | None
    link: str | None
    origin: str | None


@dataclass(frozen=True)
class EvalFeed(Intent):
    """Stage 0: the eval forward of validation batch ``index`` and its eval ACT of ``step`` on ``link``."""

    step: int
    index: int
    link: str


@dataclass(frozen=True)
class EvalForward(Intent):
    """The eval forward of a received eval ACT; :meth:`~.core.StepCore.answer`
    (:meth:`~.validation.Validation.forwarded`; nothing when its codes need a retransmission)."""

    msg: Message
    link: str


@dataclass(frozen=True)
class ApplySlice(Intent):
    """A CODEBOOK_SLICE from ``link``, applied to that link's codebooks."""

    msg: Message
    link: str


@dataclass(frozen=True)
class LoadProjector(Intent):
    """Load the PROJ ``msg`` (of ``step``) as the inbound projector (nothing comes back)."""

    msg: Message
    step: int


@dataclass(frozen=True)
class AddProjectorGrad(Intent):
    """Add the tensor of PROJ_GRAD ``msg`` (None: none) to the outbound projector's gradient in place
    of the one of ``before`` (a PROJ_GRAD of the same link added earlier; None: nothing)."""

    msg: Message | None
    before: Message | None


@dataclass(frozen=True)
class SumLosses(Intent):
    """The last stage: the sum of the step's micro-batch ``losses``; :meth:`~.core.StepCore.answer`
    (:meth:`~.averaging.Rounds.summed`)."""

    token: Token
    losses: tuple[Any, ...]


@dataclass(frozen=True)
class MeanLoss(Intent):
    """The last stage: the mean of an eval ``losses`` of the validation after ``step``, sent as its
    eval REPORT on ``links``."""

    step: int
    losses: tuple[Any, ...]
    links: tuple[str, ...]


# ---------------------------------------------------------------------- the stage's replicas
@dataclass(frozen=True)
class Sync(Intent):
    """The sync round before the first step among ``expected`` replicas (SPEC §9.10 item 2);
    ``behind``: this replica resumed without the agreed step's file (it takes a partner's state);
    :meth:`~.core.StepCore.answer` (:meth:`~.averaging.Rounds.synced`) or :meth:`~.core.StepCore.failed`."""

    expected: int
    timeout_s: float
    behind: bool = False


@dataclass(frozen=True)
class Average(Intent):
    """This stage's averaging round of the step (SPEC §9.10 item 6): the gradients of ``micro``, the
    losses' ``loss_sum``, among as many replicas as :meth:`~.averaging.Rounds.expected` counts when it
    starts; :meth:`~.core.StepCore.answer` (:meth:`~.averaging.Rounds.averaged`) or :meth:`~.core.StepCore.failed`."""

    token: Token
    micro: tuple[int, ...]
    loss_sum: float
    timeout_s: float
    leave: bool = False
    """This replica was asked to stop (SPEC §9.10 item 14)."""
    going: bool = False
    """This replica leaves after the step (it said ``leave`` in the last round too, which kept a
    replica): its partners go on without it."""
    drain: bool = False
    """This replica asks the swarm to drain."""


@dataclass(frozen=True)
class CancelRound(Intent):
    """Make the round in progress give up (a replica of the stage left, or a redo came)."""


@dataclass(frozen=True)
class Download(Intent):
    """The stage's state from a live replica (SPEC §9.10 item 11): ``join`` (a joining replica's,
    or a step-old joiner's again) or ``resync`` (a replica whose parameters differ, the state of
    step ``step``, from one of ``sources``, the members holding the stage's digest), asked for
    again until one answers with a state ``good`` takes (``what`` is awaited);
    :meth:`~.core.StepCore.answer` (:meth:`~.averaging.Rounds.downloaded`)."""

    kind: str
    step: int
    good: Callable[[dict], bool]
    what: str
    sources: tuple[str, ...] = ()


@dataclass(frozen=True)
class SetEpoch(Intent):
    """Every link speaks run epoch ``epoch`` from now on (a joiner's downloaded one)."""

    epoch: int


@dataclass(frozen=True)
class TakeStep(Intent):
    """The optimizer step of ``step`` (the step's round, if any, is in the gradients);
    :meth:`~.core.StepCore.answer` with its metrics."""

    step: int


@dataclass(frozen=True)
class Abandon(Intent):
    """Forget the current step's work in the runtime (saved forwards, gradients, losses)."""


@dataclass(frozen=True)
class Redo(Intent):
    """The run epoch is ``epoch`` from now on (a redo of ``step``): every link speaks it, what the
    inbox holds of an earlier one is dropped (not PROJ, BYE, CODEBOOK_SLICE). The core has moved
    already; the ROUTE ``redo``s and :class:`Abandon` follow as intents of their own."""

    step: int
    epoch: int


@dataclass(frozen=True)
class AskDrain(Intent):
    """CHECKPOINT ``drain_request`` (``reason``) on ``links``, upstream: the swarm drains at stage 0's
    next step boundary."""

    links: tuple[str, ...]
    reason: str


# ---------------------------------------------------------------------- records
@dataclass(frozen=True)
class RecordTrain(Intent):
    """Stage 0: the swarm's training loss of ``step`` (``step`` + 1 steps done)."""

    step: int
    loss: float
    tokens: int


@dataclass(frozen=True)
class RecordVal(Intent):
    """Stage 0: the validation loss after ``step`` steps."""

    step: int
    loss: float


@dataclass(frozen=True)
class StepEnd(Intent):
    """After each optimizer step and its PROJ: the run policy's record and checkpoint (``done``
    steps done)."""

    done: int
    metrics: dict


@dataclass(frozen=True)
class Finish(Intent):
    """Stage 0, before its BYE: until every stage heard that the final checkpoint (``step``: a
    drain's; None: the last step's) is complete."""

    step: int | None = None


@dataclass(frozen=True)
class Boundary(Intent):
    """Stage 0 of a chain at the start of ``step``: whether the swarm drains here; answered by
    :meth:`~.core.StepCore.answer` when it does, nothing otherwise."""

    step: int


@dataclass(frozen=True)
class Wait(Intent):
    """Nothing to do before a message ``wanted`` accepts comes (or the core is woken): ``what`` is
    awaited, for ``timeout_s`` at most (then the run fails naming it); ``waiting_on``: the links
    the waiting log names. The core takes the message at its next :meth:`~.core.StepCore.next`."""

    wanted: Callable[[Message], bool]
    what: str
    timeout_s: float
    waiting_on: Sequence[str] = field(default_factory=tuple)
    fatal: bool = True
    """False: a wait that ends by its timeout is no failure (the core looks again)."""


@dataclass(frozen=True)
class Done(Intent):
    """The run is over for this peer (``bye``: the BYE meta that ended it, passed on)."""

    bye: dict | None = None


@dataclass(frozen=True)
class Leave(Intent):
    """The swarm took this replica for gone (``why``: who said so): it leaves now, as one that
    departed (BYE to its neighbours, then its process ends); its stage goes on without it."""

    why: str
