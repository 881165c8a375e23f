"""How often one member's word may make the swarm re-form (SPEC §7.2 item 11).

A neighbour that tells this peer the swarm re-forms (a HELLO of the next run epoch, BYE
``"rejoin"``) is believed when it can be true (§7.2 item 9), and each re-form rolls every stage
back to the newest step all of them saved: up to ``checkpoint.interval_steps`` of everyone's
compute. A certified member running modified code can say so again and again without leaving. So
each member (its certificate's serial; in an insecure run, its stage) has :data:`BURST` re-forms'
credit, and one more for every ``steps_per_credit`` steps past the furthest step this peer had
reached: an honest neighbour that tells of real departures tells of at most one per stretch of
new progress (the swarm trains on between them), while a member that re-forms the swarm before
it regained the lost steps runs out. Beyond its credit, its word is dropped as ``implausible``
and the member is cut off and refused from then on, as if revoked (a new certificate has another
serial). The credit lasts the peer process (every session of it), as the refusal does.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from mapl_swarm.config import TrainConfig

__all__ = ["ReformCredit", "BURST", "reform_credit_steps", "STEPS_PER_CREDIT"]

BURST = 3
"""Re-forms one member may tell of before any new progress: a neighbour whose own neighbour left
twice in a row (a replacement that failed to start) still gets through; a fourth is refused."""
STEPS_PER_CREDIT = 100
"""New progress that earns a re-form's credit back in a run without periodic checkpoints."""


def reform_credit_steps(cfg: TrainConfig) -> int:
    """The steps of new progress that earn one re-form's credit back: a checkpoint interval (a
    re-form rolls back at most that far), else :data:`STEPS_PER_CREDIT`."""
    return cfg.checkpoint.interval_steps or STEPS_PER_CREDIT


@dataclass
class ReformCredit:
    """Each member's credit of re-forms (module docstring); ``steps_per_credit``: the new progress
    (steps past the furthest one reached) that earns one back."""

    steps_per_credit: int
    furthest: int = 0
    """The furthest step this peer reached in any session."""
    _credit: dict[str, tuple[float, int]] = field(default_factory=dict)
    """Member -> (credit, the furthest step when it was last counted)."""

    def reached(self, step: int) -> None:
        """This peer reached ``step`` (it may have rolled back since)."""
        self.furthest = max(self.furthest, step)

    def spend(self, member: str) -> bool:
        """``member`` tells of a re-form: True when it had credit left (one is spent), False when not."""
        credit, at = self._credit.get(member, (float(BURST), self.furthest))
        credit = min(float(BURST), credit + (self.furthest - at) / max(1, self.steps_per_credit))
        if credit < 1.0:
            self._credit[member] = (credit, self.furthest)
            return False
        self._credit[member] = (credit - 1.0, self.furthest)
        return True
