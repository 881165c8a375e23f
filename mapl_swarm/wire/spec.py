"""Constants of wire protocol 2.2: version, message types, dtypes, codecs, limits, key order.

Everything here mirrors a table of ``protocol/SPEC.md``; change the spec first, then this file.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import numpy as np

__all__ = [
    "PROTOCOL_VERSION",
    "MessageType",
    "RESERVED_TYPE_CODES",
    "CHECKPOINT_PHASES",
    "CHECKPOINT_CAPABILITY",
    "CHECKPOINT_UNSAVED_CAPABILITY",
    "CHECKPOINT_ABANDONED_CAPABILITY",
    "CHECKPOINT_UPSTREAM_PHASES",
    "DRAIN_PHASES",
    "DRAIN_CAPABILITY",
    "PIPELINE_CAPABILITY",
    "REJOIN_CAPABILITY",
    "REPLICAS_CAPABILITY",
    "ROUTE_PHASES",
    "REJOIN_REASON",
    "DRAIN_REASON",
    "LEAVE_REASON",
    "FINISHED_REASON",
    "HANDSHAKE_TYPES",
    "WINDOW_TYPES",
    "NONCE_BYTES",
    "SIG_BYTES",
    "DType",
    "DTYPES",
    "FLOAT_DTYPES",
    "INTEGER_DTYPES",
    "CODECS",
    "FP32_ONLY_TYPES",
    "CODE_DTYPES",
    "PROJ_ORTHONORMAL_TOL",
    "REPORT_LOSS_BOUND",
    "VALUE_BOUND",
    "TENSOR_TYPES",
    "MODES",
    "STREAMS",
    "REJECT_CODES",
    "HEADER_KEYS",
    "EPOCH_KEY",
    "OPTIONAL_HEADER_KEYS",
    "DESCRIPTOR_KEYS",
    "DEFAULT_MAX_HEADER_BYTES",
    "DEFAULT_MAX_FRAME_BYTES",
    "MAX_TENSORS",
    "MAX_NDIM",
    "MAX_RUN_ID_BYTES",
    "MAX_NAME_BYTES",
    "MAX_META_DEPTH",
    "UINT16_MAX",
    "UINT32_MAX",
    "UINT64_MAX",
    "INT64_MIN",
]

PROTOCOL_VERSION: tuple[int, int] = (2, 2)
"""(major, minor) spoken by this implementation. A decoder accepts any minor of its major and
refuses every other major with ``VersionMismatch`` (SPEC §10)."""


class MessageType(enum.IntEnum):
    """Message type codes (SPEC §5)."""

    HELLO = 1
    WELCOME = 2
    REJECT = 3
    ACT = 4
    GRAD = 5
    PROJ_GRAD = 6
    PROJ = 7
    REPORT = 8
    CODEBOOK_SLICE = 9
    RESYNC = 10
    HEARTBEAT = 11
    BYE = 12
    ERROR = 13
    CHECKPOINT = 14
    """Checkpoint agreement (SPEC §5.2)."""
    ROUTE = 16
    """Which replicas take part in a step's routing (2.1, SPEC §9.10)."""
    DIALBACK = 17
    """A member's request that a live peer dial its contact, and that dial (2.1, SPEC §9.11)."""


HANDSHAKE_TYPES: frozenset[MessageType] = frozenset({MessageType.HELLO, MessageType.WELCOME, MessageType.REJECT})
"""The handshake (SPEC §9.2): ``seq`` 0, WELCOME and REJECT sent as ROUTER replies, accepted at any run epoch."""

WINDOW_TYPES: frozenset[MessageType] = frozenset(
    {MessageType.ACT, MessageType.GRAD, MessageType.PROJ, MessageType.PROJ_GRAD, MessageType.REPORT,
     MessageType.CODEBOOK_SLICE, MessageType.ROUTE})
"""Checked against the receiver's step window (SPEC §6.1 rule 5, §9.7)."""

