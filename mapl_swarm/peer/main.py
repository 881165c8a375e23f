"""Start one stage peer: DHT first (it forks), then torch, data, the stage and the event loop.

A peer is a member of its run through its certified identity (:mod:`mapl_swarm.net.identity`): its
links are encrypted (CURVE) and pinned to named peers, its HELLO carries its certificate and its
DHT records are signed by its own key. Without one (``--insecure``) everything is in the clear and
anyone may join;
:class:`InsecureWarning` then says so in the log every minute while the peer runs.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

from mapl_swarm.config import TrainConfig
from mapl_swarm.errors import ConfigError, MaplError
from mapl_swarm.net.discovery import Discovery, DiscoveryConfig
from mapl_swarm.net.errors import RelayNeeded
from mapl_swarm.startup import without_collections

if TYPE_CHECKING:
    from mapl_swarm.net.transport import Membership
    from mapl_swarm.peer.dialback import Reachability

log = logging.getLogger(__name__)

__all__ = ["build_peer", "peer_assets", "PeerAssets", "run_peer", "read_peers_file", "InsecureWarning",
           "INSECURE_WARNING_INTERVAL_S"]

INSECURE_WARNING_INTERVAL_S = 60.0
"""How often an insecure peer repeats its warning."""


class InsecureWarning:
    """While open, logs a warning that this peer runs without a certificate, at once and then every
    ``interval_s`` (a daemon thread: it keeps warning while the event loop or the compute is busy)."""

    MESSAGE = ("INSECURE: stage %d runs without a certificate (--insecure): links are unencrypted and "
               "unauthenticated, anyone who can reach this host can read the training data and join or "
               "disrupt the run; use --peer-key and --cert (`mapl-swarm keys local` issues them)")

    def __init__(self, stage: int, interval_s: float = INSECURE_WARNING_INTERVAL_S) -> None:
        self.stage = stage
        self.interval_s = interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="insecure-warning", daemon=True)

    def _run(self) -> None:
        while True:
            log.warning(self.MESSAGE, self.stage)
            if self._stop.wait(self.interval_s):
                return

    def __enter__(self) -> "InsecureWarning":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def read_peers_file(path: str, timeout_s: float) -> list[str]:
    """Multiaddrs from a file written by ``mapl-swarm dht --maddr-file``, waiting for it to appear
    (containers start in any order)."""
    deadline = time.monotonic() + timeout_s
    p = Path(path)
    while not p.exists():
        if time.monotonic() > deadline:
            raise ConfigError(f"initial peers file {path} did not appear within {timeout_s:g} s")
        time.sleep(0.5)  # waiting for another container, not synchronising tests
    peers = [line.strip() for line in p.read_text().splitlines() if line.strip()]
    if not peers:
        raise ConfigError(f"initial peers file {path} is empty")
    return peers


@dataclass(frozen=True)
class PeerAssets:
    """What every session of a peer process shares (:func:`peer_assets`): the prepared data, the
    config fingerprint and the device."""

    data: Any
    fingerprint: str
    device: Any
    config: dict[str, Any]
    """The settings neighbours must share (``config.config_summary``), sent in the handshake."""


def config_record(fingerprint: str, config: dict[str, Any]) -> dict[str, Any]:
    """A peer's config record (SPEC §9.1 "Config records"): its protocol version, its config
    fingerprint and the settings its neighbours must share."""
    from mapl_swarm.wire.spec import PROTOCOL_VERSION

    return {"protocol": ".".join(map(str, PROTOCOL_VERSION)), "fingerprint": fingerprint, "config": dict(config)}


def peer_assets(cfg: TrainConfig) -> PeerAssets:
    """Prepare the data, fingerprint the config and bind the device (once per process)."""
    import torch

    from mapl_swarm.config import config_summary, model_fingerprint
    from mapl_swarm.data import prepare_data
    from mapl_swarm.pipeline.device import bind_device, resolve_device
    from mapl_swarm.pipeline.run_policy import check_vocab

    if cfg.runtime.threads:
        torch.set_num_threads(cfg.runtime.threads)
    data = prepare_data(cfg.data, progress=False)
    check_vocab(cfg, data)
    tokenizer = (data.tokenizer.file_hash, data.tokenizer.vocab_size)
    device = resolve_device(cfg.runtime.device)
    bind_device(device)  # this (event-loop) thread; the compute thread binds it itself (build_peer)
    return PeerAssets(data, model_fingerprint(cfg, *tokenizer), device, config_summary(cfg, *tokenizer))


def build_peer(cfg: TrainConfig, stage: int, *, resolve, announce, resume: bool = False, progress: bool = True,
               membership: Membership | None = None, assets: PeerAssets | None = None, epoch: int = 0,
               rejoining: bool = False, runtime: Any = None, replicas: Any = None, joining: bool = False,
               reform: Any = None, credits: Any = None, exporters: Sequence[Any] = ()):
    """The :class:`~mapl_swarm.peer.runtime.Peer` of stage ``stage``: its data (stage 1), its
    StageRuntime (built from the config's seed) and run policy. With ``resume`` the peer resumes,
    after the handshake, from the newest step every stage has (agreed by messages, SPEC §5.2).
    ``resolve(stage, timeout_s)`` (an endpoint, or every endpoint freshest first) and
    ``announce(endpoint)`` are awaitables (the DHT's, or any other directory). ``membership``: a
    certified peer's identity (CURVE links to named peers, its certificate in every HELLO); None:
    insecure.
    ``assets``: from :func:`peer_assets` (made here when None). ``epoch`` and ``rejoining``: a
    session that re-forms the swarm after a departure (:mod:`~.sessions`). ``runtime``: the stage,
    when built already (else built here); ``replicas``: the stage's averaging with its other
    replicas (:func:`stage_replicas`), which this session's stage is attached to; ``joining``: the
    replica joins a running swarm (its state is downloaded from a live replica of its stage);
    ``reform``: with replicas, a session that re-forms the swarm (:class:`~.linker.Reform`); ``credits``:
    each member's credit of re-forms and redos, kept across the process's sessions (:mod:`~.credits`);
    ``exporters``: the process's metrics exporters (:mod:`mapl_swarm.metrics.export`)."""
    from mapl_swarm.data import BatchSampler, validation_batches
    from mapl_swarm.peer.checkpoints import PeerRunPolicy
    from mapl_swarm.peer.compute import ComputeThread
    from mapl_swarm.peer.runtime import Peer
    from mapl_swarm.pipeline.device import bind_device
    from mapl_swarm.pipeline.stage import StageRuntime

    assets = assets or peer_assets(cfg)
    data, fingerprint, device = assets.data, assets.fingerprint, assets.device
    rt = runtime if runtime is not None else StageRuntime(cfg, stage, device)
    rt.codec.warm_up(cfg.pipeline.micro_batch_size * cfg.model.context_length)  # before the handshake
    if replicas is not None:
        replicas.attach(rt)
    sampler = val = None
    if stage == 0:
        sampler = BatchSampler(data.train, cfg.pipeline.micro_batch_size, cfg.model.context_length, cfg.run.seed)
        val = validation_batches(data.val, cfg.pipeline.micro_batch_size, cfg.model.context_length, cfg.eval.batches)
    compute = ComputeThread(f"stage{stage}", initializer=functools.partial(bind_device, device))
    policy = PeerRunPolicy(cfg, stage, data, fingerprint, resume=resume, runtime=rt, compute=compute,
                           sampler=sampler, averaging=replicas, exporters=exporters)  # resume: agreed after handshake
    return Peer(cfg, stage, rt, fingerprint=fingerprint, config=assets.config, resolve=resolve, announce=announce,
                sampler=sampler, val_batches=val, progress=progress and stage == 0, compute=compute, run_policy=policy,
                membership=membership, epoch=epoch, rejoining=rejoining, replicas=replicas, joining=joining,
                reform=reform, credits=credits)


def stage_replicas(cfg: TrainConfig, stage: int, dht: Any, device: Any, membership: Membership | None = None
                   ) -> tuple[Any, Any]:
    """With replicas (``replicas.enabled``): its stage, built, and the averaging with the stage's
    other replicas (:class:`~mapl_swarm.replicas.gradients.ReplicaGradients` on the peer's DHT
    node; a stage that starts with one replica has it too, so a replica may join it); (None, None)
    otherwise. The averager forks a process: call this before the event loop, ZeroMQ and the
    compute threads."""
    if not cfg.replicas.enabled:
        return None, None
    from mapl_swarm.pipeline.stage import StageRuntime
    from mapl_swarm.replicas.gradients import ReplicaGradients

    rt = StageRuntime(cfg, stage, device)
    r = cfg.replicas
    averaging = ReplicaGradients(rt, dht, run_id=cfg.run.run_id, replicas=max(2, cfg.replicas_of(stage)),
                                 identity=membership,
                                 min_matchmaking_time=r.matchmaking_s, request_timeout=min(1.0, r.matchmaking_s / 2))
    return rt, averaging


def pick_joined_stage(cfg: TrainConfig, discovery: Discovery, membership: Membership | None) -> int:
    """The stage a replica started without ``--stage`` joins (:mod:`~mapl_swarm.replicas.rebalance`),
    of the stages its certificate allows; logged with every stage's load."""
    from mapl_swarm.replicas.rebalance import pick_stage

    allowed = membership.body.stages if membership is not None else range(cfg.pipeline.num_stages)
    candidates = [k for k in allowed if 0 <= k < cfg.pipeline.num_stages]
    if not candidates:
        raise ConfigError(f"no stage to join: the certificate allows stage(s) {list(allowed)}, the run has "
                          f"{cfg.pipeline.num_stages}")
    stage, loads = pick_stage({k: discovery.stage_peers(k) for k in candidates}, candidates)
    if stage is None:
        raise MaplError(f"no live replica of stage(s) {candidates} in the DHT to join (is the swarm running, and "
                        f"--initial-peer one of its DHT nodes?)")
    log.info("joining stage %d, the one of least capacity: %s", stage,
             ", ".join(f"stage {s.stage}: {s.replicas} replica(s), {s.capacity:.0f} tokens/s" for s in loads))
    return stage


def _withdraw(discovery: Discovery, stage: int) -> None:
    """This peer's stage record goes with its process (a tombstone, at once): no partner's round
    counts it (a replica's round waits for the stage's announced replicas) and no swarm started
    again links its dead contact. A peer killed cannot; its record expires (``ttl_s``)."""
    try:
        discovery.withdraw(stage)
    except MaplError as exc:
        log.debug("stage %d: its DHT record not withdrawn: %s", stage, exc)


def decide_reachable(cfg: TrainConfig, check: Reachability, stage: int) -> TrainConfig:
    """``cfg`` with ``net.reachable = "auto"`` decided by a dial-back ``check``
    (:func:`~.dialback.reachability`): ``no`` when live peers could not dial this host,
    ``yes`` when one did or nobody could be asked (logged, with what to set if that is wrong)."""
    reachable = "no" if check.ok is False else "yes"
    if check.ok is None:
        log.warning("stage %d: net.reachable = \"auto\": %s; taken as reachable (set net.reachable = \"no\" on a "
                    "host behind NAT)", stage, check.detail)
    else:
        log.info("stage %d: net.reachable = \"auto\": %s: %s", stage, check.detail,
                 "serving as a dial-out peer" if reachable == "no" else "reachable")
    return replace(cfg, net=replace(cfg.net, reachable=reachable))


def with_announced_relay(cfg: TrainConfig, relays: Sequence[str], stage: int) -> TrainConfig:
    """A dial-out peer without ``net.relay``: ``cfg`` with the first relay the run's members announce
    in the DHT (SPEC §9.12), or as it is when none does (a dial-out neighbour then cannot be linked,
    and the link says so)."""
    if not relays:
        log.info("stage %d: no relay announced in the DHT (a dial-out neighbour would need one: net.relay, or "
                 "`mapl-swarm relay --initial-peer ...` on a reachable host)", stage)
        return cfg
    log.info("stage %d: relay %s, announced in the DHT, for dial-out neighbours", stage, relays[0])
    return replace(cfg, net=replace(cfg.net, relay=relays[0]))


def _reachability(cfg: TrainConfig, discovery: Discovery, membership: Membership | None, stage: int) -> Reachability:
    """A dial-back of the contact this host's peer would advertise, asked of live peers."""
    from mapl_swarm.peer.dialback import reachability

    staged = [(k, p) for k in range(cfg.pipeline.num_stages) for p in discovery.stage_peers(k)]
    return reachability(cfg, membership, stage, staged, discovery.config.status_s)


def run_peer(cfg: TrainConfig, stage: int | None, *, membership: Membership | None,
             initial_peers: Sequence[str] = (), resume: bool = False, progress: bool = True, joining: bool = False,
             insecure_warning_interval_s: float = INSECURE_WARNING_INTERVAL_S):
    """Run stage ``stage`` of ``cfg`` until the swarm finishes or drains (``result.end``); returns its
    PeerResult. SIGINT/SIGTERM drain the swarm once the peer serves (:mod:`~.signals`). ``membership``
    (a certified identity) None runs insecure, warning every ``insecure_warning_interval_s``.
    ``joining``: join the running swarm as one more replica (``stage`` None: of the stage it
    needs most, :func:`pick_joined_stage`)."""
    if stage is not None:
        cfg.check_stage(stage)
    if stage is None and not joining:
        raise ConfigError("--stage K is required, unless the peer joins a running swarm (--join)")
    net = cfg.net
    if net.reachable != "yes" and membership is None:
        raise ConfigError(f"net.reachable = {net.reachable!r} needs certified peers (--peer-key and --cert): a "
                          f"dial-out peer's neighbours know its connections by the CURVE key in its contact")
    peers = tuple(initial_peers) or net.initial_peers
    # a dial-out peer's DHT node serves nobody (hivemind's client mode): none could reach it
    discovery = Discovery(cfg.run.run_id, DiscoveryConfig(initial_peers=peers, host=net.dht_host, port=net.dht_port,
                                                          client_mode=net.reachable == "no"), membership=membership)
    discovery.start()  # forks the DHT process: before the event loop, ZeroMQ, torch work and threads
    try:
        if stage is None:
            stage = pick_joined_stage(cfg, discovery, membership)
        if net.reachable == "auto":
            cfg = decide_reachable(cfg, _reachability(cfg, discovery, membership, stage), stage)
            if cfg.net.reachable == "no":  # its DHT node again, serving nobody
                discovery.close()
                discovery = Discovery(cfg.run.run_id, replace(discovery.config, client_mode=True),
                                      membership=membership)
                discovery.start()
        if cfg.net.reachable == "no" and not cfg.net.relay:
            cfg = with_announced_relay(cfg, discovery.relays(), stage)
        if membership is not None:
            log.info("stage %d: %s: members-only encrypted links", stage, membership.describe())
        with InsecureWarning(stage, insecure_warning_interval_s) if membership is None else contextlib.nullcontext():
            with without_collections():  # the imports and the data (after the DHT's fork)
                from mapl_swarm.net.transport import run
                from mapl_swarm.peer.result import peak_rss_mb
                from mapl_swarm.peer.runtime import write_result
                from mapl_swarm.peer.sessions import serve_sessions
                from mapl_swarm.metrics.export import exporters_for
                from mapl_swarm.peer.figures import live_figures
                from mapl_swarm.peer.status import StatusSource

                assets = peer_assets(cfg)
            runtime, replicas = stage_replicas(cfg, stage, discovery.dht, assets.device,  # forks: before the loop
                                               membership)
            status = StatusSource()
            discovery.publish_status(stage, status)
            discovery.publish_config(stage, config_record(assets.fingerprint, assets.config))
            exporters: list[Any] = []

            async def announce(endpoint: str) -> None:
                await asyncio.get_running_loop().run_in_executor(None, discovery.announce, stage, endpoint)

            def session(*, resume: bool, epoch: int, rejoining: bool, reform: Any, credits: Any):
                nonlocal runtime
                first, runtime = runtime, None  # the stage built with the averaging serves the first session
                status.peer = build_peer(cfg, stage, resolve=discovery.lookup_all_async, announce=announce,
                                         resume=resume, progress=progress, membership=membership, assets=assets,
                                         epoch=epoch, rejoining=rejoining, runtime=first, replicas=replicas,
                                         joining=joining, reform=reform, credits=credits, exporters=exporters)
                return status.peer

            withdraw = True
            try:
                exporters += exporters_for(cfg, stage=stage, peer_id=replicas.me if replicas is not None else "",
                                           live=live_figures(status))  # their threads: after every fork
                result = run(serve_sessions(session, cfg, stage, membership=membership, resume=resume))
            except RelayNeeded:
                withdraw = False  # its record lapses by itself: the other dial-out neighbour finds it and says so too
                raise
            finally:
                for exporter in exporters:
                    exporter.close()
                if withdraw:
                    _withdraw(discovery, stage)
                if replicas is not None:  # the DHT node first (StageAverager._shutdown says why)
                    discovery.close()
                    replicas.shutdown()
        result.peak_rss_mb = peak_rss_mb()
        write_result(result, cfg.run.out_dir)
        return result
    finally:
        discovery.close()
