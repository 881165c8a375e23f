"""Crash-safe file writes: a file is written under a temporary name beside it and renamed, so a
crash or a full disk never leaves a half-written file under the final name."""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["atomic_write_text"]


def atomic_write_text(path: str | Path, text: str) -> Path:
    """Write ``text`` to ``path`` atomically (a hidden ``.NAME.tmp`` beside it, then a rename)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)
    return path
