"""VQ encoder/decoder speed against a pipeline stage's own forward+backward (MAPL+VQ).

    python bench/vq_speed.py [--presets tiny,150M] [--variants eager,compiled] [--repeats 5]
                             [--autocast off|bf16] [--batch B --seq T --rank R]

For each preset it builds a middle stage (stage 1 of 4, codec ``mapl``) and times its forward +
backward over one micro-batch, then times the VQ work that a ``mapl_vq`` middle stage adds per
micro-batch: encoding its outbound Z (with the EMA learning step) and its inbound dL/dZ, decoding
its inbound Z and outbound dL/dZ, each on its own codebooks (K=256, R=2, G=2 by default), with
the eager encoder and with the torch.compile-fused one (``compression.vq.compile``). Prints the figures and
writes bench/results/vq_speed.json. Measured on CPU here; the code is device-agnostic
(``--device cuda`` runs the same code on a GPU, where the compiled search is a Triton kernel).
``--autocast bf16`` runs the stage's forward+backward under bf16 autocast (``runtime.autocast``; the
VQ work stays fp32 either way, as in training); ``--batch/--seq/--rank`` replace the preset's
micro-batch shape (e.g. the 4 x 2048 tokens of DESIGN.md §5, or tiny smoke shapes).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

import torch

from mapl_swarm.compress.codebook_sync import VQReceiver, VQSender, stream_generator
from mapl_swarm.config import config_from_dict
from mapl_swarm.files import atomic_write_text
from mapl_swarm.pipeline.stage import StageRuntime

ROOT = Path(__file__).resolve().parents[1]
# preset -> (rank, micro-batch sequences, sequence length)
SHAPES = {"tiny": (64, 8, 256), "150M": (256, 1, 512)}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _time(fn, repeats: int, device: torch.device) -> float:
    """Median seconds of ``fn`` over ``repeats`` runs after one warm-up."""
    fn()
    times = []
    for _ in range(repeats):
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def bench_preset(preset: str, compiled: bool, args: argparse.Namespace, device: torch.device) -> dict:
    rank, batch, seq = SHAPES[preset]
    rank, batch, seq = args.rank or rank, args.batch or batch, args.seq or seq
    cfg = config_from_dict({
        "preset": preset, "model": {"context_length": seq},
        "compression": {"codec": "mapl", "rank": rank, "anchor_rank": rank,
                        "vq": {"max_distance_mib": args.max_distance_mib}},
        "pipeline": {"num_stages": 4, "micro_batch_size": batch, "num_micro_batches": 1},
        "runtime": {"autocast": args.autocast},
    })
    tokens = batch * seq
    gen = torch.Generator().manual_seed(0)
    stage = StageRuntime(cfg, 1, device)
    ids = torch.randint(0, cfg.model.vocab_size, (batch, seq + 1), generator=gen).to(stage.codec.id_dtype)
    act = torch.randn(batch, seq, rank, generator=gen).to(stage.codec.wire_dtype)
    grad = (1e-3 * torch.randn(batch, seq, rank, generator=gen)).to(stage.codec.wire_dtype)

    def stage_step() -> None:
        stage.forward(0, payload={"act": act.to(device), "ids": ids.to(device)}, train=True)
        stage.backward(0, {"grad": grad.to(device)})

    stage_s = _time(stage_step, args.repeats, device)

    s = config_from_dict({"compression": {"codec": "mapl_vq", "rank": rank, "vq": {
        "codebook_size": args.codebook_size, "rounds": args.rounds, "group_size": args.group_size,
        "max_distance_mib": args.max_distance_mib, "compile": compiled}}}).compression.vq
    z = torch.randn(batch, seq, rank, generator=gen).to(device)
    tx, rx = VQSender(s, "act", stream_generator(0, 1, "act"), device), VQReceiver(s, "act", device)
    warm = tx.warm_up(tokens)  # sizes the search for the device; compiles outside the timings
    compile_s = warm["compile_s"]
    t0 = time.perf_counter()
    tx.encode(z, learn=True)  # k-means initialisation (once per run)
    for sl in tx.take_slices():
        rx.apply(sl)
    _sync(device)
    init_s = time.perf_counter() - t0
    state = {}

    def encode() -> None:
        state["codes"] = tx.encode(z, learn=True)
        for sl in tx.take_slices():
            rx.apply(sl)

    def encode_eval() -> None:
        tx.encode(z, learn=False)

    def decode() -> None:
        rx.decode(state["codes"], tx.version)

    enc_s = _time(encode, args.repeats, device)
    enc_eval_s = _time(encode_eval, args.repeats, device)
    dec_s = _time(decode, args.repeats, device)
    vq_stage_s = 2 * (enc_s + dec_s)  # a middle stage: Z out + dL/dZ in encoded, Z in + dL/dZ out decoded
    out = {
        "preset": preset, "encoder": "compiled" if compiled else "eager", "autocast": args.autocast,
        **({"compile_s": compile_s} if compiled else {}), "hidden_size": cfg.model.hidden_size, "layers_per_stage": len(stage.model.layers),
        "rank": rank, "tokens_per_micro_batch": tokens, "codebook_size": s.codebook_size, "rounds": s.rounds,
        "group_size": s.group_size, "max_distance_mib": args.max_distance_mib,
        "distance_mib": warm["distance_mib"], "search_chunks": warm["chunks"], "fused": bool(warm["fused"]),
        "stage_fwd_bwd_s": stage_s, "stage_fwd_bwd_us_per_token": 1e6 * stage_s / tokens,
        "kmeans_init_s": init_s,
        "encode_learn_us_per_token": 1e6 * enc_s / tokens, "encode_only_us_per_token": 1e6 * enc_eval_s / tokens,
        "decode_us_per_token": 1e6 * dec_s / tokens,
        "vq_per_micro_batch_s": vq_stage_s, "vq_share_of_stage_compute": vq_stage_s / stage_s,
    }
    print(f"{preset} ({out['encoder']}): d={out['hidden_size']} r={rank} {out['layers_per_stage']} layers, {tokens} tokens/micro-batch: "
          f"stage fwd+bwd {stage_s * 1e3:.1f} ms ({out['stage_fwd_bwd_us_per_token']:.1f} us/token); "
          f"VQ encode+learn {out['encode_learn_us_per_token']:.2f} us/token "
          f"(encode only {out['encode_only_us_per_token']:.2f}), decode {out['decode_us_per_token']:.2f} us/token; "
          f"VQ per middle stage {vq_stage_s * 1e3:.1f} ms = {100 * out['vq_share_of_stage_compute']:.0f}% of its "
          f"compute; k-means init {init_s:.2f} s once")
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--presets", default="tiny,150M")
    p.add_argument("--variants", default="eager,compiled", help="encoder variants: eager, compiled")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--codebook-size", type=int, default=256)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--group-size", type=int, default=2)
    p.add_argument("--max-distance-mib", type=float, default=0.0, help="0: sized by device")
    p.add_argument("--autocast", choices=("off", "bf16"), default="off",
                   help="runtime.autocast of the stage's forward+backward (default: off, fp32)")
    p.add_argument("--batch", type=int, default=0, help="sequences per micro-batch (0: the preset's shape)")
    p.add_argument("--seq", type=int, default=0, help="tokens per sequence (0: the preset's shape)")
    p.add_argument("--rank", type=int, default=0, help="projection rank r (0: the preset's shape)")
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "vq_speed.json")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    results: list[dict] = []
    for v in args.variants.split(","):
        for name in args.presets.split(","):
            results.append(bench_preset(name, v == "compiled", args, device))
            _write_report(args, device, results)  # after each result: a run stopped later keeps these


def _write_report(args: argparse.Namespace, device: torch.device, results: list[dict]) -> None:
    report = {"benchmark": "vq_speed", "date": time.strftime("%Y-%m-%d %H:%M:%S"),
              "machine": {"platform": platform.platform(), "processor": platform.processor(),
                          "load_average_1m_at_end": os.getloadavg()[0], "cpus": os.cpu_count(),
                          "torch": torch.__version__, "threads": torch.get_num_threads(), "device": str(device),
                          **({"gpu": torch.cuda.get_device_name(device)} if device.type == "cuda" else {})},
              "command": "python bench/vq_speed.py " + " ".join(f"--{k.replace('_', '-')} {v}"
                                                                for k, v in vars(args).items() if k != "out"),
              "results": results}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(args.out, json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
