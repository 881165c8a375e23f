"""Generation speed of an exported model, with and without the KV cache, and export time.

    python bench/generate_speed.py MODEL [--run RUN_DIR] [--new-tokens 128] [--prompt TEXT] [--repeats 3]
                                   [--device cpu] [--threads 1]

MODEL is a folder written by ``mapl-swarm export``. Greedy decoding of ``--new-tokens`` tokens after
the prompt, timed ``--repeats`` times each way (the median is reported; the first, warm-up, run is
not counted); both ways must produce the same tokens. With ``--run`` the export of RUN_DIR into a
temporary folder is timed too. Prints the figures and writes bench/results/generate_speed.json.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import tempfile
import time
from pathlib import Path

import torch

from mapl_swarm.files import atomic_write_text
from mapl_swarm.hf.export import export_run
from mapl_swarm.hf.generate import generate
from mapl_swarm.hf.loading import load_model

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--run", help="also time the export of this run folder")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--prompt", default="def main():\n")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "generate_speed.json"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    lm = load_model(args.model, device=args.device)
    new = min(args.new_tokens, lm.context_length - len(lm.tokenizer(args.prompt)["input_ids"]))
    results: dict[str, dict] = {}
    tokens: dict[bool, list[int]] = {}
    for cache in (True, False):
        times = []
        for i in range(args.repeats + 1):
            g = generate(lm, args.prompt, max_new_tokens=new, temperature=0, use_cache=cache)
            if i:
                times.append(g.seconds)
            tokens[cache] = g.new_ids
        median = statistics.median(times)
        results["kv_cache" if cache else "no_cache"] = {
            "new_tokens": len(tokens[cache]), "median_s": median, "tokens_per_s": len(tokens[cache]) / median}
    assert tokens[True] == tokens[False], "cached and uncached greedy decoding differ"
    if args.run:
        with tempfile.TemporaryDirectory() as tmp:
            t0 = time.perf_counter()
            r = export_run(args.run, Path(tmp) / "hf")
            results["export"] = {"seconds": time.perf_counter() - t0, "step": r.step,
                                 "max_logit_diff": r.max_logit_diff}
    report = {"model": args.model, "model_type": lm.model.config.model_type, "device": args.device,
              "threads": args.threads, "prompt_tokens": len(lm.tokenizer(args.prompt)["input_ids"]),
              "machine": f"{platform.machine()} {platform.system()}", "torch": torch.__version__, **results}
    for key in ("kv_cache", "no_cache"):
        r = results[key]
        print(f"{key:>8}: {r['new_tokens']} tokens in {r['median_s']:.3f} s = {r['tokens_per_s']:.1f} tokens/s")
    if "export" in results:
        print(f"  export: {results['export']['seconds']:.2f} s (step {results['export']['step']})")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(Path(args.out), json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
