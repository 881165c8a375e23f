"""NAT benchmark in the namespace lab: the same chain with every host reachable, with one stage behind
NAT (a dial-out peer), and with two neighbouring stages behind NAT linked through a relay, every
host behind its own kernel-shaped (tbf) link at the same rate.

    sudo python bench/nat_lab.py [--rate-mbit 10] [--steps 4] [--stages 4] [--micro-batches 16]
                                 [--codec none] [--out bench/results/nat_lab.json]

Each row runs ``mapl-swarm lab`` (:func:`~mapl_swarm.lab.swarm.run_lab_swarm`) on the swarm of
``bench/replica_lab.py`` (tiny preset, T=128, micro-batches of 4, 1 torch thread per peer) and
records the steady-state tokens/s (steps 2..N, from stage 0's REPORT times), the train losses
(every row trains the same model) and the bytes the relay carried. The relay runs on the DHT's
host, a host of its own behind its own shaped link, so a relayed link crosses two of them.
Writes the JSON to ``--out`` and prints a Markdown table. Root, namespaces and iptables needed.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

from replica_lab import CONFIG  # noqa: E402 - the same swarm as the replica benchmark

ROWS = [("direct", [], False), ("stage 1 behind NAT", ["stage1"], False),
        ("stages 1 and 2 behind NAT, relayed", ["stage1", "stage2"], True)]


def run_one(args: argparse.Namespace, name: str, nat: list[str], relay: bool, work: Path, subnet: int) -> dict:
    from mapl_swarm.config import load_config
    from mapl_swarm.lab.swarm import run_lab_swarm

    path = work / f"nat{subnet}.toml"
    path.write_text(CONFIG.format(codec=args.codec, cache=work / "cache", steps=args.steps, out=work / f"run{subnet}",
                                  replicas=1, scheme=f"nat{subnet}", stages=args.stages, micro=args.micro_batches))
    cfg = load_config(path)
    t0 = time.perf_counter()
    s = run_lab_swarm(cfg, ["--config", str(path), "--log-level", "WARNING"], rate_mbit=args.rate_mbit,
                      subnet=subnet, timeout_s=args.timeout_s, threads=1, max_restarts=0, nat=nat, relay=relay)
    times = s.report_times_s
    steady = (cfg.tokens_per_step * (len(times) - 1) / (times[-1] - times[0])) if len(times) > 1 else float("nan")
    return {"row": name, "nat": nat, "relay": relay, "steps": len(s.train_losses), "tokens_per_s": steady,
            "wall_s": time.perf_counter() - t0, "report_times_s": times, "train_losses": s.train_losses,
            "links": s.links}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rate-mbit", type=float, default=10.0)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--stages", type=int, default=4)
    p.add_argument("--micro-batches", type=int, default=16)
    p.add_argument("--codec", default="none")
    p.add_argument("--timeout-s", type=float, default=3000.0)
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "nat_lab.json")
    args = p.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for i, (name, nat, relay) in enumerate(ROWS):
            rows.append(run_one(args, name, nat, relay, Path(tmp), subnet=90 + i))
            print(f"{name}: {rows[-1]['tokens_per_s']:.0f} tokens/s", flush=True)
    commit = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=ROOT, capture_output=True,
                            text=True).stdout.strip()
    import torch

    result = {"command": " ".join(["python", *sys.argv]), "date": time.strftime("%Y-%m-%d"), "commit": commit,
              "machine": f"{platform.machine()} {platform.system()} {platform.release()}, "
                         f"{os.cpu_count()} cores, torch {torch.__version__}",
              "rate_mbit": args.rate_mbit, "codec": args.codec, "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    base = rows[0]["tokens_per_s"]
    print("| hosts | tokens/s (steps 2..N) | vs direct | train loss, last step |")
    print("|---|---|---|---|")
    for r in rows:
        print(f"| {r['row']} | {r['tokens_per_s']:,.0f} | {r['tokens_per_s'] / base:.2f}x | "
              f"{r['train_losses'][-1]:.4f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