RESERVED_TYPE_CODES: frozenset[int] = frozenset({15})
"""Reserved type codes; a decoder rejects them as unknown."""

DRAIN_PHASES: tuple[str, ...] = ("drain_request", "drain")
"""CHECKPOINT phases of a graceful drain (SPEC §5.2; sent only to neighbours advertising
:data:`DRAIN_CAPABILITY`)."""

CHECKPOINT_PHASES: tuple[str, ...] = ("saved", "complete", "offer", "resume", *DRAIN_PHASES, "unsaved",
                                      "abandoned")
"""Values of a CHECKPOINT's ``meta["phase"]`` (SPEC §5.2; ``unsaved`` is sent only to neighbours
advertising :data:`CHECKPOINT_UNSAVED_CAPABILITY`, ``abandoned`` only to those advertising
:data:`CHECKPOINT_ABANDONED_CAPABILITY`)."""

CHECKPOINT_UPSTREAM_PHASES: tuple[str, ...] = ("saved", "unsaved", "offer", "drain_request")
"""CHECKPOINT phases that travel upstream, from stage s + 1 to s (SPEC §9.4); the others travel
downstream."""

DRAIN_CAPABILITY = "drain"
"""HELLO/WELCOME capability of peers that take part in a graceful drain (SPEC §5.2, §5.3)."""

CHECKPOINT_CAPABILITY = "checkpoint_agreement"
"""HELLO/WELCOME capability of peers that take part in checkpoint agreement (SPEC §5.2)."""

CHECKPOINT_UNSAVED_CAPABILITY = "checkpoint_unsaved"
"""HELLO/WELCOME capability of peers that take CHECKPOINT ``unsaved``, a step a stage could not save
(SPEC §5.2, §5.3)."""

CHECKPOINT_ABANDONED_CAPABILITY = "checkpoint_abandoned"
"""HELLO/WELCOME capability of peers that take CHECKPOINT ``abandoned``: stage 0's word that a step
will never be complete, so every stage deletes its files of it (SPEC §5.2, §5.3)."""

PIPELINE_CAPABILITY = "1f1b"
"""HELLO/WELCOME capability of peers that run the 1F1B schedule of SPEC §9.7 (SPEC §5.3; every
reference peer advertises it)."""

REJOIN_CAPABILITY = "rejoin"
"""HELLO/WELCOME capability of peers that take part in rejoin after a departure (SPEC §9.6)."""

REPLICAS_CAPABILITY = "replicas"
"""HELLO/WELCOME capability of the peers of a run with several peers per stage (2.1, SPEC §9.10)."""

ROUTE_PHASES: tuple[str, ...] = ("ready", "end", "commit", "gone", "redo", "taken", "reopen", "exclude")
"""Values of a ROUTE's ``meta["phase"]`` (SPEC §9.10): ``ready`` and ``taken`` travel upstream,
``end``, ``commit`` and ``reopen`` downstream, ``gone``, ``redo`` and ``exclude`` either way."""
ROUTE_UPSTREAM_PHASES: frozenset[str] = frozenset({"ready", "taken"})
"""ROUTE phases a peer takes only from downstream (s + 1)."""
ROUTE_DOWNSTREAM_PHASES: frozenset[str] = frozenset({"end", "commit", "reopen"})
"""ROUTE phases a peer takes only from upstream (s - 1); the others come from either neighbour."""

REJOIN_REASON = "rejoin"
"""BYE ``meta["reason"]`` of a peer that ends its sessions to re-form the swarm (SPEC §9.6)."""

DRAIN_REASON = "drain"
"""BYE ``meta["reason"]`` of a planned departure: a graceful drain, or a stage leaving (SPEC §9.5)."""

FINISHED_REASON = "training finished"
"""BYE ``meta["reason"]`` of stage 0 after the run's last step, passed on down the pipeline (SPEC §9.5)."""

