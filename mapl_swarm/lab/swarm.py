"""Run the compose topology (a DHT host + one host per stage) inside a :class:`NetnsLab`.

Every peer runs the same ``mapl-swarm dht`` / ``mapl-swarm peer`` commands as ``compose.yaml``,
bound to its namespace's address, with every link shaped by the kernel's tbf. The DHT node and
every peer read the run key ``run.out_dir/run.key`` (created with mode 0600 when missing), by path.
"""

from __future__ import annotations

import logging
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from mapl_swarm.config import TrainConfig
from mapl_swarm.errors import MaplError
from mapl_swarm.lab.netns import NetnsLab
from mapl_swarm.net.runkey import run_dir_key
from mapl_swarm.peer.launch import SwarmSummary, stop_all, summarize

log = logging.getLogger(__name__)

__all__ = ["run_lab_swarm"]


def run_lab_swarm(cfg: TrainConfig, config_args: list[str], *, rate_mbit: float, subnet: int = 77,
                  timeout_s: float = 3600.0, threads: int = 1) -> SwarmSummary:
    """Train ``cfg`` with the DHT and each stage in its own namespace; returns the swarm summary.
    ``config_args`` (the options that produced ``cfg``, with ``--log-level``) go to every peer; the
    DHT child gets the log level."""
    P = cfg.pipeline.num_stages
    hosts = ["dht"] + [f"stage{k}" for k in range(P)]
    key_args = ["--key-file", run_dir_key(cfg.run.out_dir).path]
    procs: list[subprocess.Popen] = []
    with tempfile.TemporaryDirectory() as tmp, NetnsLab(hosts, rate_mbit=rate_mbit, subnet=subnet) as lab:
        maddr_file = str(Path(tmp) / "dht.maddrs")
        base = [sys.executable, "-m", "mapl_swarm"]
        log_args = config_args[config_args.index("--log-level"):][:2] if "--log-level" in config_args else []
        dht = lab.popen("dht", base + ["dht", "--host", lab.address("dht"), "--maddr-file", maddr_file, *key_args,
                                       *log_args])
        procs.append(dht)
        try:
            peers = []
            for k in range(P):
                addr = lab.address(f"stage{k}")
                cmd = base + ["peer", *config_args, "--stage", str(k), "--initial-peers-file", maddr_file,
                              "--set", 'net.bind_host="0.0.0.0"', "--set", f'net.advertise_host="{addr}"',
                              "--set", f'net.dht_host="{addr}"', "--set", f"runtime.threads={threads}", "--quiet",
                              *key_args]
                peers.append(lab.popen(f"stage{k}", cmd))
            procs.extend(peers)
            deadline = time.monotonic() + timeout_s
            while True:
                codes = [p.poll() for p in peers]
                bad = [(k, c) for k, c in enumerate(codes) if c not in (None, 0)]
                if bad:
                    raise MaplError(f"lab stage {bad[0][0]} exited with status {bad[0][1]}")
                if dht.poll() is not None:
                    raise MaplError(f"lab DHT exited with status {dht.returncode}")
                if all(c == 0 for c in codes):
                    break
                if time.monotonic() > deadline:
                    raise MaplError(f"lab swarm did not finish within {timeout_s:g} s")
                time.sleep(0.2)  # supervising child processes
        finally:
            stop_all(procs)
    return summarize(cfg.run.out_dir, P)
