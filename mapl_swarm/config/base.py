"""Config building blocks: the choice types (``Literal``), the one choice check and small checks."""

from __future__ import annotations

import functools
import re
from dataclasses import fields
from typing import Any, Literal, get_args, get_origin, get_type_hints

from mapl_swarm.config.catalog import CODEC_NAMES
from mapl_swarm.errors import ConfigError


__all__ = [
    "Codec",
    "Anchor",
    "WireDtype",
    "Schedule",
    "VQSync",
    "VQSliceOrder",
    "VQUpdate",
    "Device",
    "Autocast",
    "CODECS",
    "ANCHORS",
    "SCHEDULES",
    "MIN_BPE_VOCAB",
]



Codec = Literal["none", "none_offsets", "ssn", "fixed", "naive", "mapl", "mapl_vq"]
"""Boundary codec names; equal to :data:`mapl_swarm.config.catalog.CODEC_NAMES` (a test checks)."""
Anchor = Literal["factorized", "full", "static", "none"]
WireDtype = Literal["bf16", "fp16", "fp32"]
Schedule = Literal["cosine", "wsd", "constant"]
VQSync = Literal["stream", "full"]
VQSliceOrder = Literal["priority", "round_robin"]
VQUpdate = Literal["micro_batch", "step"]
Device = Literal["auto", "cpu", "cuda"]
"""``runtime.device`` choices; ``cuda:N`` (a CUDA device index) is accepted too (the field's
``pattern`` metadata, checked by :func:`_check_choices`)."""
Autocast = Literal["auto", "off", "bf16"]

CODECS: tuple[str, ...] = CODEC_NAMES
ANCHORS: tuple[str, ...] = get_args(Anchor)
SCHEDULES: tuple[str, ...] = get_args(Schedule)

MIN_BPE_VOCAB = 260
"""Smallest ``data.vocab_size`` for the byte-level BPE trained here (256 bytes, EOS and a few merges);
checked when the tokenizer is trained, so configs used without data may have smaller vocabularies."""


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise ConfigError(msg)


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return get_type_hints(cls)


def _check_choices(obj: Any) -> None:
    """The one check of every ``Literal``-typed field of a config section: its value is one of the
    Literal's arguments, or matches the field's ``pattern`` metadata when it has one (a regular
    expression, with ``pattern_name`` saying it in words, e.g. ``runtime.device = "cuda:1"``).
    Called by each section's ``__post_init__`` (files and code alike)."""
    for f in fields(obj):
        hint = _hints(type(obj))[f.name]
        if get_origin(hint) is Literal:
            allowed, value = get_args(hint), getattr(obj, f.name)
            pattern = f.metadata.get("pattern")
            ok = isinstance(value, str) and (value in allowed or bool(pattern and re.fullmatch(pattern, value)))
            also = f" or {f.metadata['pattern_name']}" if pattern else ""
            _check(ok, f"{obj.SECTION}.{f.name} must be one of {allowed}{also}, got {value!r}")


def _check_ints(obj: Any, positive: tuple[str, ...] = (), non_negative: tuple[str, ...] = ()) -> None:
    for name in positive:
        _check(getattr(obj, name) > 0, f"{obj.SECTION}.{name} must be positive, got {getattr(obj, name)}")
    for name in non_negative:
        _check(getattr(obj, name) >= 0, f"{obj.SECTION}.{name} must be >= 0, got {getattr(obj, name)}")
