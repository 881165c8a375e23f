"""Lazy package exports (PEP 562): a package names what it re-exports and from which submodule,
and a submodule is imported only when one of its names is first used. This keeps light imports
light, e.g. the parts of :mod:`mapl_swarm.compress` that need torch, or the codebook rules
under :mod:`mapl_swarm.wire` without msgpack."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["lazy_exports"]


def lazy_exports(package: str, exports: Mapping[str, str]) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """``(__getattr__, __dir__)`` for ``package`` whose public ``name`` lives in ``exports[name]``
    (a module path); a loaded name is cached in the package so later lookups skip the hook."""

    def __getattr__(name: str) -> Any:
        module = exports.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        setattr(sys.modules[package], name, value)
        return value

    def __dir__() -> list[str]:
        return sorted(set(vars(sys.modules[package])) | set(exports))

    return __getattr__, __dir__
