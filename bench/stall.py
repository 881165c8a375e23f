"""Stall benchmark: the middle stage of a 3-stage swarm is stopped (SIGSTOP) for ``--stall-s`` seconds,
then goes on (SIGCONT); how long until the swarm trains again, and what each stage logged.

    python bench/stall.py [--runs 5] [--stall-s 30] [--out bench/results/stall.json]

Each run starts a DHT bootstrap node and three ``mapl-swarm peer`` processes on 127.0.0.1 (a tiny
model, live rejoin on, checkpoints every 2 steps, the default liveness and ZeroMQ heartbeat
settings; certified: ``issue_local`` issues each stage its ``--peer-key`` and ``--cert`` once, the
DHT node gets stage 0's ``--cert``), waits for 6 training steps, stops stage 1 for the stall, and
measures from its SIGCONT until stage 0 logs that training goes on at run epoch 1 (``agreeing ->
training ... (run epoch 1)``). A stall longer than ZeroMQ's heartbeat timeout (3 x
``net.zmq_heartbeat_s`` = 15 s) drops every connection of stage 1, so this is the time to re-form on
new connections. Per stage it counts the WARN lines and the dropped-message lines. Writes every run
to ``--out`` and prints a table; exit status 1 when a run did not finish with every peer at status
0.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from mapl_swarm.net.identity import LocalIdentities

ROOT = Path(__file__).resolve().parents[1]
RUN_ID = "stall"
"""The run id of :data:`CONFIG` (the certificates name it)."""

CONFIG = f"""
preset = "tiny"
[model]
vocab_size = 512
hidden_size = 64
num_layers = 4
num_heads = 4
ffn_hidden_size = 128
context_length = 32
[data]
vocab_size = 512
max_corpus_bytes = 400000
val_fraction = 0.2
cache_dir = "{{cache}}"
[run]
steps = 40
out_dir = "{{out}}"
run_id = "{RUN_ID}"
[pipeline]
num_stages = 3
micro_batch_size = 2
num_micro_batches = 3
[net]
timeout_s = 60
rejoin_timeout_s = 120
hello_retry_s = 2
[checkpoint]
interval_steps = 2
"""


class Process:
    """A ``mapl-swarm`` subprocess whose output lines are collected by a thread."""

    def __init__(self, *args: str) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", "mapl_swarm", *args], stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True, start_new_session=True)
        self.lines: list[str] = []
        self._cond = threading.Condition()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            with self._cond:
                self.lines.append(line.rstrip("\n"))
                self._cond.notify_all()

    def wait_for(self, pattern: str, timeout_s: float) -> re.Match:
        rx = re.compile(pattern)
        with self._cond:
            self._cond.wait_for(lambda: any(rx.search(line) for line in self.lines) or self.proc.poll() is not None,
                                timeout_s)
            for line in self.lines:
                if m := rx.search(line):
                    return m
        raise RuntimeError(f"no {pattern!r} within {timeout_s} s:\n" + "\n".join(self.lines[-40:]))

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()


def steps_done(out: Path) -> int:
    path = out / "metrics_stage0.jsonl"
    return sum('"loss"' in line for line in path.read_text().splitlines()) if path.exists() else 0


def one_run(work: Path, local: LocalIdentities, stall_s: float) -> dict:
    out = work / "out"
    config = work / "stall.toml"
    config.write_text(CONFIG.format(cache=work.parent / "cache", out=out))
    dht = Process("dht", "--host", "127.0.0.1", "--cert", str(local.cert_file(0)))
    peers: list[Process] = []
    try:
        maddr = dht.wait_for(r"--initial-peer (\S+)", 60).group(1)
        peers = [Process("peer", "--config", str(config), "--stage", str(s), "--initial-peer", maddr,
                         *local.args(s), "--quiet") for s in range(3)]
        deadline = time.monotonic() + 300
        while steps_done(out) < 6:
            if time.monotonic() > deadline or any(p.proc.poll() is not None for p in peers):
                raise RuntimeError("the swarm did not reach 6 steps:\n" + "\n".join(peers[0].lines[-40:]))
            time.sleep(0.2)
        os.kill(peers[1].proc.pid, signal.SIGSTOP)
        time.sleep(stall_s)  # the stall itself
        woke = time.monotonic()
        os.kill(peers[1].proc.pid, signal.SIGCONT)
        peers[0].wait_for(r"agreeing -> training: from step \d+ \(run epoch 1\)", 300)
        resumed_s = time.monotonic() - woke
        codes = [p.proc.wait(300) for p in peers]
    finally:
        for p in [*peers, dht]:
            p.stop()
    return {"resumed_after_sigcont_s": round(resumed_s, 2), "exit_codes": codes,
            "warnings": [sum(" WARN " in line for line in p.lines) for p in peers],
            "dropped_lines": [sum("dropped a message" in line for line in p.lines) for p in peers],
            "logs": ["\n".join(p.lines) for p in peers]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--stall-s", type=float, default=30.0)
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "stall.json")
    args = ap.parse_args()
    from mapl_swarm.net.identity import issue_local

    with tempfile.TemporaryDirectory(prefix="mapl-stall-") as tmp:
        local = issue_local(Path(tmp) / "identities", run_id=RUN_ID, num_stages=3)
        runs = []
        for i in range(args.runs):
            work = Path(tmp) / f"run{i}"
            work.mkdir()
            runs.append(one_run(work, local, args.stall_s))
            r = runs[-1]
            print(f"run {i + 1}: training went on {r['resumed_after_sigcont_s']:.1f} s after SIGCONT; exit "
                  f"{r['exit_codes']}; WARN lines per stage {r['warnings']}, dropped-message lines "
                  f"{r['dropped_lines']}", flush=True)
    times = sorted(r["resumed_after_sigcont_s"] for r in runs)
    result = {"stall_s": args.stall_s, "runs": runs, "resumed_after_sigcont_s": times,
              "machine": f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}",
              "date": time.strftime("%Y-%m-%d")}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print(f"{args.runs} runs, stall {args.stall_s:g} s: training went on {times[0]:.1f}-{times[-1]:.1f} s after "
          f"SIGCONT (median {times[len(times) // 2]:.1f} s); results in {args.out}")
    return 0 if all(r["exit_codes"] == [0, 0, 0] for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
