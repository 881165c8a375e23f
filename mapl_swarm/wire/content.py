"""Content checks (SPEC §6.1): does a well-formed message fit the run it claims to belong to?

The frame decoder proves a message is well formed; these checks prove it can be used: it comes
from the neighbour allowed to send its type, belongs to the current step window, and its tensors
have the run's names, dtypes and shapes, ids below the vocabulary, VQ codes below K, finite
floats, the projector version the link is at and a projector that is orthonormal. A message
that fails is dropped with the :class:`ContentError` ``code`` (counted by code, logged); the peer
keeps training. Pure numpy on the decoded host arrays, no torch, so a peer runs them before
anything reaches the model.

Use, per received message (the order of SPEC §6.1)::

    header, _ = decode_header(frames, limits)                # run, session, seq: the peer's state
    check_epoch(header, epoch)                               # the peer's run epoch, before seq
    check_header(header, shapes, window)                     # sender, step window, projector version
    check_declared(header, shapes)                           # declared sizes, nothing inflated yet
    msg = decode_tensors(header, frames, shapes.decode_limits())
    check_content(msg, shapes, window)                       # raises ContentError(code, text)

:class:`RunShapes` describes the run as seen from one stage; :class:`Window` what that stage
accepts right now (steps, projector version), kept per link by the peer.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Mapping

import numpy as np

from mapl_swarm.errors import MaplError

from . import spec
from .frames import DecodeLimits
from .header import Header
from .message import Message
from .spec import MessageType

__all__ = [
    "CONTENT_CODES",
    "ContentError",
    "RunShapes",
    "Window",
    "TENSOR_NAMES",
    "check_sender",
    "check_epoch",
    "check_header",
    "check_declared",
    "check_content",
    "orthonormal_error",
]

MT = MessageType

CONTENT_CODES: tuple[str, ...] = (
    "wrong_shape",
    "wrong_dtype",
    "id_out_of_range",
    "code_out_of_range",
    "non_finite",
    "stale_projector",
    "out_of_window",
    "not_allowed",
    "replay",
    "wrong_session",
    "stage_taken",
    "queue_full",
    "size_mismatch",
    "stale_epoch",
    "not_orthonormal",
    "implausible",
    "value_out_of_range",
)
"""Stable codes of SPEC §6.1. :func:`check_content` / :func:`check_sender` / :func:`check_declared`
raise the first nine, ``size_mismatch``, ``not_orthonormal`` and ``implausible`` (a REPORT's
numbers; the peer raises it too, for control messages out of place); :func:`check_epoch` raises
``stale_epoch`` given the receiver's epoch; ``replay``, ``wrong_session``, ``stage_taken`` and
``queue_full`` need the link's state and are the peer's (same error class)."""

TENSOR_NAMES: Mapping[MessageType, tuple[str, ...]] = {
    MT.ACT: ("ids", "z", "codes"),
    MT.GRAD: ("dz", "codes"),
    MT.PROJ: ("proj",),
    MT.PROJ_GRAD: ("grad",),
    MT.CODEBOOK_SLICE: ("codes", "index"),
}
"""Tensor names per type (SPEC §4 conventional names; ``mapl_swarm.pipeline.payload.WireName``)."""


class ContentError(MaplError):
    """A well-formed message that does not fit the run; ``code`` is one of :data:`CONTENT_CODES`."""

    def __init__(self, code: str, text: str) -> None:
        if code not in CONTENT_CODES:
            raise ValueError(f"unknown content error code {code!r}")
        self.code = code
        self.text = text
        super().__init__(f"{code}: {text}")

    def __reduce__(self):  # picklable despite the custom __init__
        return (type(self), (self.code, self.text))


def _positive(value: Any, what: str, minimum: int = 1) -> None:
    if type(value) is not int or value < minimum:
        raise ValueError(f"RunShapes.{what} must be an integer >= {minimum}, got {value!r}")


@dataclass(frozen=True, kw_only=True)
class RunShapes:
    """The run as one stage sees it: what every tensor it receives must look like."""

    micro_batch_size: int
    """B: sequences per micro-batch."""
    context_length: int
    """T: tokens per sequence (ids carry T + 1 per sequence: the last stage's labels)."""
    hidden_size: int
    """d: model width (rows of a projector)."""
    width: int
    """r: last dimension of ``z`` / ``dz`` on the wire (the rank; d for an uncompressed codec) and
    columns of a projector."""
    vocab_size: int
    """V: every id is in ``0 .. V-1``."""
    wire_dtype: str = "bf16"
    """Dtype tag of ``z`` / ``dz`` (a float tag)."""
    id_dtype: str = "uint16"
    """Dtype tag of ``ids`` (an integer tag)."""
    vq_rounds: int = 0
    """R: residual VQ rounds; 0 when the codec sends no codes (``z`` / ``dz`` travel instead)."""
    vq_group_size: int = 0
    """G: coordinates per VQ group (``width`` divisible by G); 0 without VQ."""
    vq_codebook_size: int = 0
    """K: codes per codebook; 0 without VQ."""
    num_micro_batches: int
    """M: training micro-batches per optimizer step (``micro`` of train ACT / GRAD below it)."""
    eval_batches: int = 0
    """Eval ACTs per validation (``micro`` of an eval ACT below it; 0: no eval ACT is accepted)."""
    num_stages: int
    """P: stages of the pipeline."""
    stage: int
    """The receiving stage."""
    trainable_projector: bool = True
    """The boundary's projector learns and travels (PROJ, PROJ_GRAD); False: those are not allowed."""
    orthonormal_projector: bool = True
    """The projector stays on St(d, r) (SPEL: ``mapl``, ``mapl_vq``): a PROJ whose ``proj`` is
    more than :data:`~mapl_swarm.wire.spec.PROJ_ORTHONORMAL_TOL` off orthonormal is dropped
    (``not_orthonormal``). False for a projector learned without the constraint (``naive``)."""

    def __post_init__(self) -> None:
        for name in ("micro_batch_size", "context_length", "hidden_size", "width", "vocab_size",
                     "num_micro_batches", "num_stages"):
            _positive(getattr(self, name), name)
        for name in ("vq_rounds", "vq_group_size", "vq_codebook_size", "eval_batches", "stage"):
            _positive(getattr(self, name), name, 0)
        if self.stage >= self.num_stages:
            raise ValueError(f"RunShapes.stage {self.stage} outside 0..{self.num_stages - 1}")
        if self.wire_dtype not in spec.FLOAT_DTYPES:
            raise ValueError(f"RunShapes.wire_dtype must be a float tag, got {self.wire_dtype!r}")
        if self.id_dtype not in spec.INTEGER_DTYPES:
            raise ValueError(f"RunShapes.id_dtype must be an integer tag, got {self.id_dtype!r}")
        for name in ("trainable_projector", "orthonormal_projector"):
            if type(getattr(self, name)) is not bool:
                raise ValueError(f"RunShapes.{name} must be a bool")
        if self.vq_rounds:
            if not self.vq_group_size or self.width % self.vq_group_size:
                raise ValueError(f"RunShapes.width {self.width} must be divisible by vq_group_size "
                                 f"{self.vq_group_size}")
            if not 1 <= self.vq_codebook_size <= 1 << 16:
                raise ValueError(f"RunShapes.vq_codebook_size must be in 1..65536, got {self.vq_codebook_size}")
        elif self.vq_group_size or self.vq_codebook_size:
            raise ValueError("RunShapes: vq_group_size / vq_codebook_size need vq_rounds > 0")

    # ------------------------------------------------------------------ derived
    @property
    def vq(self) -> bool:
        """The codec sends VQ codes instead of ``z`` / ``dz``."""
        return self.vq_rounds > 0

    @property
    def vq_groups(self) -> int:
        """r/G: VQ groups per token."""
        return self.width // self.vq_group_size if self.vq else 0

    @property
    def code_dtype(self) -> str:
        """Dtype tag of VQ codes and slice indices: uint8 when K <= 256, else uint16."""
        return "uint8" if self.vq_codebook_size <= 256 else "uint16"

    def tensor_bytes(self, mtype: MessageType, name: str) -> int | None:
        """Largest ``rawbytes`` the run allows for tensor ``name`` of a ``mtype`` message (None: no
        such tensor in this run)."""
        B, T, d, w = self.micro_batch_size, self.context_length, self.hidden_size, self.width
        size = {tag: spec.DTYPES[tag].itemsize for tag in (self.wire_dtype, self.id_dtype, "fp32")}
        code = spec.DTYPES[self.code_dtype].itemsize
        R, NG, K, G = self.vq_rounds, self.vq_groups, self.vq_codebook_size, self.vq_group_size
        payload = {"codes": B * T * R * NG * code} if self.vq else {"z": B * T * w * size[self.wire_dtype]}
        table: dict[MessageType, dict[str, int]] = {
            MT.ACT: {"ids": B * (T + 1) * size[self.id_dtype], **payload},
            MT.GRAD: {"dz" if k == "z" else k: v for k, v in payload.items()},
        }
        if self.trainable_projector:
            table[MT.PROJ] = {"proj": d * w * 4}
            table[MT.PROJ_GRAD] = {"grad": d * w * 4}
        if self.vq:
            table[MT.CODEBOOK_SLICE] = {"codes": R * NG * K * G * 4, "index": R * NG * K * code}
        return table.get(mtype, {}).get(name)

    def decode_limits(self, *, max_header_bytes: int = spec.DEFAULT_MAX_HEADER_BYTES) -> DecodeLimits:
        """Decoder limits of this run: per tensor name the largest size any type allows it."""
        limits: dict[str, int] = {}
        for mtype, names in TENSOR_NAMES.items():
            for name in names:
                size = self.tensor_bytes(mtype, name)
                if size is not None:
                    limits[name] = max(limits.get(name, 0), size)
        biggest = max([*limits.values(), 1])
        lz4_bound = biggest + biggest // 255 + 16  # an incompressible block is slightly longer
        return DecodeLimits(max_header_bytes=max_header_bytes,
                            max_frame_bytes=min(spec.DEFAULT_MAX_FRAME_BYTES, lz4_bound), max_rawbytes=limits)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready fields (the golden vectors' run descriptions)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "RunShapes":
        return cls(**d)


@dataclass(frozen=True, kw_only=True)
class Window:
    """What a receiver accepts on one link right now (SPEC §6.1 rules 5-6, §9.7)."""

    low: int
    """Oldest step accepted."""
    high: int
    """Newest step accepted."""
    pver: int | None = None
    """The link's projector version: for messages from upstream the ``pver`` of the last PROJ
    accepted on the link (or the version loaded from a checkpoint before any), for messages from
    downstream the ``pver`` of the last PROJ sent on it. None: not checked (no trainable projector)."""

    def __post_init__(self) -> None:
        for name in ("low", "high"):
            if type(getattr(self, name)) is not int or getattr(self, name) < 0:
                raise ValueError(f"Window.{name} must be a non-negative integer, got {getattr(self, name)!r}")
        if self.low > self.high:
            raise ValueError(f"Window.low {self.low} > high {self.high}")
        if self.pver is not None and (type(self.pver) is not int or self.pver < 0):
            raise ValueError(f"Window.pver must be None or a non-negative integer, got {self.pver!r}")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "Window":
        return cls(**d)


# ---------------------------------------------------------------------------- who may say what
_FROM_UPSTREAM = frozenset({MT.ACT, MT.PROJ})
_FROM_DOWNSTREAM = frozenset({MT.GRAD, MT.PROJ_GRAD, MT.REPORT})


def _direction(mtype: MessageType, meta: Mapping[str, Any]) -> str:
    """``up`` (only from the upstream neighbour), ``down`` (only from downstream) or ``any``."""
    if mtype in _FROM_UPSTREAM:
        return "up"
    if mtype in _FROM_DOWNSTREAM:
        return "down"
    stream = meta.get("stream")
    if mtype is MT.CODEBOOK_SLICE and stream in spec.STREAMS:  # the stream's sender sends slices
        return "up" if stream == "act" else "down"
    if mtype is MT.RESYNC and stream in spec.STREAMS:  # the stream's receiver asks
        return "down" if stream == "act" else "up"
    if mtype is MT.CHECKPOINT and meta.get("phase") in spec.CHECKPOINT_PHASES:
        return "down" if meta["phase"] in spec.CHECKPOINT_UPSTREAM_PHASES else "up"
    if mtype is MT.ROUTE and meta.get("phase") in spec.ROUTE_UPSTREAM_PHASES:  # receivers say ready, stage 1 taken
        return "down"
    if mtype is MT.ROUTE and meta.get("phase") in spec.ROUTE_DOWNSTREAM_PHASES:  # senders end and commit
        return "up"
    return "any"


def check_sender(msg: Message | Header, shapes: RunShapes) -> None:
    """``not_allowed`` unless ``msg`` is addressed to this stage by a neighbour allowed to send its
    type (SPEC §9.4). Works on a decoded message or on a header from ``decode_header``."""
    s, P = shapes.stage, shapes.num_stages
    mtype = msg.type
    if msg.dst != s:
        raise ContentError("not_allowed", f"{mtype.name} for stage {msg.dst} reached stage {s}")
    up, down = s - 1, s + 1 if s + 1 < P else -1
    way = _direction(mtype, msg.meta)
    allowed = {"up": {up}, "down": {down}, "any": {up, down}}[way] - {-1}
    if msg.src not in allowed:
        who = {"up": "the upstream neighbour", "down": "the downstream neighbour", "any": "a neighbour"}[way]
        raise ContentError("not_allowed", f"{mtype.name} from stage {msg.src}: stage {s} takes it only from {who}")
    if mtype in (MT.PROJ, MT.PROJ_GRAD) and not shapes.trainable_projector:
        raise ContentError("not_allowed", f"{mtype.name} but this run's boundary has no trainable projector")
    if mtype in (MT.CODEBOOK_SLICE, MT.RESYNC) and not shapes.vq:
        raise ContentError("not_allowed", f"{mtype.name} but this run's codec has no codebooks")


def check_epoch(msg: Message | Header, epoch: int) -> None:
    """``stale_epoch`` (SPEC §6.1 rule 3, §9.6) when ``msg`` is not HELLO, WELCOME or REJECT and
    its header ``epoch`` is below ``epoch``, the receiver's current run epoch: a message sent before
    the swarm last re-formed. Dropped, counted, never answered. Works on a header from
    ``decode_header`` or on a decoded message."""
    if msg.type not in spec.HANDSHAKE_TYPES and msg.epoch < epoch:
        raise ContentError("stale_epoch", f"{msg.type.name} of epoch {msg.epoch} from stage {msg.src}, this "
                                          f"peer is at epoch {epoch}")


def check_declared(header: Header, shapes: RunShapes) -> None:
    """``size_mismatch`` when a tensor's declared ``rawbytes`` exceeds what the run allows for its
    name and type (an unexpected name is allowed none), before any frame is inflated. Descriptors
    that are not well formed are left to :func:`decode_tensors`, which rejects them."""
    for d in header.tensors:
        if not isinstance(d, dict):
            continue
        name, rawbytes = d.get("name"), d.get("rawbytes")
        if not isinstance(name, str) or type(rawbytes) is not int or rawbytes < 0:
            continue
        allowed = shapes.tensor_bytes(header.type, name)
        if allowed is None and rawbytes > 0:
            raise ContentError("size_mismatch", f"{header.type.name} tensor {name!r} ({rawbytes} bytes) is not "
                                                f"part of this run's {header.type.name}")
        if allowed is not None and rawbytes > allowed:
            raise ContentError("size_mismatch", f"{header.type.name} tensor {name!r} declares {rawbytes} bytes, "
                                                f"this run's is at most {allowed}")


# ---------------------------------------------------------------------------- the checks
def _window(msg: Message | Header, shapes: RunShapes, window: Window) -> None:
    if msg.type not in spec.WINDOW_TYPES:
        return
    if not window.low <= msg.step <= window.high:
        raise ContentError("out_of_window", f"{msg.type.name} of step {msg.step}, this link accepts steps "
                                            f"{window.low}..{window.high}")
    if msg.type is MT.ACT and msg.meta.get("mode") == "eval":
        if msg.micro >= shapes.eval_batches:
            raise ContentError("out_of_window", f"eval ACT micro {msg.micro}, the run validates on "
                                                f"{shapes.eval_batches} micro-batches")
    elif msg.type in (MT.ACT, MT.GRAD) and msg.micro >= shapes.num_micro_batches:
        raise ContentError("out_of_window", f"{msg.type.name} micro {msg.micro}, a step has "
                                            f"{shapes.num_micro_batches} micro-batches")


def _projector(msg: Message | Header, shapes: RunShapes, window: Window) -> None:
    if window.pver is None or not shapes.trainable_projector:
        return
    v = window.pver
    if msg.type is MT.PROJ:
        if msg.pver not in (v, v + 1):
            raise ContentError("stale_projector", f"PROJ version {msg.pver}, the link is at {v}: only {v} "
                                                  f"(a re-send) or {v + 1} (the next) fit")
    elif msg.type in (MT.ACT, MT.GRAD, MT.PROJ_GRAD) and msg.pver != v:
        raise ContentError("stale_projector", f"{msg.type.name} made with projector version {msg.pver}, "
                                              f"the link is at {v}")


def _expected(msg: Message, shapes: RunShapes) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Tensor name -> (dtype tag, shape) the run expects in ``msg`` (``n`` of a slice: -1)."""
    B, T, d, w = shapes.micro_batch_size, shapes.context_length, shapes.hidden_size, shapes.width
    R, NG, G = shapes.vq_rounds, shapes.vq_groups, shapes.vq_group_size
    payload = ("codes", (shapes.code_dtype, (B, T, R, NG))) if shapes.vq else ("z", (shapes.wire_dtype, (B, T, w)))
    if msg.type is MT.ACT:
        return {"ids": (shapes.id_dtype, (B, T + 1)), payload[0]: payload[1]}
    if msg.type is MT.GRAD:
        return {"dz" if payload[0] == "z" else "codes": payload[1]}
    if msg.type is MT.PROJ:
        return {"proj": ("fp32", (d, w))}
    if msg.type is MT.PROJ_GRAD:
        return {"grad": ("fp32", (d, w))}
    if msg.type is MT.CODEBOOK_SLICE:
        out = {"codes": ("fp32", (R, NG, -1, G))}
        if "index" in msg.tensors:
            out["index"] = (shapes.code_dtype, (R, NG, -1))
        return out
    return {}


def _shape_fits(got: tuple[int, ...], want: tuple[int, ...]) -> bool:
    return len(got) == len(want) and all(w == -1 or g == w for g, w in zip(got, want))


def _largest(tag: str, a: np.ndarray) -> float:
    """The largest magnitude in a non-empty float array, ``inf`` when it holds a NaN or an Inf (one
    pass decides ``non_finite`` and ``value_out_of_range``). bf16 comes as raw bit patterns: its
    largest biased exponent, all ones for Inf and NaN, gives a power of two at most the magnitude,
    2^24 exactly when the value is 2^24 or more."""
    if tag == "bf16":
        exponent = int(((a >> np.uint16(7)) & np.uint16(0xFF)).max())
        return math.inf if exponent == 0xFF else 2.0 ** (exponent - 127)
    top = float(np.abs(a).max())  # NaN propagates through max
    return top if math.isfinite(top) else math.inf


def _values(msg: Message, shapes: RunShapes) -> None:
    K = shapes.vq_codebook_size
    for name, t in msg.tensors.items():
        a = t.data
        if a.size == 0:
            continue
        if name == "ids":
            lo, hi = int(a.min()), int(a.max())
            if lo < 0 or hi >= shapes.vocab_size:
                bad = lo if lo < 0 else hi
                raise ContentError("id_out_of_range", f"token id {bad} outside 0..{shapes.vocab_size - 1}")
        elif name in ("codes", "index") and t.dtype in spec.CODE_DTYPES:
            top = int(a.max())
            if top >= K:
                raise ContentError("code_out_of_range", f"{msg.type.name} {name} value {top} outside 0..{K - 1}")
        elif t.dtype in spec.FLOAT_DTYPES:
            largest = _largest(t.dtype, a)
            if largest == math.inf:
                raise ContentError("non_finite", f"{msg.type.name} tensor {name!r} holds NaN or Inf")
            if largest >= spec.VALUE_BOUND:
                raise ContentError("value_out_of_range", f"{msg.type.name} tensor {name!r} holds a value of "
                                                         f"magnitude 2^24 or more (SPEC §6.1: no honest value comes near)")


def orthonormal_error(a: np.ndarray) -> float:
    """``‖AᵀA − I_r‖_F`` of a ``(d, r)`` array, computed in fp64 (the Gram matrix is r × r: cheap for
    the ranks that travel, r ≤ a few hundred)."""
    a64 = np.asarray(a, dtype=np.float64)  # (d, r)
    gram = a64.T @ a64  # (r, r)
    gram[np.diag_indices_from(gram)] -= 1.0
    return float(np.linalg.norm(gram))


def _orthonormal(msg: Message, shapes: RunShapes) -> None:
    """``not_orthonormal``: a PROJ of a run whose projector stays on St(d, r) must carry one.
    Runs after the dtype, shape and finiteness rules, so ``proj`` is a finite fp32 (d, r) array."""
    if msg.type is not MT.PROJ or not shapes.orthonormal_projector:
        return
    err = orthonormal_error(msg.tensors["proj"].data)
    tol = spec.PROJ_ORTHONORMAL_TOL
    if not err <= tol:  # fp32 inputs cannot overflow the fp64 Gram matrix; NaN-safe all the same
        raise ContentError("not_orthonormal", f"PROJ version {msg.pver} is {err:.3g} off orthonormal "
                                              f"(||A^T A - I||_F in fp64), the tolerance is {tol:g}")


def check_header(msg: Message | Header, shapes: RunShapes, window: Window) -> None:
    """The rules of SPEC §6.1 a header decides: sender (``not_allowed``), step and micro window
    (``out_of_window``), projector version (``stale_projector``). Works on a header from
    ``decode_header`` (before any tensor is unpacked) or on a decoded message."""
    check_sender(msg, shapes)
    _window(msg, shapes, window)
    _projector(msg, shapes, window)


def _plausible_report(msg: Message, shapes: RunShapes) -> None:
    """A REPORT's loss is a mean cross-entropy of this run (0 .. ``REPORT_LOSS_BOUND`` x ln V)
    over at most the tokens of one step's micro-batches (train: M, eval: E)."""
    loss, tokens = msg.meta["loss"], msg.meta["tokens"]
    bound = spec.REPORT_LOSS_BOUND * math.log(shapes.vocab_size)
    if not 0.0 <= loss <= bound:
        raise ContentError("implausible", f"REPORT loss {loss:g} outside 0 .. {bound:.1f} "
                                          f"({spec.REPORT_LOSS_BOUND:g} x ln V, V = {shapes.vocab_size})")
    batches = shapes.eval_batches if msg.meta.get("mode") == "eval" else shapes.num_micro_batches
    most = batches * shapes.micro_batch_size * shapes.context_length
    if tokens > most:
        raise ContentError("implausible", f"REPORT of {tokens} tokens, more than a step's {most}")


def check_content(msg: Message, shapes: RunShapes, window: Window) -> None:
    """Raise :class:`ContentError` for the first rule of SPEC §6.1 that ``msg`` breaks, in order:
    sender (``not_allowed``), step and micro window (``out_of_window``), projector version
    (``stale_projector``), tensor names (``wrong_shape``), dtypes (``wrong_dtype``), shapes
    (``wrong_shape``), then values: ids (``id_out_of_range``), codes and slice indices
    (``code_out_of_range``), floats (``non_finite``, then ``value_out_of_range``), a REPORT's numbers (``non_finite``, then
    ``implausible``), and a PROJ's columns (``not_orthonormal``, unless the run's projector
    learns unconstrained).
    Types without content rules (HEARTBEAT, BYE, ...) pass after the sender check.
    """
    check_header(msg, shapes, window)
    if msg.type is MT.REPORT:
        numbers = [("loss", msg.meta.get("loss"))]
        numbers += [(f"metrics.{k}", v) for k, v in (msg.meta.get("metrics") or {}).items()]
        for what, v in numbers:
            if isinstance(v, float) and not math.isfinite(v):
                raise ContentError("non_finite", f"REPORT {what} is {v}")
        _plausible_report(msg, shapes)
        return
    if msg.type not in TENSOR_NAMES:
        return
    expected = _expected(msg, shapes)
    names = list(msg.tensors)
    if sorted(names) != sorted(expected):
        raise ContentError("wrong_shape", f"{msg.type.name} carries tensors {names}, this run's carries "
                                          f"{list(expected)}")
    for name, (tag, shape) in expected.items():
        t = msg.tensors[name]
        if t.dtype != tag:
            raise ContentError("wrong_dtype", f"{msg.type.name} tensor {name!r} is {t.dtype}, this run's is {tag}")
    for name, (tag, shape) in expected.items():
        got = msg.tensors[name].shape
        if not _shape_fits(got, shape):
            want = "(" + ", ".join("n" if x == -1 else str(x) for x in shape) + ")"
            raise ContentError("wrong_shape", f"{msg.type.name} tensor {name!r} of shape {got}, this run's is {want}")
    if msg.type is MT.CODEBOOK_SLICE:
        n = msg.tensors["codes"].shape[2]
        if not 1 <= n <= shapes.vq_codebook_size or ("index" in expected and msg.tensors["index"].shape[2] != n):
            raise ContentError("wrong_shape", f"CODEBOOK_SLICE of {n} codes, the codebooks hold "
                                              f"{shapes.vq_codebook_size}")
    _values(msg, shapes)
    _orthonormal(msg, shapes)
