"""A process's start without cyclic garbage collection.

Importing torch, hivemind and transformers and building a peer's data allocates about a million
objects that live as long as the process. The cyclic collector scans them again and again while
they are made (pausing it saves 4-8 % of a peer's start-up CPU, BENCHMARKS.md "Peer start") and at
every full collection afterwards.
:func:`without_collections` pauses it for such a phase and then freezes what exists
(``gc.freeze``: never scanned again, and shared copy-on-write with a forked child).
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator

__all__ = ["without_collections"]


@contextlib.contextmanager
def without_collections() -> Iterator[None]:
    """No cyclic collection inside; on leaving, what exists is frozen and collection resumes. Do
    not fork inside: the child would inherit the paused collector."""
    gc.disable()
    try:
        yield
    finally:
        gc.freeze()
        gc.enable()
