"""Boundary compression: codecs (none, mapl, fixed, naive, ssn, mapl_vq), anchors, byte accounting.

The package imports lazily so that :mod:`mapl_swarm.compress.catalog` (torch-free codec facts used
by configs and reports) does not pull in torch.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "StageAnchor": "mapl_swarm.compress.anchors",
    "Boundary": "mapl_swarm.compress.boundary",
    "BoundaryBytes": "mapl_swarm.compress.boundary",
    "WIRE_TORCH_DTYPES": "mapl_swarm.compress.boundary",
    "boundary_bytes": "mapl_swarm.compress.boundary",
    "config_boundary_bytes": "mapl_swarm.compress.boundary",
    "id_wire_dtype": "mapl_swarm.compress.boundary",
    "payload_width": "mapl_swarm.compress.boundary",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
