"""In-memory messages: :class:`Message`, :class:`WireTensor`, and the per-type rules of SPEC §5.

A :class:`WireTensor` pairs a dtype tag with a numpy array holding the elements (bf16 as
``uint16``). Decoded tensors are read-only views of the received frames (no copy for ``raw``).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping

import msgpack
import numpy as np

from . import spec
from .errors import BadDtype, InvalidMessage, UnknownMessageType
from .spec import MessageType

__all__ = ["WireTensor", "Message", "META_SCHEMA", "check_type_rules"]

_TAG_BY_NUMPY = {
    np.dtype(np.float16): "fp16",
    np.dtype(np.float32): "fp32",
    np.dtype(np.float64): "fp64",
    np.dtype(np.uint8): "uint8",
    np.dtype(np.uint16): "uint16",
    np.dtype(np.uint32): "uint32",
    np.dtype(np.int32): "int32",
    np.dtype(np.int64): "int64",
}


@dataclass(frozen=True, eq=False)
class WireTensor:
    """A tensor as it travels: dtype tag plus numpy elements.

    For ``bf16`` the array holds the raw 16-bit patterns (``uint16``; an ``int16`` or
    ``ml_dtypes.bfloat16`` array is viewed as ``uint16``). Equality compares tag, shape and bytes.
    """

    dtype: str
    """Dtype tag (``spec.DTYPES``)."""
    data: np.ndarray
    """Element array; its numpy dtype must match the tag (kind and itemsize)."""

    def __post_init__(self) -> None:
        info = spec.DTYPES.get(self.dtype) if isinstance(self.dtype, str) else None
        if info is None:
            raise BadDtype(f"unknown dtype tag {self.dtype!r:.40}")
        data = self.data
        if not isinstance(data, np.ndarray):
            raise BadDtype(f"WireTensor data must be a numpy array, got {type(data).__name__}")
        nd = data.dtype
        if self.dtype == "bf16":
            ok = nd.itemsize == 2 and (nd.kind in "uiV" or nd.name == "bfloat16")
            if ok and nd.kind != "u":  # keep the bits, label them uint16 (same byte order)
                order = nd.str[0] if nd.kind == "i" and nd.str[0] in "<>" else "="
                object.__setattr__(self, "data", data.view(np.dtype(order + "u2")))
        else:
            ok = nd.kind == info.numpy.kind and nd.itemsize == info.itemsize
        if not ok:
            raise BadDtype(f"numpy dtype {nd} does not carry tag {self.dtype!r}")

    @classmethod
    def from_array(cls, array: np.ndarray, dtype: str | None = None) -> "WireTensor":
        """Wrap ``array``, inferring the tag from its numpy dtype unless ``dtype`` is given."""
        array = np.asarray(array)
        if dtype is None:
            if array.dtype.name == "bfloat16":
                dtype = "bf16"
            else:
                dtype = _TAG_BY_NUMPY.get(array.dtype.newbyteorder("="))
                if dtype is None:
                    raise BadDtype(f"numpy dtype {array.dtype} has no wire dtype tag")
        return cls(dtype, array)

    @property
    def shape(self) -> tuple[int, ...]:
        """Shape of the tensor."""
        return tuple(self.data.shape)

    @property
    def nbytes(self) -> int:
        """Bytes of element data."""
        return int(self.data.nbytes)

    def wire_array(self) -> np.ndarray:
        """The elements as a C-contiguous little-endian array of the tag's numpy dtype.

        A view of ``data`` (no copy) when it already is one, which is the usual case.
        """
        target = spec.DTYPES[self.dtype].numpy
        a = self.data
        if a.dtype != target:
            a = a.astype(target)  # byte-swap (big-endian source); same kind and size
        return np.ascontiguousarray(a)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, WireTensor):
            return NotImplemented
        return (
            self.dtype == other.dtype
            and self.shape == other.shape
            and self.wire_array().tobytes() == other.wire_array().tobytes()
        )

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"WireTensor(dtype={self.dtype!r}, shape={self.shape})"


@dataclass(kw_only=True)
class Message:
    """One protocol message; field meanings are those of the header keys in SPEC §2."""

    type: MessageType
    """Message type (an int is converted)."""
    run_id: str
    """Run id (header ``run``)."""
    src: int
    """Sending stage (0-based)."""
    dst: int
    """Destination stage (0-based)."""
    step: int = 0
    """Optimizer step."""
    micro: int = 0
    """Micro-batch index within the step."""
    seq: int = 0
    """Per-link, per-direction sequence number."""
    pver: int = 0
    """Projector version."""
    cver: int = 0
    """Codebook version."""
    epoch: int = 0
    """The sender's run epoch (header ``epoch``, SPEC §9.6): 0 until the swarm first re-forms
    after a departure; messages of a lower epoch than the receiver's are dropped (``stale_epoch``)."""
    meta: dict[str, Any] = field(default_factory=dict)
    """Typed fields of the message type (META_SCHEMA) plus free fields."""
    tensors: dict[str, WireTensor] = field(default_factory=dict)
    """Tensors by name, in frame order; numpy arrays given here are wrapped by inferred tag."""
    version: tuple[int, int] = spec.PROTOCOL_VERSION
    """Protocol version the message was (or is to be) encoded with."""

    def __post_init__(self) -> None:
        if not isinstance(self.type, MessageType):
            try:
                self.type = MessageType(self.type)
            except (ValueError, TypeError):
                raise UnknownMessageType(f"unknown message type {self.type!r:.40}") from None
        self.tensors = {
            k: v if isinstance(v, WireTensor) else WireTensor.from_array(v)
            for k, v in self.tensors.items()
        }
        self.version = tuple(self.version)  # type: ignore[assignment]


