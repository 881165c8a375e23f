"""Learning-rate schedule: a pure function from step number to a multiplier of the peak lr.

Linear warmup over ``warmup_steps`` (step 0 already gets ``1/warmup_steps``, never zero), then

* ``cosine``: half-cosine from 1 at step ``warmup_steps`` to ``min_lr_ratio`` at the last step
  (``total_steps - 1``);
* ``wsd`` (warmup-stable-decay): 1 until the last ``round(wsd_decay_fraction · total_steps)`` steps,
  then linear decay reaching ``min_lr_ratio`` at the last step;
* ``constant``: 1.

Steps at or past ``total_steps`` keep the final value. Every optimizer (Muon, AdamW, SPEL) scales its
own peak lr by the same multiplier.
"""

from __future__ import annotations

import math

__all__ = ["SCHEDULE_NAMES", "lr_multiplier"]

from mapl_swarm.config import SCHEDULES as SCHEDULE_NAMES  # one list, owned by the config


def lr_multiplier(
    step: int,
    *,
    total_steps: int,
    warmup_steps: int,
    schedule: str,
    min_lr_ratio: float,
    wsd_decay_fraction: float,
) -> float:
    """Multiplier in ``(0, 1]`` of the peak learning rate for optimizer step ``step`` (0-based)."""
    if schedule not in SCHEDULE_NAMES:
        raise ValueError(f"unknown lr schedule {schedule!r}; expected one of {SCHEDULE_NAMES}")
    if step < 0 or total_steps < 1 or warmup_steps < 0:
        raise ValueError(f"need step >= 0, total_steps >= 1, warmup_steps >= 0; "
                         f"got {step}, {total_steps}, {warmup_steps}")
    if not 0.0 <= min_lr_ratio <= 1.0 or not 0.0 <= wsd_decay_fraction <= 1.0:
        raise ValueError("min_lr_ratio and wsd_decay_fraction must be in [0, 1]")
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if schedule == "constant":
        return 1.0
    last = total_steps - 1
    if schedule == "cosine":
        span = max(1, last - warmup_steps)
        progress = min(1.0, (step - warmup_steps) / span)
        return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))
    # wsd
    decay_steps = round(wsd_decay_fraction * total_steps)
    if decay_steps <= 0:
        return 1.0
    decay_start = max(warmup_steps, total_steps - decay_steps)
    if step < decay_start:
        return 1.0
    progress = min(1.0, (step - decay_start + 1) / max(1, total_steps - decay_start))
    return 1.0 - (1.0 - min_lr_ratio) * progress
