"""What each boundary codec *is*, torch-free: names, display names, families and report roles.

The codec objects themselves (:mod:`mapl_swarm.compress.codecs`) carry the behaviour; this
catalog is the part that configs, grids, reports and plots need without torch. It lives with the
configs (the bottom layer, which chooses a codec by name), so nothing below the codecs imports them. It is the only place
where codec names are spelled out: everything else asks :func:`codec_info` (or iterates
:data:`CODEC_INFO`) instead of comparing codec-name strings.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["CodecInfo", "CODEC_INFO", "CODEC_NAMES", "codec_info", "uncompressed_codec", "headline_codec",
           "codecs_by_order"]


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
    unconstrained_projector: bool = False
    """The learnt projector may leave the Stiefel manifold (no SPEL), so a receiver does not check
    its PROJ for orthonormality (SPEC §6.1 ``not_orthonormal``)."""
    quantized: bool = False
    """Z and dL/dZ travel as VQ codes (codebooks streamed)."""
    frozen_offsets: bool = False
    """Stage 0 adds the frozen token offsets T_fixed (``compression.ssn_offset_std``) to its embedding."""
    offsets_reference: bool = False
    """The uncompressed run with the same frozen offsets: the second reference of every codec with
    ``frozen_offsets`` (so an offset table's own effect is not counted as the codec's)."""
    projector_label: str = ""
    """Table-5 row label (projector ablation), empty when the codec is not one of its rows."""
    color: str
    """Matplotlib colour of the codec's markers and lines in plots."""
    headline: bool = False
    """The paper's method, which the figures single out (spectra, projector angles, energy captured,
    cosine pairs) and whose anchors Table 6 compares; exactly one codec has it."""
    in_table1: bool = False
    """Has rows in Table 1 (codecs at equal token budget); the projector ablations appear only in Table 5."""
    paper_ratio: int | None = None
    """Compression ratio of the codec's rows in the paper's Table 1 (150M model); None when the paper
    reports no Δ% for it. Our rows show the paper's Δ% only at this ratio."""
    paper_delta_pct: tuple[tuple[int, float], ...] = ()
    """The paper's Table 1 Δ% vs uncompressed at ``paper_ratio``, as (P, Δ%) pairs (150M, 3B DCLM tokens)."""
    paper_projector_delta_pct: float | None = None
    """The paper's Table 5 Δ% vs uncompressed of the ``projector_label`` row (150M model, 4x, 3B DCLM tokens)."""

    @property
    def short_name(self) -> str:
        """``display_name`` without its parenthesised detail (plot legends and titles)."""
        return self.display_name.split(" (")[0]


CODEC_INFO: dict[str, CodecInfo] = {i.name: i for i in (
    CodecInfo(name="none", display_name="Uncompressed", family="uncompressed", order=0, uncompressed=True,
              baseline=True, projected=False, color="black", in_table1=True),
    CodecInfo(name="none_offsets", display_name="Uncompressed + SSN offsets", family="uncompressed", order=1,
              baseline=True, projected=False, frozen_offsets=True, offsets_reference=True, color="tab:brown",
              in_table1=True),
    CodecInfo(name="ssn", display_name="SSN", family="ssn", order=2, baseline=True, color="tab:red",
              frozen_offsets=True, in_table1=True, paper_ratio=4, paper_delta_pct=((4, 8.37), (8, 8.63))),
    CodecInfo(name="fixed", display_name="Fixed orthogonal (no updates)", family="projected", order=3,
              baseline=True, anchored=True, projector_label="Fixed orthogonal (no updates)", color="tab:gray",
              paper_projector_delta_pct=1.19),
    CodecInfo(name="naive", display_name="Naive learned (Muon, unconstrained)", family="projected", order=4,
              baseline=True, anchored=True, trainable_projector=True, unconstrained_projector=True,
              projector_label="Learnable, unconstrained (Muon)", color="tab:orange", paper_projector_delta_pct=2.56),
    CodecInfo(name="mapl", display_name="MAPL", family="projected", order=5, anchored=True,
              trainable_projector=True, projector_label="Learnable + SPEL updates (MAPL)", color="tab:green",
              headline=True, in_table1=True, paper_ratio=4, paper_delta_pct=((4, 0.84), (8, 1.11)),
              paper_projector_delta_pct=0.84),
    CodecInfo(name="mapl_vq", display_name="MAPL+VQ", family="projected_vq", order=6, anchored=True,
              trainable_projector=True, quantized=True, color="tab:blue", in_table1=True, paper_ratio=8,
              paper_delta_pct=((4, 1.11), (8, 1.28))),
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


def headline_codec() -> str:
    """Name of the paper's method (the codec the figures and Table 6 single out)."""
    return next(i.name for i in CODEC_INFO.values() if i.headline)


def codecs_by_order() -> list[CodecInfo]:
    """Every codec in report-table order."""
    return sorted(CODEC_INFO.values(), key=lambda i: i.order)
