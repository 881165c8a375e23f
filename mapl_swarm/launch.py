"""``mapl-swarm launch``: a DHT plus P stage peer processes on this machine.

The launcher starts a DHT node (the bootstrap), then one ``mapl-swarm peer`` process per stage
with the machine's cores split between their torch threads, waits for them, restarts one that
dies (below), and stops all of them as soon as one fails for good (:func:`stop_all`: SIGTERM twice,
which stops a peer at once, then SIGKILL after a grace period). At the end it prints the swarm's
loss, tokens/s and measured bytes/token per link.

Ctrl-C / SIGTERM: each peer runs in a process group of its own, so a terminal's Ctrl-C reaches the
launcher only, and the launcher forwards every SIGINT/SIGTERM it gets to each peer, once: the
first one drains the swarm (every stage stops after the same step and checkpoints it,
:mod:`~mapl_swarm.peer.signals`), a second stops the peers at once. When every peer drained, the launcher returns a
summary whose ``end_note`` is the one line to print, and exits 0.

Restarts (``--max-restarts N``, default 3, per stage): a peer that dies (a non-zero status, 3 for a
NaN/Inf included, or a signal) while no signal was forwarded is started again, the same command plus
``--resume``, and joins the waiting swarm (which rolls back to the newest common checkpoint); the
other peers are left alone. :class:`RestartPolicy` decides (pure), :class:`Supervisor` runs the
processes. A stage that died once more than N restarts allow stops the swarm as before (exit 2,
naming the stage); the summary counts the restarts per stage. With replicas a replica whose stage
keeps a running one is never restarted (from its checkpoint it would not hold the others' state:
the swarm goes on without it), except one the swarm took for gone while it lived (exit status 4,
SPEC §9.10 item 10), which is started again with ``--join`` on a new port (:func:`rejoining`: it
downloads a partner's state as a new member), up to N times per stage; a stage's last one is, as a
chain's peer (the swarm re-forms), when the run can re-form (``net.rejoin_timeout_s`` > 0,
checkpoints on).

GPUs: each peer is given one GPU through its own ``CUDA_VISIBLE_DEVICES`` (:func:`gpu_plan`):
round-robin over the launcher's visible GPUs, or over ``--gpus 0,1,2,3``; several peers may share
one GPU (4 peers on one H200 all get it). The launcher itself never imports torch for this: it
reads its ``CUDA_VISIBLE_DEVICES``, else counts ``nvidia-smi -L``. With no GPU, with
``runtime.device = "cpu"`` or with an explicit ``cuda:N`` the children's environment is left as it
is. The command and environment of every peer are built by the pure :func:`peer_processes`.

Identities: the launcher is its swarm's authority (:func:`~mapl_swarm.net.identity.issue_local`
under ``run.out_dir/identities``): each stage's peer gets its own key file and a certificate for
that stage alone (``--peer-key``, ``--cert``; paths only, never a key), so no peer can serve or
impersonate another's stage. What exists and still fits is kept for a ``--resume``; the
certificates allow ``drain`` (Ctrl-C drains the local swarm through any of its peers).
"""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Literal

from mapl_swarm.config import TrainConfig
from mapl_swarm.data import prepare_data
from mapl_swarm.errors import ConfigError, MaplError
from mapl_swarm.net.dht_node import check_listen_address
from mapl_swarm.net.discovery import Discovery, DiscoveryConfig, TrustedAuthority
from mapl_swarm.net.identity import LocalIdentities, issue_local, read_signed, verify_revocations
from mapl_swarm.peer.departures import TakenForGone
from mapl_swarm.peer.signals import Interrupted
from mapl_swarm.procs import die_with_parent
from mapl_swarm.pipeline.payload import BACKWARD_KINDS, FORWARD_KINDS, kind_bytes

log = logging.getLogger(__name__)

__all__ = ["launch", "restarts_allowed", "SwarmSummary", "summarize", "replica_out_dir", "replica_counts", "stop_all",
           "parse_gpus", "visible_gpus", "gpu_plan",
           "PeerProcess", "peer_processes", "drain_note", "RestartPolicy", "Supervisor", "supervise", "resumed",
           "exit_text"]

_GRACE_S = 20.0
_ABORT_GAP_S = 0.5
"""Between the two SIGTERMs of :func:`stop_all` (two signals at once may arrive as one)."""


