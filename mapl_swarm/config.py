"""Typed run configuration: frozen dataclasses, presets, strict TOML loading, fingerprint.

A run is described by one :class:`TrainConfig` made of one small section per concern: ``model``,
``compression`` (with its ``compression.vq`` sub-table), ``optim``, ``data``, ``run`` (seed, steps,
output), ``pipeline`` (stages and batch sizes), ``eval``, ``checkpoint``, ``metrics``, ``runtime``
(device, threads) and ``net``. TOML files mirror that layout; an optional top-level ``preset`` key
picks a model preset whose fields the ``[model]`` table may then override. Unknown keys are errors
that name the key and the file.

Choice fields are typed ``Literal[...]`` and checked in one place (:func:`_check_choices`, called by
every section's ``__post_init__``). Keys of the older layout (``run.num_stages``,
``compression.vq_rounds``...) still load: :data:`LEGACY_KEYS` maps each to its new place and a
warning names the new key.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import hashlib
import json
import logging
import math
import re
import tomllib
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any, ClassVar, Literal, get_args, get_origin, get_type_hints

from mapl_swarm.wire.codebook_rules import CodebookLayout, code_dtype
from mapl_swarm.compress.catalog import CODEC_NAMES, codec_info
from mapl_swarm.errors import ConfigError

__all__ = [
    "ModelConfig",
    "VQConfig",
    "CompressionConfig",
    "OptimConfig",
    "DataConfig",
    "RunConfig",
    "PipelineConfig",
    "EvalConfig",
    "CheckpointConfig",
    "MetricsConfig",
    "RuntimeConfig",
    "NetConfig",
    "TrainConfig",
    "MODEL_PRESETS",
    "LEGACY_KEYS",
    "Codec",
    "CODECS",
    "ANCHORS",
    "SCHEDULES",
    "MIN_BPE_VOCAB",
    "load_config",
    "read_toml",
    "upgrade_legacy_keys",
    "config_from_dict",
    "config_to_dict",
    "legacy_layout",
    "model_fingerprint",
]

log = logging.getLogger(__name__)

Codec = Literal["none", "ssn", "fixed", "naive", "mapl", "mapl_vq"]
"""Boundary codec names; equal to :data:`mapl_swarm.compress.catalog.CODEC_NAMES` (a test checks)."""
Anchor = Literal["factorized", "full", "static", "none"]
WireDtype = Literal["bf16", "fp16", "fp32"]
Schedule = Literal["cosine", "wsd", "constant"]
VQSync = Literal["stream", "full"]
VQSliceOrder = Literal["priority", "round_robin"]
Device = Literal["auto", "cpu", "cuda"]
"""``runtime.device`` choices; ``cuda:N`` (a CUDA device index) is accepted too (the field's
``pattern`` metadata, checked by :func:`_check_choices`)."""
Autocast = Literal["auto", "off", "bf16"]

CODECS: tuple[str, ...] = CODEC_NAMES
ANCHORS: tuple[str, ...] = get_args(Anchor)
SCHEDULES: tuple[str, ...] = get_args(Schedule)

MIN_BPE_VOCAB = 260
"""Smallest ``data.vocab_size`` for the byte-level BPE trained here (256 bytes, EOS and a few merges);
checked when the tokenizer is trained, so configs used without data may have smaller vocabularies."""


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise ConfigError(msg)


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return get_type_hints(cls)


def _check_choices(obj: Any) -> None:
    """The one check of every ``Literal``-typed field of a config section: its value is one of the
    Literal's arguments, or matches the field's ``pattern`` metadata when it has one (a regular
    expression, with ``pattern_name`` saying it in words, e.g. ``runtime.device = "cuda:1"``).
    Called by each section's ``__post_init__`` (files and code alike)."""
    for f in fields(obj):
        hint = _hints(type(obj))[f.name]
        if get_origin(hint) is Literal:
            allowed, value = get_args(hint), getattr(obj, f.name)
            pattern = f.metadata.get("pattern")
            ok = isinstance(value, str) and (value in allowed or bool(pattern and re.fullmatch(pattern, value)))
            also = f" or {f.metadata['pattern_name']}" if pattern else ""
            _check(ok, f"{obj.SECTION}.{f.name} must be one of {allowed}{also}, got {value!r}")


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """LLaMA-style decoder shape."""

    SECTION: ClassVar[str] = "model"

    vocab_size: int = 8192
    """Vocabulary size; must equal the tokenizer's (derived from ``data.vocab_size`` at load when
    only that one is set, see :func:`config_from_dict`)."""
    hidden_size: int = 256
    """Residual stream width d."""
    num_layers: int = 8
    """Number of decoder layers L, split over the pipeline stages."""
    num_heads: int = 4
    """Attention heads."""
    num_kv_heads: int = 0
    """Key/value heads for grouped-query attention; 0 means equal to num_heads."""
    ffn_hidden_size: int = 672
    """SwiGLU intermediate width."""
    context_length: int = 256
    """Tokens per training sequence T (each sequence carries T+1 ids for labels)."""
    rope_theta: float = 10000.0
    """Rotary embedding base."""
    rms_norm_eps: float = 1e-5
    """RMSNorm epsilon."""
    init_std: float = 0.02
    """Standard deviation of the normal initialisation of linear and embedding weights."""

    def __post_init__(self) -> None:
        _check_choices(self)
        for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "ffn_hidden_size",
                     "context_length"):
            _check(getattr(self, name) > 0, f"model.{name} must be positive, got {getattr(self, name)}")
        _check(self.hidden_size % self.num_heads == 0,
               f"model.hidden_size {self.hidden_size} is not divisible by num_heads {self.num_heads}")
        _check((self.hidden_size // self.num_heads) % 2 == 0, "model head dimension must be even (rotary)")
        kv = self.kv_heads
        _check(kv > 0 and self.num_heads % kv == 0,
               f"model.num_heads {self.num_heads} is not divisible by num_kv_heads {kv}")
        _check(self.init_std > 0, "model.init_std must be positive")

    @property
    def kv_heads(self) -> int:
        return self.num_kv_heads or self.num_heads


MODEL_PRESETS: dict[str, ModelConfig] = {
    "tiny": ModelConfig(hidden_size=256, num_layers=8, num_heads=4, ffn_hidden_size=672,
                        context_length=256),
    "150M": ModelConfig(vocab_size=32000, hidden_size=1024, num_layers=9, num_heads=8,
                        ffn_hidden_size=2688, context_length=2048),
    "500M": ModelConfig(vocab_size=32000, hidden_size=1536, num_layers=18, num_heads=12,
                        ffn_hidden_size=4096, context_length=2048),
    "1B": ModelConfig(vocab_size=32000, hidden_size=2048, num_layers=20, num_heads=16,
                      ffn_hidden_size=5440, context_length=2048),
}


@dataclass(frozen=True, kw_only=True)
class VQConfig:
    """``[compression.vq]``: residual vector quantization of Z and dL/dZ (codec ``mapl_vq``), and
    the settings object of every VQ stream (:mod:`mapl_swarm.compress.vq`). Its derived sizes below
    need no torch."""

    SECTION: ClassVar[str] = "compression.vq"

    rank: int = field(default=0, metadata={"derived_from": "compression.rank"})
    """Rank r of the quantized stream: not a key of its own, copied from ``compression.rank`` by
    :class:`CompressionConfig` (0 only in a VQConfig built outside one)."""
    codebook_size: int = 256
    """Codes K per codebook (one per group and round); codes travel as uint8 when K <= 256, else
    uint16 (K <= 65536)."""
    rounds: int = 2
    """Residual quantization rounds R (round k quantizes what rounds < k left)."""
    group_size: int = 2
    """Coordinates G per group; the rank is split into rank/G groups, each with its own codebooks.
    G=2, R=2, K=256 sends rank bytes per token (bf16 MAPL: 2 x rank)."""
    slice_fraction: float = 0.0625
    """Stream sync: fraction of each codebook's codes sent per training micro-batch (a
    CODEBOOK_SLICE of n = ceil(fraction x K) codes of every codebook, chosen by ``slice_order``).
    Its bytes per micro-batch are :attr:`slice_bytes_per_micro`; the default's cost in bytes and loss:
    BENCHMARKS.md, "Quality: codecs at equal token budget"."""
    slice_order: VQSliceOrder = "priority"
    """Stream sync: which codes a slice carries: priority (per codebook the codes with the largest
    usage share x squared drift since the receiver's copy, as an indexed slice: +1 byte per code and
    codebook for K <= 256) | round_robin (a contiguous range cycling over the codebook). Default from
    the comparison of the two orders in BENCHMARKS.md, "Quality: codecs at equal token budget"."""
    sync: VQSync = "stream"
    """Codebook synchronisation: stream (slices, SPEC 5.1) | full (whole codebooks every
    micro-batch, for comparison)."""
    ema_decay: float = 0.99
    """EMA decay of the k-means statistics (code usage and sums) per micro-batch."""
    kmeans_init_batches: int = 1
    """The first this many training micro-batches initialise the codebooks by k-means on their data
    (each sent as a full slice) before EMA updates take over."""
    kmeans_iters: int = 10
    """Lloyd iterations per k-means initialisation."""
    dead_code_ratio: float = 0.03
    """A code whose EMA usage share falls below ratio / K is dead and replaced by a random vector of
    the current micro-batch (0 disables replacement)."""
    max_distance_mib: float = 0.0
    """Override of the eager encoder's distance-tensor budget per chunk of tokens, in MiB; 0 (auto)
    sizes it by device (``mapl_swarm.compress.vq.distance_budget_bytes``: a fraction of the free
    memory on CUDA, a cache-sized chunk on CPU). The fused (``compile``) search stores no distances
    and is never chunked."""
    compile: bool = False
    """Fuse the nearest-code search (distances + argmin) into one kernel with torch.compile (Triton
    on CUDA, C++/OpenMP on CPU; compiles once). Off by default: BENCHMARKS.md, "VQ encoder speed". Codes
    may differ from the eager path on (near-)ties; sender and receiver stay identical either way."""

    def __post_init__(self) -> None:
        _check_choices(self)
        _check(self.rank >= 0, f"compression.vq.rank must be >= 0, got {self.rank}")
        _check(2 <= self.codebook_size <= 1 << 16,
               f"compression.vq.codebook_size must be in 2..65536, got {self.codebook_size}")
        for name in ("rounds", "group_size", "kmeans_init_batches", "kmeans_iters"):
            _check(getattr(self, name) >= 1, f"compression.vq.{name} must be >= 1, got {getattr(self, name)}")
        _check(0 < self.slice_fraction <= 1,
               f"compression.vq.slice_fraction must be in (0, 1], got {self.slice_fraction}")
        _check(0 <= self.ema_decay < 1, f"compression.vq.ema_decay must be in [0, 1), got {self.ema_decay}")
        _check(0 <= self.dead_code_ratio < 1,
               f"compression.vq.dead_code_ratio must be in [0, 1), got {self.dead_code_ratio}")
        _check(self.max_distance_mib >= 0,
               f"compression.vq.max_distance_mib must be >= 0 (0: sized by device), got {self.max_distance_mib}")

    @property
    def groups(self) -> int:
        """Groups r/G per token."""
        if self.rank <= 0:
            raise ValueError("VQConfig.rank is unset: take the VQ settings from CompressionConfig.vq")
        return self.rank // self.group_size

    @property
    def layout(self) -> CodebookLayout:
        return CodebookLayout(rounds=self.rounds, groups=self.groups, codebook_size=self.codebook_size,
                              group_size=self.group_size)

    @property
    def code_dtype(self) -> str:
        """Wire dtype name of one code: uint8 for K <= 256, else uint16."""
        return code_dtype(self.codebook_size)

    @property
    def code_bytes(self) -> int:
        """Bytes of one code (and of one index of an indexed slice): 1 for K <= 256, else 2."""
        return 1 if self.codebook_size <= 256 else 2

    @property
    def code_bytes_per_token(self) -> int:
        """Bytes of codes per token: R x r/G x (1 or 2)."""
        return self.rounds * self.groups * self.code_bytes

    @property
    def slice_codes(self) -> int:
        """Codes per partial slice: ceil(fraction x K)."""
        return min(self.codebook_size, math.ceil(self.slice_fraction * self.codebook_size - 1e-9))

    def slice_bytes(self, n: int, *, indexed: bool = False) -> int:
        """Bytes of a slice of ``n`` codes of every codebook: fp32 codes, 4 x R x r/G x n x G, plus
        for an indexed slice its index, R x r/G x n x (1 or 2)."""
        per_code = 4 * self.group_size + (self.code_bytes if indexed else 0)
        return self.rounds * self.groups * n * per_code

    @property
    def slice_bytes_per_micro(self) -> float:
        """Steady-state slice bytes per training micro-batch (full sync: the whole codebooks;
        stream round_robin: K codes spread over ceil(K / n) micro-batches; priority: n indexed codes)."""
        K = self.codebook_size
        if self.sync == "full":
            return float(self.slice_bytes(K))
        if self.slice_order == "priority":
            return float(self.slice_bytes(self.slice_codes, indexed=True))
        return self.slice_bytes(K) / math.ceil(K / self.slice_codes)


@dataclass(frozen=True, kw_only=True)
class CompressionConfig:
    """How activations and gradients cross each stage boundary."""

    SECTION: ClassVar[str] = "compression"

    codec: Codec = "mapl"
    """Boundary codec: none | mapl | fixed | naive | ssn | mapl_vq (mapl + residual VQ of Z and dL/dZ,
    set up in ``[compression.vq]``); see :mod:`mapl_swarm.compress.catalog`."""
    rank: int = 64
    """Projection rank r (ssn: subspace rank k). Ignored by `none`."""
    anchor: Anchor = "factorized"
    """Token anchor for mapl/fixed/naive: factorized | full | static | none."""
    anchor_rank: int = 64
    """Rank r_a of the factorized anchor E_small (V x r_a) @ P (r_a x d)."""
    anchor_init_std: float = 0.02
    """Initial standard deviation of trainable anchor tables."""
    wire_dtype: WireDtype = "bf16"
    """Dtype of activations and their gradients on the wire: bf16 | fp16 | fp32."""
    ssn_refresh_interval_steps: int = 500
    """SSN: Grassmann refresh of U every this many steps; 0 keeps U frozen (as node0)."""
    ssn_refresh_lr: float = 1e-2
    """SSN: Grassmann refresh learning rate."""
    vq: VQConfig = field(default_factory=VQConfig)
    """``[compression.vq]``: the VQ settings of codec mapl_vq (its ``rank`` is this section's)."""

    def __post_init__(self) -> None:
        _check_choices(self)
        _check(self.rank > 0, f"compression.rank must be positive, got {self.rank}")
        _check(self.anchor_rank > 0, f"compression.anchor_rank must be positive, got {self.anchor_rank}")
        _check(self.ssn_refresh_interval_steps >= 0, "compression.ssn_refresh_interval_steps must be >= 0")
        _check(isinstance(self.vq, VQConfig), f"compression.vq must be a table, got {self.vq!r}")
        if self.vq.rank != self.rank:
            object.__setattr__(self, "vq", replace(self.vq, rank=self.rank))
        if codec_info(self.codec).quantized:
            _check(self.rank % self.vq.group_size == 0,
                   f"compression.rank {self.rank} is not divisible by compression.vq.group_size "
                   f"{self.vq.group_size}")


@dataclass(frozen=True, kw_only=True)
class OptimConfig:
    """Hybrid Muon / AdamW / SPEL optimizer (MAPL paper Appendix E, H)."""

    SECTION: ClassVar[str] = "optim"

    muon_lr: float = 0.02
    """Peak Muon learning rate; AdamW and SPEL rates are multiples of it."""
    adamw_lr_ratio: float = 0.5
    """AdamW lr = ratio x muon_lr (embeddings, norms, lm_head, anchors)."""
    projector_lr_ratio: float = 0.1
    """SPEL (and naive projector Muon) lr = ratio x muon_lr."""
    weight_decay: float = 0.01
    """Decoupled weight decay for Muon and AdamW parameters."""
    muon_momentum: float = 0.95
    """Muon Nesterov momentum."""
    muon_ns_steps: int = 5
    """Polar Express steps for the Muon direction."""
    spel_momentum: float = 0.95
    """SPEL heavy-ball momentum beta."""
    spel_direction_steps: int = 5
    """Polar Express steps for the SPEL direction msign(G)."""
    spel_retraction_steps: int = 8
    """Polar Express steps (fp32) for the SPEL retraction msign(A - lr D)."""
    adam_beta1: float = 0.9
    """AdamW beta1."""
    adam_beta2: float = 0.95
    """AdamW beta2."""
    adam_eps: float = 1e-8
    """AdamW epsilon."""
    schedule: Schedule = "cosine"
    """Learning-rate schedule after warmup: cosine | wsd | constant."""
    warmup_steps: int = 10
    """Linear warmup steps."""
    min_lr_ratio: float = 0.1
    """Final lr as a fraction of the peak (cosine, wsd)."""
    wsd_decay_fraction: float = 0.2
    """WSD: fraction of the run spent in the final linear decay."""
    grad_clip_norm: float = 0.0
    """Per-stage gradient norm clipping threshold; 0 disables."""

    def __post_init__(self) -> None:
        _check_choices(self)
        for name in ("muon_lr", "adamw_lr_ratio", "projector_lr_ratio", "adam_eps"):
            _check(getattr(self, name) > 0, f"optim.{name} must be positive")
        for name in ("muon_momentum", "spel_momentum", "adam_beta1", "adam_beta2", "min_lr_ratio",
                     "wsd_decay_fraction"):
            _check(0 <= getattr(self, name) <= 1, f"optim.{name} must be in [0, 1]")
        _check(self.warmup_steps >= 0 and self.grad_clip_norm >= 0 and self.weight_decay >= 0,
               "optim.warmup_steps, grad_clip_norm and weight_decay must be >= 0")
        for name in ("muon_ns_steps", "spel_direction_steps", "spel_retraction_steps"):
            _check(getattr(self, name) >= 1, f"optim.{name} must be >= 1")


@dataclass(frozen=True, kw_only=True)
class DataConfig:
    """Corpus, tokenizer and token shards."""

    SECTION: ClassVar[str] = "data"

    source: str = "stdlib"
    """`stdlib` (the interpreter's own standard library sources), a local file or folder path,
    or `hf:NAME` for a Hugging Face dataset (name or local path)."""
    cache_dir: str = ".mapl_cache"
    """Folder for the trained tokenizer and token shards."""
    tokenizer: str = ""
    """Empty: train a byte-level BPE on the corpus. Else a tokenizer.json path, or a
    transformers tokenizer name/path."""
    vocab_size: int = 8192
    """Vocabulary size when training a BPE tokenizer (at least 260); equals ``model.vocab_size``
    (derived from it at load when only that one is set, see :func:`config_from_dict`)."""
    val_fraction: float = 0.02
    """Fraction of documents held out for validation (chosen by a hash of their name)."""
    max_corpus_bytes: int = 0
    """Read at most this many bytes of corpus (0 = all); for quick tests."""
    text_extensions: tuple[str, ...] = (".py", ".txt", ".md", ".rst")
    """File suffixes read when the source is a folder."""
    hf_split: str = "train"
    """Hugging Face split to read."""
    hf_text_field: str = "text"
    """Hugging Face column holding the text."""

    def __post_init__(self) -> None:
        _check_choices(self)
        _check(self.source != "", "data.source must not be empty")
        _check(0 < self.val_fraction < 1, f"data.val_fraction must be in (0, 1), got {self.val_fraction}")
        _check(self.vocab_size > 0, f"data.vocab_size must be positive, got {self.vocab_size}")
        _check(self.max_corpus_bytes >= 0, "data.max_corpus_bytes must be >= 0")


def _check_ints(obj: Any, positive: tuple[str, ...] = (), non_negative: tuple[str, ...] = ()) -> None:
    for name in positive:
        _check(getattr(obj, name) > 0, f"{obj.SECTION}.{name} must be positive, got {getattr(obj, name)}")
    for name in non_negative:
        _check(getattr(obj, name) >= 0, f"{obj.SECTION}.{name} must be >= 0, got {getattr(obj, name)}")


@dataclass(frozen=True, kw_only=True)
class RunConfig:
    """What this run is: its seed, length, name and output folder."""

    SECTION: ClassVar[str] = "run"

    seed: int = 0
    """Run seed; every random initialisation derives from (seed, component)."""
    steps: int = 100
    """Optimizer steps to train."""
    out_dir: str = "runs/default"
    """Folder for metrics.jsonl, checkpoints and the run manifest."""
    run_id: str = "mapl"
    """Swarm run name; peers of different runs never talk."""

    def __post_init__(self) -> None:
        _check_choices(self)
        _check_ints(self, positive=("steps",))


@dataclass(frozen=True, kw_only=True)
class PipelineConfig:
    """Pipeline layout and batch sizes."""

    SECTION: ClassVar[str] = "pipeline"

    num_stages: int = 4
    """Pipeline stages P."""
    micro_batch_size: int = 4
    """Sequences per micro-batch."""
    num_micro_batches: int = 4
    """Micro-batches per optimizer step (gradient accumulation)."""

    def __post_init__(self) -> None:
        _check_choices(self)
        _check_ints(self, positive=("num_stages", "micro_batch_size", "num_micro_batches"))


@dataclass(frozen=True, kw_only=True)
class EvalConfig:
    """Validation on held-out data."""

    SECTION: ClassVar[str] = "eval"

    interval_steps: int = 25
    """Validate every this many steps (and at the end); 0 disables periodic validation."""
    batches: int = 4
    """Micro-batches of held-out data per validation."""

    def __post_init__(self) -> None:
        _check_choices(self)
        _check_ints(self, positive=("batches",), non_negative=("interval_steps",))


@dataclass(frozen=True, kw_only=True)
class CheckpointConfig:
    """Per-stage checkpoints under ``run.out_dir``."""

    SECTION: ClassVar[str] = "checkpoint"

    interval_steps: int = 0
    """Save per-stage checkpoints every this many steps (and at the end); 0 disables."""
    keep: int = 2
    """Newest complete checkpoints kept on disk."""

    def __post_init__(self) -> None:
        _check_choices(self)
        _check_ints(self, positive=("keep",), non_negative=("interval_steps",))


@dataclass(frozen=True, kw_only=True)
class MetricsConfig:
    """What goes into the metrics stream (``metrics.jsonl``)."""

    SECTION: ClassVar[str] = "metrics"

    log_interval_steps: int = 1
    """Write a metrics record every this many steps."""
    health_interval_steps: int = 0
    """Log compression health per boundary (energy captured, projector orthonormality error,
    backward gradient fidelity, codec stats) into the metrics stream every this many steps; 0 is off."""

    def __post_init__(self) -> None:
        _check_choices(self)
        _check_ints(self, positive=("log_interval_steps",), non_negative=("health_interval_steps",))


@dataclass(frozen=True, kw_only=True)
class RuntimeConfig:
    """Where and how this process computes."""

    SECTION: ClassVar[str] = "runtime"

    device: Device = field(default="auto", metadata={
        "pattern": r"cuda:[0-9]+", "pattern_name": "'cuda:N' (N: a CUDA device index, 0, 1, ...)"})
    """auto (CUDA when present, else the CPU) | cpu | cuda (the first visible CUDA device) | cuda:N
    (visible CUDA device N; more than the visible count is an error when the device is resolved,
    :func:`mapl_swarm.pipeline.run_policy.resolve_device`). Honoured by every thread that computes
    (``bind_device``). Under ``mapl-swarm launch`` each peer sees only the GPU it is given through
    ``CUDA_VISIBLE_DEVICES`` (``--gpus``), so ``cuda`` / ``auto`` is the setting to use there."""
    threads: int = 0
    """torch intra-op threads per process; 0 keeps torch's default."""
    autocast: Autocast = "auto"
    """Mixed precision of a stage's forward: bf16 (``torch.autocast`` to bfloat16, on CUDA and on
    CPU alike; boundary projections, VQ and the loss stay fp32) | off (fp32) | auto (bf16 on CUDA,
    off on CPU). MAPL paper Table 7: bf16."""

    def __post_init__(self) -> None:
        _check_choices(self)
        _check_ints(self, non_negative=("threads",))


@dataclass(frozen=True, kw_only=True)
class NetConfig:
    """How a stage peer binds, finds its neighbours and shapes its outbound links."""

    SECTION: ClassVar[str] = "net"

    bind_host: str = "127.0.0.1"
    """Interface the peer's ZeroMQ ROUTER binds (0.0.0.0 for every interface)."""
    port: int = 0
    """TCP port to bind; 0 picks a free one."""
    advertise_host: str = ""
    """Host announced to other peers; empty: bind_host, or this host's address when bound to 0.0.0.0."""
    dht_host: str = "127.0.0.1"
    """Interface the peer's DHT node listens on."""
    dht_port: int = 0
    """DHT TCP port; 0 picks a free one."""
    initial_peers: tuple[str, ...] = ()
    """DHT bootstrap multiaddrs (one is enough)."""
    bandwidth_mbps: float = 0.0
    """Emulated bandwidth of every outbound link in Mbit/s; 0 is unlimited."""
    latency_ms: float = 0.0
    """Emulated one-way latency of every outbound link."""
    max_in_flight: int = 0
    """Micro-batches stage 1 keeps in flight (1F1B warm-up depth); 0 means num_stages."""
    timeout_s: float = 120.0
    """Longest wait for any expected message (neighbour discovery, handshake, activations)."""
    heartbeat_interval_s: float = 2.0
    """Heartbeat period on idle links."""
    compress_ids: bool = True
    """lz4-compress token-id frames (activations are never compressed: lz4 gains nothing on them)."""
    max_frame_bytes: int = 256 * 1024 * 1024
    """Largest tensor frame accepted."""

    def __post_init__(self) -> None:
        _check_choices(self)
        _check(0 <= self.port < 65536 and 0 <= self.dht_port < 65536, "net.port and net.dht_port must be in [0, 65535]")
        for name in ("bandwidth_mbps", "latency_ms", "max_in_flight"):
            _check(getattr(self, name) >= 0, f"net.{name} must be >= 0")
        for name in ("timeout_s", "heartbeat_interval_s", "max_frame_bytes"):
            _check(getattr(self, name) > 0, f"net.{name} must be positive")


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """A whole run."""

    model: ModelConfig = field(default_factory=lambda: MODEL_PRESETS["tiny"])
    compression: CompressionConfig = field(default_factory=CompressionConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    data: DataConfig = field(default_factory=DataConfig)
    run: RunConfig = field(default_factory=RunConfig)
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)
    net: NetConfig = field(default_factory=NetConfig)

    def __post_init__(self) -> None:
        m, c, p = self.model, self.compression, self.pipeline
        _check(p.num_stages <= m.num_layers,
               f"cannot split {m.num_layers} layers over {p.num_stages} stages "
               f"(pipeline.num_stages > model.num_layers)")
        if codec_info(c.codec).projected:
            _check(c.rank <= m.hidden_size,
                   f"compression.rank {c.rank} exceeds model.hidden_size {m.hidden_size}")
            _check(c.anchor_rank <= m.hidden_size,
                   f"compression.anchor_rank {c.anchor_rank} exceeds model.hidden_size {m.hidden_size}")

    @property
    def tokens_per_step(self) -> int:
        return self.pipeline.micro_batch_size * self.pipeline.num_micro_batches * self.model.context_length


_SECTIONS: dict[str, type] = {f.name: get_type_hints(TrainConfig)[f.name] for f in fields(TrainConfig)}

LEGACY_KEYS: dict[str, str] = {
    "run.num_stages": "pipeline.num_stages",
    "run.micro_batch_size": "pipeline.micro_batch_size",
    "run.num_micro_batches": "pipeline.num_micro_batches",
    "run.val_interval_steps": "eval.interval_steps",
    "run.val_batches": "eval.batches",
    "run.checkpoint_interval_steps": "checkpoint.interval_steps",
    "run.keep_checkpoints": "checkpoint.keep",
    "run.log_interval_steps": "metrics.log_interval_steps",
    "run.health_interval_steps": "metrics.health_interval_steps",
    "run.device": "runtime.device",
    "run.threads": "runtime.threads",
    **{f"compression.vq_{name}": f"compression.vq.{name}" for name in (
        "codebook_size", "rounds", "group_size", "slice_fraction", "slice_order", "sync", "ema_decay",
        "kmeans_init_batches", "kmeans_iters", "dead_code_ratio", "max_distance_mib", "compile")},
}
"""Keys of the older config layout -> their place now (dotted paths). They still load, with a
warning naming the new key; a config that sets both is an error."""


def _lookup(raw: dict[str, Any], path: list[str]) -> tuple[dict[str, Any] | None, bool]:
    """The table holding ``path``'s last key (None when a table on the way is missing) and
    whether that key is set."""
    node: Any = raw
    for part in path[:-1]:
        node = node.get(part) if isinstance(node, dict) else None
        if not isinstance(node, dict):
            return None, False
    return node, path[-1] in node


def upgrade_legacy_keys(raw: dict[str, Any], source: str = "<dict>") -> dict[str, Any]:
    """A copy of the nested config dict ``raw`` with every :data:`LEGACY_KEYS` key moved to its new
    place, logging one warning per moved key; setting a key under both names is a ConfigError."""
    raw = copy.deepcopy(raw)
    for old, new in LEGACY_KEYS.items():
        old_path, new_path = old.split("."), new.split(".")
        table, present = _lookup(raw, old_path)
        if not present:
            continue
        _, clash = _lookup(raw, new_path)
        if clash:
            raise ConfigError(f"{source}: both {old} (old name) and {new} are set; keep only {new}")
        value = table.pop(old_path[-1])
        node = raw
        for part in new_path[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"{source}: {part} must be a table")
        node[new_path[-1]] = value
        log.warning("%s: %s is now %s; please rename it", source, old, new)
    return raw


def _coerce(cls: type, name: str, value: Any, where: str) -> Any:
    hint = _hints(cls)[name]
    if dataclasses.is_dataclass(hint):
        return _section(hint, value, f"{where.rstrip(']')}.{name}]")
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if get_origin(hint) is tuple:
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{where}: {name} must be a list, got {value!r}")
        return tuple(value)
    base = hint if isinstance(hint, type) else None
    if base is not None and (not isinstance(value, base) or (base is int and isinstance(value, bool))):
        raise ConfigError(f"{where}: {name} must be {base.__name__}, got {value!r}")
    return value  # Literal choices are checked by the section's __post_init__ (_check_choices)


def _keys(cls: type) -> set[str]:
    """TOML keys of a section (derived fields such as ``compression.vq.rank`` are not keys)."""
    return {f.name for f in fields(cls) if "derived_from" not in f.metadata}


def _section(cls: type, values: dict[str, Any], where: str, base: Any = None) -> Any:
    if not isinstance(values, dict):
        raise ConfigError(f"{where} must be a table")
    known = _keys(cls)
    for key in values:
        if key not in known:
            derived = next((f.metadata["derived_from"] for f in fields(cls)
                            if f.name == key and "derived_from" in f.metadata), None)
            if derived:
                raise ConfigError(f"{where}: {key} is not a key of its own: set {derived}")
            raise ConfigError(f"{where}: unknown key {key!r} (known: {', '.join(sorted(known))})")
    kwargs = {k: _coerce(cls, k, v, where) for k, v in values.items()}
    if base is not None:
        return replace(base, **kwargs)
    return cls(**kwargs)


def _derive_vocab(raw: dict[str, Any], preset: ModelConfig, source: str) -> None:
    """Make ``model.vocab_size`` and ``data.vocab_size`` agree when the tokenizer is trained here.

    Values set in the file (or ``--set``) win over the preset's: only ``data.vocab_size`` set ->
    ``model.vocab_size`` follows it; only ``model.vocab_size`` set -> ``data.vocab_size`` follows it;
    neither -> both take the preset's ``model.vocab_size``; both set to different values -> ConfigError
    naming both. With an external tokenizer (``data.tokenizer``) nothing is derived: the trainer checks
    ``model.vocab_size`` against the tokenizer's size.
    """
    model, data = raw.get("model", {}), raw.get("data", {})
    if not isinstance(model, dict) or not isinstance(data, dict) or data.get("tokenizer", ""):
        return
    m, d = model.get("vocab_size"), data.get("vocab_size")
    if m is not None and d is not None:
        if m != d:
            raise ConfigError(f"{source}: model.vocab_size {m!r} != data.vocab_size {d!r} (the tokenizer trained "
                              f"here has data.vocab_size tokens): set one of them, or both to the same value")
        return
    if d is not None:
        raw.setdefault("model", {})["vocab_size"] = d
    else:
        raw.setdefault("data", {})["vocab_size"] = preset.vocab_size if m is None else m


def config_from_dict(raw: dict[str, Any], source: str = "<dict>") -> TrainConfig:
    """Build a TrainConfig from nested plain data; unknown keys raise ConfigError naming them.

    Legacy keys are moved first (:func:`upgrade_legacy_keys`). Then, when the tokenizer is trained
    here (``data.tokenizer`` empty), the two vocabulary sizes are made to agree: a value set in the
    data wins over the preset's; only ``data.vocab_size`` set -> ``model.vocab_size`` follows it, only
    ``model.vocab_size`` set -> ``data.vocab_size`` follows it, neither -> both are the preset's
    ``model.vocab_size`` (``tiny``: 8192, ``150M``: 32000); both set and different -> ConfigError
    naming both (:func:`_derive_vocab`)."""
    raw = upgrade_legacy_keys(raw, source)
    preset = raw.pop("preset", "tiny")
    if preset not in MODEL_PRESETS:
        raise ConfigError(f"{source}: unknown preset {preset!r} (known: {', '.join(MODEL_PRESETS)})")
    for key in raw:
        if key not in _SECTIONS:
            raise ConfigError(f"{source}: unknown key {key!r} (known: preset, {', '.join(_SECTIONS)})")
    _derive_vocab(raw, MODEL_PRESETS[preset], source)
    parts = {}
    for name, cls in _SECTIONS.items():
        base = MODEL_PRESETS[preset] if name == "model" else None
        parts[name] = _section(cls, raw.get(name, {}), f"{source} [{name}]", base)
    return TrainConfig(**parts)


def read_toml(path: Path, what: str) -> dict[str, Any]:
    """Parse a TOML file; a missing file or bad syntax is a ConfigError naming the file."""
    try:
        return tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{what} file not found: {path}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: invalid TOML: {exc}") from None


def _merge(into: dict[str, Any], over: dict[str, Any], where: str) -> None:
    for key, value in over.items():
        if isinstance(value, dict):
            node = into.setdefault(key, {})
            if not isinstance(node, dict):
                raise ConfigError(f"{where}: {key} must be a table")
            _merge(node, value, where)
        else:
            into[key] = value


def load_config(path: str | Path, overrides: dict[str, Any] | None = None) -> TrainConfig:
    """Load a TOML config strictly; ``overrides`` is a nested dict merged over the file (legacy keys
    of either are moved to their new place first, so an old-name override replaces a new-name key)."""
    path = Path(path)
    raw = upgrade_legacy_keys(read_toml(path, "config"), str(path))
    _merge(raw, upgrade_legacy_keys(overrides or {}, "--set"), str(path))
    return config_from_dict(raw, str(path))


def _plain(obj: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for f in fields(obj):
        if "derived_from" in f.metadata:
            continue
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value):
            value = _plain(value)
        elif isinstance(value, tuple):
            value = list(value)
        out[f.name] = value
    return out


def config_to_dict(cfg: TrainConfig) -> dict[str, Any]:
    """Plain nested dict (JSON/TOML friendly) of a config; :func:`config_from_dict` reads it back."""
    return _plain(cfg)


def legacy_layout(d: dict[str, Any]) -> dict[str, Any]:
    """A copy of a :func:`config_to_dict` dict in the older layout (every :data:`LEGACY_KEYS` key back
    at its old place): digests of configs (fingerprint, sweep hashes) stay what they were."""
    d = copy.deepcopy(d)
    for old, new in LEGACY_KEYS.items():
        table, present = _lookup(d, new.split("."))
        if present:
            node = d
            for part in old.split(".")[:-1]:
                node = node.setdefault(part, {})
            node[old.split(".")[-1]] = table.pop(new.split(".")[-1])
    for name, value in list(d.items()):
        if isinstance(value, dict):
            for key in [k for k, v in value.items() if v == {}]:
                del value[key]
            if not value:
                del d[name]
    return d


def model_fingerprint(cfg: TrainConfig, tokenizer_hash: str, vocab_size: int) -> str:
    """Hex digest that two peers must share: model, codec, seed, tokenizer hash and vocab size
    (the compression section in the older flat layout). The VQ encoder's host-local performance
    knobs (``compression.vq.max_distance_mib``, ``compression.vq.compile``) are left out: hosts with
    different memory or compilers must still join the same run."""
    compression = legacy_layout({"compression": config_to_dict(cfg)["compression"]})["compression"]
    for local in ("vq_max_distance_mib", "vq_compile"):
        compression.pop(local, None)
    payload = {
        "model": dataclasses.asdict(cfg.model),
        "compression": compression,
        "seed": cfg.run.seed,
        "num_stages": cfg.pipeline.num_stages,
        "context_length": cfg.model.context_length,
        "tokenizer_hash": tokenizer_hash,
        "vocab_size": vocab_size,
    }
    blob = json.dumps(payload, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(blob).hexdigest()[:32]