def payload_digest(tensors: Mapping[str, "WireTensor"]) -> bytes:
    """SHA-256 of a message's tensors as they travel (SPEC §9.10 item 15): for each tensor, by
    name in sorted order, msgpack ``[name, dtype tag, shape]`` then its elements' little-endian
    bytes. What a run whose replicas check each other's work signs of each train ACT and GRAD."""
    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name]
        arr = t.wire_array()
        h.update(msgpack.packb([name, t.dtype, list(arr.shape)]))
        h.update(np.ascontiguousarray(arr).tobytes())
    return h.digest()


_HELLO_REQUIRED = {"fingerprint": "str", "num_stages": "uint", "capabilities": "strs", "nonce": "nonce",
                   "num_micro_batches": "count", "micro_batch_size": "count", "eval_batches": "uint"}
_HELLO_OPTIONAL = {"components": "map", "peer": "str", "config": "map", "anchored": "bool", "max_in_flight": "count",
                   "cert": "cert", "contact": "str", "stage_replicas": "count", "lost": "uint"}
META_SCHEMA: dict[MessageType, tuple[dict[str, str], dict[str, str]]] = {
    MessageType.HELLO: (_HELLO_REQUIRED, _HELLO_OPTIONAL),
    MessageType.WELCOME: ({**_HELLO_REQUIRED, "hello_nonce": "nonce"}, _HELLO_OPTIONAL),
    MessageType.REJECT: ({"code": "str", "reason": "str"}, {"local": "any", "remote": "any", "hello_nonce": "nonce",
                                                             "anchored": "bool"}),
    MessageType.ACT: ({"mode": "mode"}, {"sig": "sig"}),
    MessageType.GRAD: ({}, {"sig": "sig"}),
    MessageType.PROJ_GRAD: ({}, {"micro_batches": "uint"}),
    MessageType.REPORT: ({"loss": "float", "tokens": "uint"}, {"mode": "mode", "metrics": "metrics"}),
    MessageType.CODEBOOK_SLICE: ({}, {"stream": "stream", "start": "uint", "full": "bool"}),
    MessageType.RESYNC: ({}, {"stream": "stream", "have": "uint", "reason": "str", "retransmit": "bool",
                              "mode": "mode"}),
    MessageType.HEARTBEAT: ({}, {"sent_ns": "uint", "echo_ns": "uint", "held_ns": "uint",
                                      "anchored": "bool"}),
    MessageType.BYE: ({}, {"reason": "str", "lost": "uint"}),
    MessageType.ERROR: ({"code": "str", "message": "str"}, {"ref_seq": "uint"}),
    MessageType.CHECKPOINT: ({"phase": "phase"}, {"step": "uint_or_nil", "steps": "uints", "have": "have",
                                                  "reason": "str", "epoch": "uint", "missing": "uints",
                                                  "cert": "cert", "sig": "sig"}),
    MessageType.ROUTE: ({"phase": "route_phase"}, {"acts": "uint", "gone": "strs", "held": "uints", "cert": "cert",
                                                   "sig": "sig"}),
    MessageType.DIALBACK: ({"nonce": "nonce"}, {"cert": "cert", "contact": "str"}),
}
"""(required, optional) typed ``meta`` fields per message type (SPEC §5); other types have none."""


