"""Start one stage peer: DHT first (it forks), then torch, data, the stage and the event loop."""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from pathlib import Path
from typing import Sequence

from mapl_swarm.config import TrainConfig
from mapl_swarm.errors import ConfigError
from mapl_swarm.net.discovery import Discovery, DiscoveryConfig

log = logging.getLogger(__name__)

__all__ = ["build_peer", "run_peer", "read_peers_file"]


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


def build_peer(cfg: TrainConfig, stage: int, *, resolve, announce, resume: bool = False, progress: bool = True,
               secret: bytes | None = None):
    """The :class:`~mapl_swarm.peer.runtime.Peer` of stage ``stage``: its data (stage 1), its
    StageRuntime and run policy. With ``resume`` the peer resumes, after the handshake, from the
    newest step every stage has (agreed by messages, SPEC §5.2). ``resolve(stage, timeout_s)`` and
    ``announce(endpoint)`` are awaitables (the DHT's, or any other directory)."""
    import torch

    from mapl_swarm.config import model_fingerprint
    from mapl_swarm.data import BatchSampler, prepare_data, validation_batches
    from mapl_swarm.peer.checkpoints import PeerRunPolicy
    from mapl_swarm.peer.compute import ComputeThread
    from mapl_swarm.peer.runtime import Peer
    from mapl_swarm.pipeline.run_policy import bind_device, check_vocab, resolve_device
    from mapl_swarm.pipeline.stage import StageRuntime

    if cfg.runtime.threads:
        torch.set_num_threads(cfg.runtime.threads)
    data = prepare_data(cfg.data, progress=False)
    check_vocab(cfg, data)
    fingerprint = model_fingerprint(cfg, data.tokenizer.file_hash, data.tokenizer.vocab_size)
    device = resolve_device(cfg.runtime.device)
    bind_device(device)  # this (event-loop) thread; the compute thread binds it itself, below
    rt = StageRuntime(cfg, stage, device)
    rt.codec.warm_up(cfg.pipeline.micro_batch_size * cfg.model.context_length)  # before the handshake
    sampler = val = None
    if stage == 0:
        sampler = BatchSampler(data.train, cfg.pipeline.micro_batch_size, cfg.model.context_length, cfg.run.seed)
        val = validation_batches(data.val, cfg.pipeline.micro_batch_size, cfg.model.context_length, cfg.eval.batches)
    compute = ComputeThread(f"stage{stage}", initializer=functools.partial(bind_device, device))
    policy = PeerRunPolicy(cfg, stage, data, fingerprint, resume=resume, runtime=rt, compute=compute,
                           sampler=sampler)  # resume: agreed after the handshake
    return Peer(cfg, stage, rt, fingerprint=fingerprint, resolve=resolve, announce=announce, sampler=sampler,
                val_batches=val, progress=progress and stage == 0, secret=secret, compute=compute,
                run_policy=policy)


def run_peer(cfg: TrainConfig, stage: int, *, initial_peers: Sequence[str] = (), resume: bool = False,
             progress: bool = True, secret: bytes | None = None):
    """Run stage ``stage`` of ``cfg`` until the swarm finishes; returns its PeerResult."""
    if not 0 <= stage < cfg.pipeline.num_stages:
        raise ConfigError(f"--stage {stage} is outside 0..{cfg.pipeline.num_stages - 1} (pipeline.num_stages)")
    net = cfg.net
    peers = tuple(initial_peers) or net.initial_peers
    discovery = Discovery(cfg.run.run_id, DiscoveryConfig(initial_peers=peers, host=net.dht_host,
                                                          port=net.dht_port))
    discovery.start()  # forks the DHT process: before the event loop, ZeroMQ and torch work
    try:
        from mapl_swarm.net.transport import run
        from mapl_swarm.peer.runtime import write_result

        async def announce(endpoint: str) -> None:
            await asyncio.get_running_loop().run_in_executor(None, discovery.announce, stage, endpoint)

        peer = build_peer(cfg, stage, resolve=discovery.lookup_async, announce=announce, resume=resume,
                          progress=progress, secret=secret)
        result = run(peer.run())
        write_result(result, cfg.run.out_dir)
        return result
    finally:
        discovery.close()
