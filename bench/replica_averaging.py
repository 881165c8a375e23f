"""Replica averaging benchmark: how long one members-only averaging round of a stage's gradients
takes between two certified replicas on this machine (hivemind's matchmaking and all-reduce).

    python bench/replica_averaging.py [--numel 1000000,10000000] [--rounds 5]
                                      [--out bench/results/replica_averaging.json]

Starts a certified bootstrap DHT node and two replicas of stage 1 (each its own identity, its DHT
peer id derived from it) on 127.0.0.1, then per size ``--rounds`` averaging rounds of a float32
tensor of that many elements (weights 1 and 3). Per round: seconds from the two ``step`` calls to
both results (matchmaking included), and whether both replicas then hold bitwise-equal tensors.
Loopback only: no link emulation (the lab's shaping of averaging traffic is not built yet).
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

ROOT = Path(__file__).resolve().parents[1]
RUN = "bench-replicas"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--numel", default="1000000,10000000", help="comma-separated tensor sizes (elements)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", type=Path, default=ROOT / "bench/results/replica_averaging.json")
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT))
    import torch

    torch.set_num_threads(1)
    from mapl_swarm.net.discovery import Discovery, DiscoveryConfig, TrustedAuthority, dht_validators
    from mapl_swarm.net.dht_node import start_dht
    from mapl_swarm.net.identity import create_peer_key, issue, issue_local, load_identity, make_request, write_signed

    folder = Path(tempfile.mkdtemp(prefix="bench-replicas-"))
    local = issue_local(folder, run_id=RUN, num_stages=2)
    second = create_peer_key(folder / "b.key")
    write_signed(folder / "b.cert", issue(local.authority, make_request(second, "stage1b", [1]), run_id=RUN,
                                          valid_s=3600))
    ids = [load_identity(local.key_file(1), local.cert_file(1), run_id=RUN, stage=1),
           load_identity(folder / "b.key", folder / "b.cert", run_id=RUN, stage=1)]
    sizes = [int(float(x)) for x in args.numel.split(",")]
    boot = start_dht(host="127.0.0.1", record_validators=dht_validators(TrustedAuthority(RUN, local.authority.public)))
    maddrs = [str(m) for m in boot.get_visible_maddrs()]
    cfg = DiscoveryConfig(initial_peers=tuple(maddrs), host="127.0.0.1")
    results = []
    with Discovery(RUN, cfg, membership=ids[0]) as a, Discovery(RUN, cfg, membership=ids[1]) as b:
        from mapl_swarm.replicas.averaging import StageAverager

        for numel in sizes:
            tensors = [[torch.full((numel,), 1.0)], [torch.full((numel,), 3.0)]]
            avgs = [StageAverager(t, d.dht, run_id=RUN, stage=1, replicas=2, start=True)
                    for t, d in zip(tensors, (a, b))]
            try:
                times, equal = [], []
                for _ in range(args.rounds + 1):  # the first round also waits for both declarations
                    t0 = time.perf_counter()
                    steps = [avgs[0].step(weight=1.0, timeout=120, wait=False),
                             avgs[1].step(weight=3.0, timeout=120, wait=False)]
                    for s in steps:
                        s.result(timeout=180)
                    times.append(time.perf_counter() - t0)
                    with avgs[0].get_tensors() as x, avgs[1].get_tensors() as y:
                        equal.append(bool(torch.equal(x[0], y[0])))
            finally:
                for avg in avgs:
                    avg.shutdown()
            row = {"numel": numel, "mbytes": numel * 4 / 1e6, "first_round_s": times[0],
                   "median_round_s": statistics.median(times[1:]), "rounds": times[1:], "bitwise_equal": all(equal)}
            results.append(row)
            print(f"{numel:>12,d} float32 ({row['mbytes']:.0f} MB): first round {times[0]:.2f} s, median of "
                  f"{args.rounds} {row['median_round_s']:.2f} s, replicas bitwise equal: {row['bitwise_equal']}")
    boot.shutdown()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"date": time.strftime("%Y-%m-%d"), "machine": platform.platform(),
                                    "cpus": os.cpu_count(), "torch_threads": 1, "results": results},
                                   indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
