"""What each boundary codec *is*, torch-free: names, display names, families and report roles.

The codec objects themselves (:mod:`mapl_swarm.compress.codecs`) carry the behaviour; this
catalog is the part that configs, grids, reports and plots need without torch. It is the only place
where codec names are spelled out: everything else asks :func:`codec_info` (or iterates
:data:`CODEC_INFO`) instead of comparing codec-name strings.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["CodecInfo", "CODEC_INFO", "CODEC_NAMES", "codec_info", "uncompressed_codec"]


@dataclass(frozen=True, kw_only=True)
class CodecInfo:
    """Static facts about one codec."""

    name: str
    """Registry name (``compression.codec``)."""
    display_name: str
    """Name in reports and plot legends."""
    family: str
    """Implementation family: uncompressed | projected | ssn | projected_vq."""
    order: int
    """Position in report tables (ascending)."""
    uncompressed: bool = False
    """The uncompressed reference every Δ% is measured against."""
    baseline: bool = False
    """A baseline the method is compared with (not the method itself)."""
    projected: bool = True
    """The boundary sends a rank-r projection (``compression.rank`` matters)."""
    anchored: bool = False
    """Later stages use the token anchor ``compression.anchor``."""
    trainable_projector: bool = False
    """The projector learns (its gradient crosses the link once per step)."""
    quantized: bool = False
    """Z and dL/dZ travel as VQ codes (codebooks streamed)."""
    projector_label: str = ""
    """Table-5 row label (projector ablation), empty when the codec is not one of its rows."""


CODEC_INFO: dict[str, CodecInfo] = {i.name: i for i in (
    CodecInfo(name="none", display_name="Uncompressed", family="uncompressed", order=0, uncompressed=True,
              baseline=True, projected=False),
    CodecInfo(name="ssn", display_name="SSN", family="ssn", order=1, baseline=True),
    CodecInfo(name="fixed", display_name="Fixed orthogonal (no updates)", family="projected", order=2,
              baseline=True, anchored=True, projector_label="Fixed orthogonal (no updates)"),
    CodecInfo(name="naive", display_name="Naive learned (Muon, unconstrained)", family="projected", order=3,
              baseline=True, anchored=True, trainable_projector=True,
              projector_label="Learnable, unconstrained (Muon)"),
    CodecInfo(name="mapl", display_name="MAPL", family="projected", order=4, anchored=True,
              trainable_projector=True, projector_label="Learnable + SPEL updates (MAPL)"),
    CodecInfo(name="mapl_vq", display_name="MAPL+VQ", family="projected_vq", order=5, anchored=True,
              trainable_projector=True, quantized=True),
)}
"""Every codec, by name."""

CODEC_NAMES: tuple[str, ...] = tuple(CODEC_INFO)


def codec_info(name: str) -> CodecInfo:
    """The catalog entry of ``name``; an unknown name is a ValueError listing the known ones."""
    try:
        return CODEC_INFO[name]
    except KeyError:
        raise ValueError(f"unknown codec {name!r} (known: {', '.join(CODEC_NAMES)})") from None


def uncompressed_codec() -> str:
    """Name of the uncompressed reference codec."""
    return next(i.name for i in CODEC_INFO.values() if i.uncompressed)
