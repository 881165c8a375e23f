"""Peer start benchmark: how long a ``mapl-swarm peer`` takes from its process start to its bound
socket, and the CPU its own process spent to get there.

    python bench/peer_start.py [--runs 5] [--out bench/results/peer_start.json]

Starts a DHT bootstrap node on 127.0.0.1, then ``--runs`` times stage 0 of a 2-stage tiny config
(the stall benchmark's model; the corpus and token shards are prepared once before, as on any host's
second start), one after another on an otherwise idle machine. The peer is certified:
``issue_local`` issues the run's identities once (stage 0's ``--peer-key`` and ``--cert`` for the
peer, its ``--cert`` for the DHT node), so each start includes loading and checking them. Per run:
seconds from the spawn to the log line ``bound tcp://...`` and the peer process's user + system CPU
seconds at that moment (``/proc/PID/stat``; its DHT child and p2pd not counted). Stage 1 never
comes, so each run is stopped there (SIGKILL of its process group).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

from stall import CONFIG, RUN_ID, Process

ROOT = Path(__file__).resolve().parents[1]


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "peer_start.json")
    args = ap.parse_args()
    from mapl_swarm.net.identity import issue_local

    with tempfile.TemporaryDirectory(prefix="mapl-start-") as tmp:
        local = issue_local(Path(tmp) / "identities", run_id=RUN_ID, num_stages=2)
        config = Path(tmp) / "start.toml"
        config.write_text(CONFIG.format(cache=Path(tmp) / "cache", out=Path(tmp) / "out")
                          .replace("num_stages = 3", "num_stages = 2"))
        prepared = Process("prepare", "--config", str(config))
        if prepared.proc.wait(600) != 0:
            raise RuntimeError("prepare failed:\n" + "\n".join(prepared.lines[-20:]))
        dht = Process("dht", "--host", "127.0.0.1", "--cert", str(local.cert_file(0)))
        runs = []
        try:
            maddr = dht.wait_for(r"--initial-peer (\S+)", 60).group(1)
            for i in range(args.runs):
                started = time.monotonic()
                peer = Process("peer", "--config", str(config), "--stage", "0", "--initial-peer", maddr,
                               *local.args(0), "--quiet")
                try:
                    peer.wait_for(r"bound tcp://", 120)
                    bound_s = time.monotonic() - started
                    runs.append({"bound_s": round(bound_s, 2), "cpu_s": round(cpu_s(peer.proc.pid), 2)})
                finally:
                    peer.stop()
                print(f"run {i + 1}: bound after {runs[-1]['bound_s']:.2f} s, {runs[-1]['cpu_s']:.2f} CPU s",
                      flush=True)
        finally:
            dht.stop()
    bound, cpu = [r["bound_s"] for r in runs], [r["cpu_s"] for r in runs]
    result = {"runs": runs, "median_bound_s": statistics.median(bound), "median_cpu_s": statistics.median(cpu),
              "machine": f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}",
              "date": time.strftime("%Y-%m-%d")}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print(f"{args.runs} starts: bound after {min(bound):.2f}-{max(bound):.2f} s (median "
          f"{result['median_bound_s']:.2f} s), peer process CPU median {result['median_cpu_s']:.2f} s; {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
