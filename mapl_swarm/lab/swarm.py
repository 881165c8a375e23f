"""Run the compose topology (a DHT host + one host per stage, or per replica of a stage) inside a
:class:`NetnsLab`.

Every peer runs the same ``mapl-swarm dht`` / ``mapl-swarm peer`` commands as ``compose.yaml``,
bound to its namespace's address, with every link shaped by the kernel's tbf (a replica's too, and
with it its stage's averaging traffic: hivemind's connections leave through the same interface).
The lab issues the identities as ``launch`` does (:func:`~mapl_swarm.launch.local_identities`): each peer gets its own
key and a certificate for its stage, and the DHT node any certificate of the run (its authority).
The data is prepared once, first. The peers are supervised as ``launch`` supervises its own
(:func:`~mapl_swarm.launch.supervise`): Ctrl-C drains them, and one that dies is started again
with ``--resume`` in its namespace (at most ``max_restarts`` times per stage) while the others wait
for it; the DHT node exiting stops the run. Hosts named in ``nat`` (``stage1``, ``stage2r1``: a
replica's host is its stage's with ``r<index>``) sit behind NAT (:class:`NetnsLab`) and run with
``net.reachable = "no"``; with ``relay`` a ``mapl-swarm relay`` runs on the DHT's host (port
:data:`RELAY_PORT`) and they use it (``net.relay``).
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Sequence

from mapl_swarm.config import TrainConfig
from mapl_swarm.data import prepare_data
from mapl_swarm.errors import ConfigError
from mapl_swarm.lab.netns import NetnsLab
from mapl_swarm.net.identity import create_peer_key
from mapl_swarm.launch import (PeerProcess, RestartPolicy, Supervisor, SwarmSummary, local_identities, replica_counts,
                               replica_out_dir, restarts_allowed, revocation_args, supervise)
from mapl_swarm.procs import die_with_parent

log = logging.getLogger(__name__)

__all__ = ["run_lab_swarm"]

_DHT_GRACE_S = 30.0
RELAY_PORT = 7400


def run_lab_swarm(cfg: TrainConfig, config_args: list[str], *, rate_mbit: float, subnet: int = 77,
                  timeout_s: float = 3600.0, threads: int = 1, max_restarts: int = 3,
                  revocations: str | os.PathLike[str] | None = None, nat: Sequence[str] = (),
                  relay: bool = False) -> SwarmSummary:
    """Train ``cfg`` with the DHT and each stage in its own namespace; returns the swarm summary
    (or, after Ctrl-C, the drained one with its ``end_note``). ``config_args`` (the options that
    produced ``cfg``, with ``--log-level``) go to every peer; the DHT child gets the log level.
    ``revocations``: the authority's revocation list, read and watched by every peer."""
    P = cfg.pipeline.num_stages
    counts = replica_counts(cfg)
    policy = RestartPolicy(restarts_allowed(cfg, max_restarts))  # before any work: a bad --max-restarts answers at once
    layout = [(k, r) for k in range(P) for r in range(counts[k])]  # a host (a namespace, its own links) each
    names = {(k, r): f"stage{k}" + (f"r{r}" if r else "") for k, r in layout}
    hosts = ["dht"] + [names[kr] for kr in layout]
    unknown = sorted(set(nat) - set(hosts[1:]))
    if unknown:
        raise ConfigError(f"--nat names no peer host of this lab: {', '.join(unknown)} (its hosts: "
                          f"{', '.join(hosts[1:])})")
    local = local_identities(cfg)
    revoked = revocation_args(revocations, local, cfg.run.run_id)
    for k, r in layout:  # results of an earlier run must not be mistaken for this one's
        (replica_out_dir(cfg.run.out_dir, r) / f"peer_stage{k}.json").unlink(missing_ok=True)
    prepare_data(cfg.data, progress=False)  # once, here, rather than raced by every peer
    with tempfile.TemporaryDirectory() as tmp, NetnsLab(hosts, rate_mbit=rate_mbit, subnet=subnet,
                                                                   nat=nat) as lab:
        maddr_file = str(Path(tmp) / "dht.maddrs")
        base = [sys.executable, "-m", "mapl_swarm"]
        log_args = config_args[config_args.index("--log-level"):][:2] if "--log-level" in config_args else []
        # a process group of its own, as every peer's: a terminal's Ctrl-C reaches the lab, which drains the peers
        dht = lab.popen("dht", base + ["dht", "--host", lab.address("dht"), "--maddr-file", maddr_file,
                                       "--cert", str(local.cert_file(0)),
                                       *log_args], preexec_fn=die_with_parent(), process_group=0)
        relay_key = Path(tmp) / "relay.key"
        relay_public = create_peer_key(relay_key).curve_public if relay else b""
        relay_proc = lab.popen("dht", base + ["relay", "--host", lab.address("dht"), "--port", str(RELAY_PORT),
                                              "--relay-key", str(relay_key), "--cert", str(local.cert_file(0)),
                                              *log_args], preexec_fn=die_with_parent(), process_group=0) \
            if relay else None
        relayed = ["--set", f'net.relay="{lab.address("dht")}:{RELAY_PORT}#{relay_public.hex()}"'] \
            if relay else []
        try:
            peers = []
            for k, r in layout:
                addr = lab.address(names[k, r])
                cmd = base + ["peer", *config_args, "--stage", str(k), "--initial-peers-file", maddr_file,
                              "--set", 'net.bind_host="0.0.0.0"', "--set", f'net.advertise_host="{addr}"',
                              "--set", f'net.dht_host="{addr}"', "--set", f"runtime.threads={threads}", "--quiet",
                              *(["--set", 'net.reachable="no"', *relayed] if lab.behind_nat(names[k, r]) else []),
                              "--launched", *local.args(k, r), *revoked,
                              *(["--set", f"run.out_dir={json.dumps(str(replica_out_dir(cfg.run.out_dir, r)))}"]
                                if r else [])]
                peers.append(PeerProcess(k, lab.command(names[k, r], cmd), dict(os.environ), None, r))
            essential = {"the lab's DHT node": dht, **({"the lab's relay": relay_proc} if relay_proc else {})}
            return supervise(cfg, Supervisor(policy, essential, rejoins=max_restarts), peers, timeout_s,
                             command="lab")
        finally:
            if relay_proc is not None:
                relay_proc.terminate()
                relay_proc.wait(_DHT_GRACE_S)
            dht.terminate()  # once: its normal end (a second SIGTERM, as stop_all sends, cuts its close short)
            try:
                dht.wait(_DHT_GRACE_S)
            except subprocess.TimeoutExpired:
                log.warning("the lab's DHT node did not stop within %.0f s; killing it", _DHT_GRACE_S)
                dht.kill()
                dht.wait()