def _is_uint(v: Any) -> bool:
    return type(v) is int and v >= 0


def _is_number(v: Any) -> bool:
    return type(v) in (int, float)


def _kind_ok(kind: str, v: Any) -> bool:
    if kind == "str":
        return isinstance(v, str)
    if kind == "uint":
        return _is_uint(v)
    if kind == "count":
        return _is_uint(v) and v >= 1
    if kind == "nonce":
        return isinstance(v, bytes) and len(v) == spec.NONCE_BYTES
    if kind == "cert":
        return isinstance(v, bytes) and 0 < len(v) <= spec.MAX_CERT_BYTES
    if kind == "sig":
        return isinstance(v, bytes) and len(v) == spec.SIG_BYTES
    if kind == "float":
        return type(v) is float
    if kind == "mode":
        return isinstance(v, str) and v in spec.MODES
    if kind == "stream":
        return isinstance(v, str) and v in spec.STREAMS
    if kind == "bool":
        return type(v) is bool
    if kind == "strs":
        return isinstance(v, list) and all(isinstance(x, str) for x in v)
    if kind == "map":
        return isinstance(v, dict)
    if kind == "metrics":
        return isinstance(v, dict) and all(_is_number(x) for x in v.values())
    if kind == "phase":
        return isinstance(v, str) and v in spec.CHECKPOINT_PHASES
    if kind == "route_phase":
        return isinstance(v, str) and v in spec.ROUTE_PHASES
    if kind == "uint_or_nil":
        return v is None or _is_uint(v)
    if kind == "uints":
        return isinstance(v, list) and all(_is_uint(x) for x in v)
    if kind == "have":
        return isinstance(v, dict) and all(isinstance(x, list) and all(_is_uint(y) for y in x) for x in v.values())
    return True


_KIND_TEXT = {
    "str": "a string",
    "uint": "a non-negative integer",
    "count": "a positive integer",
    "nonce": f"a bin of {spec.NONCE_BYTES} bytes",
    "cert": f"a bin of 1 to {spec.MAX_CERT_BYTES} bytes",
    "sig": f"a bin of {spec.SIG_BYTES} bytes",
    "float": "a float",
    "mode": "'train' or 'eval'",
    "stream": "'act' or 'grad'",
    "bool": "a bool",
    "strs": "an array of strings",
    "map": "a map",
    "metrics": "a map of numbers",
    "phase": "'saved', 'complete', 'offer', 'resume', 'drain_request', 'drain', 'unsaved' or 'abandoned'",
    "route_phase": "'ready', 'end', 'commit', 'gone', 'redo', 'taken', 'reopen' or 'exclude'",
    "uint_or_nil": "a non-negative integer or nil",
    "uints": "an array of non-negative integers",
    "have": "a map of arrays of non-negative integers",
}


