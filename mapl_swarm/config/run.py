"""Config sections of a run: its identity and budget, pipeline layout, evaluation, checkpoints,
metrics, runtime (device, precision), network; and the whole :class:`TrainConfig`."""

from __future__ import annotations

import ipaddress
import math
import re
from dataclasses import dataclass, field, fields, replace
from typing import ClassVar, Literal, get_type_hints

from mapl_swarm.config.catalog import codec_info
from mapl_swarm.config.base import Autocast, Device, _check, _check_choices, _check_ints
from mapl_swarm.config.sections import CompressionConfig, DataConfig, MODEL_PRESETS, ModelConfig, OptimConfig

__all__ = [
    "RunConfig",
    "PipelineConfig",
    "EvalConfig",
    "CheckpointConfig",
    "MetricsConfig",
    "RuntimeConfig",
    "NetConfig",
    "ReplicasConfig",
    "TrainConfig",
]


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

    interval_steps: int = 50
    """Save per-stage checkpoints every this many steps (and at the end); 0 disables, and with it a
    swarm's live rejoin (a departed stage can only come back to a step every stage saved). 50 steps
    bounds the compute a departure costs while keeping the writes rare."""
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
    prometheus_port: int | None = None
    """Serve this process's metrics to Prometheus on this TCP port (``/metrics``; 0: a free port,
    logged; not set: no endpoint). ``launch`` and ``lab`` give each local peer its own port from this
    one up. Names: ``mapl_swarm.metrics.export``."""
    prometheus_host: str = "127.0.0.1"
    """The address the Prometheus endpoint binds (``0.0.0.0`` to be scraped from other hosts: it
    serves figures only, but anyone who can reach it can read them)."""
    tensorboard: bool = False
    """Also write every metrics record as TensorBoard scalars under ``<out_dir>/tensorboard/``."""

    def __post_init__(self) -> None:
        _check_choices(self)
        _check_ints(self, positive=("log_interval_steps",), non_negative=("health_interval_steps",))
        _check(self.prometheus_port is None or 0 <= self.prometheus_port <= 65535,
               f"metrics.prometheus_port must be a TCP port 0..65535, got {self.prometheus_port!r}")
        _check(bool(self.prometheus_host),
               f"metrics.prometheus_host must be an address, got {self.prometheus_host!r}")


