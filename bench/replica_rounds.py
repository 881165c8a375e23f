"""Rounds without faults: how often an honest swarm with replicas redoes a step or retries a round.

    python bench/replica_rounds.py [--steps 800] [--initial 2,2,2] [--out bench/results/replica_rounds.json]

Runs ``mapl-swarm launch`` of the tiny ``mapl`` swarm of ``bench/replica_drift.py`` (M = 4, one
torch thread per peer) with ``replicas.initial`` = ``--initial``, nothing killed or stopped, and
reads every peer's log lines: steps redone (``is redone``) and why, rounds run again (``averaging
again``), all-reduce streams that broke (``all-reduce with ... failed``) and rounds whose all-reduce
broke at one member and whose result it took from a member that kept it (``took the round's
result``). An honest run should redo no step; each kept round is one that would have been redone
before. Printed and written with the command, machine, date and duration.
"""

from __future__ import annotations

import argparse
import json
import platform
import re
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

from replica_drift import CONFIG  # noqa: E402 - the same swarm as the drift benchmark

PATTERNS = {
    "redone": re.compile(r"step (\d+) is redone \(run epoch \d+\): (.*)"),
    "averaging_again": re.compile(r"; averaging again"),
    "stream_failed": re.compile(r"all-reduce with \S+ failed: (.*)"),
    "kept_round_taken": re.compile(r"took the round's result from"),
}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=800)
    ap.add_argument("--initial", default="2,2,2", help="replicas per stage, comma-separated")
    ap.add_argument("--out", type=Path, default=ROOT / "bench/results/replica_rounds.json")
    args = ap.parse_args()
    initial = [int(n) for n in args.initial.split(",")]
    t0 = time.time()
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        replicas = (f"[replicas]\nenabled = true\ninitial = {initial}\nrouting = \"throughput\"\n"
                    f"matchmaking_s = 1.0\n")
        config = CONFIG.format(cache=tmp / "cache", steps=args.steps, out=tmp / "run", name="rounds",
                               replicas=replicas).replace("num_stages = 3", f"num_stages = {len(initial)}")
        path = tmp / "rounds.toml"
        path.write_text(config)
        log = tmp / "launch.log"
        with log.open("w") as out:
            rc = subprocess.call([sys.executable, "-m", "mapl_swarm", "launch", "--config", str(path)],
                                 stdout=out, stderr=subprocess.STDOUT, cwd=ROOT)
        text = log.read_text(errors="replace")
    counts: Counter[str] = Counter()
    examples: dict[str, list[str]] = {}
    for line in text.splitlines():
        for name, pattern in PATTERNS.items():
            if pattern.search(line):
                counts[name] += 1
                examples.setdefault(name, [])
                if len(examples[name]) < 5:
                    examples[name].append(line.strip()[-300:])
    rounds = args.steps * sum(1 for n in initial if n >= 2)  # one round per step of each stage with replicas
    result = {"command": "python bench/replica_rounds.py " + " ".join(sys.argv[1:]), "exit_status": rc,
              "steps": args.steps, "initial": initial, "rounds": rounds,
              "machine": f"{platform.node()} {platform.machine()}, {platform.python_version()}",
              "date": time.strftime("%Y-%m-%d"), "seconds": round(time.time() - t0),
              "counts": {name: counts[name] for name in PATTERNS}, "examples": examples}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print(f"launch exited {rc} after {result['seconds']} s; {args.steps} steps, {rounds} averaging rounds")
    for name in PATTERNS:
        print(f"  {name:18s} {counts[name]}")
        for line in examples.get(name, []):
            print(f"      {line}")
    print(f"wrote {args.out}")
    return 0 if rc == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
