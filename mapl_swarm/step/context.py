"""What the parts of the step core (:mod:`~.flow`, :mod:`~.repair`, :mod:`~.commit`, :mod:`~.validation`)
use of the core that holds them: the run's settings and links, the step's books and its moves.

:class:`~.core.StepCore` is one; the parts never import it (they are its parts).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

from mapl_swarm.wire import Message

if TYPE_CHECKING:
    from mapl_swarm.step import intents as do
    from mapl_swarm.step.members import Members
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
    """The step core as its parts see it."""

    s: Any
    """The run's settings (:class:`~.core.CoreSettings`)."""
    links: LinksView
    inbox: Inbox
    proj: Projectors
    window: StepWindow
    members: Members
    router: Router
    clock: Callable[[], float]
    stage: int
    first: bool
    last: bool
    cur: StepState
    epoch: int
    joined: int
    projector_step: int
    flow: Any
    repair: Any
    commit: Any
    validation: Any
    """The other parts (:class:`~.flow.Flow`, :class:`~.repair.Repair`, :class:`~.commit.Commit`,
    :class:`~.validation.Validation`)."""

    @property
    def step(self) -> int: ...

    @property
    def token(self) -> do.Token: ...

    @property
    def serving(self) -> bool: ...

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

    def take(self, got: tuple[Message, LinkView], cur: StepState) -> do.Intent | None: ...

    def on_bye(self, msg: Message, link: str, *, during_step: bool) -> do.Intent | None: ...

    def proj_copy(self, msg: Message, link: str | None = None, *, copy: bool = False) -> None: ...

    def projector_ready(self, step: int) -> bool: ...

    def take_later_readies(self, cur: StepState) -> None: ...

    def end_queued_readies(self, cur: StepState) -> None: ...

    def issue_redo(self, step: int, problem: str) -> None: ...

    def redo_soon(self, step: int, problem: str) -> None: ...

    def serve_again(self) -> None: ...

    def resume_if_flushing(self) -> None: ...

    def cancel_round(self) -> None: ...

    def gone_named(self, msg: Message) -> list[str]: ...
