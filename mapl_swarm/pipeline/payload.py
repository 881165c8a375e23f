"""Names a boundary payload goes by, defined once: stage payload keys, wire tensor names, codebook
streams and the link-counter kinds, with the byte counter both drivers use.

A :class:`~mapl_swarm.pipeline.stage.StageRuntime` payload is a dict keyed by :class:`PayloadKey`
(``act`` or ``codes``, ``ids`` forward; ``grad`` or ``codes`` backward). On the wire (protocol/SPEC.md
§4, "conventional tensor names") the same tensors are named by :class:`WireName` (``z``, ``dz``...);
:data:`ACT_WIRE` and :data:`GRAD_WIRE` map one to the other. Every payload byte crossing a boundary
is counted under a :class:`LinkKind`, in memory (:mod:`~mapl_swarm.pipeline.inprocess`) and over the
network (:mod:`mapl_swarm.peer`); the kinds are StrEnums, so JSON results keep their string keys.

No torch import here: the launcher reads result files without loading torch.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping
from enum import StrEnum
from typing import Any

__all__ = [
    "PayloadKey",
    "WireName",
    "Stream",
    "LinkKind",
    "ACT_WIRE",
    "GRAD_WIRE",
    "FORWARD_KINDS",
    "BACKWARD_KINDS",
    "act_kind",
    "kind_bytes",
    "LinkCounter",
]


class PayloadKey(StrEnum):
    """Keys of a stage payload dict (what ``StageRuntime.forward``/``backward`` return and take)."""

    ACT = "act"
    """Forward boundary tensor Z (B, T, r), wire dtype (uncompressed codecs: X itself)."""
    GRAD = "grad"
    """Backward boundary tensor dL/dZ (B, T, r), wire dtype."""
    CODES = "codes"
    """mapl_vq: the VQ codes standing in for ``act`` or ``grad`` (B, T, R, r/G)."""
    IDS = "ids"
    """Token ids (B, T+1), travelling forward with the activations."""


class WireName(StrEnum):
    """Tensor names in messages (SPEC §4: conventional names; §5.1: codebook slices)."""

    Z = "z"
    """ACT: the forward boundary tensor."""
    DZ = "dz"
    """GRAD: its gradient."""
    CODES = "codes"
    """ACT/GRAD: VQ codes; CODEBOOK_SLICE: the codebook rows."""
    IDS = "ids"
    """ACT: token ids."""
    PROJ = "proj"
    """PROJ: the sender's projector A_p (fp32, d x r)."""
    PROJ_GRAD = "grad"
    """PROJ_GRAD: the receiver's partial projector gradient (fp32, d x r)."""
    INDEX = "index"
    """CODEBOOK_SLICE (1.2): which codes an indexed slice carries."""


class Stream(StrEnum):
    """The two VQ codebook streams of a boundary (SPEC §5.1 ``meta.stream``, ``wire.spec.STREAMS``)."""

    ACT = "act"
    """Sent downstream with the activations."""
    GRAD = "grad"
    """Sent upstream with the gradients."""

    @property
    def slice_kind(self) -> "LinkKind":
        """The counter kind of this stream's CODEBOOK_SLICE payloads."""
        return LinkKind.CODEBOOK if self is Stream.ACT else LinkKind.GRAD_CODEBOOK


class LinkKind(StrEnum):
    """What payload bytes on a link are counted as (keys of ``LinkCounter.bytes`` and of the
    peers' ``payload_tx`` result)."""

    ACT = "act"
    """Training activations (or their VQ codes), downstream."""
    IDS = "ids"
    """Token ids of training micro-batches, downstream."""
    GRAD = "grad"
    """Boundary gradients (or their VQ codes), upstream."""
    PROJ = "proj"
    """The projector after each step, downstream."""
    PROJ_GRAD = "proj_grad"
    """The receiver's projector gradient once per step, upstream."""
    CODEBOOK = "codebook"
    """mapl_vq ``act`` codebook slices, downstream."""
    GRAD_CODEBOOK = "grad_codebook"
    """mapl_vq ``grad`` codebook slices, upstream."""
    EVAL_ACT = "eval_act"
    """Validation activations (peers only; not part of the training bytes/token)."""
    EVAL_IDS = "eval_ids"
    """Validation token ids (peers only)."""


ACT_WIRE: Mapping[PayloadKey, WireName] = {PayloadKey.ACT: WireName.Z, PayloadKey.CODES: WireName.CODES,
                                           PayloadKey.IDS: WireName.IDS}
"""ACT payload key -> wire tensor name."""
GRAD_WIRE: Mapping[PayloadKey, WireName] = {PayloadKey.GRAD: WireName.DZ, PayloadKey.CODES: WireName.CODES}
"""GRAD payload key -> wire tensor name."""

FORWARD_KINDS: tuple[LinkKind, ...] = (LinkKind.ACT, LinkKind.IDS, LinkKind.PROJ, LinkKind.CODEBOOK)
"""The training bytes a boundary carries downstream (bytes/token forward)."""
BACKWARD_KINDS: tuple[LinkKind, ...] = (LinkKind.GRAD, LinkKind.PROJ_GRAD, LinkKind.GRAD_CODEBOOK)
"""The training bytes a boundary carries upstream (bytes/token backward)."""


def act_kind(key: str, *, eval_mode: bool = False) -> LinkKind:
    """The counter kind of ACT payload tensor ``key`` (ids are counted apart from activations)."""
    if key == PayloadKey.IDS:
        return LinkKind.EVAL_IDS if eval_mode else LinkKind.IDS
    return LinkKind.EVAL_ACT if eval_mode else LinkKind.ACT


def kind_bytes(by_kind: Mapping[str, int], kinds: Iterable[LinkKind]) -> int:
    """Sum of ``by_kind`` over ``kinds`` (missing kinds count 0; keys may be plain strings)."""
    return sum(by_kind.get(k, 0) for k in kinds)


class LinkCounter:
    """Payload bytes and messages per :class:`LinkKind` crossing one boundary in one direction."""

    def __init__(self) -> None:
        self.bytes: dict[LinkKind, int] = defaultdict(int)
        self.messages: dict[LinkKind, int] = defaultdict(int)

    def add(self, kind: LinkKind, tensors: Mapping[str, Any] | Any) -> None:
        """Count one message of ``kind`` carrying ``tensors`` (a tensor or a dict of them)."""
        items = tensors.values() if isinstance(tensors, Mapping) else [tensors]
        self.bytes[kind] += sum(t.numel() * t.element_size() for t in items)
        self.messages[kind] += 1

    def total(self) -> int:
        return sum(self.bytes.values())
