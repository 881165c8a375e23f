"""Throughput benchmark: a real 4-peer local swarm with every link shaped, per codec.

    python bench/throughput.py [--bandwidth-mbps 0.25] [--steps 5] [--wan] [--codecs none,mapl:64,mapl:32]

For each codec (``name:rank``) the script launches the swarm (DHT + 4 peer processes over ZeroMQ,
tiny preset, T=128, 4 micro-batches of 2 per step), every outbound link shaped by the link emulator
to B Mbit/s (plus the WAN profile 200 Mbit/s + 50 ms with ``--wan``), and measures:

- steady-state tokens/s (steps after the first, from the times stage 1 received each step's REPORT);
- wire bytes per token by message type (ACT, GRAD, PROJ, PROJ_GRAD, control) and payload bytes by
  kind (activations, ids, gradients, projectors), summed over the 3 links and both directions;
- link utilisation: whole-run (shaped bytes / wall time / B) and the busy fraction (time the
  emulated link had a backlog draining at rate B / wall time), next to the 1F1B bubble bound
  M / (M + P - 1). While busy, the token bucket sends at exactly B by construction (above B only
  out of its burst credit), so bytes/s while busy is not a measurement for the app-level emulator;
  the kernel tbf lab measures it for real;
- the efficiency ratio (tokens/s ratio codec/none) / (wire bytes ratio none/codec), target >= 0.9.

Writes bench/results/throughput.json and .md and replaces BENCHMARKS.md's throughput section.
"""

from __future__ import annotations

import argparse
import json
import logging
import platform
import re
import tempfile
import time
from pathlib import Path

from mapl_swarm.config.catalog import codec_info
from mapl_swarm.config import load_config
from mapl_swarm.metrics import run_manifest
from mapl_swarm.launch import launch

ROOT = Path(__file__).resolve().parents[1]
BEGIN, END = "<!-- throughput:begin -->", "<!-- throughput:end -->"
P, M = 4, 8

CONFIG = """
preset = "tiny"
[model]
context_length = 128
[compression]
codec = "{codec}"
rank = {rank}
anchor_rank = 64
[data]
cache_dir = "{cache}"
[run]
steps = {steps}
out_dir = "{out}"
run_id = "tp-{codec}-{rank}"
[pipeline]
num_stages = {P}
micro_batch_size = 2
num_micro_batches = {M}
[eval]
interval_steps = 0
[runtime]
threads = 1
[net]
bandwidth_mbps = {bw}
latency_ms = {lat}
timeout_s = 600
"""

CONTROL_TYPES = ("HELLO", "WELCOME", "HEARTBEAT", "REPORT", "BYE", "REJECT", "ERROR")


def run_case(codec: str, rank: int, bw: float, lat: float, steps: int, cache: Path, tmp: Path) -> dict:
    out = tmp / f"{codec}-{rank}-{bw}-{lat}"
    path = tmp / f"{codec}-{rank}-{bw}-{lat}.toml"
    path.write_text(CONFIG.format(codec=codec, rank=rank, cache=cache, P=P, M=M, steps=steps, out=out,
                                  bw=bw, lat=lat))
    cfg = load_config(path)
    t0 = time.perf_counter()
    s = launch(cfg, ["--config", str(path)], progress=False, timeout_s=3600)
    wall = time.perf_counter() - t0
    tokens_per_step = s.tokens / len(s.train_losses)
    times = s.report_times_s
    steady_tps = tokens_per_step * (len(times) - 1) / (times[-1] - times[0])
    wire: dict[str, float] = {}
    payload: dict[str, float] = {}
    util_whole, util_busy = [], []
    rate = bw * 1e6 / 8
    for link in s.links:
        for k, v in link["wire_by_type"].items():
            kind = k.split("_", 1)[1]
            kind = "control" if kind in CONTROL_TYPES else kind
            wire[kind] = wire.get(kind, 0.0) + v
        for k, v in link["payload_by_kind"].items():
            kind = k.split("_", 1)[1]
            payload[kind] = payload.get(kind, 0.0) + v
        for side in ("shaper_forward", "shaper_backward"):
            st = link[side]
            if rate > 0 and st:
                util_whole.append(st["bytes_sent"] / s.wall_s / rate)
                util_busy.append(st["busy_s"] / s.wall_s)
    data_payload = sum(payload.get(k, 0.0) for k in ("act", "ids", "grad"))
    headers = wire.get("ACT", 0.0) + wire.get("GRAD", 0.0) - data_payload
    control = wire.get("PROJ", 0.0) + wire.get("PROJ_GRAD", 0.0) + wire.get("control", 0.0) + headers
    # projector traffic is d*r*4 bytes each way per step: its share halves when the step's tokens double
    proj = wire.get("PROJ", 0.0) + wire.get("PROJ_GRAD", 0.0)
    tokens_for_2pct = tokens_per_step * proj / (0.02 * data_payload) if proj else 0.0
    return {
        "codec": codec, "rank": rank, "bandwidth_mbps": bw, "latency_ms": lat, "steps": steps,
        "tokens_per_s": steady_tps, "tokens": s.tokens, "launch_wall_s": wall, "swarm_wall_s": s.wall_s,
        "wire_bytes_per_token": wire, "payload_bytes_per_token": payload,
        "wire_total_per_token": sum(wire.values()), "control_share_of_payload": control / data_payload,
        "headers_per_token": headers, "tokens_per_step": tokens_per_step,
        "tokens_per_step_for_2pct_projector": tokens_for_2pct,
        "util_whole_mean": sum(util_whole) / len(util_whole) if util_whole else None,
        "busy_fraction_mean": sum(util_busy) / len(util_busy) if util_busy else None,
        "bubble_bound": M / (M + P - 1), "final_loss": s.train_losses[-1],
    }