@dataclass
class SwarmSummary:
    train_losses: list[float]
    report_times_s: list[float]
    """When each step's loss reached stage 0 (seconds since the handshake)."""
    val_history: list[list[float]]
    tokens: int
    wall_s: float
    links: list[dict[str, float]]
    """Per boundary: payload and wire bytes per token forward and backward, by kind."""
    end_note: str = ""
    """Set when the swarm drained or stopped on a signal: the one line to print (else empty)."""
    drained_at: int | None = None
    """The step every stage stopped after, when it drained."""
    restarts: dict[str, int] = field(default_factory=dict)
    """Per stage (as a string, JSON-style) that was restarted: how many times, e.g. ``{"1": 2}``."""
    averaging: dict[str, float] = field(default_factory=dict)
    """With replicas: the bytes the stages' averaging rounds sent per step, every replica together
    (``bytes_per_step``), and their share of all bytes the peers sent (``share``, ZeroMQ frames included)."""


def replica_out_dir(out_dir: str | Path, replica: int) -> Path:
    """Where replica ``replica`` of a stage keeps its run folder on this machine (SPEC §9.10): the
    run's own for replica 0, ``replica<r>/`` in it for the others (each keeps its own checkpoints)."""
    return Path(out_dir) if replica == 0 else Path(out_dir) / f"replica{replica}"


def _to_stage(results: Sequence[dict], field_name: str, stage: int) -> dict[str, int]:
    """``field_name`` (``payload_tx``, ``wire_tx``) of ``results`` summed over their links to
    ``stage``: the link ``stage<k>``, or with replicas each ``stage<k>@...``, by kind."""
    out: dict[str, int] = {}
    for r in results:
        for link, kinds in r[field_name].items():
            if link == f"stage{stage}" or link.startswith(f"stage{stage}@"):
                for kind, n in kinds.items():
                    out[kind] = out.get(kind, 0) + n
    return out


def summarize(out_dir: str | Path, num_stages: int, replicas: Sequence[int] = ()) -> SwarmSummary:
    """Combine the peers' result files into swarm-level figures (with ``replicas[s]`` peers of
    stage s: their bytes summed over every replica and link)."""
    counts = list(replicas) or [1] * num_stages
    paths = [[replica_out_dir(out_dir, r) / f"peer_stage{s}.json" for r in range(counts[s])] for s in range(num_stages)]
    by_stage = [[json.loads(path.read_text()) for path in stage if path.exists()] for stage in paths]
    for s, stage in enumerate(by_stage):  # a replica that left wrote none; a stage needs one
        if not stage:
            raise MaplError(f"no peer of stage {s} wrote its results ({paths[s][0]})")
    res = [stage[0] for stage in by_stage]
    tokens = max(res[0]["tokens"], 1)
    links = []
    for b in range(num_stages - 1):
        fwd = _to_stage(by_stage[b], "payload_tx", b + 1)
        bwd = _to_stage(by_stage[b + 1], "payload_tx", b)
        wf = _to_stage(by_stage[b], "wire_tx", b + 1)
        wb = _to_stage(by_stage[b + 1], "wire_tx", b)
        links.append({
            "forward_payload": kind_bytes(fwd, FORWARD_KINDS) / tokens,
            "backward_payload": kind_bytes(bwd, BACKWARD_KINDS) / tokens,
            "forward_wire": sum(wf.values()) / tokens,
            "backward_wire": sum(wb.values()) / tokens,
            "payload_by_kind": {**{f"fwd_{k}": v / tokens for k, v in fwd.items()},
                                **{f"bwd_{k}": v / tokens for k, v in bwd.items()}},
            "wire_by_type": {**{f"fwd_{k}": v / tokens for k, v in wf.items()},
                             **{f"bwd_{k}": v / tokens for k, v in wb.items()}},
        })
    for b, link in enumerate(links):  # the shapers of the first replica's first link
        link["shaper_forward"] = next((v for k, v in res[b]["shaper"].items() if k.startswith(f"stage{b + 1}")), {})
        link["shaper_backward"] = next((v for k, v in res[b + 1]["shaper"].items() if k.startswith(f"stage{b}")), {})
    averaging = {}
    everyone = [r for stage in by_stage for r in stage]
    averaged = sum(r.get("averaging", {}).get("sent_bytes", 0) for r in everyone)
    if averaged:
        wire = sum(n for r in everyone for kinds in r["wire_tx"].values() for n in kinds.values())
        averaging = {"bytes_per_step": averaged / max(len(res[0]["train_losses"]), 1),
                     "share": averaged / (averaged + wire)}
    return SwarmSummary(res[0]["train_losses"], res[0]["report_times_s"], res[0]["val_history"], res[0]["tokens"],
                        res[0]["wall_s"], links, averaging=averaging)