def check_type_rules(mtype: MessageType, meta: Mapping[str, Any], dtypes: Iterable[tuple[str, str]]) -> None:
    """Check SPEC §5 for a message of type ``mtype`` with tensors ``(name, dtype tag)``.

    Raises InvalidMessage (tensor on a control type, bad ``meta``) or BadDtype (fp32 rule).
    """
    dtypes = list(dtypes)
    if dtypes and mtype not in spec.TENSOR_TYPES:
        raise InvalidMessage(f"{mtype.name} carries no tensors, got {[n for n, _ in dtypes]}")
    if mtype in spec.FP32_ONLY_TYPES:
        for name, tag in dtypes:
            if mtype is MessageType.CODEBOOK_SLICE and name == "index":  # an indexed slice
                if tag not in spec.CODE_DTYPES:
                    raise BadDtype(f"CODEBOOK_SLICE tensor 'index' must be uint8 or uint16, got {tag}")
            elif tag != "fp32":
                raise BadDtype(f"{mtype.name} tensor {name!r} must be fp32, got {tag}")
    required, optional = META_SCHEMA.get(mtype, ({}, {}))
    for key in required:
        if key not in meta:
            raise InvalidMessage(f"{mtype.name} meta lacks required field {key!r}")
    for key, kind in (*required.items(), *optional.items()):
        if key in meta and not _kind_ok(kind, meta[key]):
            raise InvalidMessage(
                f"{mtype.name} meta field {key!r} must be {_KIND_TEXT[kind]}, got {meta[key]!r:.60}"
            )
    if mtype in (MessageType.HELLO, MessageType.WELCOME) and meta["num_stages"] < 1:
        raise InvalidMessage(f"{mtype.name} num_stages must be >= 1")
    if mtype is MessageType.CHECKPOINT:
        _check_checkpoint(meta)
    if mtype is MessageType.ROUTE and meta["phase"] == "end" and "acts" not in meta:
        raise InvalidMessage("ROUTE end needs acts")
    if mtype is MessageType.ROUTE and meta["phase"] in ("gone", "redo", "exclude") and "gone" not in meta:
        raise InvalidMessage(f"ROUTE {meta['phase']} needs gone")
    if mtype is MessageType.ROUTE and "held" in meta and meta["phase"] != "gone":
        raise InvalidMessage(f"ROUTE {meta['phase']} takes no held (only gone does)")
    if mtype is MessageType.ROUTE and ("cert" in meta or "sig" in meta) and meta["phase"] != "redo":
        raise InvalidMessage(f"ROUTE {meta['phase']} takes no cert or sig (only redo does)")


def _check_checkpoint(meta: Mapping[str, Any]) -> None:
    """CHECKPOINT fields by phase (SPEC §5.2); the field types are already checked."""
    phase = meta["phase"]
    if phase in ("saved", "unsaved", "abandoned", "complete", "drain") and meta.get("step") is None:
        raise InvalidMessage(f"CHECKPOINT {phase} needs a step")
    if phase in ("unsaved", "abandoned") and "reason" not in meta:
        raise InvalidMessage(f"CHECKPOINT {phase} needs a reason")
    if phase == "offer":
        steps = meta.get("steps")
        if steps is None:
            raise InvalidMessage("CHECKPOINT offer needs steps")
        if any(b <= a for a, b in zip(steps, steps[1:])):
            raise InvalidMessage(f"CHECKPOINT offer steps must be strictly increasing, got {steps!r:.60}")
    if phase == "resume":
        if "step" not in meta:
            raise InvalidMessage("CHECKPOINT resume needs a step (nil when refused)")
        if meta["step"] is None and not meta.get("reason"):
            raise InvalidMessage("CHECKPOINT resume without a step needs a reason")
