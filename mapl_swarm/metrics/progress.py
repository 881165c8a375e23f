"""Step progress: a tqdm bar on a terminal, a log line every ``interval_s`` elsewhere.

A container's log or a redirected file is not a terminal: there a bar's carriage-return redraws
pile up into one unreadable line, so progress is logged instead, one line per interval and one at
the end, with the same figures as the bar.
"""

from __future__ import annotations

import logging
import sys
import time

from tqdm import tqdm

log = logging.getLogger(__name__)

__all__ = ["StepProgress"]


class StepProgress:
    """``p = StepProgress(total, initial=start, desc="swarm mapl P=4"); p.step(loss=l, tok_s=t); p.close()``.

    ``enabled`` False shows nothing; ``terminal`` None asks whether stderr is a terminal."""

    def __init__(self, total: int, *, initial: int = 0, desc: str = "", enabled: bool = True,
                 terminal: bool | None = None, interval_s: float = 30.0) -> None:
        self.total, self.done, self.desc = total, initial, desc
        self.enabled = enabled
        self.interval_s = interval_s
        self._last_line = time.monotonic()
        terminal = sys.stderr.isatty() if terminal is None else terminal
        self._bar = (tqdm(total=total, initial=initial, desc=desc, unit="step", dynamic_ncols=True)
                     if enabled and terminal else None)

    def step(self, **figures: str) -> None:
        """One more step done; ``figures`` (already formatted) go after it, as ``loss=5.123``."""
        self.done += 1
        if self._bar is not None:
            self._bar.set_postfix(figures)
            self._bar.update(1)
            return
        now = time.monotonic()
        if self.enabled and (now - self._last_line >= self.interval_s or self.done >= self.total):
            self._last_line = now
            shown = ", ".join(f"{k} {v}" for k, v in figures.items())
            log.info("%s: step %d/%d%s", self.desc, self.done, self.total, f", {shown}" if shown else "")

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