def stop_all(procs: list[subprocess.Popen]) -> None:
    """Stop every peer still running at once: SIGTERM (a peer drains on it), and after
    ``_ABORT_GAP_S`` a second SIGTERM (a peer stops at once on it); SIGKILL after ``_GRACE_S``."""
    for _ in range(2):
        alive = [p for p in procs if p.poll() is None]
        for p in alive:
            p.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + _ABORT_GAP_S
        while alive and time.monotonic() < deadline and any(p.poll() is None for p in alive):
            time.sleep(0.05)  # supervising child processes, not synchronising tests
    deadline = time.monotonic() + _GRACE_S
    for p in procs:
        try:
            p.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            log.warning("peer pid %d did not stop within %.0f s; killing it", p.pid, _GRACE_S)
            p.kill()
            p.wait()


# ---------------------------------------------------------------- GPUs and peer processes
_GPU_ID = re.compile(r"[0-9]+|(GPU|MIG)-[0-9A-Za-z/-]+")


def parse_gpus(text: str) -> list[str]:
    """``--gpus 0,1,2,3``: the GPUs to hand out, as ``CUDA_VISIBLE_DEVICES`` takes them (indices or
    ``GPU-``/``MIG-`` UUIDs); they replace the launcher's own ``CUDA_VISIBLE_DEVICES`` in the
    children. A repeated id is fine (two peers on one GPU)."""
    ids = [t.strip() for t in text.split(",")]
    bad = [t for t in ids if not _GPU_ID.fullmatch(t)]
    if not ids or bad:
        raise ConfigError(f"--gpus {text!r}: expected comma-separated GPU indices or UUIDs, e.g. --gpus 0,1,2,3"
                          + (f" (bad: {', '.join(repr(b) for b in bad)})" if bad else ""))
    return ids


def _nvidia_smi_count() -> int:
    """GPUs listed by ``nvidia-smi -L`` (0 when it is missing or fails): a probe that needs no torch."""
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=15, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return 0
    return sum(1 for line in out.splitlines() if re.match(r"GPU [0-9]+:", line))


def visible_gpus(environ: Mapping[str, str], probe: Callable[[], int] = _nvidia_smi_count) -> list[str]:
    """The GPUs the launcher may hand out: its ``CUDA_VISIBLE_DEVICES`` entries when that is set
    (up to the first invalid one such as ``-1``, where CUDA stops too; empty: none), else
    ``0 .. n-1`` for the ``n`` GPUs ``probe`` counts."""
    cvd = environ.get("CUDA_VISIBLE_DEVICES")
    if cvd is None:
        return [str(i) for i in range(probe())]
    out = []
    for t in (t.strip() for t in cvd.split(",")):
        if not _GPU_ID.fullmatch(t):
            break
        out.append(t)
    return out


def gpu_plan(device: str, num_peers: int, *, gpus: Sequence[str] | None = None,
             environ: Mapping[str, str] | None = None,
             probe: Callable[[], int] = _nvidia_smi_count) -> list[str | None]:
    """Per peer, the ``CUDA_VISIBLE_DEVICES`` value it gets (None: its environment is left alone).

    ``runtime.device`` ``auto`` / ``cuda``: round-robin over ``gpus`` (``--gpus``) or else the
    launcher's :func:`visible_gpus` (4 GPUs, 4 peers -> 0,1,2,3; 1 GPU -> every peer gets it;
    ``--gpus 2,3`` -> 2,3,2,3); no GPU -> all None. ``cpu`` and an explicit ``cuda:N`` (every
    peer on device N of the launcher's view, as configured) -> all None, and ``--gpus`` with
    either is a ConfigError (a peer that sees one GPU has no ``cuda:1``)."""
    if device == "cpu" or device.startswith("cuda:"):
        if gpus:
            raise ConfigError(f"--gpus needs runtime.device = \"auto\" or \"cuda\" (each peer then sees its one "
                              f"GPU as cuda:0), got runtime.device = {device!r}")
        return [None] * num_peers
    pool = list(gpus) if gpus else visible_gpus(os.environ if environ is None else environ, probe)
    if not pool:
        return [None] * num_peers
    return [pool[s % len(pool)] for s in range(num_peers)]


@dataclass(frozen=True)
class PeerProcess:
    """How ``launch`` starts one stage peer."""

    stage: int
    cmd: list[str]
    env: dict[str, str]
    gpu: str | None
    """Its ``CUDA_VISIBLE_DEVICES`` (None: inherited unchanged)."""
    replica: int = 0
    """Which of the stage's replicas it is (SPEC §9.10; 0 without replicas)."""

    @property
    def label(self) -> str:
        return f"stage {self.stage}" + (f" replica {self.replica}" if self.replica else "")


def peer_ports(base: int, num_stages: int, *, offset: int = 0) -> list[int]:
    """Each peer's own port when a base port is set (``base + offset + stage``); 0 (the OS picks)
    for every peer otherwise."""
    return [base + offset + s if base else 0 for s in range(num_stages)]