LEAVE_REASON = "leave"
"""BYE ``meta["reason"]`` of a replica that leaves at a step boundary while its stage goes on (SPEC §9.10
item 14); its ``step``: the steps it took."""

NONCE_BYTES = 16
"""Length of the handshake nonces ``meta.nonce`` / ``meta.hello_nonce`` (SPEC §5, §9.2): WELCOME's
and REJECT's ``hello_nonce`` names the HELLO they answer."""
MAX_CERT_BYTES = 4096
"""Largest ``meta.cert`` of a HELLO or WELCOME (a certified peer's certificate, SPEC §7.1, §7.2)."""
SIG_BYTES = 64
"""An Ed25519 signature's bytes (``meta.sig`` of a CHECKPOINT ``drain``, SPEC §5.2)."""


@dataclass(frozen=True)
class DType:
    """One element type tag of SPEC §4."""

    tag: str
    """Name on the wire."""
    itemsize: int
    """Bytes per element."""
    numpy: np.dtype
    """Little-endian numpy dtype the elements are viewed as (bf16 is viewed as uint16)."""
    is_float: bool
    """Whether the tag is a floating-point type."""


def _dt(tag: str, np_str: str, is_float: bool) -> DType:
    d = np.dtype(np_str)
    return DType(tag=tag, itemsize=d.itemsize, numpy=d, is_float=is_float)


DTYPES: dict[str, DType] = {
    d.tag: d
    for d in (
        _dt("bf16", "<u2", True),
        _dt("fp16", "<f2", True),
        _dt("fp32", "<f4", True),
        _dt("fp64", "<f8", True),
        _dt("uint8", "|u1", False),
        _dt("uint16", "<u2", False),
        _dt("uint32", "<u4", False),
        _dt("int32", "<i4", False),
        _dt("int64", "<i8", False),
    )
}
"""Supported dtype tags, by tag."""

FLOAT_DTYPES: frozenset[str] = frozenset(t for t, d in DTYPES.items() if d.is_float)
INTEGER_DTYPES: frozenset[str] = frozenset(t for t, d in DTYPES.items() if not d.is_float)

CODECS: tuple[str, ...] = ("raw", "lz4")
"""Tensor frame codecs: uncompressed, or one LZ4 block without stored size."""

FP32_ONLY_TYPES: frozenset[MessageType] = frozenset(
    {MessageType.PROJ, MessageType.PROJ_GRAD, MessageType.CODEBOOK_SLICE}
)
"""Message types whose tensors must all be fp32 (but a CODEBOOK_SLICE ``index``: CODE_DTYPES)."""

CODE_DTYPES: tuple[str, ...] = ("uint8", "uint16")
"""Dtypes of VQ codes and of a CODEBOOK_SLICE's ``index`` tensor (SPEC §5.1)."""

PROJ_ORTHONORMAL_TOL = 1e-3
"""Largest ``‖AᵀA − I_r‖_F`` (computed in fp64) of a PROJ's ``proj`` in a run whose projector stays on
St(d, r); above it the PROJ is dropped as ``not_orthonormal`` (SPEC §6.1 rule 15).

A PROJ is always fp32 (:data:`FP32_ONLY_TYPES`: any other dtype is ``BadDtype`` before the content
rules), and SPEL retracts in fp32, so a legitimate projector sits at the fp32 floor: measured with
``mapl_swarm.optim.spel`` (8 retraction steps, CPU), ~2·sqrt(r)·eps_fp32 after SPEL steps —
3.5e-7 (64×16), 3.7e-6 (1024×256), 7.0e-6 (4096×1024) — and 0.8–6e-7 for a fresh fp32 QR. The
tolerance leaves over 100× margin at r = 1024 (~250× at the paper's r = 256), while a bf16 copy of
an orthonormal matrix is already 5e-3 (64×16) to 3.8e-2 (4096×1024) off, and any scaling, rank loss
or tampering worth the name is far above it. A constant rather than a function of r: the fp32 floor
reaches 1e-3 only near r ~ 10^7."""