def to_markdown(rows: list[dict], command: str, manifest: dict) -> str:
    lines = [
        f"Command: `{command}`  ",
        f"Machine: {platform.machine()} {manifest['machine']}, 2 cores, torch {manifest['versions']['torch']}; "
        f"date {time.strftime('%Y-%m-%d')}; commit {manifest['commit'][:12]}  ",
        f"Setup: 4 peer processes (1 torch thread each) + DHT on one machine, tiny preset (d=256, 8 layers), "
        f"T=128, {M} micro-batches of 2 per step ({M * 2 * 128} tokens), every outbound link shaped by the app-level emulator; "
        f"tokens/s over steps 2..N. Bytes are per token summed over the 3 links and both directions. "
        f"1F1B bubble bound M/(M+P-1) = {M / (M + P - 1):.2f}.",
        "",
        "| link | codec | rank | tokens/s | wire B/token | ACT | GRAD | PROJ+PROJ_GRAD | control+headers | "
        "tok/s ratio vs none | bytes ratio none/codec | efficiency | util whole-run | link busy fraction | control % of payload | tokens/step for PROJ <= 2% |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        base = next((b for b in rows if codec_info(b["codec"]).uncompressed
                     and b["bandwidth_mbps"] == r["bandwidth_mbps"] and b["latency_ms"] == r["latency_ms"]), None)
        w = r["wire_bytes_per_token"]
        tps_ratio = r["tokens_per_s"] / base["tokens_per_s"] if base else float("nan")
        bytes_ratio = base["wire_total_per_token"] / r["wire_total_per_token"] if base else float("nan")
        ctl = w.get("control", 0.0) + r["headers_per_token"]
        uw = f"{100 * r['util_whole_mean']:.0f}%" if r["util_whole_mean"] is not None else "-"
        ub = f"{100 * r['busy_fraction_mean']:.0f}%" if r["busy_fraction_mean"] is not None else "-"
        link = f"{r['bandwidth_mbps']:g} Mbit/s + {r['latency_ms']:g} ms"
        rank = r["rank"] if codec_info(r["codec"]).projected else "-"
        lines.append(
            f"| {link} | {r['codec']} | {rank} | {r['tokens_per_s']:.0f} | "
            f"{r['wire_total_per_token']:.0f} | {w.get('ACT', 0):.0f} | {w.get('GRAD', 0):.0f} | "
            f"{w.get('PROJ', 0) + w.get('PROJ_GRAD', 0):.1f} | {ctl:.1f} | {tps_ratio:.2f} | {bytes_ratio:.2f} | "
            f"{tps_ratio / bytes_ratio:.2f} | {uw} | {ub} | {100 * r['control_share_of_payload']:.2f}% | "
            f"{r['tokens_per_step_for_2pct_projector']:,.0f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--codecs", default="none:64,mapl:64,mapl:32")
    ap.add_argument("--bandwidth-mbps", type=float, default=0.1)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--wan", action="store_true", help="also run 200 Mbit/s + 50 ms")
    ap.add_argument("--no-update", action="store_true")
    ap.add_argument("--merge", action="store_true",
                    help="add these rows to bench/results/throughput.json instead of replacing it")
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    command = f"python bench/throughput.py --codecs {args.codecs} --bandwidth-mbps {args.bandwidth_mbps:g} " \
              f"--steps {args.steps}" + (" --wan" if args.wan else "")
    profiles = [(args.bandwidth_mbps, 0.0)] + ([(200.0, 50.0)] if args.wan else [])
    cache = ROOT / ".mapl_cache"
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for bw, lat in profiles:
            for item in args.codecs.split(","):
                codec, _, rank = item.partition(":")
                row = run_case(codec, int(rank or 64), bw, lat, args.steps, cache, Path(tmp))
                print(json.dumps({k: row[k] for k in ("codec", "rank", "bandwidth_mbps", "tokens_per_s",
                                                       "wire_total_per_token")}), flush=True)
                rows.append(row)
    manifest = run_manifest({"codecs": args.codecs, "profiles": profiles, "steps": args.steps})
    out = ROOT / "bench" / "results"
    out.mkdir(parents=True, exist_ok=True)
    if args.merge and (out / "throughput.json").exists():  # keep earlier rows of other cases
        def key(r: dict) -> tuple:
            return r["codec"], r["rank"], r["bandwidth_mbps"], r["latency_ms"]
        new = {key(r) for r in rows}
        old = json.loads((out / "throughput.json").read_text())["rows"]
        rows = [r for r in old if key(r) not in new] + rows
        rows.sort(key=lambda r: (r["bandwidth_mbps"], r["latency_ms"]))  # stable: old rows first
        command += " (merged into the earlier rows)"
    (out / "throughput.json").write_text(json.dumps({"manifest": manifest, "rows": rows}, indent=2))
    md = to_markdown(rows, command, manifest)
    (out / "throughput.md").write_text(md)
    print(md)
    bench = ROOT / "BENCHMARKS.md"
    if not args.no_update and bench.exists():
        text = bench.read_text()
        if BEGIN in text:
            text = re.sub(re.escape(BEGIN) + ".*?" + re.escape(END), BEGIN + "\n" + md + END, text, flags=re.S)
        else:
            text += f"\n## Throughput: link-bound 4-stage swarm (issue: peers)\n\n{BEGIN}\n{md}{END}\n"
        bench.write_text(text)


if __name__ == "__main__":
    main()
