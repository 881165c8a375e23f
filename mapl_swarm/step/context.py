"""What the parts of the step core (:mod:`~.flow`, :mod:`~.repair`, :mod:`~.commit`, :mod:`~.validation`
and the others) use of the core that holds them: the run's settings and links, the step's books and its moves.

:class:`~.core.StepCore` is one; the parts never import it (they are its parts).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

from mapl_swarm.wire import Message

if TYPE_CHECKING:
    from mapl_swarm.step import intents as do
    from mapl_swarm.step.members import Members
    from mapl_swarm.step.phase import Phase
    from mapl_swarm.step.router import Router
    from mapl_swarm.step.state import StepState
    from mapl_swarm.step.window import Projectors, StepWindow

__all__ = ["Core", "LinkView", "LinksView", "Inbox"]


class LinkView(Protocol):
    """A link as the core reads it (:class:`~mapl_swarm.peer.link.PeerLink` is one)."""

    name: str
    stage: int
    contact: str | None
    welcomed: bool
    local_contact: str | None


class LinksView(Protocol):
    """A peer's links by neighbour stage (:class:`~mapl_swarm.peer.link.Links` is one)."""

    up: int | None
    down: int | None

    def of_stage(self, stage: int | None) -> list[LinkView]: ...

    def named(self, name: str) -> LinkView | None: ...

    def __iter__(self) -> Any: ...


class Inbox(Protocol):
    """The peer's queue of pipeline messages (:class:`~mapl_swarm.peer.mailbox.Mailbox` is one)."""

    def take_from(self, wanted: Callable[[Message], bool]) -> tuple[Message, LinkView] | None: ...

    def has(self, wanted: Callable[[Message], bool]) -> bool: ...


class Core(Protocol):
    """The step core as its parts see it: the run's settings, links and books, the other parts, and
    the moves the parts make."""

    s: Any
    """The run's settings (:class:`~.core.CoreSettings`)."""
    links: LinksView
    inbox: Inbox
    proj: Projectors
    window: StepWindow
    members: Members
    router: Router
    clock: Callable[[], float]
    reject: Callable[[str, str, str], None]
    stage: int
    first: bool
    last: bool
    cur: StepState
    epoch: int
    phase: Phase
    joined: int
    projector_step: int
    flow: Any
    projector: Any
    rounds: Any
    repair: Any
    redo: Any
    commit: Any
    validation: Any
    stopping: Any
    """The parts (:class:`~.flow.Flow`, :class:`~.projector.ProjectorExchange`, :class:`~.averaging.Rounds`,
    :class:`~.repair.Repair`, :class:`~.redo.Redo`, :class:`~.commit.Commit`, :class:`~.validation.Validation`,
    :class:`~.stopping.Stopping`)."""
    byes: set[str]
    bye: Message | None
    drained: bool

    @property
    def step(self) -> int: ...

    @property
    def token(self) -> do.Token: ...

    @property
    def active(self) -> bool: ...

    @property
    def committing(self) -> bool: ...

    @property
    def redo_due(self) -> bool: ...

    def send(self, intent: do.Intent) -> None: ...

    def spawn(self, intent: do.Intent) -> None: ...

    def wake(self) -> None: ...

    def drop(self, code: str, msg: Message, rule: str, text: str) -> None: ...

    def queued(self) -> bool: ...

    def take(self, got: tuple[Message, LinkView], handle: Callable[[Message, str], Any]) -> Any: ...

    def take_message(self, wanted: Callable[[Message], bool], what: str, handle: Callable[[Message, str], Any], *,
                     timeout_s: float | None = None) -> Any: ...

    def on_bye(self, msg: Message, link: str, *, during_step: bool) -> Any: ...

    def whole(self) -> None: ...

    def restarted(self, step: int, epoch: int) -> None: ...

    def joined_at(self, step: int, epoch: int, projector: int, members: str, gone: str) -> None: ...
