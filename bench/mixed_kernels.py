"""Replicas on other CPU kernels: how often a stage whose replicas step to other last bits re-syncs.

    python bench/mixed_kernels.py [--steps 200] [--replicas 3] [--capability default] [--out bench/results/mixed_kernels.json]

Starts a 3-stage ``mapl`` swarm of real peer processes (the integration tests' ``ReplicaSwarm``:
tiny model, 6 micro-batches a step, one replica of stages 0 and 2, ``--replicas`` of stage 1), the
last replica of stage 1 with ``ATEN_CPU_CAPABILITY=--capability`` (the others on this machine's
best), so its AdamW steps round differently (measured: ``default`` against AVX2 differs after one
step). Counts, per replica of stage 1, the rounds, re-syncs (a state download) and redone steps
until the run ends. Printed and written with the command, machine, date and duration.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests" / "integration"), str(ROOT / "tests")]

from swarm_helpers import ReplicaSwarm  # noqa: E402 - the tests' real-process swarm


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--replicas", type=int, default=3, help="replicas of stage 1 (the last on other kernels)")
    ap.add_argument("--capability", default="default", help="ATEN_CPU_CAPABILITY of the last replica")
    ap.add_argument("--out", type=Path, default=ROOT / "bench/results/mixed_kernels.json")
    args = ap.parse_args()
    R, t0 = args.replicas, time.time()
    with tempfile.TemporaryDirectory() as tmp_name, \
            ReplicaSwarm(Path(tmp_name), "mixed-kernels", steps=args.steps, identities=[1, R, 1],
                         initial=(1, R, 1)) as swarm:
        for key in [(0, 0), *[(1, r) for r in range(R - 1)], (2, 0)]:
            swarm.start(*key)
        swarm.start(1, R - 1, env=dict(os.environ, ATEN_CPU_CAPABILITY=args.capability))
        codes = {f"{s}.{r}": p.proc.wait(3600) for (s, r), p in swarm.procs.items()}
        replicas = []
        for r in range(R):
            averaging = swarm.result(1, r)["averaging"]
            lines = swarm.procs[1, r].lines
            replicas.append({"replica": r, "capability": args.capability if r == R - 1 else "best",
                             "rounds": averaging.get("rounds", 0), "resyncs": averaging.get("resyncs", 0),
                             "redone": sum("is redone" in line for line in lines)})
    result = {"command": " ".join(["python", "bench/mixed_kernels.py", *sys.argv[1:]]),
              "machine": f"{platform.node()} ({platform.machine()}, {os.cpu_count()} cores)",
              "date": time.strftime("%Y-%m-%d"), "wall_s": round(time.time() - t0, 1), "steps": args.steps,
              "exit_codes": codes, "stage1": replicas}
    print(json.dumps(result, indent=2))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    return 0 if all(c == 0 for c in codes.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
