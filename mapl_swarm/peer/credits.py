"""How often one member's word may cost the swarm work: re-forms (SPEC §7.2 item 11) and redos (§9.10 item 10).

A neighbour that tells this peer the swarm re-forms (a HELLO of the next run epoch, BYE
``"rejoin"``) is believed when it can be true (§7.2 item 9), and each re-form rolls every stage
back to the newest step all of them saved: up to ``checkpoint.interval_steps`` of everyone's
compute. A member that decides a step is redone (ROUTE ``redo``, signed by its maker and passed on
unchanged) makes every stage run the step again: one step of everyone's compute. A certified member
running modified code can say either again and again without leaving, and nothing else bounds it
over a run (a step is redone at most ``max(3, sum(replicas.initial))`` times, but every step may be).

So each member (its certificate's serial; in an insecure run, its stage) has a credit of each: a
burst, and one more for every stretch of steps past the furthest step this peer had reached. An
honest member tells of real departures and failed rounds, between which the swarm trains on; one
that re-forms the swarm or redoes steps faster runs out. Beyond its credit, its word is dropped as
``implausible`` and the member is cut off and refused from then on, as if revoked (a new
certificate has another serial). A redo that two members decided (the replicas of a stage reading
the same failed round) is corroborated: its makers get the credit back, so a member that makes its
stage's rounds fail spends none of its honest partners' credit. The credits last the peer process
(every session of it), as the refusal does.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from mapl_swarm.config import TrainConfig

__all__ = ["Credit", "Credits", "REFORM_BURST", "STEPS_PER_REFORM", "REDO_STEPS_PER_CREDIT"]

REFORM_BURST = 1
"""Re-forms one member may tell of before any new progress: one, so a dishonest member rolls the
swarm back at most once before it is cut off. An honest teller tells of one departure, and the
swarm regains the rolled-back steps and a checkpoint interval more before the next one counts; a
replacement that has not trained yet spends nobody's credit (:meth:`Credits.of`). A second before
that is refused."""
STEPS_PER_REFORM = 100
"""New progress that earns a re-form's credit back in a run without periodic checkpoints."""
REDO_STEPS_PER_CREDIT = 20
"""New progress that earns a redo's credit back: a member whose redos outrun it slows the run by at
most one step in this many (a redo costs the step's compute, not a rollback)."""


@dataclass
class Credit:
    """Each member's credit of one kind of word (module docstring): ``burst`` at first and at most,
    one more per ``steps_per_credit`` steps past the furthest one reached. ``free_before_progress``:
    a peer that has not gone past the step it started from spends none (it has nothing to lose)."""

    burst: int
    steps_per_credit: int
    free_before_progress: bool = False
    furthest: int = 0
    """The furthest step this peer reached in any session."""
    start: int | None = None
    """The step this peer process started from (its first session's)."""
    _credit: dict[str, tuple[float, int]] = field(default_factory=dict)
    """Member -> (credit, the furthest step when it was last counted)."""

    def reached(self, step: int) -> None:
        """This peer reached ``step`` (it may have rolled back since)."""
        if self.start is None:
            self.start = step
        self.furthest = max(self.furthest, step)

    def spend(self, member: str) -> bool:
        """``member`` says it: True when it had credit left (one is spent), False when not."""
        if self.free_before_progress and self.furthest == self.start:
            return True
        credit, at = self._credit.get(member, (float(self.burst), self.furthest))
        credit = min(float(self.burst), credit + (self.furthest - at) / max(1, self.steps_per_credit))
        if credit < 1.0:
            self._credit[member] = (credit, self.furthest)
            return False
        self._credit[member] = (credit - 1.0, self.furthest)
        return True

    def refund(self, member: str) -> None:
        """Give ``member`` back one credit (at most its burst): what it said was corroborated."""
        credit, at = self._credit.get(member, (float(self.burst), self.furthest))
        self._credit[member] = (min(float(self.burst), credit + 1.0), at)


@dataclass
class Credits:
    """A peer process's credits, kept across its sessions."""

    reforms: Credit
    redos: Credit

    @classmethod
    def of(cls, cfg: TrainConfig) -> Credits:
        """Re-forms: one, one back per checkpoint interval of new progress (a re-form rolls back at most
        that far; :data:`STEPS_PER_REFORM` without periodic checkpoints), none spent while this
        process has not trained past its first step (a replacement joining a swarm that re-forms
        around it loses nothing, and excluding the teller would leave it waiting for good). Redos: the redos one step
        may take (``max(3, sum(replicas.initial))``, a fault's worth), one back per
        :data:`REDO_STEPS_PER_CREDIT` steps."""
        return cls(reforms=Credit(REFORM_BURST, cfg.checkpoint.interval_steps or STEPS_PER_REFORM,
                                  free_before_progress=True),
                   redos=Credit(max(3, sum(cfg.replicas.initial)), REDO_STEPS_PER_CREDIT))

    def reached(self, step: int) -> None:
        self.reforms.reached(step)
        self.redos.reached(step)
