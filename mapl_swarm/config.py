"""Typed run configuration: frozen dataclasses, presets, strict TOML loading, fingerprint.

A run is described by one :class:`TrainConfig` made of five sections (model, compression,
optim, data, run). TOML files mirror that layout; an optional top-level ``preset`` key picks a
model preset whose fields the ``[model]`` table may then override. Unknown keys are errors
that name the key and the file.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import tomllib
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any, get_type_hints

from mapl_swarm.errors import ConfigError

__all__ = [
    "ModelConfig",
    "CompressionConfig",
    "OptimConfig",
    "DataConfig",
    "RunConfig",
    "NetConfig",
    "TrainConfig",
    "MODEL_PRESETS",
    "CODECS",
    "ANCHORS",
    "WIRE_DTYPES",
    "load_config",
    "read_toml",
    "config_from_dict",
    "config_to_dict",
    "model_fingerprint",
]

CODECS = ("none", "mapl", "fixed", "naive", "ssn", "mapl_vq")
VQ_SYNC_MODES = ("stream", "full")
VQ_SLICE_ORDERS = ("round_robin", "priority")
ANCHORS = ("factorized", "full", "static", "none")
WIRE_DTYPES = ("bf16", "fp16", "fp32")
SCHEDULES = ("cosine", "wsd", "constant")


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise ConfigError(msg)


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """LLaMA-style decoder shape."""

    vocab_size: int = 8192
    """Vocabulary size; must equal the tokenizer's."""
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
class CompressionConfig:
    """How activations and gradients cross each stage boundary."""

    codec: str = "mapl"
    """Boundary codec: none | mapl | fixed | naive | ssn | mapl_vq (mapl + residual VQ of Z and dL/dZ)."""
    rank: int = 64
    """Projection rank r (ssn: subspace rank k). Ignored by `none`."""
    anchor: str = "factorized"
    """Token anchor for mapl/fixed/naive: factorized | full | static | none."""
    anchor_rank: int = 64
    """Rank r_a of the factorized anchor E_small (V x r_a) @ P (r_a x d)."""
    anchor_init_std: float = 0.02
    """Initial standard deviation of trainable anchor tables."""
    wire_dtype: str = "bf16"
    """Dtype of activations and their gradients on the wire: bf16 | fp16 | fp32."""
    ssn_refresh_interval_steps: int = 500
    """SSN: Grassmann refresh of U every this many steps; 0 keeps U frozen (as node0)."""
    ssn_refresh_lr: float = 1e-2
    """SSN: Grassmann refresh learning rate."""
    vq_codebook_size: int = 256
    """mapl_vq: codes K per codebook (one per group and round); codes travel as uint8 when K <= 256,
    else uint16 (K <= 65536)."""
    vq_rounds: int = 2
    """mapl_vq: residual quantization rounds R (round k quantizes what rounds < k left)."""
    vq_group_size: int = 2
    """mapl_vq: coordinates G per group; the rank is split into rank/G groups, each with its own
    codebooks. G=2, R=2, K=256 sends rank bytes per token (bf16 MAPL: 2 x rank)."""
    vq_slice_fraction: float = 0.0625
    """mapl_vq, stream sync: fraction of each codebook's codes sent per training micro-batch (a
    CODEBOOK_SLICE of n = ceil(fraction x K) codes of every codebook, chosen by vq_slice_order).
    At G=2 and K <= 256 its bytes are 9 x n / tokens of the codes' bytes per micro-batch with
    priority slices (8 x n / tokens round-robin): 1.8 % at n=16 and 8k-token micro-batches."""
    vq_slice_order: str = "priority"
    """mapl_vq, stream sync: which codes a slice carries: priority (per codebook the codes with the
    largest usage share x squared drift since the receiver's copy, as an indexed slice: +1 byte per
    code and codebook for K <= 256; measured +4.85% vs +6.55% for round_robin in BENCHMARKS.md) |
    round_robin (a contiguous range cycling over the codebook)."""
    vq_sync: str = "stream"
    """mapl_vq codebook synchronisation: stream (slices, SPEC 5.1) | full (whole codebooks every
    micro-batch, for comparison)."""
    vq_ema_decay: float = 0.99
    """mapl_vq: EMA decay of the k-means statistics (code usage and sums) per micro-batch."""
    vq_kmeans_init_batches: int = 1
    """mapl_vq: the first this many training micro-batches initialise the codebooks by k-means on
    their data (each sent as a full slice) before EMA updates take over."""
    vq_kmeans_iters: int = 10
    """mapl_vq: Lloyd iterations per k-means initialisation."""
    vq_dead_code_ratio: float = 0.03
    """mapl_vq: a code whose EMA usage share falls below ratio / K is dead and replaced by a random
    vector of the current micro-batch (0 disables replacement)."""
    vq_max_distance_mib: float = 0.0
    """mapl_vq: override of the eager encoder's distance-tensor budget per chunk of tokens, in MiB;
    0 (auto) sizes it by device: a quarter of the available memory on CUDA (8 MiB..1 GiB), 32 MiB
    on CPU. The fused (vq_compile) search stores no distances and is never chunked."""
    vq_compile: bool = False
    """mapl_vq: fuse the nearest-code search (distances + argmin) into one kernel with
    torch.compile (Triton on CUDA, C++/OpenMP on CPU; ~1 min to compile once). Codes may differ
    from the eager path on (near-)ties; sender and receiver stay identical either way."""

    def __post_init__(self) -> None:
        _check(self.codec in CODECS, f"compression.codec must be one of {CODECS}, got {self.codec!r}")
        _check(self.anchor in ANCHORS, f"compression.anchor must be one of {ANCHORS}, got {self.anchor!r}")
        _check(self.wire_dtype in WIRE_DTYPES,
               f"compression.wire_dtype must be one of {WIRE_DTYPES}, got {self.wire_dtype!r}")
        _check(self.rank > 0, f"compression.rank must be positive, got {self.rank}")
        _check(self.anchor_rank > 0, f"compression.anchor_rank must be positive, got {self.anchor_rank}")
        _check(self.ssn_refresh_interval_steps >= 0, "compression.ssn_refresh_interval_steps must be >= 0")
        _check(2 <= self.vq_codebook_size <= 1 << 16,
               f"compression.vq_codebook_size must be in 2..65536, got {self.vq_codebook_size}")
        for name in ("vq_rounds", "vq_group_size", "vq_kmeans_init_batches", "vq_kmeans_iters"):
            _check(getattr(self, name) >= 1, f"compression.{name} must be >= 1, got {getattr(self, name)}")
        _check(0 < self.vq_slice_fraction <= 1,
               f"compression.vq_slice_fraction must be in (0, 1], got {self.vq_slice_fraction}")
        _check(self.vq_slice_order in VQ_SLICE_ORDERS,
               f"compression.vq_slice_order must be one of {VQ_SLICE_ORDERS}, got {self.vq_slice_order!r}")
        _check(self.vq_sync in VQ_SYNC_MODES,
               f"compression.vq_sync must be one of {VQ_SYNC_MODES}, got {self.vq_sync!r}")
        _check(0 <= self.vq_ema_decay < 1, f"compression.vq_ema_decay must be in [0, 1), got {self.vq_ema_decay}")
        _check(0 <= self.vq_dead_code_ratio < 1,
               f"compression.vq_dead_code_ratio must be in [0, 1), got {self.vq_dead_code_ratio}")
        _check(self.vq_max_distance_mib >= 0,
               f"compression.vq_max_distance_mib must be >= 0 (0: sized by device), got {self.vq_max_distance_mib}")
        if self.codec == "mapl_vq":
            _check(self.rank % self.vq_group_size == 0,
                   f"compression.rank {self.rank} is not divisible by vq_group_size {self.vq_group_size}")


