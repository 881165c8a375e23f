"""A dishonest replica among three: what it does to training with the mean, CenteredClip and a trimmed mean.

    python bench/robust_attack.py [--steps 200] [--scale -10] [--aggregations mean,centered_clip,trimmed_mean]
                                  [--out bench/results/robust_attack.json]

A 3-stage ``mapl`` swarm of real processes (the slow tests' ``ReplicaSwarm``: tiny model, M = 6,
uniform routing, certified peers) with three replicas of stage 1 trains ``--steps`` steps four
times: honest and with replica 2 of stage 1 dishonest (its gradient share multiplied by
``--scale`` before each round: modified peer code, ``bench/dishonest_replica.py``), each with
every ``replicas.aggregation`` of ``--aggregations``. Printed and written: each run's mean loss
of the last 20 steps and its final loss, and the attacked runs' difference from the honest run of
the same aggregation, in percent.
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "integration"))
sys.path.insert(0, str(ROOT / "tests"))  # the helpers import deadlines from there
sys.path.insert(0, str(ROOT))

from swarm_helpers import ReplicaSwarm, Watched  # noqa: E402 - the slow tests' real-process swarm


def _run(tmp: Path, name: str, steps: int, aggregation: str, scale: float | None) -> list[float]:
    from mapl_swarm.launch import replica_out_dir

    (tmp / name).mkdir()
    with ReplicaSwarm(tmp / name, f"robust-{name}", steps=steps, identities=[1, 3, 1], initial=(1, 3, 1)) as swarm:
        args = ("--set", f'replicas.aggregation="{aggregation}"', "--set", "runtime.threads=1")
        for key in ((0, 0), (1, 0), (1, 1), (2, 0)):
            swarm.start(*key, *args)
        peer = ["peer", "--config", str(swarm.path), "--stage", "1", "--initial-peer", swarm.maddr,
                *swarm.local.args(1, 2), *args,
                "--set", f"run.out_dir={json.dumps(str(replica_out_dir(swarm.out, 2)))}"]
        if scale is None:
            swarm.start(1, 2, *args)
        else:
            swarm.procs[1, 2] = Watched([sys.executable, str(ROOT / "bench" / "dishonest_replica.py"), str(scale),
                                         *peer])
        codes = {key: p.wait(60 * 60) for key, p in swarm.procs.items()}  # each ends once the run finished
        if any(codes.values()):
            raise SystemExit(f"{name}: a peer failed: {codes}\n" + "\n".join(
                f"--- peer {key}:\n{p.output[-1500:]}" for key, p in swarm.procs.items()))
        return list(swarm.result(0, 0)["train_losses"])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--scale", type=float, default=-10.0)
    ap.add_argument("--aggregations", default="mean,centered_clip,trimmed_mean")
    ap.add_argument("--out", type=Path, default=ROOT / "bench/results/robust_attack.json")
    ap.add_argument("--one", help=argparse.SUPPRESS)  # AGGREGATION-honest|attacked: one run, its losses to --out
    args = ap.parse_args()
    if args.one:  # one run, in a process of its own (each swarm's helpers are per process)
        aggregation, kind = args.one.rsplit("-", 1)
        with tempfile.TemporaryDirectory() as tmp_name:
            losses = _run(Path(tmp_name), args.one, args.steps, aggregation, args.scale if kind == "attacked" else None)
        args.out.write_text(json.dumps(losses))
        return 0
    t0 = time.time()
    runs: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory() as tmp_name:
        for aggregation in args.aggregations.split(","):
            for kind in ("honest", "attacked"):
                name = f"{aggregation}-{kind}"
                out = Path(tmp_name) / f"{name}.json"
                subprocess.run([sys.executable, __file__, "--one", name, "--steps", str(args.steps), "--scale",
                                str(args.scale), "--out", str(out)], check=True)
                runs[name] = json.loads(out.read_text())
                tail = runs[name][-20:]
                print(f"{name}: {len(runs[name])} steps, last-20 mean loss {sum(tail) / len(tail):.4f} "
                      f"({time.time() - t0:.0f} s so far)", flush=True)
    last20 = {k: sum(v[-20:]) / len(v[-20:]) for k, v in runs.items()}
    effect = {agg: 100.0 * (last20[f"{agg}-attacked"] - last20[f"{agg}-honest"]) / last20[f"{agg}-honest"]
              for agg in args.aggregations.split(",")}
    result = {"command": "python bench/robust_attack.py " + " ".join(sys.argv[1:]), "steps": args.steps,
              "scale": args.scale, "machine": f"{platform.node()} {platform.machine()}, {platform.python_version()}",
              "date": time.strftime("%Y-%m-%d"), "seconds": round(time.time() - t0),
              "mean_loss_last_20": last20, "final_loss": {k: v[-1] for k, v in runs.items()},
              "attack_effect_pct": effect, "losses": runs}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    for k, v in last20.items():
        print(f"{k:28s} last-20 mean {v:.4f}  final {runs[k][-1]:.4f}")
    print("attacked vs honest, last-20 mean loss:", {k: f"{v:+.2f}%" for k, v in effect.items()})
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
