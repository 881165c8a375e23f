"""Rounds without faults: how often an honest swarm with replicas redoes a step or retries a round.

    python bench/replica_rounds.py [--steps 800] [--initial 2,2,2] [--averaging fp32] [--runs 1]
                                   [--out bench/results/replica_rounds.json]

Runs ``mapl-swarm launch`` of the tiny ``mapl`` swarm of ``bench/replica_drift.py`` (M = 4, one
torch thread per peer) with ``replicas.initial`` = ``--initial``, ``--runs`` times per scheme of
``--averaging`` (``replicas.averaging``), one after another, nothing killed or stopped, and
reads every peer's log lines: steps redone (``is redone``) and why, rounds run again (``averaging
again``), all-reduce streams that broke (``all-reduce with ... failed``) and rounds whose all-reduce
broke at one member and whose result it took from a member that kept it (``took the round's
result``) or at every member (``broke at every member``, run again). An honest run should redo no
step. Printed and written with the command, machine, date and duration; the whole log of a run
that redid a step is kept beside the results (``<out>.<scheme>-<run>.log``).
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
from replica_lab import scheme_settings  # noqa: E402 - SCHEME[:PARAMETER][/updates], as the lab reads it

PATTERNS = {
    "redone": re.compile(r"step (\d+) is redone \(run epoch \d+\): (.*)"),
    "averaging_again": re.compile(r"; averaging again"),
    "stream_failed": re.compile(r"all-reduce with \S+ failed: (.*)"),
    "kept_round_taken": re.compile(r"took the round's result from"),
    "broke_at_every_member": re.compile(r"broke at every member of the group"),
}


def one_run(steps: int, initial: list[int], averaging: str, keep: Path) -> dict:
    """One launched swarm: its exit status, seconds, counts of each pattern and a few examples; its
    log is copied to ``keep`` when it redid a step."""
    t0 = time.time()
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        replicas = (f"[replicas]\nenabled = true\ninitial = {initial}\nrouting = \"throughput\"\n"
                    f"matchmaking_s = 1.0\n{scheme_settings(averaging, 4)}")
        config = CONFIG.format(cache=tmp / "cache", steps=steps, out=tmp / "run", name="rounds",
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
    if counts["redone"]:
        keep.write_text(text)
    return {"averaging": averaging, "exit_status": rc, "seconds": round(time.time() - t0),
            "counts": {name: counts[name] for name in PATTERNS}, "examples": examples}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=800)
    ap.add_argument("--initial", default="2,2,2", help="replicas per stage, comma-separated")
    ap.add_argument("--averaging", default="fp32", help="replicas.averaging schemes, comma-separated, each "
                    "SCHEME[:PARAMETER][/updates] as bench/replica_lab.py reads them")
    ap.add_argument("--runs", type=int, default=1, help="runs per scheme")
    ap.add_argument("--out", type=Path, default=ROOT / "bench/results/replica_rounds.json")
    args = ap.parse_args()
    initial = [int(n) for n in args.initial.split(",")]
    rounds = args.steps * sum(1 for n in initial if n >= 2)  # one round per step of each stage with replicas
    t0, runs = time.time(), []
    for averaging in args.averaging.split(","):
        name = averaging.replace(":", "-").replace("/", "-")
        for i in range(args.runs):
            runs.append(one_run(args.steps, initial, averaging, args.out.with_suffix(f".{name}-{i + 1}.log")))
            r = runs[-1]
            print(f"{averaging}: launch exited {r['exit_status']} after {r['seconds']} s; {args.steps} steps, "
                  f"{rounds} averaging rounds; " + ", ".join(f"{k} {v}" for k, v in r["counts"].items()), flush=True)
            for name in PATTERNS:
                for line in r["examples"].get(name, []):
                    print(f"      {line}")
            result = {"command": "python bench/replica_rounds.py " + " ".join(sys.argv[1:]),
                      "steps": args.steps, "initial": initial, "rounds_per_run": rounds,
                      "machine": f"{platform.node()} {platform.machine()}, {platform.python_version()}",
                      "date": time.strftime("%Y-%m-%d"), "seconds": round(time.time() - t0), "runs": runs}
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(result, indent=1))  # after every run: a stopped benchmark keeps them
    print(f"wrote {args.out}")
    return 0 if all(r["exit_status"] == 0 for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
