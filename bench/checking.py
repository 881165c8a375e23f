"""Replicas that check each other's work: what checking costs, and how fast it finds a dishonest replica.

    python bench/checking.py [--steps 200] [--fractions 0,0.05,0.2] [--attacks=-10,sign,noise,bias]
                             [--attack-fraction 0.2] [--out bench/results/checking.json]

A 3-stage ``mapl`` swarm of real processes (the slow tests' ``ReplicaSwarm``: tiny model, M = 6,
uniform routing, certified peers, one torch thread each) with three replicas of stage 1 and
``replicas.aggregation = "trimmed_mean"`` trains ``--steps`` steps:

- honest, at each ``replicas.check_fraction`` of ``--fractions``: tokens/s (stage 0's, steps 10 to
  the end), bytes per step (pipeline, averaging, inputs handed to checkers) and the checkers'
  compute (micro-batches recomputed per micro-batch trained, seconds);
- with replica 2 of stage 1 dishonest (``bench/dishonest_replica.py``: each attack of
  ``--attacks``) at ``--attack-fraction``: the step whose round excluded it, and the final and
  last-20 mean loss against the honest run at that fraction;
- honest at ``--attack-fraction`` with replica 2 on another CPU kernel (``ATEN_CPU_CAPABILITY=
  default``): who was excluded (nobody should be).

Printed and written with the command, machine, date and duration; each run is a process of its own.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests" / "integration"), str(ROOT / "tests"), str(ROOT)]

EXCLUDED = re.compile(r"is excluded in the round of step (\d+): (\d) of the round's \d replicas found its gradient "
                      r"share of step (\d+)")


def _run(tmp: Path, name: str, steps: int, fraction: float, attack: str | None, kernel: str | None) -> dict:
    """One swarm run; what it measured."""
    from swarm_helpers import ReplicaSwarm, Watched

    from mapl_swarm.launch import replica_out_dir

    (tmp / name).mkdir()
    with ReplicaSwarm(tmp / name, f"check-{name}"[:40], steps=steps, identities=[1, 3, 1], initial=(1, 3, 1)) as swarm:
        args = ("--set", f"replicas.check_fraction={fraction}", "--set", 'replicas.aggregation="trimmed_mean"',
                "--set", "runtime.threads=1")
        for key in ((0, 0), (1, 0), (1, 1), (2, 0)):
            swarm.start(*key, *args)
        if attack is not None:
            peer = ["peer", "--config", str(swarm.path), "--stage", "1", "--initial-peer", swarm.maddr,
                    *swarm.local.args(1, 2), *args,
                    "--set", f"run.out_dir={json.dumps(str(replica_out_dir(swarm.out, 2)))}"]
            swarm.procs[1, 2] = Watched([sys.executable, str(ROOT / "bench" / "dishonest_replica.py"), attack, *peer])
        else:
            swarm.start(1, 2, *args, env=dict(os.environ, ATEN_CPU_CAPABILITY=kernel) if kernel else None)
        honest = [key for key in swarm.procs if key != (1, 2) or attack is None]
        codes = {f"{s}.{r}": swarm.procs[s, r].wait(3 * 3600) for s, r in honest}
        if attack is not None:
            swarm.procs[1, 2].stop()
        if any(codes.values()):
            raise SystemExit(f"{name}: a peer failed: {codes}\n" + "\n".join(
                f"--- peer {key}:\n{p.output[-2000:]}" for key, p in swarm.procs.items()))
        first = swarm.result(0, 0)
        losses, times = first["train_losses"], first["report_times_s"]
        results = {key: swarm.result(*key) for key in honest}
        wire = sum(n for r in results.values() for kinds in r["wire_tx"].values() for n in kinds.values())
        averaged = sum(r.get("averaging", {}).get("sent_bytes", 0) for r in results.values())
        checking = [results[1, r].get("checking", {}) for r in range(3) if (1, r) in results]
        excluded = [m.groups() for key in ((1, 0), (1, 1)) if (m := EXCLUDED.search(swarm.procs[key].output))]
        tokens_per_step = first["tokens"] / max(len(losses), 1)
        start = min(10, len(times) - 2)
        return {
            "losses": losses, "tokens_per_s": tokens_per_step * (len(times) - 1 - start) / (times[-1] - times[start]),
            "bytes_per_step": {"pipeline": wire / steps, "averaging": averaged / steps,
                               "check_inputs": sum(c.get("served_input_bytes", 0) for c in checking) / steps},
            "recomputed_per_trained": sum(c.get("micro_batches_recomputed", 0) for c in checking)
            / (steps * swarm.cfg.pipeline.num_micro_batches),
            "check_s": sum(c.get("check_s", 0.0) for c in checking),
            "shares_checked": sum(c.get("shares_checked", 0) for c in checking),
            "shares_wrong": sum(c.get("shares_wrong", 0) for c in checking),
            "largest_ok_difference": max((c.get("largest_ok_difference", 0.0) for c in checking), default=0.0),
            "excluded": [{"round_step": int(a), "accusers": int(b), "share_step": int(c)} for a, b, c in excluded],
        }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--fractions", default="0,0.05,0.2")
    ap.add_argument("--attacks", default="-10,sign,noise,bias")
    ap.add_argument("--attack-fraction", type=float, default=0.2)
    ap.add_argument("--kernel", default="default",
                    help="ATEN_CPU_CAPABILITY of replica 2 in the mixed-kernel run (empty: no such run)")
    ap.add_argument("--out", type=Path, default=ROOT / "bench/results/checking.json")
    ap.add_argument("--keep", help="with --one: run in this folder and keep its peers' logs")
    ap.add_argument("--one", help=argparse.SUPPRESS)  # NAME FRACTION ATTACK|- KERNEL|-: one run, to --out
    args = ap.parse_args()
    if args.one:
        name, fraction, attack, kernel = args.one.split(" ")
        with tempfile.TemporaryDirectory() as tmp_name:
            folder = Path(args.keep or tmp_name)
            folder.mkdir(parents=True, exist_ok=True)
            got = _run(folder, name, args.steps, float(fraction), None if attack == "-" else attack,
                       None if kernel == "-" else kernel)
        args.out.write_text(json.dumps(got))
        return 0
    t0 = time.time()
    plan = [(f"honest-{f}", f, "-", "-") for f in args.fractions.split(",")]
    plan += [(f"attack{a}", str(args.attack_fraction), a, "-") for a in args.attacks.split(",") if a]
    plan += [(f"mixed-{args.kernel}", str(args.attack_fraction), "-", args.kernel)] if args.kernel else []
    runs: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp_name:
        for name, fraction, attack, kernel in plan:
            out = Path(tmp_name) / f"{name}.json"
            subprocess.run([sys.executable, __file__, "--one", f"{name} {fraction} {attack} {kernel}", "--steps",
                            str(args.steps), "--out", str(out)], check=True)
            runs[name] = json.loads(out.read_text())
            r = runs[name]
            print(f"{name}: {len(r['losses'])} steps, {r['tokens_per_s']:.0f} tok/s, bytes/step "
                  f"{ {k: round(v) for k, v in r['bytes_per_step'].items()} }, excluded {r['excluded']} "
                  f"({time.time() - t0:.0f} s so far)", flush=True)
    ref = runs.get(f"honest-{args.attack_fraction:g}") or runs.get(f"honest-{args.attack_fraction}")

    def last20(losses: list[float]) -> float:
        return sum(losses[-20:]) / len(losses[-20:])

    off = runs[f"honest-{args.fractions.split(',')[0]}"]
    summary = {
        "overhead": {name: {"tokens_per_s": r["tokens_per_s"], "vs_off": r["tokens_per_s"] / off["tokens_per_s"],
                            "bytes_per_step": r["bytes_per_step"],
                            "bytes_vs_off": sum(r["bytes_per_step"].values()) / sum(off["bytes_per_step"].values()),
                            "recomputed_per_trained": r["recomputed_per_trained"], "check_s": r["check_s"],
                            "excluded": r["excluded"]}
                     for name, r in runs.items() if name.startswith("honest")},
        "attacks": {} if ref is None else {name: {"excluded": r["excluded"], "final_loss": r["losses"][-1],
                           "final_vs_honest_pct": 100 * (r["losses"][-1] - ref["losses"][-1]) / ref["losses"][-1],
                           "last20_vs_honest_pct": 100 * (last20(r["losses"]) - last20(ref["losses"]))
                           / last20(ref["losses"])}
                    for name, r in runs.items() if name.startswith("attack")},
        "mixed_kernels": {name: {"excluded": r["excluded"], "shares_checked": r["shares_checked"],
                                 "shares_wrong": r["shares_wrong"],
                                 "largest_ok_difference": r.get("largest_ok_difference")}
                          for name, r in runs.items() if name.startswith("mixed")},
    }
    result = {"command": " ".join(["python", "bench/checking.py", *sys.argv[1:]]),
              "machine": f"{platform.node()} ({platform.machine()}, {os.cpu_count()} cores, Python "
                         f"{platform.python_version()})",
              "date": time.strftime("%Y-%m-%d"), "wall_s": round(time.time() - t0), "steps": args.steps,
              **summary, "runs": runs}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(summary, indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
