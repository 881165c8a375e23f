"""Replica benchmark in the namespace lab: the same swarm with 1 and with 2 peers per stage, every
peer in its own network namespace behind its own kernel-shaped (tbf) link, so the replicas'
averaging traffic is shaped like the pipeline's.

    sudo python bench/replica_lab.py [--rate-mbit 20] [--steps 4] [--stages 4] [--micro-batches 16]
                                     [--codec none] [--replicas 1,2] [--averaging fp32,powersgd]
                                     [--averaging-rank 4] [--liveness-floor-s 0]
                                     [--out bench/results/replica_lab.json]

Per replica count it runs ``mapl-swarm lab`` (:func:`~mapl_swarm.lab.swarm.run_lab_swarm`, tiny
preset, T=128, micro-batches of 4, 1 torch thread per peer) and, for replica counts above 1, once
per ``replicas.averaging`` scheme of ``--averaging`` (in the same session), records:

- steady-state tokens/s: tokens of steps 2..N over the time between the first and the last step's
  REPORT at stage 0 (the first step holds the start-up and the first averaging rounds);
- the averaging bytes per step (every replica's all-reduce, sent) and their share of all bytes the
  peers sent (:attr:`~mapl_swarm.launch.SwarmSummary.averaging`);
- the train losses (2 replicas over the same global batch train the same model);
- with ``--kill-after-steps K`` (replica counts > 1): replica 1 of stage 1 is killed (SIGKILL)
  ``--kill-delay-s`` seconds after stage 0 recorded K steps, and the run records the seconds from
  that death to the first step stage 0 records after it and the length of the step that held the
  death, beside the steps' median length before and after it and the peers' liveness deadline
  (the floor, and the two heartbeat intervals after which a neighbour whose connection ended is
  lost: a killed process's; the bound: deadline plus one step). The swarm goes on without it.

Writes the JSON to ``--out`` and prints a Markdown table. Root and network namespaces needed.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

CONFIG = """\
preset = "tiny"

[compression]
codec = "{codec}"
rank = 64
anchor_rank = 64

[data]
source = "stdlib"
vocab_size = 8192
cache_dir = "{cache}"

[run]
steps = {steps}
out_dir = "{out}"
run_id = "bench-replica-lab-{replicas}-{scheme}"

[pipeline]
num_stages = {stages}
micro_batch_size = 4
num_micro_batches = {micro}

[eval]
interval_steps = 0
batches = 1

[checkpoint]
interval_steps = 0