@dataclass(frozen=True, kw_only=True)
class OptimConfig:
    """Hybrid Muon / AdamW / SPEL optimizer (MAPL paper Appendix E, H)."""

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
    schedule: str = "cosine"
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
        _check(self.schedule in SCHEDULES, f"optim.schedule must be one of {SCHEDULES}, got {self.schedule!r}")
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

    source: str = "stdlib"
    """`stdlib` (the interpreter's own standard library sources), a local file or folder path,
    or `hf:NAME` for a Hugging Face dataset (name or local path)."""
    cache_dir: str = ".mapl_cache"
    """Folder for the trained tokenizer and token shards."""
    tokenizer: str = ""
    """Empty: train a byte-level BPE on the corpus. Else a tokenizer.json path, or a
    transformers tokenizer name/path."""
    vocab_size: int = 8192
    """Vocabulary size when training a BPE tokenizer."""
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
        _check(self.source != "", "data.source must not be empty")
        _check(0 < self.val_fraction < 1, f"data.val_fraction must be in (0, 1), got {self.val_fraction}")
        _check(self.vocab_size >= 260, f"data.vocab_size must be >= 260, got {self.vocab_size}")
        _check(self.max_corpus_bytes >= 0, "data.max_corpus_bytes must be >= 0")


@dataclass(frozen=True, kw_only=True)
class RunConfig:
    """Pipeline layout, batch sizes, schedule of validation/checkpoints, runtime settings."""

    seed: int = 0
    """Run seed; every random initialisation derives from (seed, component)."""
    num_stages: int = 4
    """Pipeline stages P."""
    micro_batch_size: int = 4
    """Sequences per micro-batch."""
    num_micro_batches: int = 4
    """Micro-batches per optimizer step (gradient accumulation)."""
    steps: int = 100
    """Optimizer steps to train."""
    val_interval_steps: int = 25
    """Validate every this many steps (and at the end); 0 disables periodic validation."""
    val_batches: int = 4
    """Micro-batches of held-out data per validation."""
    checkpoint_interval_steps: int = 0
    """Save per-stage checkpoints every this many steps (and at the end); 0 disables."""
    keep_checkpoints: int = 2
    """Newest complete checkpoints kept on disk."""
    log_interval_steps: int = 1
    """Write a metrics record every this many steps."""
    health_interval_steps: int = 0
    """Log compression health per boundary (energy captured, projector orthonormality error,
    backward gradient fidelity, codec stats) into the metrics stream every this many steps; 0 is off."""
    out_dir: str = "runs/default"
    """Folder for metrics.jsonl, checkpoints and the run manifest."""
    threads: int = 0
    """torch intra-op threads per process; 0 keeps torch's default."""
    device: str = "auto"
    """auto (CUDA when present) | cpu | cuda."""
    run_id: str = "mapl"
    """Swarm run name; peers of different runs never talk."""

    def __post_init__(self) -> None:
        for name in ("num_stages", "micro_batch_size", "num_micro_batches", "steps", "val_batches",
                     "keep_checkpoints", "log_interval_steps"):
            _check(getattr(self, name) > 0, f"run.{name} must be positive, got {getattr(self, name)}")
        for name in ("val_interval_steps", "checkpoint_interval_steps", "threads", "health_interval_steps"):
            _check(getattr(self, name) >= 0, f"run.{name} must be >= 0")
        _check(self.device in ("auto", "cpu", "cuda"), f"run.device must be auto|cpu|cuda, got {self.device!r}")

    @property
    def tokens_per_step_factor(self) -> int:
        return self.micro_batch_size * self.num_micro_batches


