"""Members whose messages keep failing the content checks are cut off (SPEC §7.2 item 10).

A neighbour in session is a certified member; running modified code it can still send well-formed
messages that do not fit the run. Each is dropped with its SPEC §6.1 code before it reaches the
model, but a member that keeps sending them would keep the step waiting for what it owes. Some
codes an honest peer never causes, whatever its timing, hardware or kernels: tensors of another
shape or dtype, ids or codes out of range, NaN or Inf, sizes that differ from what the header
declared, a projector that is not orthonormal. :data:`STRIKES` such messages from one member in a
peer's lifetime cut it off: a departure (with replicas, of that one replica, while its stage keeps
another; a chain re-forms around a replacement of its stage), and its certificate's serial is
refused from then on as if revoked, until this peer restarts (a new certificate has a new
serial). Codes a race between honest peers can cause (``stale_projector``, ``out_of_window``,
``implausible`` re-form words...) never count.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable

__all__ = ["Strikes", "STRIKES", "STRIKE_CODES"]

log = logging.getLogger(__name__)

STRIKE_CODES = frozenset({"wrong_shape", "wrong_dtype", "id_out_of_range", "code_out_of_range", "non_finite",
                          "value_out_of_range", "size_mismatch", "not_orthonormal",
                          "slice_malformed", "slice_shape_mismatch", "slice_index_out_of_range", "future_full_slice"})
"""SPEC §6.1 codes, and the codebook receiver's (§5.1; ``future_full_slice``: a ``future_slice`` of a
full slice), only a broken or dishonest sender causes (module docstring)."""

STRIKES = 8
"""Such messages from one member that cut it off: a few, so that one bad step's worth of a broken
peer (its ACTs or GRADs of two or three micro-batches with their codes) is dropped and counted
before anything is decided, and few enough that a member cannot hold a step for long with them
(each costs the step at most a retransmission)."""


class Strikes:
    """Counts each member's messages that failed a check of :data:`STRIKE_CODES`; at ``limit``,
    ``cut(member, why)`` (once per member)."""

    def __init__(self, cut: Callable[[str, str], None], *, limit: int = STRIKES) -> None:
        self.cut, self.limit = cut, limit
        self.counts: Counter[str] = Counter()

    def count(self, member: str, code: str, text: str) -> None:
        """``member``'s message (a link in session) failed the check of ``code``."""
        if code not in STRIKE_CODES:
            return
        self.counts[member] += 1
        if self.counts[member] == self.limit:
            why = f"{self.limit} of its messages failed the content checks (the last: {code}: {text})"
            log.error("member %s: %s: cut off (SPEC §7.2 item 10)", member, why)
            self.cut(member, why)
