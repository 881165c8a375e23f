"""Config sections of the model and the method: model (and its presets), compression (with
its VQ sub-table), optimizer, data."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import ClassVar

from mapl_swarm.wire.codebook_rules import CodebookLayout, code_dtype
from mapl_swarm.config.catalog import codec_info
from mapl_swarm.config.base import Anchor, Codec, Schedule, VQSliceOrder, VQSync, VQUpdate, WireDtype, _check, _check_choices

__all__ = [
    "ModelConfig",
    "MODEL_PRESETS",
    "VQConfig",
    "CompressionConfig",
    "OptimConfig",
    "DataConfig",
]


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
    Its bytes per micro-batch are :attr:`slice_bytes_per_micro`. Default from BENCHMARKS.md, "Honest
    baselines", "MAPL+VQ codebook refresh" (the paper's Table 8 uses 1/5; ``peers/*-mapl-vq.toml`` do)."""
    slice_order: VQSliceOrder = "priority"
    """Stream sync: which codes a slice carries: priority (per codebook the codes with the largest
    usage share x squared drift since the receiver's copy, as an indexed slice: +1 byte per code and
    codebook for K <= 256) | round_robin (a contiguous range cycling over the codebook). Default from
    the comparison of the two orders in BENCHMARKS.md, "Quality: codecs at equal token budget"."""
    sync: VQSync = "stream"
    """Codebook synchronisation: stream (slices, SPEC 5.1) | full (whole codebooks every
    micro-batch, for comparison)."""
    update: VQUpdate = "micro_batch"
    """When the codebooks learn: micro_batch (the sender takes an EMA k-means step after every
    training micro-batch it encodes and streams slices of them, SPEC §5.1) | step (every sender of a
    stream encodes the whole step with the same codebooks and learns once at the step's end from
    the step's statistics, which replicas of a stage average like gradients, then sends one full
    slice per link: what several replicas per stage need, SPEC §9.10; a stream encodes with the
    all-zero codebooks of version 0 until the k-means initialisation on a step's first micro-batch
    takes effect, from the next step: the second for every act stream). ``slice_fraction``,
    ``slice_order`` and ``sync`` apply to micro_batch."""
    ema_decay: float = 0.99
    """EMA decay of the k-means statistics (code usage and sums) per micro-batch (``update = step``:
    ``ema_decay ** num_micro_batches`` per step, the same memory in tokens)."""
    kmeans_init_batches: int = 1
    """The first this many training micro-batches initialise the codebooks by k-means on their data
    (each sent as a full slice) before EMA updates take over (``update = step``: the first step's
    first micro-batch, once)."""
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
    """Boundary codec: none | none_offsets | mapl | fixed | naive | ssn | mapl_vq (mapl + residual VQ of
    Z and dL/dZ, set up in ``[compression.vq]``); see :mod:`mapl_swarm.config.catalog`."""
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
    ssn_offset_std: float | None = None
    """SSN and none_offsets: standard deviation of the frozen token offsets T_fixed. Unset (default):
    the model's ``init_std``, so the offsets are commensurate with the learned embedding they are
    added to (the comparison of offset scales in BENCHMARKS.md, "Honest baselines"); 1.0 gives the
    unscaled N(0, 1) table. Resolved by :class:`~mapl_swarm.config.TrainConfig`, so run manifests
    record the number."""
    ssn_adamw_lr_ratio: float = 0.1
    """SSN: AdamW lr = ratio x ``optim.muon_lr`` for SSN runs (replaces ``optim.adamw_lr_ratio``);
    the MAPL paper's Table 8 setting for SSN + Muon."""
    vq: VQConfig = field(default_factory=VQConfig)
    """``[compression.vq]``: the VQ settings of codec mapl_vq (its ``rank`` is this section's)."""

    def __post_init__(self) -> None:
        _check_choices(self)
        _check(self.rank > 0, f"compression.rank must be positive, got {self.rank}")
        _check(self.anchor_rank > 0, f"compression.anchor_rank must be positive, got {self.anchor_rank}")
        _check(self.ssn_refresh_interval_steps >= 0, "compression.ssn_refresh_interval_steps must be >= 0")
        _check(self.ssn_offset_std is None or self.ssn_offset_std >= 0,
               f"compression.ssn_offset_std must be >= 0, got {self.ssn_offset_std}")
        _check(self.ssn_adamw_lr_ratio > 0,
               f"compression.ssn_adamw_lr_ratio must be positive, got {self.ssn_adamw_lr_ratio}")
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
