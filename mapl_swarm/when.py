"""Moments as people read them: every time a message or a record shows is ISO 8601, in UTC."""

from __future__ import annotations

import time

__all__ = ["iso_time"]


def iso_time(t: float) -> str:
    """Unix time ``t`` as ISO 8601 in UTC, to the second: ``2026-12-05T15:09:18Z``."""
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t))
