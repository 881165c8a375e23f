"""What compressed averaging among replicas costs in quality (``replicas.averaging``, SPEC §9.10 item 16).

    python bench/averaging_quality.py [--steps 100] [--val-every 0] [--micro 4] [--replicas 2] [--seeds 0,1]
                                      [--schemes fp32,powersgd:4,powersgd:16,topk:0.01,topk:0.05]
                                      [--out bench/results/averaging_quality.json]

R replicas per stage are emulated in one process, with the compression code the peers run: the
tiny preset (P = 4, ``mapl``) trains ``--steps`` steps; each step's micro-batches are split among
the R replicas as stage 0 splits them in a swarm (``replica_share``); each replica's gradients
(scaled to the whole batch, with its own error feedback under PowerSGD) are kept apart, then
combined per stage as its scheme does: ``fp32`` the weighted mean; ``fp16`` the weight matrices'
shares and their mean rounded through hivemind's ``Float16Compression``; ``powersgd:R`` at rank R with
:func:`mapl_swarm.replicas.schemes.emulate` (the averager's arithmetic, each all-reduce a weighted
mean), ``topk:F`` with F of each matrix's values (:func:`~mapl_swarm.replicas.schemes.sparse_share`
and ``sparse_sum``, each replica's error feedback its M less its own share), projector
gradients exact. A label may add ``+rows`` (the embedding tables averaged exactly, counted as the
rows each replica touched: index and row) and ``+warmN`` (the first N steps averaged as ``fp32``,
as PyTorch's ``start_powerSGD_iter``) and ``+mom`` (the Muon matrices' error feedback is
their momentum, as Dion's: Muon itself then runs without momentum) and ``+upd`` (the matrices
Muon trains carry each replica's own Muon update, ``replicas.averaged = "updates"``, through the
peers' :class:`~mapl_swarm.replicas.updates.LocalUpdates`, each emulated replica with its own
optimizer state; ``+updall``: every compressed matrix, ``+updadamw``: AdamW's only; with ``fp32``
the same, uncompressed). ``quant:B`` sends each
matrix's values at B bits with error feedback (each row on a uniform grid scaled by its rms; 1 bit:
the sign times the row's mean magnitude). Equal token budget for all; printed and written: each run's
final validation loss (with ``--val-every N`` also every N steps: how the gap moves as training
goes on), and per scheme the mean over seeds of its Δ% against ``fp32`` at the same seed, with the
averaging values each scheme sends per step against fp32's.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from mapl_swarm.config import config_from_dict  # noqa: E402
from mapl_swarm.data import BatchSampler, prepare_data, validation_batches  # noqa: E402
from mapl_swarm.optim.param_table import build_optimizers  # noqa: E402
from mapl_swarm.pipeline.inprocess import InProcessPipeline  # noqa: E402
from mapl_swarm.replicas.schemes import (emulate, initial_factors, low_rank_plan,  # noqa: E402
                                         compressible, feedback, part_compression, sparse_decoded, sparse_plan,
                                         sparse_share, sparse_sum, with_feedback)
from mapl_swarm.replicas.gradients import exact_tensors  # noqa: E402
from mapl_swarm.replicas.updates import LocalUpdates, updated  # noqa: E402
from mapl_swarm.rng import derive_seed  # noqa: E402
from mapl_swarm.step.assignment import replica_share  # noqa: E402

from hivemind.compression import CompressionInfo, deserialize_torch_tensor  # noqa: E402


def _fp16(t: torch.Tensor) -> torch.Tensor:
    c = part_compression("fp16")
    return deserialize_torch_tensor(c.compress(t, CompressionInfo.from_tensor(t)))


class StageAveraging:
    """One stage's averaging among R emulated replicas: its plan, warm-start factors and each
    replica's error feedback."""

    def __init__(self, stage, scheme: str, parameter: str, replicas: int, seed: int, rows: bool = False,
                 momentum: bool = False, update: str = "") -> None:
        self.stage, self.scheme = stage, scheme
        self.params = list(stage.optimized_parameters())
        self.tables = table_tensors(stage) if rows else []
        exact = exact_tensors(stage) + self.tables
        self.rows_sent = self.dense_rounds = 0
        shapes = [tuple(p.shape) for p in self.params]
        self.plan = low_rank_plan(shapes, int(parameter or 4), exact=exact) if scheme == "powersgd" else None
        self.sparse = sparse_plan(shapes, float(parameter or 0.01), exact=exact) if scheme == "topk" else None
        self.half = compressible(shapes, exact) if scheme == "fp16" else ()
        self.bits = int(parameter or 1) if scheme == "quant" else 0
        self.quantized = compressible(shapes, exact) if scheme == "quant" else ()
        self.compressed = self.plan.matrices if self.plan else self.sparse.tensors if self.sparse else self.quantized
        self.factors = initial_factors(self.plan, derive_seed(seed, "powersgd", stage.stage)) if self.plan else []
        self.errors = [[torch.zeros(shapes[i]) for i in self.compressed] for _ in range(replicas)] \
            if self.compressed else None
        self.shares: list[tuple[list[torch.Tensor], float]] = []
        # ``+upd``: the matrices Muon trains cross as each replica's own Muon step (its own momentum,
        # from its own gradient; ``replicas.averaged = "updates"``, the peers' code), not as gradients;
        # ``+updall`` every compressed matrix (AdamW's too), ``+updadamw`` AdamW's only
        self.local = (self.compressed or compressible(shapes, exact)) if update else ()
        if update == "muon":  # the peers' rule
            self.local = updated(stage.optimizers, self.params, self.local)
        elif update == "adamw":  # the others only
            self.local = tuple(i for i in self.local if i not in updated(stage.optimizers, self.params, self.local))
        self.updates = [LocalUpdates(build_optimizers(stage.param_rows, stage.cfg.optim),
                                     [self.params[i] for i in self.local], stage.stage)
                        for _ in range(replicas)] if update else []
        # ``+mom``: the Muon matrices' error feedback is their momentum (Dion's, Ahn et al. 2025): a
        # replica keeps mu of what was sent beside all that was not, and Muon runs without its own
        # momentum, so the averaged, compressed tensor is already the momentum Muon orthogonalizes
        self.decay = [0.0] * len(self.params)
        if momentum and self.compressed:
            muon = stage.optimizers[0]
            ids = {id(p) for g in muon.param_groups for p in g["params"]}
            left = [p for p in ids if p not in {id(self.params[i]) for i in self.compressed}]
            if left:
                raise SystemExit(f"+mom: {len(left)} Muon matrices of stage {stage.stage} are not compressed")
            for i in self.compressed:
                if id(self.params[i]) in ids:
                    self.decay[i] = muon.param_groups[0]["momentum"]
            for g in muon.param_groups:
                g["momentum"] = 0.0

    def _feedback(self, i: int, m: torch.Tensor, sent: torch.Tensor, n: int, total: int) -> torch.Tensor:
        """A replica's error feedback of tensor ``i`` after a round (``+mom``: with mu of ``sent``)."""
        e = feedback(m, sent, n, total)
        return e.add_(sent, alpha=self.decay[i] * n / total) if self.decay[i] else e

    def keep(self, replica: int, n: int, num_micro_batches: int) -> None:
        """Replica ``replica`` computed ``n`` micro-batches: keep its filled tensors, clear the grads."""
        scale = num_micro_batches / n
        filled = [(p.grad.detach().float() * scale) if p.grad is not None else torch.zeros(p.shape)
                  for p in self.params]
        for i in self.tables:  # a table's rows this replica touched: (row index, row) each
            self.rows_sent += int((filled[i] != 0).any(dim=1).sum()) * (filled[i].shape[1] + 1)
        if self.local:  # the replica's own optimizer step, from its own state (the peers' code)
            got = self.updates[replica].compute([filled[i] for i in self.local], self.stage.lr_multiplier())
            for i, u in zip(self.local, got):
                filled[i] = u
        if self.errors is not None:
            for e, i in zip(self.errors[replica], self.compressed):
                with_feedback(filled[i], e, n, num_micro_batches)
        self.shares.append((filled, float(n)))
        for p in self.params:
            p.grad = None

    def combine(self, dense: bool = False) -> None:
        """Set every parameter's gradient to the scheme's average of the kept shares (``dense``: to
        their plain mean, as ``fp32`` does: a warm-up step)."""
        ms, weights = [s for s, _ in self.shares], [w for _, w in self.shares]
        total = sum(weights)
        if self.scheme == "powersgd" and not dense:
            out = emulate(ms, weights, self.plan, self.factors)
            for r, m in enumerate(ms):
                for e, i in zip(self.errors[r], self.plan.matrices):
                    e.copy_(self._feedback(i, m[i], out[i], int(weights[r]), int(total)))
        else:  # the weighted mean, then the scheme's compressed tensors in its place
            out = [sum(m[i] * (w / total) for m, w in zip(ms, weights)) for i in range(len(ms[0]))]
            if dense:
                self.dense_rounds += 1
            elif self.scheme == "topk":
                for i, k in zip(self.sparse.tensors, self.sparse.counts):
                    shares = [sparse_share(m[i], k) for m in ms]
                    out[i] = sparse_sum([(*sh, w) for sh, w in zip(shares, weights)], ms[0][i])
                    for r, (m, sh) in enumerate(zip(ms, shares)):
                        self.errors[r][self.sparse.tensors.index(i)].copy_(
                            self._feedback(i, m[i], sparse_decoded(*sh, m[i]), int(weights[r]), int(total)))
            elif self.scheme == "quant":
                for i in self.quantized:
                    shares = [quantized(m[i], self.bits) for m in ms]
                    out[i] = sum(sh * (w / total) for sh, w in zip(shares, weights))
                    for r, (m, sh) in enumerate(zip(ms, shares)):
                        self.errors[r][self.quantized.index(i)].copy_(
                            self._feedback(i, m[i], sh, int(weights[r]), int(total)))
            elif self.scheme == "fp16":
                for i in self.half:
                    out[i] = _fp16(sum(_fp16(m[i]) * (w / total) for m, w in zip(ms, weights)))
        if self.local:
            self.updates[0].commit([out[i] for i in self.local], self.stage.step_count)
            for u in self.updates[1:]:  # the emulated replicas share one set of parameters
                u.keep_state()
        for i, (p, g) in enumerate(zip(self.params, out)):
            p.grad = None if i in self.local else g.to(p.dtype)
        self.shares = []

    def values(self, rounds: int) -> tuple[float, int]:
        """(values this scheme's round sends for the stage, on average over ``rounds``, values fp32's
        sends); with ``+rows`` the tables' touched rows instead of the tables."""
        counts = [p.numel() for p in self.params]
        plan = self.plan or self.sparse
        sent, dense = plan.values(counts) if plan is not None else (sum(counts), sum(counts))
        if self.quantized:  # bits per value and one float16 scale per row, in 4-byte words
            shapes = [p.shape for p in self.params]
            sent -= sum(counts[i] - counts[i] * self.bits / 32 - shapes[i][0] / 2 for i in self.quantized)
        if self.tables:
            sent += self.rows_sent / rounds - sum(counts[i] for i in self.tables)
        sent += (sum(counts) - sent) * self.dense_rounds / rounds  # warm-up rounds send every value
        return sent, dense


