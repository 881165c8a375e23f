"""Boundary compression: codecs (none, mapl, fixed, naive, ssn, mapl_vq), anchors, byte accounting.

The package imports lazily, so that naming one of its parts does not pull in torch before it is
needed. The codecs' static facts (names, families, report roles) are the torch-free
:mod:`mapl_swarm.config.catalog`, beside the configs that choose a codec.
"""

from __future__ import annotations

from mapl_swarm.lazy import lazy_exports

_EXPORTS = {
    "StageAnchor": "mapl_swarm.compress.anchors",
    "Boundary": "mapl_swarm.compress.boundary",
    "BoundaryBytes": "mapl_swarm.compress.boundary",
    "WIRE_TORCH_DTYPES": "mapl_swarm.compress.boundary",
    "BoundaryShape": "mapl_swarm.compress.boundary",
    "id_wire_dtype": "mapl_swarm.compress.boundary",
    "StageCodec": "mapl_swarm.compress.codecs",
    "boundary_bytes": "mapl_swarm.compress.codecs",
    "build_codec": "mapl_swarm.compress.codecs",
    "codec_class": "mapl_swarm.compress.codecs",
    "config_boundary_bytes": "mapl_swarm.compress.codecs",
}

__all__ = list(_EXPORTS)


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
