"""When periodic work comes due in a run of steps (validation, checkpoints, metrics records)."""

from __future__ import annotations

__all__ = ["due"]


def due(every: int, step: int, total_steps: int) -> bool:
    """The cadence of periodic work after optimizer step ``step``: every ``every`` steps and after
    the last one; never when ``every`` is 0."""
    return bool(every) and (step % every == 0 or step == total_steps)