@dataclass(frozen=True, kw_only=True)
class RuntimeConfig:
    """Where and how this process computes."""

    SECTION: ClassVar[str] = "runtime"

    device: Device = field(default="auto", metadata={
        "pattern": r"cuda:[0-9]+", "pattern_name": "'cuda:N' (N: a CUDA device index, 0, 1, ...)"})
    """auto (CUDA when present, else the CPU) | cpu | cuda (the first visible CUDA device) | cuda:N
    (visible CUDA device N; more than the visible count is an error when the device is resolved,
    :func:`mapl_swarm.pipeline.device.resolve_device`). Honoured by every thread that computes
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


def relay_address(text: str) -> tuple[str, int, bytes] | None:
    """``(host, port, CURVE key)`` of a ``net.relay`` value ``HOST:PORT#<64 hex>``; None when malformed."""
    address, _, key = text.partition("#")
    host, colon, port = address.rpartition(":")
    try:
        raw = bytes.fromhex(key)
    except ValueError:
        return None
    if not (colon and port.isdigit() and 0 < int(port) < 65536 and len(raw) == 32):
        return None
    if host.startswith("[") and host.endswith("]"):  # an IPv6 literal
        try:
            return str(ipaddress.IPv6Address(host[1:-1])), int(port), raw
        except ValueError:
            return None
    return (host, int(port), raw) if re.fullmatch(r"[A-Za-z0-9.-]+", host) else None


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
    reachable: Literal["yes", "no", "auto"] = "yes"
    """Whether other hosts can open connections to this peer: ``yes``; ``no`` (behind NAT or a
    firewall that admits nothing inbound): it announces a dial-out contact and its neighbours send to
    it on the connections it opens (SPEC §1.2), and its DHT node runs in hivemind's client mode;
    ``auto``: ask a live peer of the run to dial it back (SPEC §9.11) and decide by that (``yes``
    when nobody can be asked: the first peer). Dial-out needs certified peers, and two dial-out
    neighbours cannot link to each other."""
    relay: str = ""
    """``HOST:PORT#<hex CURVE key>`` of a relay, as ``mapl-swarm relay`` prints it: a dial-out peer
    links to its dial-out neighbours through it (SPEC §9.12), its request sealed to that key; empty:
    none (two dial-out neighbours then cannot link)."""
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
    """Micro-batches stage 0 keeps in flight (1F1B warm-up depth); 0 means num_stages."""
    timeout_s: float = 120.0
    """Longest wait for any expected message (neighbour discovery, handshake, activations)."""
    heartbeat_interval_s: float = 2.0
    """Seconds between two heartbeats to each neighbour (sent by the event loop, which a long compute
    does not block)."""
    liveness_floor_s: float = 10.0
    """Shortest silence after which a neighbour is declared lost, whatever its measured round trip:
    a dead neighbour on a fast link is reported after about this long (one whose connection ended,
    a killed process, once it stayed ended for two heartbeat intervals), and a stall shorter than
    it (a GC pause, a few seconds of SIGSTOP) is survived. Capped at the ceiling; must exceed
    ``heartbeat_interval_s``. Deadlines between floor and ceiling follow the link's round trip and
    the gaps between its messages (SPEC §9.5: ``clamp(min(4 x rtt estimate + 2 x
    heartbeat_interval_s, 4 x longest gap of the last minute), floor, ceiling)``)."""
    liveness_ceiling_s: float = 0.0
    """Longest silence a neighbour is allowed (a stopped process, a link that carries nothing), and
    the deadline before its round trip is measured; 0: ``timeout_s``."""
    rejoin_timeout_s: float = 300.0
    """How long the peers wait for a replacement of a departed stage (SPEC "Rejoin": they pause, a new
    peer of that stage joins, every stage rolls back to the newest step all have saved); then the
    peer ends naming the stage. 0 turns live rejoin off: a departure ends the peer."""
    hello_retry_s: float = 5.0
    """During a handshake, HELLO is sent again (to the next DHT record of the stage) when the newest
    one is not answered within this many seconds (SPEC "Rejoin")."""
    compress_ids: bool = True
    """lz4-compress token-id frames (activations are never compressed: lz4 gains nothing on them)."""
    max_frame_bytes: int = 256 * 1024 * 1024
    """Largest tensor frame accepted."""
    max_message_bytes: int = 0
    """Largest frame a peer's socket accepts (ZeroMQ's maximum message size; the connection of a
    larger one is dropped before it is buffered). 0 derives it from the run's shapes: its largest
    legitimate message plus the header limit and 12.5% (:mod:`mapl_swarm.net.limits`). Otherwise
    at least 4096."""
    zmq_heartbeat_s: float = 5.0
    """ZeroMQ heartbeat interval on every connection: one that does not answer within 3x this is
    dropped, freeing its routing id; a dropped link reconnects after 5x to 10x this. Keep 3x it
    above the time the slowest link needs to carry the largest message. 0 turns ZeroMQ
    heartbeats off (dead connections then linger until TCP gives up)."""

    def __post_init__(self) -> None:
        _check_choices(self)
        _check(0 <= self.port < 65536 and 0 <= self.dht_port < 65536, "net.port and net.dht_port must be in [0, 65535]")
        for name in ("bandwidth_mbps", "latency_ms", "max_in_flight"):
            _check(getattr(self, name) >= 0, f"net.{name} must be >= 0")
        _check(math.isfinite(self.rejoin_timeout_s) and self.rejoin_timeout_s >= 0,
               f"net.rejoin_timeout_s must be >= 0 (0: no live rejoin), got {self.rejoin_timeout_s}")
        for name in ("timeout_s", "heartbeat_interval_s", "max_frame_bytes", "hello_retry_s"):
            _check(getattr(self, name) > 0, f"net.{name} must be positive")
        _check(self.max_message_bytes == 0 or self.max_message_bytes >= 4096,  # the handshake counts too
               f"net.max_message_bytes must be 0 (derived from the run) or >= 4096, got {self.max_message_bytes}")
        _check(not self.relay or relay_address(self.relay) is not None,
               f"net.relay must be HOST:PORT#<64 hex digits> as `mapl-swarm relay` prints it, got {self.relay!r}")
        _check(math.isfinite(self.zmq_heartbeat_s) and self.zmq_heartbeat_s >= 0,
               f"net.zmq_heartbeat_s must be >= 0 (0: off), got {self.zmq_heartbeat_s}")
        _check(math.isfinite(self.liveness_floor_s) and self.liveness_floor_s > self.heartbeat_interval_s,
               f"net.liveness_floor_s ({self.liveness_floor_s}) must be greater than net.heartbeat_interval_s "
               f"({self.heartbeat_interval_s})")
        _check(self.liveness_ceiling_s == 0 or self.liveness_ceiling_s >= self.liveness_floor_s,
               f"net.liveness_ceiling_s must be 0 (net.timeout_s) or at least net.liveness_floor_s "
               f"({self.liveness_floor_s}), got {self.liveness_ceiling_s}")

    @property
    def liveness_ceiling(self) -> float:
        """The ceiling in effect: ``liveness_ceiling_s``, or ``timeout_s`` when that is 0."""
        return self.liveness_ceiling_s or self.timeout_s

    @property
    def liveness_floor(self) -> float:
        """The floor in effect: ``liveness_floor_s``, at most the ceiling (a short ``timeout_s``)."""
        return min(self.liveness_floor_s, self.liveness_ceiling)