def quantized(m: torch.Tensor, bits: int) -> torch.Tensor:
    """``m`` as a member's ``bits``-bit share decodes it: each row's values rounded to the
    2^bits-level uniform grid (step = the row's rms, levels ±0.5, ±1.5, ... steps: the optimal
    4-level grid for Gaussian values; 1 bit: the sign times the row's mean |value|, as EF-signSGD)."""
    rows = m.reshape(m.shape[0], -1)
    if bits == 1:
        return (torch.sign(rows) * rows.abs().mean(dim=1, keepdim=True)).reshape(m.shape)
    step = rows.pow(2).mean(dim=1, keepdim=True).sqrt().clamp_min(1e-30)
    half = 2 ** (bits - 1)
    q = torch.clamp(torch.floor(rows / step), -half, half - 1) + 0.5
    return (q * step).reshape(m.shape)


def table_tensors(stage) -> list[int]:
    """The stage's embedding tables among its optimized parameters (the token embedding, the MAPL
    anchor table): a replica's gradient of one is non-zero only in the rows of the tokens its
    micro-batches held."""
    tables = [t for t in (getattr(getattr(stage.model, "embed_tokens", None), "weight", None),
                          getattr(stage.anchor, "table", None)) if t is not None]
    return [i for i, p in enumerate(stage.optimized_parameters()) if any(p is t for t in tables)]


