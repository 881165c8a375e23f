"""Boundary overhead per codec: a middle stage's forward+backward with each codec vs ``none``.

    python bench/boundary_overhead.py [--preset 150M] [--rank 256] [--batch 4 --seq 2048]
                                      [--autocast bf16] [--device cuda] [--codecs all] --out FILE

For every codec of the catalog (``mapl_swarm.config.catalog.CODEC_NAMES``) it builds the stages
of a ``--stages``-stage pipeline at the preset's shape, runs one micro-batch through all of them
(forward, then backward, delivering codebook slices as the in-process pipeline does) to obtain the
ACT payload a middle stage receives and the GRAD payload it gets back, then times that middle
stage's ``StageRuntime.forward`` + ``backward`` on those payloads (median of ``--repeats``, after
``--warmup`` runs; the first micro-batch, which initialises mapl_vq's codebooks by k-means, is not
timed). Each codec's time is compared with ``none`` (the uncompressed boundary) at the same shape:
``overhead = t_codec / t_none - 1`` is what the codec's boundary work (projection, anchors, VQ
encode/decode) adds to the stage's compute. It also reports the payload bytes per token the middle
stage sends forward and backward (activation or codes tensors; ids and codebook slices apart).

Runs on any device (``--device cpu`` with tiny shapes for a smoke check); writes one JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

from mapl_swarm.cli import parse_overrides
from mapl_swarm.config.catalog import CODEC_NAMES, codec_info, uncompressed_codec
from mapl_swarm.files import atomic_write_text
from mapl_swarm.config import config_from_dict
from mapl_swarm.pipeline.payload import PayloadKey, Stream
from mapl_swarm.pipeline.device import bind_device, resolve_device
from mapl_swarm.pipeline.stage import StageRuntime

ROOT = Path(__file__).resolve().parents[1]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _nbytes(payload: dict[str, torch.Tensor] | None, *keys: str) -> int:
    return sum(payload[k].numel() * payload[k].element_size() for k in keys if payload and k in payload)


def _prime(stages: list[StageRuntime], ids: torch.Tensor, middle: int) -> dict:
    """One micro-batch through every stage, forward then backward, slices delivered before their
    payload (as :class:`mapl_swarm.pipeline.inprocess.InProcessPipeline`); returns what the middle
    stage received: its ACT payload and GRAD payload with their codebook versions."""
    got: dict = {}
    payload, cver = None, None
    for s, stage in enumerate(stages):
        if s == middle:
            got["act"], got["act_cver"] = payload, cver
        res = stage.forward(0, ids=ids if s == 0 else None, payload=payload, train=True, cver=cver)
        payload = res.payload
        if payload is not None:
            for sl in stage.take_slices(Stream.ACT):
                stages[s + 1].apply_slice(sl)
            cver = stage.codebook_version(Stream.ACT)
    grad, cver = None, None
    for s in range(len(stages) - 1, -1, -1):
        if s == middle:
            got["grad"], got["grad_cver"] = grad, cver
        grad = stages[s].backward(0, grad, cver=cver)
        if grad is not None:
            for sl in stages[s].take_slices(Stream.GRAD):
                stages[s - 1].apply_slice(sl)
            cver = stages[s].codebook_version(Stream.GRAD)
    return got


def bench_codec(codec: str, args: argparse.Namespace, device: torch.device) -> dict:
    raw = {
        "preset": args.preset,
        "model": {"context_length": args.seq, **args.model},
        "compression": {"codec": codec, "rank": args.rank, "anchor_rank": args.rank},
        "pipeline": {"num_stages": args.stages, "micro_batch_size": args.batch, "num_micro_batches": 1},
        "runtime": {"autocast": args.autocast},
    }
    if "vocab_size" in args.model:
        raw["data"] = {"vocab_size": args.model["vocab_size"]}
    cfg = config_from_dict(raw, f"boundary_overhead {codec}")
    middle = 1  # a stage with both boundaries (stage 1 of P >= 3), as in bench/vq_speed.py
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    stages = [StageRuntime(cfg, s, device) for s in range(args.stages)]
    gen = torch.Generator().manual_seed(args.seed)
    ids = torch.randint(0, cfg.model.vocab_size, (args.batch, args.seq + 1), generator=gen)
    got = _prime(stages, ids, middle)
    stage = stages[middle]
    sent: dict = {}

    def fwd_bwd(micro: int) -> None:
        res = stage.forward(micro, payload=got["act"], train=True, cver=got["act_cver"])
        sent["fwd"] = res.payload
        stage.take_slices(Stream.ACT)  # this stage's outbound codebook slices: not delivered, not timed
        sent["bwd"] = stage.backward(micro, got["grad"], cver=got["grad_cver"])
        stage.take_slices(Stream.GRAD)

    for i in range(args.warmup):
        fwd_bwd(1 + i)
    _sync(device)
    times = []
    for i in range(args.repeats):
        t0 = time.perf_counter()
        fwd_bwd(1 + args.warmup + i)
        _sync(device)
        times.append(time.perf_counter() - t0)
    tokens = args.batch * args.seq
    t = statistics.median(times)
    out = {
        "codec": codec, "display_name": codec_info(codec).display_name, "stage": middle,
        "layers": len(stage.model.layers), "tokens": tokens,
        "fwd_bwd_s": t, "fwd_bwd_s_min": min(times), "tokens_per_s": tokens / t,
        "fwd_payload_bytes_per_token": _nbytes(sent["fwd"], PayloadKey.ACT, PayloadKey.CODES) / tokens,
        "bwd_payload_bytes_per_token": _nbytes(sent["bwd"], PayloadKey.GRAD, PayloadKey.CODES) / tokens,
    }
    if device.type == "cuda":
        out["max_memory_allocated_mib"] = torch.cuda.max_memory_allocated(device) / 2**20
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", default="150M", help="model preset (default: 150M)")
    p.add_argument("--model", action="append", default=[], metavar="KEY=VALUE",
                   help="override a model.KEY of the preset (repeatable), e.g. --model hidden_size=64")
    p.add_argument("--rank", type=int, default=256, help="projection rank r (default: 256, 4x at d=1024)")
    p.add_argument("--stages", type=int, default=4, help="pipeline stages P >= 3 (default: 4); stage 1 is timed")
    p.add_argument("--batch", type=int, default=4, help="sequences per micro-batch (default: 4)")
    p.add_argument("--seq", type=int, default=2048, help="tokens per sequence (default: 2048)")
    p.add_argument("--autocast", choices=("off", "bf16"), default="bf16", help="runtime.autocast (default: bf16)")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N (default: auto)")
    p.add_argument("--codecs", default="all", help="comma-separated codec names (default: all, the catalog's)")
    p.add_argument("--warmup", type=int, default=2, help="untimed forward+backward runs per codec (default: 2)")
    p.add_argument("--repeats", type=int, default=10, help="timed runs per codec (default: 10)")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "boundary_overhead.json")
    args = p.parse_args()
    if args.stages < 3:
        p.error("--stages must be >= 3 (stage 1 needs both an inbound and an outbound boundary)")
    args.model = parse_overrides([f"model.{kv}" for kv in args.model]).get("model", {})
    if args.threads:
        torch.set_num_threads(args.threads)
    codecs = list(CODEC_NAMES) if args.codecs == "all" else args.codecs.split(",")
    ref = uncompressed_codec()
    codecs = [ref] + [c for c in codecs if c != ref]  # the reference (none) first
    device = resolve_device(args.device)
    bind_device(device)
    results: list[dict] = []
    for codec in codecs:
        r = bench_codec(codec, args, device)
        if device.type == "cuda":
            torch.cuda.empty_cache()  # the codec's stages are gone: the next one starts from a clean cache
        results.append(r)
        print(f"{codec}: stage {r['stage']} ({r['layers']} layers) fwd+bwd {1e3 * r['fwd_bwd_s']:.2f} ms over "
              f"{r['tokens']} tokens; payload {r['fwd_payload_bytes_per_token']:.0f} / "
              f"{r['bwd_payload_bytes_per_token']:.0f} B/token fwd/bwd", flush=True)
        _write_report(args, device, results)  # after each codec: a run stopped later keeps these


def _write_report(args: argparse.Namespace, device: torch.device, results: list[dict]) -> None:
    base = results[0]["fwd_bwd_s"]  # the uncompressed reference runs first
    for r in results:
        r["overhead_vs_none"] = r["fwd_bwd_s"] / base - 1
    report = {
        "benchmark": "boundary_overhead", "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "torch": torch.__version__,
                    "threads": torch.get_num_threads(), "device": str(device),
                    **({"gpu": torch.cuda.get_device_name(device)} if device.type == "cuda" else {})},
        "shape": {"preset": args.preset, "model_overrides": args.model, "rank": args.rank, "stages": args.stages,
                  "batch": args.batch, "seq": args.seq, "autocast": args.autocast},
        "command": " ".join(["python bench/boundary_overhead.py", *sys.argv[1:]]),
        "results": results,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(args.out, json.dumps(report, indent=2) + "\n")
    print(f"{results[-1]['codec']}: {100 * results[-1]['overhead_vs_none']:+.1f}% vs none; wrote {args.out}")


if __name__ == "__main__":
    main()