@dataclass(frozen=True, kw_only=True)
class NetConfig:
    """How a stage peer binds, finds its neighbours and shapes its outbound links."""

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
    net: NetConfig = field(default_factory=NetConfig)

    def __post_init__(self) -> None:
        m, c, r = self.model, self.compression, self.run
        _check(r.num_stages <= m.num_layers,
               f"cannot split {m.num_layers} layers over {r.num_stages} stages (run.num_stages > model.num_layers)")
        if c.codec != "none":
            _check(c.rank <= m.hidden_size,
                   f"compression.rank {c.rank} exceeds model.hidden_size {m.hidden_size}")
            _check(c.anchor_rank <= m.hidden_size,
                   f"compression.anchor_rank {c.anchor_rank} exceeds model.hidden_size {m.hidden_size}")

    @property
    def tokens_per_step(self) -> int:
        return self.run.micro_batch_size * self.run.num_micro_batches * self.model.context_length


_SECTIONS: dict[str, type] = {
    "model": ModelConfig,
    "compression": CompressionConfig,
    "optim": OptimConfig,
    "data": DataConfig,
    "run": RunConfig,
    "net": NetConfig,
}


def _coerce(cls: type, name: str, value: Any, where: str) -> Any:
    hint = get_type_hints(cls)[name]
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if getattr(hint, "__origin__", None) is tuple:
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{where}: {name} must be a list, got {value!r}")
        return tuple(value)
    base = hint if isinstance(hint, type) else None
    if base is not None and (not isinstance(value, base) or (base is int and isinstance(value, bool))):
        raise ConfigError(f"{where}: {name} must be {base.__name__}, got {value!r}")
    return value


