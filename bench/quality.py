"""Quality benchmark: none / mapl / fixed / naive / ssn at equal token budget on the tiny preset.

    python bench/quality.py [--steps 120] [--codecs none,mapl,...] [--rank 64]

Each run trains in-process (P=4) from the same seed on the embedded stdlib corpus, then the script
writes bench/results/quality.json (with a run manifest per run) and bench/results/quality.md, and
replaces the quality section of BENCHMARKS.md between its markers.
"""

from __future__ import annotations

import argparse
import json
import logging
import platform
import re
import time
from pathlib import Path

from mapl_swarm.config.catalog import CODEC_INFO, codecs_by_order, uncompressed_codec
from mapl_swarm.config import config_from_dict, config_to_dict
from mapl_swarm.data import prepare_data
from mapl_swarm.metrics import run_manifest
from mapl_swarm.pipeline.trainer import train

ROOT = Path(__file__).resolve().parents[1]
BEGIN, END = "<!-- quality:begin -->", "<!-- quality:end -->"
DEFAULT_CODECS = "none,mapl,fixed,naive,ssn"


def run_one(label: str, args: argparse.Namespace, data, command: str) -> dict:
    codec, _, variant = label.partition(":")
    compression = {"codec": codec, "rank": args.rank, "anchor_rank": args.rank,
                   "ssn_refresh_interval_steps": args.ssn_refresh}
    seed = args.seed
    for part in filter(None, variant.split("+")):  # variants, e.g. mapl_vq:priority+slice=0.25, mapl:seed=1
        if part.startswith("seed="):  # another seed (model init and data order) than --seed
            seed = int(part.removeprefix("seed="))
        elif part == "full":  # ablation: whole codebooks every micro-batch instead of slices
            compression.setdefault("vq", {})["sync"] = "full"
        elif part == "step":  # codebooks learned once per step (what replicas need)
            compression.setdefault("vq", {})["update"] = "step"
        elif part in ("priority", "round_robin"):
            compression.setdefault("vq", {})["slice_order"] = part
        elif part.startswith("slice="):  # another slice fraction than the default
            compression.setdefault("vq", {})["slice_fraction"] = float(part.removeprefix("slice="))
        elif part.startswith("adamw="):  # SSN's AdamW lr ratio other than its default
            compression["ssn_adamw_lr_ratio"] = float(part.removeprefix("adamw="))
        elif part.startswith("offsets="):  # frozen-offset std (ssn, none_offsets) other than the default
            compression["ssn_offset_std"] = float(part.removeprefix("offsets="))
        else:
            raise SystemExit(f"unknown codec variant {label!r} (known parts, joined by '+': full, priority, "
                             "round_robin, step, slice=FRACTION, adamw=RATIO, offsets=STD, seed=N)")
    cfg = config_from_dict({
        "preset": "tiny",
        "compression": compression,
        "optim": {"warmup_steps": max(1, args.steps // 20)},
        "run": {"steps": args.steps, "seed": seed,
                "out_dir": str(ROOT / "runs" / "bench-quality" / label.replace(":", "-"))},
        "pipeline": {"num_stages": args.stages, "micro_batch_size": args.micro_batch_size,
                     "num_micro_batches": args.micro_batches},
        "eval": {"interval_steps": max(1, args.steps // 4), "batches": 8},
        "runtime": {"threads": args.threads},
    })
    t0 = time.perf_counter()
    s = train(cfg, progress=not args.quiet, data=data)
    wall = time.perf_counter() - t0
    return {
        "codec": label,
        "val_loss": s.final_val_loss,
        "train_loss": s.final_train_loss,
        "val_history": s.val_history,
        "bytes_per_token": s.bytes_per_token[0] if s.bytes_per_token else {},
        "tokens": s.tokens,
        "wall_s": wall,
        "command": command,
        "manifest": run_manifest(config_to_dict(cfg), corpus_fingerprint=data.meta["corpus_fingerprint"],
                                 tokenizer_hash=data.tokenizer.file_hash, seed=seed),
    }


def _seed(r: dict) -> int:
    return int(r["manifest"]["seed"])


def _codec(label: str) -> str:
    """The codec of a row label (``codec[:variant]``, e.g. ``ssn:adamw=0.5``, ``ssn:offsets=1.0+seed=1``)."""
    return label.partition(":")[0]


def _offsets_key(r: dict) -> tuple[int, float | None]:
    """What a frozen-offset row is paired on: its seed and its offsets' std (``ssn:offsets=1.0`` is
    compared with ``none_offsets:offsets=1.0``, not with the default offsets)."""
    return _seed(r), r["manifest"]["config"]["compression"].get("ssn_offset_std")


def offsets_deltas(results: list[dict]) -> dict[str, float]:
    """Δ% of every frozen-offset row (``ssn`` and its variants) vs the uncompressed row with the same
    frozen offsets (the catalog's ``offsets_reference``) of the same seed and offset std, by row label.
    A plain reference row is preferred to a variant of it."""
    refs: dict[tuple[int, float | None], float] = {}
    for r in sorted(results, key=lambda r: ":" not in r["codec"]):  # plain rows last: they win
        info = CODEC_INFO.get(_codec(r["codec"]))
        if info is not None and info.offsets_reference:
            refs[_offsets_key(r)] = r["val_loss"]
    out = {}
    for r in results:
        info = CODEC_INFO.get(_codec(r["codec"]))
        ref = refs.get(_offsets_key(r))
        if info is not None and info.frozen_offsets and not info.offsets_reference and ref:
            out[r["codec"]] = 100 * (r["val_loss"] - ref) / ref
    return out


def sort_rows(results: list[dict]) -> list[dict]:
    """Rows in the default ``--codecs`` order, then the other codecs in catalog order; variants after
    their plain codec, by label; unknown codecs last."""
    order = list(dict.fromkeys(DEFAULT_CODECS.split(",") + [i.name for i in codecs_by_order()]))
    return sorted(results, key=lambda r: (order.index(_codec(r["codec"])) if _codec(r["codec"]) in order else 99,
                                          r["codec"]))


def to_markdown(results: list[dict], args: argparse.Namespace) -> str:
    reference = uncompressed_codec()
    base = {_seed(r): r["val_loss"] for r in results if _codec(r["codec"]) == reference}  # per seed
    # bytes of the plain uncompressed row (variants such as seed=N send the same bytes)
    none_bytes = next((r["bytes_per_token"]["total"] for r in results if r["codec"] == reference), None)
    m = results[0]["manifest"]
    commands = list(dict.fromkeys(r["command"] for r in results))
    lines = [
        "Commands (rows merged from separate runs; each row's commit in the last column): "
        + ", ".join(f"`{c}`" for c in commands) + "  ",
        f"Machine: {platform.machine()}, {m['machine']}, torch {m['versions']['torch']}, "
        f"{args.threads or 'default'} threads; date {time.strftime('%Y-%m-%d')}  ",
        f"Setup: tiny preset (d=256, 8 layers), P={args.stages}, rank {args.rank} "
        f"({256 // args.rank}x vs bf16 `none`), {args.steps} steps x {args.micro_batches} micro-batches x "
        f"{args.micro_batch_size} x 256 tokens = {results[0]['tokens']:,} tokens per run, seed {args.seed} "
        f"(`:seed=N` rows: seed N, Δ% against `none` of the same seed), "
        f"corpus {m['corpus_fingerprint'][:16]} (stdlib), tokenizer {m['tokenizer_hash'][:12]}; "
        f"ssn U refresh every {args.ssn_refresh or 'never (frozen, node0)'} steps.",
        "",
        "Δ% vs none_offsets: frozen-offset codecs (SSN) against the uncompressed run that adds the same "
        "frozen offsets, of the same seed and offset std (—: no such row).",
        "",
        "| codec | final val loss | Δ% vs none | Δ% vs none_offsets | payload B/token per boundary (fwd+bwd) "
        "| compression vs none | wall s | commit |",
        "|---|---|---|---|---|---|---|---|",
    ]
    vs_offsets = offsets_deltas(results)
    for r in results:
        b = base.get(_seed(r))
        delta = f"{100 * (r['val_loss'] - b) / b:+.2f}%" if b else "-"
        delta_offsets = f"{vs_offsets[r['codec']]:+.2f}%" if r["codec"] in vs_offsets else "—"
        total = r["bytes_per_token"].get("total", 0.0)
        ratio = f"{none_bytes / total:.2f}x" if none_bytes and total else "-"
        lines.append(f"| {r['codec']} | {r['val_loss']:.4f} | {delta} | {delta_offsets} | {total:.1f} | {ratio} "
                     f"| {r['wall_s']:.0f} | {r['manifest']['commit'][:7]} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--codecs", default=DEFAULT_CODECS)
    ap.add_argument("--steps", type=int, default=120)
    ap.add_argument("--rank", type=int, default=64)
    ap.add_argument("--stages", type=int, default=4)
    ap.add_argument("--micro-batch-size", type=int, default=4)
    ap.add_argument("--micro-batches", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--ssn-refresh", type=int, default=500)
    ap.add_argument("--quiet", action="store_true")
    ap.add_argument("--no-update", action="store_true", help="do not rewrite BENCHMARKS.md")
    ap.add_argument("--merge", action="store_true",
                    help="add these codecs' rows to bench/results/quality.json instead of replacing it")
    ap.add_argument("--render-only", action="store_true",
                    help="run nothing: rewrite quality.md and BENCHMARKS.md from bench/results/quality.json")
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    command = ("python bench/quality.py " + " ".join(
        f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items()
        if k not in ("quiet", "no_update", "merge", "render_only") and v != ap.get_default(k))
        + (" --merge" if args.merge else "")).strip()
    out = ROOT / "bench" / "results"
    out.mkdir(parents=True, exist_ok=True)
    previous = {}
    if (args.merge or args.render_only) and (out / "quality.json").exists():  # keep other rows of the setup
        previous = {r["codec"]: r for r in json.loads((out / "quality.json").read_text())}
    if not args.render_only:
        data = prepare_data(config_from_dict({}).data, progress=not args.quiet)
        for c in args.codecs.split(","):
            previous[c] = run_one(c, args, data, command)
    results = sort_rows(list(previous.values()))
    (out / "quality.json").write_text(json.dumps(results, indent=2))
    md = to_markdown(results, args)
    (out / "quality.md").write_text(md)
    print(md)
    bench = ROOT / "BENCHMARKS.md"
    if not args.no_update and bench.exists():
        text = bench.read_text()
        if BEGIN in text and END in text:
            text = re.sub(re.escape(BEGIN) + ".*?" + re.escape(END), BEGIN + "\n" + md + END, text, flags=re.S)
            bench.write_text(text)


if __name__ == "__main__":
    main()