def run(scheme_label: str, seed: int, args: argparse.Namespace, data) -> dict:
    scheme_label_base, *extras = scheme_label.split("+")
    scheme, _, parameter = scheme_label_base.partition(":")
    warm = next((int(x.removeprefix("warm")) for x in extras if x.startswith("warm")), 0)
    cfg = config_from_dict({"preset": "tiny", "compression": {"codec": "mapl"},
                            "optim": {"warmup_steps": max(1, args.steps // 20)},
                            "run": {"steps": args.steps, "seed": seed, "out_dir": "runs/bench-averaging-quality"},
                            "pipeline": {"num_stages": 4, "micro_batch_size": 4, "num_micro_batches": args.micro},
                            "runtime": {"threads": 1}}, "bench")
    torch.manual_seed(seed)
    pipe = InProcessPipeline(cfg)
    stages = [StageAveraging(s, scheme, parameter, args.replicas, seed, rows="rows" in extras, momentum="mom" in extras,
                             update=next((x.removeprefix("upd") or "muon" for x in extras if x.startswith("upd")), ""))
              for s in pipe.stages]
    T, M = cfg.model.context_length, cfg.pipeline.num_micro_batches
    sampler = BatchSampler(data.train, cfg.pipeline.micro_batch_size, T, seed)
    val = validation_batches(data.val, cfg.pipeline.micro_batch_size, T, cfg.eval.batches)
    losses, curve = [], []
    for step in range(args.steps):
        batches = [next(sampler) for _ in range(M)]
        step_losses = []
        for r in range(args.replicas):
            share = [g - step * M for g in replica_share(step, M, r, args.replicas)]
            got, _ = pipe.accumulate([batches[g] for g in share])
            step_losses += got
            for b in range(len(pipe.stages) - 1):
                g = pipe.stages[b + 1].take_inbound_projector_grad()
                if g is not None:
                    pipe.stages[b].add_outbound_projector_grad(g)
            for st in stages:
                st.keep(r, len(share), M)
        for st in stages:
            st.combine(dense=step < warm)
        codecs = [s.codec for s in pipe.stages]
        codecs[0].before_pipeline_step(codecs, pipe.stages[0].step_count)
        for s in pipe.stages:
            s.step()
        pipe.sync_projectors()
        losses.append(sum(step_losses) / len(step_losses))
        if args.val_every and (step + 1) % args.val_every == 0 and step + 1 < args.steps:
            curve.append([step + 1, pipe.evaluate(val)])
    sent, dense = (sum(x) for x in zip(*(st.values(args.steps) for st in stages)))
    final = pipe.evaluate(val)
    return {"scheme": scheme_label, "seed": seed, "final_val_loss": final, "val_curve": [*curve, [args.steps, final]],
            "mean_train_loss_last_20": sum(losses[-20:]) / len(losses[-20:]), "values_per_round": sent,
            "fp32_values_per_round": dense}


def write(args: argparse.Namespace, runs: list[dict], t0: float) -> dict:
    """Write the runs so far and their summary to ``args.out``; the summary (per scheme: the mean
    Δ% of val loss against ``fp32`` at the same seed, and averaging bytes against fp32's)."""
    base = {r["seed"]: r["final_val_loss"] for r in runs if r["scheme"] == "fp32"}
    base_curve = {r["seed"]: dict(r["val_curve"]) for r in runs if r["scheme"] == "fp32"}
    summary = {}
    for label in dict.fromkeys(r["scheme"] for r in runs):
        mine = [r for r in runs if r["scheme"] == label]
        deltas = [100.0 * (r["final_val_loss"] - base[r["seed"]]) / base[r["seed"]] for r in mine if r["seed"] in base]
        summary[label] = {"val_loss_delta_pct_mean": sum(deltas) / len(deltas) if deltas else float("nan"),
                          "val_loss_delta_pct": deltas,
                          "val_curve_delta_pct": [[r["seed"], [[step, 100.0 * (loss - base_curve[r["seed"]][step])
                                                                 / base_curve[r["seed"]][step]]
                                                                for step, loss in r["val_curve"]
                                                                if step in base_curve.get(r["seed"], {})]]
                                                  for r in mine],
                          "bytes_vs_fp32": (mine[0]["values_per_round"] * (2 if label == "fp16" else 4))
                          / (4 * mine[0]["fp32_values_per_round"])}
    result = {"command": "python bench/averaging_quality.py " + " ".join(sys.argv[1:]), "steps": args.steps,
              "replicas": args.replicas, "micro_batches": args.micro,
              "machine": f"{platform.node()} {platform.machine()}, {platform.python_version()}, 1 torch thread",
              "date": time.strftime("%Y-%m-%d"), "seconds": round(time.time() - t0), "summary": summary,
              "runs": runs}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    return summary


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--val-every", type=int, default=0, help="also record the validation loss every N steps")
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--micro", type=int, default=4, help="micro-batches per step (split among the replicas)")
    ap.add_argument("--seeds", default="0,1")
    ap.add_argument("--schemes", default="fp32,powersgd:4,powersgd:16,topk:0.01,topk:0.05")
    ap.add_argument("--out", type=Path, default=ROOT / "bench/results/averaging_quality.json")
    args = ap.parse_args()
    torch.set_num_threads(1)
    data = prepare_data(config_from_dict({"preset": "tiny"}, "bench").data, progress=False)
    t0 = time.time()
    runs: list[dict] = []
    for seed in map(int, args.seeds.split(",")):
        for label in args.schemes.split(","):
            runs.append(run(label, seed, args, data))
            r = runs[-1]
            print(f"{label:14s} seed {seed}: val {r['final_val_loss']:.4f}, train (last 20) "
                  f"{r['mean_train_loss_last_20']:.4f}  ({time.time() - t0:.0f} s)", flush=True)
            summary = write(args, runs, t0)  # after every run: a long benchmark stopped keeps what it measured
    for label, got in summary.items():
        print(f"{label:14s} Δ val loss vs fp32 {got['val_loss_delta_pct_mean']:+.2f}% (per seed "
              f"{', '.join(f'{d:+.2f}' for d in got['val_loss_delta_pct'])}), averaging bytes "
              f"{got['bytes_vs_fp32']:.4f} of fp32's")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
