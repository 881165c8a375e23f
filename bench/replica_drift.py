"""How far honest replica runs drift from each other and from ``train``, against what float rounding alone does.

    python bench/replica_drift.py [--steps 200] [--runs 3] [--out bench/results/replica_drift.json]

A 3-stage swarm with two replicas of the middle stage (the tiny test model, ``mapl``) trains
``--steps`` steps, ``--runs`` times with throughput routing (the default: which replica gets a
micro-batch follows measured round trips, so it differs run to run) and ``--runs`` times with
uniform routing (a fixed seed: the same draws every run). Beside them, in one process: ``train``
(the reference) and ``train`` with each step's micro-batches processed in a shuffled order — the
same data and mathematics, only the floating-point summation order changed, which is all that
routing changes in a replica run (a micro-batch's gradient is summed on another replica and
averaged in another order). Printed and written: per pair of runs, the first step whose loss
differs, the largest difference over the first 10/50/all steps, and the mean loss of the last 50.
If replica runs spread no more than the shuffled reference does from ``train``, their
differences are rounding amplified by training; more would be a fault to find.
"""

from __future__ import annotations

import argparse
import itertools
import json
import logging
import platform
import random
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

CONFIG = """
preset = "tiny"
[model]
vocab_size = 512
hidden_size = 64
num_layers = 4
num_heads = 4
ffn_hidden_size = 128
context_length = 32
[compression]
codec = "mapl"
rank = 16
anchor_rank = 16
[optim]
warmup_steps = 2
[data]
vocab_size = 512
max_corpus_bytes = 400000
val_fraction = 0.2
cache_dir = "{cache}"
[run]
steps = {steps}
out_dir = "{out}"
run_id = "drift-{name}"
[pipeline]
num_stages = 3
micro_batch_size = 2
num_micro_batches = 4
[eval]
interval_steps = 0
[checkpoint]
interval_steps = 0
[runtime]
threads = 1
[net]
timeout_s = 120
{replicas}"""
REPLICAS = """[replicas]
enabled = true
initial = [1, 2, 1]
routing = "{routing}"
matchmaking_s = 1.0
"""


def _config(tmp: Path, name: str, steps: int, *, replicas: bool, routing: str = "throughput"):
    from mapl_swarm.config import load_config

    path = tmp / f"{name}.toml"
    path.write_text(CONFIG.format(cache=tmp / "cache", steps=steps, out=tmp / name, name=name,
                                  replicas=REPLICAS.format(routing=routing) if replicas else ""))
    return path, load_config(path)


def _train(cfg, shuffle_seed: int | None) -> list[float]:
    """``train``'s losses; with ``shuffle_seed``, each step's micro-batches in a shuffled order."""
    import torch

    from mapl_swarm.data import BatchSampler, prepare_data
    from mapl_swarm.pipeline.inprocess import InProcessPipeline

    torch.set_num_threads(1)
    data = prepare_data(cfg.data, progress=False)
    sampler = BatchSampler(data.train, cfg.pipeline.micro_batch_size, cfg.model.context_length, cfg.run.seed)
    pipe = InProcessPipeline(cfg)
    rng = random.Random(shuffle_seed)
    losses = []
    for _ in range(cfg.run.steps):
        batches = [next(sampler) for _ in range(cfg.pipeline.num_micro_batches)]
        if shuffle_seed is not None:
            rng.shuffle(batches)
        losses.append(pipe.train_step(batches).loss)
    return losses


def _swarm(path: Path, cfg) -> list[float]:
    from mapl_swarm.launch import launch

    return list(launch(cfg, ["--config", str(path)], progress=False, timeout_s=3600, max_restarts=0).train_losses)


def compare(a: list[float], b: list[float]) -> dict:
    diffs = [abs(x - y) for x, y in zip(a, b)]
    first = next((i for i, d in enumerate(diffs) if d), None)
    return {"first_differing_step": first, "max_diff_first_10": max(diffs[:10], default=0.0),
            "max_diff_first_50": max(diffs[:50], default=0.0), "max_diff": max(diffs, default=0.0),
            "mean_diff_last_50": sum(diffs[-50:]) / max(len(diffs[-50:]), 1)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--out", type=Path, default=ROOT / "bench/results/replica_drift.json")
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(message)s")
    t0 = time.time()
    series: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        _, cfg = _config(tmp, "train", args.steps, replicas=False)
        series["train"] = _train(cfg, None)
        for k in range(2):
            series[f"train-shuffled-{k}"] = _train(cfg, 1000 + k)
        for routing in ("uniform", "throughput"):
            for k in range(args.runs):
                name = f"replicas-{routing}-{k}"
                path, cfg = _config(tmp, name, args.steps, replicas=True, routing=routing)
                series[name] = _swarm(path, cfg)
                print(f"{name}: {len(series[name])} steps, last loss {series[name][-1]:.4f} "
                      f"({time.time() - t0:.0f} s so far)", flush=True)
    pairs = {f"{a} vs {b}": compare(series[a], series[b]) for a, b in itertools.combinations(series, 2)}
    mean_last = {name: sum(v[-50:]) / len(v[-50:]) for name, v in series.items()}
    result = {"command": "python bench/replica_drift.py " + " ".join(sys.argv[1:]), "steps": args.steps,
              "machine": f"{platform.node()} {platform.machine()}, {platform.python_version()}",
              "date": time.strftime("%Y-%m-%d"), "seconds": round(time.time() - t0), "mean_loss_last_50": mean_last,
              "pairs": pairs, "series": series}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print(f"{'pair':60s} {'first':>5s} {'max@10':>9s} {'max@50':>9s} {'max':>9s} {'mean last50':>11s}")
    for name, c in pairs.items():
        print(f"{name:60s} {str(c['first_differing_step']):>5s} {c['max_diff_first_10']:9.2e} "
              f"{c['max_diff_first_50']:9.2e} {c['max_diff']:9.2e} {c['mean_diff_last_50']:11.2e}")
    print("mean loss of the last 50 steps:", {k: round(v, 4) for k, v in mean_last.items()})
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