[net]
timeout_s = 600.0
"""


def step_times(metrics: Path) -> list[float]:
    """Wall-clock times of the train losses stage 0 recorded in ``metrics`` (JSONL) so far."""
    if not metrics.exists():
        return []
    records = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    return [r["time"] for r in records if "loss" in r]


def kill_replica(metrics: Path, after_steps: int, delay_s: float, killed: dict) -> None:
    """Once stage 0 recorded ``after_steps`` steps and ``delay_s`` more seconds passed: SIGKILL to
    replica 1 of stage 1 (its ``peer`` process, in its namespace); ``killed["time"]``: when."""
    while len(step_times(metrics)) < after_steps:
        time.sleep(0.5)  # a benchmark watching files, not a test synchronising
    time.sleep(delay_s)
    found = subprocess.run(["pgrep", "-f", "mapl_swarm peer .*--stage 1 .*replica1"], capture_output=True,
                           text=True).stdout.split()
    for pid in found:
        os.kill(int(pid), signal.SIGKILL)
    killed.update(time=time.time(), pids=found)


def scheme_settings(scheme: str, rank: int) -> str:
    """The ``[replicas]`` lines of an ``--averaging`` entry: ``SCHEME[:PARAMETER][/updates]``
    (``powersgd:8``: rank 8, else ``--averaging-rank``; ``topk:0.04``: that fraction, else the
    default; ``/updates``: ``averaged = "updates"``)."""
    spec, _, carried = scheme.partition("/")
    name, _, parameter = spec.partition(":")
    rank = int(parameter) if name == "powersgd" and parameter else rank
    lines = [f'averaging = "{name}"', f"averaging_rank = {rank}"]
    if name == "topk" and parameter:
        lines.append(f"topk_fraction = {float(parameter)}")
    if carried:
        lines.append(f'averaged = "{carried}"')
    return "\n".join(lines) + "\n"


def run_one(args: argparse.Namespace, replicas: int, work: Path, subnet: int, scheme: str = "fp32") -> dict:
    from mapl_swarm.config import load_config
    from mapl_swarm.lab.swarm import run_lab_swarm

    name = scheme.replace(":", "-").replace("/", "-")
    path = work / f"r{replicas}-{name}.toml"
    text = CONFIG.format(codec=args.codec, cache=work / "cache", steps=args.steps, out=work / f"run{replicas}-{name}",
                         replicas=replicas, scheme=name.replace(".", "-"), stages=args.stages,
                         micro=args.micro_batches)
    if replicas > 1:
        text += f"\n[replicas]\nenabled = true\ninitial = {[replicas] * args.stages}\nmatchmaking_s = 1.0\n"
        text += f"averaging_timeout_s = 600.0\n{scheme_settings(scheme, args.averaging_rank)}"
    if args.liveness_floor_s:
        text = text.replace("[net]\n", f"[net]\nliveness_floor_s = {args.liveness_floor_s}\n")
    path.write_text(text)
    cfg = load_config(path)
    killed: dict = {}
    if args.kill_after_steps and replicas > 1:
        threading.Thread(target=kill_replica, args=(Path(cfg.run.out_dir) / "metrics_stage0.jsonl",
                                                    args.kill_after_steps, args.kill_delay_s, killed),
                         daemon=True).start()
    t0 = time.perf_counter()
    s = run_lab_swarm(cfg, ["--config", str(path), "--log-level", "WARNING"], rate_mbit=args.rate_mbit,
                      subnet=subnet, timeout_s=args.timeout_s, threads=1, max_restarts=0)
    wall = time.perf_counter() - t0
    times = s.report_times_s
    steady = (cfg.tokens_per_step * (len(times) - 1) / (times[-1] - times[0])) if len(times) > 1 else float("nan")
    death = {}
    if killed:
        walls = step_times(Path(cfg.run.out_dir) / "metrics_stage0.jsonl")
        steps = list(zip(walls, walls[1:]))
        before = [b - a for a, b in steps if b < killed["time"]]
        held = [b - a for a, b in steps if a < killed["time"] < b]
        later = [b - a for a, b in steps if a > killed["time"]]
        after = [t for t in walls if t > killed["time"]]
        death = {"killed_after_steps": args.kill_after_steps, "kill_delay_s": args.kill_delay_s,
                 "death_to_next_step_s": after[0] - killed["time"] if after else None,
                 "step_s_before": sorted(before)[len(before) // 2] if before else None,
                 "death_step_s": held[0] if held else None,
                 "step_s_after": sorted(later)[len(later) // 2] if later else None,
                 "liveness_deadline_s": cfg.net.liveness_floor_s,
                 "connection_grace_s": 2 * cfg.net.heartbeat_interval_s,
                 "step_walls": walls, "kill_wall": killed["time"]}
    return {"replicas": replicas, "averaging": scheme if replicas > 1 else "-", "peers": replicas * args.stages,
            "steps": len(s.train_losses),
            "tokens_per_step": cfg.tokens_per_step, "tokens_per_s": steady, "wall_s": wall,
            "report_times_s": times, "train_losses": s.train_losses,
            "averaging_bytes_per_step": s.averaging.get("bytes_per_step", 0.0),
            "averaging_share": s.averaging.get("share", 0.0),
            "links": s.links, "death": death}


def table(rows: list[dict]) -> str:
    base = rows[0]["tokens_per_s"]
    out = ["| replicas per stage | averaging | peers | tokens/step | tokens/s (steps 2..N) | vs 1 replica "
           "| averaging MB/step | averaging share of bytes sent | last train loss |",
           "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        out.append(f"| {r['replicas']} | {r['averaging']} | {r['peers']} | {r['tokens_per_step']:,} | "
                   f"{r['tokens_per_s']:.0f} | "
                   f"{r['tokens_per_s'] / base:.2f}x | {r['averaging_bytes_per_step'] / 1e6:.2f} | "
                   f"{100 * r['averaging_share']:.1f}% | {r['train_losses'][-1]:.4f} |")
    return "\n".join(out)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rate-mbit", type=float, default=20.0)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--stages", type=int, default=4)
    p.add_argument("--micro-batches", type=int, default=16)
    p.add_argument("--codec", default="none")
    p.add_argument("--replicas", default="1,2")
    p.add_argument("--averaging", default="fp32", help="replicas.averaging schemes to run (replica counts > 1), "
                   "each SCHEME[:PARAMETER][/updates], e.g. topk:0.04/updates")
    p.add_argument("--averaging-rank", type=int, default=4)
    p.add_argument("--timeout-s", type=float, default=3000.0)
    p.add_argument("--liveness-floor-s", type=float, default=0.0,
                   help="net.liveness_floor_s of every peer (0: the default): on a slow FIFO link a neighbour's "
                        "heartbeats can starve behind bulk flows for longer than the default floor")
    p.add_argument("--kill-after-steps", type=int, default=0)
    p.add_argument("--kill-delay-s", type=float, default=5.0)
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "replica_lab.json")
    args = p.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        runs = [(n, scheme) for n in (int(x) for x in args.replicas.split(","))
                for scheme in (args.averaging.split(",") if n > 1 else ["fp32"])]
        for i, (n, scheme) in enumerate(runs):
            rows.append(run_one(args, n, Path(tmp), subnet=78 + i, scheme=scheme))
            print(f"{n} replica(s) per stage ({scheme if n > 1 else 'alone'}): {rows[-1]['tokens_per_s']:.0f} "
                  f"tokens/s", flush=True)
    commit = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=ROOT, capture_output=True,
                            text=True).stdout.strip()
    import torch

    result = {"command": " ".join(["python", *sys.argv]), "date": time.strftime("%Y-%m-%d"), "commit": commit,
              "machine": f"{platform.machine()} {platform.system()} {platform.release()}, "
                         f"{os.cpu_count()} cores, torch {torch.__version__}",
              "rate_mbit": args.rate_mbit, "codec": args.codec, "averaging_rank": args.averaging_rank, "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(table(rows))
    for r in rows:
        if r["death"]:
            d = r["death"]
            def s_(x: float | None) -> str:
                return "-" if x is None else f"{x:.1f} s"

            print(f"{r['replicas']} replicas: a stage-1 replica killed {d['kill_delay_s']:g} s after step "
                  f"{d['killed_after_steps']}: next step {s_(d['death_to_next_step_s'])} after its death; the step "
                  f"that held it took {s_(d['death_step_s'])}; steps took {s_(d['step_s_before'])} before it and "
                  f"{s_(d['step_s_after'])} after it; liveness deadline {d['liveness_deadline_s']:g} s, "
                  f"{d['connection_grace_s']:g} s for a connection that ended (the bound: deadline plus one step)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
