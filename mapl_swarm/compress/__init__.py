"""Boundary compression: codecs (none, mapl, fixed, naive, ssn, mapl_vq), anchors, byte accounting."""

from mapl_swarm.compress.anchors import StageAnchor
from mapl_swarm.compress.boundary import (
    WIRE_TORCH_DTYPES,
    Boundary,
    BoundaryBytes,
    boundary_bytes,
    config_boundary_bytes,
    id_wire_dtype,
    payload_width,
)

__all__ = [
    "StageAnchor",
    "Boundary",
    "BoundaryBytes",
    "WIRE_TORCH_DTYPES",
    "boundary_bytes",
    "config_boundary_bytes",
    "id_wire_dtype",
    "payload_width",
]