def _section(cls: type, values: dict[str, Any], where: str, base: Any = None) -> Any:
    if not isinstance(values, dict):
        raise ConfigError(f"{where} must be a table")
    known = {f.name for f in fields(cls)}
    for key in values:
        if key not in known:
            raise ConfigError(f"{where}: unknown key {key!r} (known: {', '.join(sorted(known))})")
    kwargs = {k: _coerce(cls, k, v, where) for k, v in values.items()}
    if base is not None:
        return replace(base, **kwargs)
    return cls(**kwargs)


def config_from_dict(raw: dict[str, Any], source: str = "<dict>") -> TrainConfig:
    """Build a TrainConfig from nested plain data; unknown keys raise ConfigError naming them."""
    raw = dict(raw)
    preset = raw.pop("preset", "tiny")
    if preset not in MODEL_PRESETS:
        raise ConfigError(f"{source}: unknown preset {preset!r} (known: {', '.join(MODEL_PRESETS)})")
    for key in raw:
        if key not in _SECTIONS:
            raise ConfigError(f"{source}: unknown key {key!r} (known: preset, {', '.join(_SECTIONS)})")
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


def load_config(path: str | Path, overrides: dict[str, Any] | None = None) -> TrainConfig:
    """Load a TOML config strictly; ``overrides`` is a nested dict merged over the file."""
    path = Path(path)
    raw = read_toml(path, "config")
    for section, values in (overrides or {}).items():
        if isinstance(values, dict):
            raw.setdefault(section, {})
            if not isinstance(raw[section], dict):
                raise ConfigError(f"{path}: {section} must be a table")
            raw[section].update(values)
        else:
            raw[section] = values
    return config_from_dict(raw, str(path))


def config_to_dict(cfg: TrainConfig) -> dict[str, Any]:
    """Plain nested dict (JSON/TOML friendly) of a config."""
    out = dataclasses.asdict(cfg)
    out["data"]["text_extensions"] = list(cfg.data.text_extensions)
    out["net"]["initial_peers"] = list(cfg.net.initial_peers)
    return out


def model_fingerprint(cfg: TrainConfig, tokenizer_hash: str, vocab_size: int) -> str:
    """Hex digest that two peers must share: model, codec, seed, tokenizer hash and vocab size."""
    payload = {
        "model": dataclasses.asdict(cfg.model),
        "compression": dataclasses.asdict(cfg.compression),
        "seed": cfg.run.seed,
        "num_stages": cfg.run.num_stages,
        "context_length": cfg.model.context_length,
        "tokenizer_hash": tokenizer_hash,
        "vocab_size": vocab_size,
    }
    blob = json.dumps(payload, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(blob).hexdigest()[:32]

