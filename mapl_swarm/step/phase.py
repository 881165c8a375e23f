"""Where a peer is in its run: one enum for the whole step protocol (:class:`~.core.StepCore`'s state)."""

from __future__ import annotations

import enum

__all__ = ["Phase", "STEP_PHASES", "ACTIVE", "WAITING"]


class Phase(enum.Enum):
    """A peer's phase; each step runs BOUNDARY, [VALIDATE], SERVE, FLUSH, [AVERAGE, [REPAIR]],
    COMMIT, STEP (the core's module docstring draws the transitions)."""

    START = "start"
    """Before the first step: the first PROJ, then the sync round or a joiner's download."""
    SYNC = "sync"
    """The stage's replicas' round before the first step."""
    JOIN = "join"
    """A joining replica downloads its stage's state (again, when it was a step old)."""
    RESYNC = "resync"
    """This replica's parameters differ from its stage's: it downloads a partner's."""
    BOUNDARY = "boundary"
    """Between two steps: a chain's drain, stage 0's validation, or the end."""
    VALIDATE = "validate"
    SERVE = "serve"
    """The step's forwards and backwards."""
    FLUSH = "flush"
    """PROJ_GRADs up and in, the step's losses."""
    AVERAGE = "average"
    """The stage's averaging round of the step."""
    REPAIR = "repair"
    """A round not whole after a replica left: waiting for word whether its work comes again."""
    COMMIT = "commit"
    """The round is whole: waiting until every stage's is."""
    STEP = "step"
    """The optimizer step."""
    FINISH = "finish"
    """After the last step (or a drain): the last REPORTs, the last validation, BYE."""
    OVER = "over"


STEP_PHASES = frozenset({Phase.SERVE, Phase.FLUSH, Phase.AVERAGE, Phase.REPAIR, Phase.COMMIT})
"""Phases a redo of the current step interrupts."""
ACTIVE = frozenset({Phase.SERVE, Phase.FLUSH, Phase.AVERAGE, Phase.REPAIR})
"""Phases in which a neighbour's loss is repaired (the round is not whole yet), not redone."""
WAITING = frozenset({Phase.SYNC, Phase.JOIN, Phase.RESYNC, Phase.AVERAGE, Phase.STEP})
"""Phases in which the core waits for its driver's answer to what it asked (a round, a download,
the optimizer step): :meth:`~.core.StepCore.next` is not asked meanwhile."""