def check_ports(cfg: TrainConfig) -> None:
    """Before anything starts: every fixed port the swarm will listen on (the bootstrap's
    ``net.dht_port``, and for the i-th of its peers in :func:`peer_processes`' order, every replica
    counted, ``net.dht_port + 1 + i``, ``net.port + i`` and ``metrics.prometheus_port + i``) is free;
    DiscoveryError naming the first one that is not."""
    n, net = sum(replica_counts(cfg)), cfg.net
    wanted = [(net.dht_host, p) for p in ([net.dht_port] if net.dht_port else [])]
    wanted += [(net.dht_host, p) for p in peer_ports(net.dht_port, n, offset=1) if p]
    wanted += [(net.bind_host, p) for p in peer_ports(net.port, n) if p]
    wanted += [(cfg.metrics.prometheus_host, p) for p in peer_ports(cfg.metrics.prometheus_port or 0, n) if p]
    ports = [p for _, p in wanted]
    clash = sorted({p for p in ports if ports.count(p) > 1})
    if clash:
        raise ConfigError(f"net.port, net.dht_port and metrics.prometheus_port give the swarm overlapping ports "
                          f"{clash}: its {n} peers use net.port + i and metrics.prometheus_port + i, the DHT "
                          f"net.dht_port .. net.dht_port + {n}; move one of them")
    for host, port in wanted:
        check_listen_address(host, port)


def peer_processes(num_stages: int, config_args: Sequence[str], *, maddr: str, threads: int, progress: bool,
                   gpus: Sequence[str | None], environ: Mapping[str, str], member_args: Sequence[Sequence[str]],
                   net_port: int = 0, dht_port: int = 0, python: str = sys.executable,
                   replicas: Sequence[int] = (), out_dir: str | Path = "",
                   metrics_port: int | None = None) -> list[PeerProcess]:
    """The command and environment of every stage peer (pure: nothing is started), in stage order
    and, with ``replicas[s]`` peers of stage s (SPEC §9.10), replica order within a stage; replica
    r > 0 keeps its run folder in :func:`replica_out_dir` of ``out_dir``. ``gpus`` is
    :func:`gpu_plan`'s answer, one per peer; a peer's environment is ``environ`` with its GPU as
    ``CUDA_VISIBLE_DEVICES``, or ``environ`` unchanged when it has none. ``member_args[i]``: the
    options that make peer i a member (``--peer-key``/``--cert``: paths only, a key never appears
    in a command or environment). With a base ``net_port`` / ``dht_port`` each peer gets its own
    (:func:`peer_ports`; the bootstrap keeps ``dht_port`` itself), and so with a base
    ``metrics_port`` (``metrics.prometheus_port``) each its own Prometheus port."""
    base = [python, "-m", "mapl_swarm", "peer", *config_args]
    layout = [(s, r) for s in range(num_stages) for r in range(replicas[s] if replicas else 1)]
    ports, dht_ports = peer_ports(net_port, len(layout)), peer_ports(dht_port, len(layout), offset=1)
    metrics_ports = peer_ports(metrics_port or 0, len(layout))
    out = []
    for i, (s, r) in enumerate(layout):
        cmd = base + ["--stage", str(s), "--initial-peer", maddr, "--set", f"runtime.threads={threads}",
                      "--launched", *member_args[i]]
        if r:
            cmd += ["--set", f"run.out_dir={json.dumps(str(replica_out_dir(out_dir, r)))}"]
        if ports[i]:
            cmd += ["--set", f"net.port={ports[i]}"]
        if dht_ports[i]:
            cmd += ["--set", f"net.dht_port={dht_ports[i]}"]
        if metrics_ports[i]:
            cmd += ["--set", f"metrics.prometheus_port={metrics_ports[i]}"]
        if s > 0 or r > 0 or not progress:
            cmd.append("--quiet")
        env = dict(environ)
        if gpus[i] is not None:
            env["CUDA_VISIBLE_DEVICES"] = gpus[i]
        out.append(PeerProcess(s, cmd, env, gpus[i], r))
    return out


def _log_metrics_ports(cfg: TrainConfig, layout: Sequence[tuple[int, int]]) -> None:
    """Where each local peer serves its Prometheus metrics (``metrics.prometheus_port``)."""
    base, host = cfg.metrics.prometheus_port, cfg.metrics.prometheus_host
    if base is None:
        return
    if base == 0:
        log.info("Prometheus metrics: each peer picks a free port and logs it")
        return
    log.info("Prometheus metrics: %s", ", ".join(
        f"stage {s}" + (f" replica {r}" if r else "") + f" http://{host}:{port}/metrics"
        for (s, r), port in zip(layout, peer_ports(base, len(layout)))))


