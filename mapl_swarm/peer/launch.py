"""``mapl-swarm launch``: a DHT plus P stage peer processes on this machine.

The launcher starts a DHT node (the bootstrap), then one ``mapl-swarm peer`` process per stage
with the machine's cores split between their torch threads, waits for them, and stops all of
them cleanly (SIGTERM, then SIGKILL after a grace period) on Ctrl-C or as soon as any one fails.
At the end it prints the swarm's loss, tokens/s and measured bytes/token per link.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from mapl_swarm.config import TrainConfig
from mapl_swarm.data import prepare_data
from mapl_swarm.errors import MaplError
from mapl_swarm.net.discovery import Discovery, DiscoveryConfig
from mapl_swarm.pipeline.payload import BACKWARD_KINDS, FORWARD_KINDS, kind_bytes

log = logging.getLogger(__name__)

__all__ = ["launch", "SwarmSummary", "summarize", "stop_all"]

_GRACE_S = 20.0


@dataclass
class SwarmSummary:
    train_losses: list[float]
    report_times_s: list[float]
    """When each step's loss reached stage 1 (seconds since the handshake)."""
    val_history: list[list[float]]
    tokens: int
    wall_s: float
    links: list[dict[str, float]]
    """Per boundary: payload and wire bytes per token forward and backward, by kind."""


def summarize(out_dir: str | Path, num_stages: int) -> SwarmSummary:
    """Combine the peers' result files into swarm-level figures."""
    res = [json.loads((Path(out_dir) / f"peer_stage{s}.json").read_text()) for s in range(num_stages)]
    tokens = max(res[0]["tokens"], 1)
    links = []
    for b in range(num_stages - 1):
        fwd = res[b]["payload_tx"].get(f"stage{b + 1}", {})
        bwd = res[b + 1]["payload_tx"].get(f"stage{b}", {})
        wf = res[b]["wire_tx"].get(f"stage{b + 1}", {})
        wb = res[b + 1]["wire_tx"].get(f"stage{b}", {})
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
    for b, link in enumerate(links):
        link["shaper_forward"] = res[b]["shaper"].get(f"stage{b + 1}", {})
        link["shaper_backward"] = res[b + 1]["shaper"].get(f"stage{b}", {})
    return SwarmSummary(res[0]["train_losses"], res[0]["report_times_s"], res[0]["val_history"], res[0]["tokens"],
                        res[0]["wall_s"], links)


def stop_all(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + _GRACE_S
    for p in procs:
        try:
            p.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            log.warning("peer pid %d did not stop within %.0f s; killing it", p.pid, _GRACE_S)
            p.kill()
            p.wait()


def launch(cfg: TrainConfig, config_args: list[str], *, progress: bool = True,
           timeout_s: float | None = None) -> SwarmSummary:
    """Run the whole swarm locally (each peer gets ``config_args``, the options that produced
    ``cfg`` and the log level); raises MaplError naming the failed stage. The launcher prepares the
    data and runs the DHT bootstrap, and logs those once; its peers log them at DEBUG."""
    P = cfg.pipeline.num_stages
    threads = cfg.runtime.threads or max(1, (os.cpu_count() or 1) // P)
    Path(cfg.run.out_dir).mkdir(parents=True, exist_ok=True)
    for s in range(P):  # results of an earlier run must not be mistaken for this one's
        (Path(cfg.run.out_dir) / f"peer_stage{s}.json").unlink(missing_ok=True)
    prepare_data(cfg.data, progress=progress)  # once, here, rather than raced by every peer
    bootstrap = Discovery(cfg.run.run_id, DiscoveryConfig(host=cfg.net.dht_host, port=cfg.net.dht_port))
    bootstrap.start()
    procs: list[subprocess.Popen] = []
    try:
        maddr = bootstrap.visible_maddrs()[0]
        log.info("DHT bootstrap at %s; starting %d peers with %d torch threads each", maddr, P, threads)
        out = Path(cfg.run.out_dir)
        log.info("metrics: %s (one per stage, appended every step); checkpoints: %s; manifest: %s",
                 out / f"metrics_stage{{0..{P - 1}}}.jsonl", out / "checkpoints", out / "manifest.json")
        base = [sys.executable, "-m", "mapl_swarm", "peer", *config_args]
        for s in range(P):
            cmd = base + ["--stage", str(s), "--initial-peer", maddr, "--set", f"runtime.threads={threads}",
                          "--launched"]
            if s > 0 or not progress:
                cmd.append("--quiet")
            procs.append(subprocess.Popen(cmd))
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            codes = [p.poll() for p in procs]
            failed = [(s, c) for s, c in enumerate(codes) if c not in (None, 0)]
            if failed:
                s, c = failed[0]
                raise MaplError(f"stage {s} peer exited with status {c}; stopped the swarm")
            if all(c == 0 for c in codes):
                break
            if deadline is not None and time.monotonic() > deadline:
                raise MaplError(f"swarm did not finish within {timeout_s:g} s; stopped it")
            time.sleep(0.2)  # supervising child processes, not synchronising tests
    except KeyboardInterrupt:
        raise MaplError("interrupted; stopped every peer") from None
    finally:
        stop_all(procs)
        bootstrap.close()
    return summarize(cfg.run.out_dir, P)