VALUE_BOUND = 2.0**24
"""(SPEC §6.1 rule 14) The largest magnitude of a value in a float tensor (an ACT's ``z``, a GRAD's
``dz``, a projector, a PROJ_GRAD, codebook codes): a larger one is ``value_out_of_range``. Honest
values are orders of magnitude below: activations, even the "massive" ones of large language
models (~1e4), projected onto r orthonormal columns grow by at most sqrt(d) (~1e6 at d = 8192), and
gradients of a mean loss are far smaller. A neighbour's finite 1e30 would overflow the receiver's
own sums instead (a gradient's squared norm passes the fp32 range at ~1.8e19 per value), making
the peer's own step non-finite, which stops it; 2^24 keeps every sum this peer forms from what it
received well inside that range."""

REPORT_LOSS_BOUND = 10.0
"""(SPEC §6.1 rule 16) A REPORT's ``loss`` is a mean cross-entropy in nats: at least 0 and at
most this many times ln V, the loss of a uniform guess over the vocabulary (a freshly initialised
model reports about 1 x ln V): a larger or negative one is ``implausible``."""

TENSOR_TYPES: frozenset[MessageType] = frozenset(
    {
        MessageType.ACT,
        MessageType.GRAD,
        MessageType.PROJ_GRAD,
        MessageType.PROJ,
        MessageType.CODEBOOK_SLICE,
    }
)
"""Message types that may carry tensors; every other type carries none."""

MODES: tuple[str, ...] = ("train", "eval")
"""Values of ``meta["mode"]`` (ACT, REPORT)."""

STREAMS: tuple[str, ...] = ("act", "grad")
"""Values of ``meta["stream"]`` (CODEBOOK_SLICE, RESYNC; SPEC §5.1): forward Z or backward dL/dZ."""

REJECT_CODES: tuple[str, ...] = (
    "version_mismatch",
    "run_mismatch",
    "stage_mismatch",
    "fingerprint_mismatch",
    "stage_taken",
    "not_certified",
)
"""Codes a REJECT uses (SPEC §9.2; ``not_certified``: a certificate that fails, §7.2 item 3); not
enforced by the decoder (a receiver treats any code as a refusal)."""

HEADER_KEYS: tuple[str, ...] = (
    "v",
    "type",
    "run",
    "src",
    "dst",
    "step",
    "micro",
    "seq",
    "pver",
    "cver",
    "meta",
    "tensors",
)
"""Required header keys in canonical order; ``epoch`` (:data:`OPTIONAL_HEADER_KEYS`) sits right after
``cver`` when present."""

EPOCH_KEY = "epoch"
"""Header key of the sender's run epoch (SPEC §2, §9.6): uint64, absent means 0, and a
canonical encoder writes it only when it is not 0."""

OPTIONAL_HEADER_KEYS: tuple[str, ...] = (EPOCH_KEY,)
"""Optional header keys a decoder of this version reads (SPEC §2); unknown keys (``auth`` among
them: messages carry no tag, SPEC §7) are ignored."""

DESCRIPTOR_KEYS: tuple[str, ...] = ("name", "dtype", "shape", "codec", "nbytes", "rawbytes", "crc")
"""Tensor descriptor keys in canonical order."""

DEFAULT_MAX_HEADER_BYTES = 64 * 1024
DEFAULT_MAX_FRAME_BYTES = 256 * 1024 * 1024
MAX_TENSORS = 64
MAX_NDIM = 8
MAX_RUN_ID_BYTES = 128
MAX_NAME_BYTES = 64
MAX_META_DEPTH = 8

UINT16_MAX = 2**16 - 1
UINT32_MAX = 2**32 - 1
UINT64_MAX = 2**64 - 1
INT64_MIN = -(2**63)