IDENTITIES_DIR = "identities"
"""Folder under ``run.out_dir`` where a local swarm keeps its authority, peer keys and certificates."""


def replica_counts(cfg: TrainConfig) -> list[int]:
    """The peers of each stage a local swarm starts (``replicas.initial``; one each without replicas)."""
    return [cfg.replicas_of(s) for s in range(cfg.pipeline.num_stages)]


def revocation_args(path: str | os.PathLike[str] | None, local: LocalIdentities, run_id: str) -> list[str]:
    """The ``peer`` options that give every peer of a local swarm the authority's revocation list at
    ``path`` (each peer re-reads it when it changes: SPEC §7.2 item 8); checked first, so a wrong
    file is named before any peer starts. None: no list."""
    if path is None:
        return []
    file = Path(path).resolve()
    if not file.is_file():
        raise ConfigError(f"--revocations {path}: no such file (`mapl-swarm keys revoke --authority "
                          f"{local.folder / 'authority.key'} ... --out {path}` writes one)")
    try:
        verify_revocations(read_signed(file, "revocations"), authority=local.authority.public, run_id=run_id)
    except MaplError as exc:
        raise ConfigError(f"--revocations {path}: not a revocation list of run {run_id!r} by this swarm's authority "
                          f"({local.folder / 'authority.key'}): {exc}") from None
    return ["--revocations", str(file)]


def local_identities(cfg: TrainConfig) -> LocalIdentities:
    """The local swarm's authority and per-stage identities (module docstring), issued or kept."""
    local = issue_local(Path(cfg.run.out_dir) / IDENTITIES_DIR, run_id=cfg.run.run_id,
                        num_stages=cfg.pipeline.num_stages, replicas=replica_counts(cfg))
    log.info("identities: %s (authority %s; one key and certificate per stage)", local.folder,
             local.authority.key_id)
    return local