@dataclass(frozen=True, kw_only=True)
class ReplicasConfig:
    """Several peers per stage (SPEC §9.10): how micro-batches are routed among a stage's replicas
    and how the replicas of a stage average their gradients."""

    SECTION: ClassVar[str] = "replicas"

    enabled: bool = False
    """Peers of this run may share a stage: every peer holds a session with every replica of its
    neighbour stages, routes each micro-batch to one replica of the next stage, and the replicas of
    a stage average their gradients at the end of every step (hivemind) and take the same step.
    Every peer of the run must agree (checked at the handshake)."""
    routing: Literal["throughput", "uniform"] = "throughput"
    """How a micro-batch's next replica is drawn: weighted by each link's measured throughput and
    queue (SWARM's stochastic wiring), or uniformly."""
    routing_seed: int = 0
    """Seed of the routing draws: with the same weights, every run routes the same way."""
    matchmaking_s: float = 2.0
    """How long a stage's averaging round waits for replicas that are late (hivemind's
    ``min_matchmaking_time``); a round starts at once when every known replica is in."""
    averaging_timeout_s: float = 120.0
    """Longest wait for a stage's averaging round to form and finish."""
    initial: tuple[int, ...] = ()
    """Replicas of each stage that start the run together (one entry per stage; empty: one each):
    each stage's first averaging round waits for that many."""
    aggregation: Literal["mean", "centered_clip", "trimmed_mean"] = "mean"
    """How a stage's replicas combine their gradient shares, per all-reduce part: their weighted
    mean; CenteredClip (with 3 replicas or more one replica's share, however wrong, moves the update
    by a bound of the order of the honest replicas' spread; honest shares within it give the mean);
    or the coordinate-wise trimmed mean (each coordinate's largest and smallest dropped: with one
    dishonest replica every coordinate stays within the honest shares' range). See
    ``mapl_swarm.replicas.robust``. Every replica of a stage must agree (the config fingerprint)."""
    check_fraction: float = 0.0
    """How often a replica's work is checked (0: never): after each step, each replica's gradient
    share of the step is drawn with this probability (from nonces the replicas revealed only after
    the shares were sent), and every other replica of the stage recomputes it from the inputs the
    replica took (its ACTs and GRADs) and compares it with its own part of the all-reduce. A share
    that a majority of the stage's replicas find wrong excludes its replica (SPEC §9.10 item 15).
    About this fraction of every replica's compute, times the replicas of its stage less one, is
    spent on checking. Needs a codec without streamed codebooks (a checker cannot rebuild another
    replica's mid-step codebooks)."""

    averaging: Literal["fp32", "fp16", "powersgd", "topk"] = "fp32"
    """What a stage's replicas send to average their gradients (``mapl_swarm.replicas.schemes``):
    ``fp32``, every value as it is; ``fp16``, every all-reduce part as hivemind's
    ``Float16Compression`` (half the bytes); ``powersgd``, each
    weight matrix's gradient as two rank-``averaging_rank`` factors (PowerSGD, as hivemind's
    ``PowerSGDGradientAverager``), with error feedback; ``topk``, each weight matrix's gradient as its
    ``topk_fraction`` largest values (int32 index and float16 value each), with error feedback.
    Projector gradients, vectors and the codec's step statistics are averaged exactly in every
    scheme; every replica applies the same bytes."""
    averaging_rank: int = 4
    """The rank of PowerSGD's factors (``averaging = "powersgd"``): a d x n gradient costs r(d + n)
    values instead of d n."""
    topk_fraction: float = 0.01
    """The fraction of each weight matrix's gradient values ``topk`` sends (0 < f <= 1)."""
    error_feedback: bool = True
    """``powersgd`` and ``topk``: what compression left out of a replica's gradient is added to its next one
    (each replica's own buffer, saved in its checkpoints; a joining replica starts it at zero)."""
    averaged: Literal["gradients", "updates"] = "gradients"
    """``powersgd`` and ``topk``: what the compressed weight matrices that Muon trains carry
    (``mapl_swarm.replicas.updates``): each replica's gradient, which every replica's optimizer then
    steps from; or each replica's own Muon update from its own gradient and momentum (kept per
    replica, in its checkpoints and in the state a joining replica downloads), which every replica
    adds. The other tensors are averaged as gradients either way."""

    def __post_init__(self) -> None:
        _check_choices(self)
        _check(isinstance(self.enabled, bool), f"replicas.enabled must be true or false, got {self.enabled!r}")
        _check(isinstance(self.error_feedback, bool),
               f"replicas.error_feedback must be true or false, got {self.error_feedback!r}")
        _check(type(self.averaging_rank) is int and self.averaging_rank >= 1,
               f"replicas.averaging_rank must be an integer >= 1, got {self.averaging_rank!r}")
        _check(isinstance(self.topk_fraction, (int, float)) and 0.0 < self.topk_fraction <= 1.0,
               f"replicas.topk_fraction must be a number within (0, 1], got {self.topk_fraction!r}")
        _check(not (self.check_fraction and self.averaging != "fp32"),
               f"replicas.check_fraction needs replicas.averaging = 'fp32' (a checker compares a share with "
               f"the values its partner sent), got {self.averaging!r}")
        _check(self.averaged == "gradients" or self.averaging in ("powersgd", "topk"),
               f"replicas.averaged = 'updates' needs a scheme with error feedback (powersgd or topk), got "
               f"replicas.averaging = {self.averaging!r}")
        _check(self.aggregation == "mean" or self.averaging in ("fp32", "fp16"),
               f"replicas.aggregation = {self.aggregation!r} needs dense averaging (fp32 or fp16), got "
               f"replicas.averaging = {self.averaging!r}: a robust aggregate of factors or sparse shares bounds "
               f"nothing")
        if isinstance(self.initial, list):  # TOML arrays arrive as lists
            object.__setattr__(self, "initial", tuple(self.initial))
        _check(all(type(n) is int and n >= 1 for n in self.initial),
               f"replicas.initial must list positive replica counts, got {list(self.initial)}")
        _check(math.isfinite(self.matchmaking_s) and self.matchmaking_s > 0.0,
               f"replicas.matchmaking_s must be a finite number > 0, got {self.matchmaking_s}")
        _check(math.isfinite(self.averaging_timeout_s) and self.averaging_timeout_s > self.matchmaking_s,
               f"replicas.averaging_timeout_s ({self.averaging_timeout_s}) must exceed replicas.matchmaking_s "
               f"({self.matchmaking_s})")
        _check(0.0 <= self.check_fraction <= 1.0,
               f"replicas.check_fraction must be a number within 0..1 (0: off), got {self.check_fraction!r}")


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
    replicas: ReplicasConfig = field(default_factory=ReplicasConfig)

    def __post_init__(self) -> None:
        m, c, p = self.model, self.compression, self.pipeline
        if c.ssn_offset_std is None:  # derived: commensurate with the embedding it is added to
            object.__setattr__(self, "compression", replace(c, ssn_offset_std=m.init_std))
        _check(p.num_stages <= m.num_layers,
               f"cannot split {m.num_layers} layers over {p.num_stages} stages "
               f"(pipeline.num_stages > model.num_layers)")
        if codec_info(c.codec).projected:
            _check(c.rank <= m.hidden_size,
                   f"compression.rank {c.rank} exceeds model.hidden_size {m.hidden_size}")
            _check(c.anchor_rank <= m.hidden_size,
                   f"compression.anchor_rank {c.anchor_rank} exceeds model.hidden_size {m.hidden_size}")
        r = self.replicas
        _check(not r.initial or len(r.initial) == p.num_stages,
               f"replicas.initial lists {len(r.initial)} stage(s), pipeline.num_stages is {p.num_stages}")
        _check(r.enabled or not any(n > 1 for n in r.initial),
               "replicas.initial asks for several replicas of a stage: set replicas.enabled = true")
        _check(not r.enabled or p.num_stages >= 2,
               "replicas.enabled needs pipeline.num_stages >= 2 (replicas route between stages)")
        _check(not (r.enabled and codec_info(c.codec).quantized and c.vq.update != "step"),
               f"replicas.enabled with compression.codec = {c.codec!r} needs compression.vq.update = 'step' (the "
               f"replicas of a stage then learn the same codebooks from the step's averaged statistics), got "
               f"{c.vq.update!r}")
        _check(not (r.enabled and r.averaged == "updates" and self.optim.grad_clip_norm > 0),
               f"replicas.averaged = 'updates' with optim.grad_clip_norm = {self.optim.grad_clip_norm:g}: a replica "
               f"steps its compressed matrices from its own gradient, whose norm is not the step's; set "
               f"optim.grad_clip_norm = 0 or average gradients")
        _check(not (r.check_fraction and codec_info(c.codec).quantized),
               f"replicas.check_fraction with compression.codec = {c.codec!r}: a checker cannot rebuild another "
               f"replica's streamed codebooks; use a codec without VQ or check_fraction = 0")

    def check_stage(self, stage: int) -> None:
        """A peer's ``--stage``: ConfigError unless the pipeline has it."""
        _check(0 <= stage < self.pipeline.num_stages,
               f"--stage {stage} is outside 0..{self.pipeline.num_stages - 1} (pipeline.num_stages)")

    def replicas_of(self, stage: int) -> int:
        """The replicas of ``stage`` that start the run together (``replicas.initial``)."""
        return self.replicas.initial[stage] if self.replicas.initial else 1

    @property
    def tokens_per_step(self) -> int:
        return self.pipeline.micro_batch_size * self.pipeline.num_micro_batches * self.model.context_length


_SECTIONS: dict[str, type] = {f.name: get_type_hints(TrainConfig)[f.name] for f in fields(TrainConfig)}