def launch(cfg: TrainConfig, config_args: list[str], *, progress: bool = True,
           timeout_s: float | None = None, gpus: Sequence[str] | None = None,
           max_restarts: int = 3, revocations: str | os.PathLike[str] | None = None) -> SwarmSummary:
    """Run the whole swarm locally (each peer gets ``config_args``, the options that produced
    ``cfg`` and the log level); raises MaplError naming the failed stage. The launcher prepares the
    data and runs the DHT bootstrap, and logs those once; its peers log them at DEBUG. ``gpus``
    (``--gpus``) are handed out round-robin, else the visible ones (:func:`gpu_plan`). A peer that
    dies is restarted with ``--resume``, at most ``max_restarts`` times per stage
    (:class:`RestartPolicy`). ``revocations``: the authority's revocation list, which every peer
    reads and watches (:func:`revocation_args`)."""
    P = cfg.pipeline.num_stages
    counts = replica_counts(cfg)
    # before any work: a bad --max-restarts answers at once
    swarm = Supervisor(RestartPolicy(restarts_allowed(cfg, max_restarts)), rejoins=max_restarts)
    threads = cfg.runtime.threads or max(1, (os.cpu_count() or 1) // sum(counts))
    plan = gpu_plan(cfg.runtime.device, sum(counts), gpus=gpus)  # before any work: a bad --gpus answers at once
    if any(g is not None for g in plan):
        log.info("GPUs per peer (CUDA_VISIBLE_DEVICES): %s",
                 ", ".join(f"stage {s} -> {g}" for s, g in enumerate(plan)))
    Path(cfg.run.out_dir).mkdir(parents=True, exist_ok=True)
    for s in range(P):  # results of an earlier run must not be mistaken for this one's
        for r in range(counts[s]):
            (replica_out_dir(cfg.run.out_dir, r) / f"peer_stage{s}.json").unlink(missing_ok=True)
    check_ports(cfg)  # a taken or clashing port answers at once, before data, DHT or peers
    local = local_identities(cfg)
    revoked = revocation_args(revocations, local, cfg.run.run_id)
    prepare_data(cfg.data, progress=progress)  # once, here, rather than raced by every peer
    bootstrap = Discovery(cfg.run.run_id, DiscoveryConfig(host=cfg.net.dht_host, port=cfg.net.dht_port),
                          membership=TrustedAuthority(cfg.run.run_id, local.authority.public))
    bootstrap.start()
    try:
        maddr = bootstrap.visible_maddrs()[0]
        log.info("DHT bootstrap at %s; starting %d peers with %d torch threads each", maddr, sum(counts), threads)
        out = Path(cfg.run.out_dir)
        log.info("metrics: %s (one per stage, appended every step); checkpoints: %s; manifest: %s",
                 out / f"metrics_stage{{0..{P - 1}}}.jsonl", out / "checkpoints", out / "manifest.json")
        layout = [(s, r) for s in range(P) for r in range(counts[s])]
        _log_metrics_ports(cfg, layout)
        return supervise(cfg, swarm, peer_processes(P, config_args, maddr=maddr, threads=threads,
                                                    progress=progress, gpus=plan, environ=os.environ,
                                                    member_args=[[*local.args(s, r), *revoked] for s, r in layout],
                                                    net_port=cfg.net.port, dht_port=cfg.net.dht_port,
                                                    replicas=counts if cfg.replicas.enabled else (),
                                                    out_dir=cfg.run.out_dir,
                                                    metrics_port=cfg.metrics.prometheus_port), timeout_s)
    finally:
        bootstrap.close()


def supervise(cfg: TrainConfig, swarm: "Supervisor", peers: Sequence[PeerProcess], timeout_s: float | None, *,
              command: str = "launch") -> SwarmSummary:
    """Run ``peers`` (one per stage of ``cfg``) under ``swarm`` until they all ended (module
    docstring: signals forwarded, dead peers restarted), stopping every one still running on the
    way out; the swarm's summary, or after a drain one with its ``end_note`` (which tells to
    continue with ``mapl-swarm COMMAND --resume``)."""
    try:
        with _Forwarded() as signals:
            swarm.start(peers)
            swarm.run(signals, timeout_s, drain_timeout_s=cfg.net.timeout_s + 60.0)
    except KeyboardInterrupt:
        raise MaplError("interrupted; stopped every peer") from None
    finally:
        swarm.stop()
    restarts = swarm.policy.counts()
    if restarts:
        log.info("restarts per stage: %s (--max-restarts %d each)", json.dumps(restarts), swarm.policy.max_restarts)
    if signals.received:
        note, step = drain_note(cfg, signals.received[0], command)
        if note:
            return SwarmSummary([], [], [], 0, 0.0, [], end_note=note, drained_at=step, restarts=restarts)
    summary = summarize(cfg.run.out_dir, cfg.pipeline.num_stages, replica_counts(cfg))
    summary.restarts = restarts
    return summary


class _Forwarded:
    """While open (on the main thread), SIGINT and SIGTERM are recorded for :meth:`Supervisor.run` to
    forward instead of interrupting the launcher."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self) -> None:
        self.received: list[str] = []
        self._pending: list[int] = []
        self._previous: dict[int, object] = {}

    def _record(self, signum: int, frame: object) -> None:
        self.received.append(signal.Signals(signum).name)
        self._pending.append(signum)

    def take(self) -> list[int]:
        """Signals received since the last call, in order."""
        out, self._pending = self._pending, []
        return out

    def __enter__(self) -> "_Forwarded":
        if threading.current_thread() is threading.main_thread():
            for sig in self.SIGNALS:
                self._previous[sig] = signal.signal(sig, self._record)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)


# ---------------------------------------------------------------- supervising the peers: restarts
Action = Literal["done", "restart", "stop"]

_STOPPED_AT_ONCE = (130, 128 + signal.SIGINT, 128 + signal.SIGTERM, -signal.SIGINT, -signal.SIGTERM)
"""A peer's status after a forwarded signal stopped it at once (or killed it before its handlers were in)."""


def exit_text(status: int) -> str:
    """A child's ``Popen.returncode`` for people: ``status 3``, or the signal that killed it (``SIGKILL``)."""
    if status >= 0:
        return f"status {status}"
    try:
        return signal.Signals(-status).name
    except ValueError:
        return f"signal {-status}"


class RestartPolicy:
    """Whether a stage peer that exited is restarted (pure: no processes, no clock).

    ``max_restarts`` is per stage over the whole run; :meth:`counts` holds the restarts made."""

    def __init__(self, max_restarts: int) -> None:
        if max_restarts < 0:
            raise ConfigError(f"--max-restarts {max_restarts}: expected 0 or more (0: a dead peer stops the swarm)")
        self.max_restarts = max_restarts
        self._restarts: dict[int, int] = {}

    def decide(self, stage: int, status: int, *, stopping: bool) -> Action:
        """For ``stage``'s peer that exited with ``status`` (``Popen.returncode``: negative when a
        signal killed it): ``"done"`` for 0 (its run ended); ``"stop"`` (the swarm) while
        ``stopping`` (a signal was forwarded: the swarm drains or stops, nothing restarts) or once
        the stage used its ``max_restarts``; else ``"restart"``, counted against the stage."""
        if status == 0:
            return "done"
        used = self._restarts.get(stage, 0)
        if stopping or used >= self.max_restarts:
            return "stop"
        self._restarts[stage] = used + 1
        return "restart"

    def used(self, stage: int) -> int:
        """Restarts ``stage`` had so far."""
        return self._restarts.get(stage, 0)

    def counts(self) -> dict[str, int]:
        """The restarts per stage that had any, keyed by the stage as a string (JSON-style)."""
        return {str(s): n for s, n in sorted(self._restarts.items())}


def restarts_allowed(cfg: TrainConfig, max_restarts: int) -> int:
    """``--max-restarts``, but 0 for a run with replicas that cannot re-form (``net.rejoin_timeout_s``
    0 or checkpoints off): the survivors of a stage's last replica exit, nothing waits for it."""
    if cfg.replicas.enabled and not (cfg.net.rejoin_timeout_s > 0 and cfg.checkpoint.interval_steps > 0):
        return 0
    return max_restarts


def rejoining(peer: PeerProcess) -> PeerProcess:
    """Replica ``peer`` started again as one that joins the running swarm: its command with
    ``--join`` instead of ``--resume`` and without a fixed ``net.port`` (its old contact is gone
    at every member: a new port makes it a new one)."""
    cmd, out = list(peer.cmd), []
    while cmd:
        arg = cmd.pop(0)
        if arg == "--set" and cmd and cmd[0].startswith("net.port="):
            cmd.pop(0)
        elif arg not in ("--resume", "--join"):
            out.append(arg)
    return replace(peer, cmd=[*out, "--join"])


def resumed(peer: PeerProcess) -> PeerProcess:
    """``peer`` started again: the same command (key file, ports, threads), environment and GPU, plus
    ``--resume`` when it is not there already."""
    return peer if "--resume" in peer.cmd else replace(peer, cmd=[*peer.cmd, "--resume"])


def _start(peer: PeerProcess) -> subprocess.Popen:
    """Start one peer: a launcher killed even by SIGKILL takes it (and with it its DHT node) along;
    a process group of its own, so a terminal's Ctrl-C reaches the launcher, which forwards it once."""
    return subprocess.Popen(peer.cmd, env=peer.env, preexec_fn=die_with_parent(), process_group=0)


def _exit_status(proc: subprocess.Popen) -> int | None:
    """``proc``'s status once it exited, else None. A non-zero exit is seen before the child is
    reaped (``WNOWAIT``), so what is left of its process group (its DHT node, p2pd: they die with it
    anyway) is SIGKILLed while the group id cannot have been reused, then it is reaped."""
    if proc.returncode is None and hasattr(os, "waitid"):
        try:
            info = os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        except ChildProcessError:
            info = None
        if info is not None and not (info.si_code == os.CLD_EXITED and info.si_status == 0):
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
    return proc.poll()


class Supervisor:
    """The stage peers' processes: starts them (:func:`_start`), waits for them, forwards the
    launcher's signals, restarts a dead one with ``--resume`` as its :class:`RestartPolicy` says
    and leaves the others alone, and stops them all (:func:`stop_all`)."""

    def __init__(self, policy: RestartPolicy, companions: Mapping[str, subprocess.Popen] | None = None, *,
                 rejoins: int = 0) -> None:
        self.policy = policy
        self.rejoins = rejoins
        """How often a stage's replicas that the swarm took for gone (exit status 4) are started again
        with ``--join``, in all (``--max-restarts``)."""
        self._rejoins: dict[int, int] = {}
        self.companions = dict(companions or {})
        """Processes the peers need, by name (the lab's DHT node): one that exits stops the swarm."""
        self.peers: list[PeerProcess] = []
        """How each peer is (re)started, in the order started."""
        self.procs: list[subprocess.Popen] = []
        """Each peer's current process, in that order."""
        self.left: set[int] = set()
        """Peers (by index) that exited while their stage kept a replica: the swarm went on without them."""

    def start(self, peers: Sequence[PeerProcess]) -> None:
        """Start ``peers`` (in stage order; with replicas, a stage's replicas together)."""
        for peer in peers:
            self.peers.append(peer)
            self.procs.append(_start(peer))

    def stop(self) -> None:
        """Stop every peer still running (:func:`stop_all`); no restarts."""
        stop_all(self.procs)

    def run(self, signals: _Forwarded, timeout_s: float | None, *, drain_timeout_s: float) -> None:
        """Until every peer exited 0; forwards each signal to every peer still running. Raises
        MaplError naming the first peer that failed and is not restarted (or, after a signal, that
        did not drain)."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            for sig in signals.take():
                log.info("%s: forwarded to every peer (%s)", signal.Signals(sig).name,
                         "they drain: finish the current step, checkpoint it, exit" if len(signals.received) == 1
                         else "they stop at once")
                for p in self.procs:
                    if p.poll() is None:
                        p.send_signal(sig)
                if len(signals.received) == 1:
                    deadline = time.monotonic() + drain_timeout_s
            for name, proc in self.companions.items():
                if proc.poll() is not None:
                    raise MaplError(f"{name} exited with {exit_text(proc.returncode)}; stopped the swarm")
            done = 0
            for i, proc in enumerate(self.procs):
                if i in self.left:
                    done += 1
                elif (status := _exit_status(proc)) is not None:
                    done += self._exited(i, status, stopping=bool(signals.received))
            if done == len(self.procs):
                return
            if deadline is not None and time.monotonic() > deadline:
                what = "drain" if signals.received else "finish"
                raise MaplError(f"swarm did not {what} within "
                                f"{drain_timeout_s if signals.received else timeout_s:g} s; stopped it")
            time.sleep(0.2)  # supervising child processes, not synchronising tests

    def _exited(self, i: int, status: int, *, stopping: bool) -> bool:
        """Handle peer ``i``'s exit: True when its run ended (0, or it was a replica whose stage has
        another one running: the swarm goes on without it); False when it was restarted; raises
        when the swarm stops."""
        peer, pid, n = self.peers[i], self.procs[i].pid, self.policy.max_restarts
        what = f"status {status}" + (f" ({exit_text(status)})" if status < 0 else "")
        partners = [j for j, other in enumerate(self.peers)
                    if j != i and other.stage == peer.stage and self.procs[j].poll() is None]
        if status == TakenForGone.exit_code and partners and not stopping and \
                self._rejoins.get(peer.stage, 0) < self.rejoins:
            # a live replica the swarm took for gone (a stalled link): it joins again as a new member
            self._rejoins[peer.stage] = self._rejoins.get(peer.stage, 0) + 1
            log.warning("%s (pid %d) left: the swarm took it for gone; starting it again with --join (rejoin %d of "
                        "%d)", peer.label, pid, self._rejoins[peer.stage], self.rejoins)
            self.peers[i] = rejoining(peer)
            self.procs[i] = _start(self.peers[i])
            return False
        if status != 0 and partners and not stopping:  # a replica: its stage goes on with the others (SPEC §9.10)
            log.warning("%s (pid %d) exited with %s; stage %d goes on with its %d other replica(s)", peer.label, pid,
                        what, peer.stage, len(partners))
            self.left.add(i)
            return True
        action = self.policy.decide(peer.stage, status, stopping=stopping)
        if action == "done":
            return True
        if action == "restart":
            used = self.policy.used(peer.stage)
            log.warning("%s (pid %d) died (%s); restarting it with --resume (restart %d of %d)",
                        peer.label, pid, exit_text(status), used, n)
            self.peers[i] = resumed(peer)
            self.procs[i] = _start(self.peers[i])
            return False
        if stopping:
            if status in _STOPPED_AT_ONCE:
                raise Interrupted(f"{peer.label} peer stopped at once ({what}); stopped the swarm")
            raise MaplError(f"{peer.label} peer exited with {what}; stopped the swarm")
        spent = "no restarts allowed" if n == 0 else f"restarted {n} time{'s' if n > 1 else ''} already"
        raise MaplError(f"{peer.label} peer exited with {what}; {spent} (--max-restarts {n}); stopped the swarm")


def drain_note(cfg: TrainConfig, signal_name: str, command: str = "launch") -> tuple[str, int | None]:
    """The launcher's (``mapl-swarm COMMAND``'s) one line after its peers drained on ``signal_name``
    (from their result files), and the step; ``""`` when every peer had finished the run anyway."""
    peers = [(s, r) for s, n in enumerate(replica_counts(cfg)) for r in range(n)]
    results = []
    for s, r in peers:
        path = replica_out_dir(cfg.run.out_dir, r) / f"peer_stage{s}.json"
        results.append(json.loads(path.read_text()) if path.exists() else {})
    ends = [r.get("end", "missing") for r in results]
    if all(end == "finished" for end in ends):
        return "", None  # the signal came as the run ended: the usual summary
    steps = {r.get("drained_at") for r in results}
    if any(end != "drained" for end in ends) or len(steps) != 1:
        stopped = ", ".join(f"stage {s}{f' replica {r}' if r else ''} {end}" for (s, r), end in zip(peers, ends))
        return f"swarm stopped ({signal_name}): {stopped}", None
    step = steps.pop()
    note = results[0].get("checkpoint_note", "")
    if len(results) > cfg.pipeline.num_stages and all("saved by this replica" in r.get("checkpoint_note", "")
                                                      for r in results):  # replicas: each saves its own
        note = f"checkpoint of step {step} saved by every replica; continue with --resume"
    note = note.replace("--resume", f"`mapl-swarm {command} --resume`")
    return f"swarm drained at step {step} ({signal_name}): {note}", step
