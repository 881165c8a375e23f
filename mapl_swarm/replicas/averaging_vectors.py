"""Golden vectors of what replicas compute when they average (SPEC §9.10 items 6 and 16).

    python -m mapl_swarm.replicas.averaging_vectors --out protocol/vectors/v2/averaging     # (re)write
    python -m mapl_swarm.replicas.averaging_vectors --check protocol/vectors/v2/averaging   # verify

The averaging layer's messages are hivemind's protobuf RPCs; what an implementation must get to the
byte is the arithmetic around them, where every member has to end a round with the same bytes. One
JSON file, ``manifest.json``, each entry its inputs and the reference's outputs (tensors as
little-endian element bytes in hex, with dtype and shape):

- ``plans``: which averaged tensors each scheme compresses, and how (``fp16``/``topk``: the weight
  matrices; ``powersgd``: their matrix views and which save enough at a rank);
- ``fp16``: float32 values as a ``FLOAT16`` part carries them (clamped to ±65504);
- ``feedback``: X = g + e·M/n, and e after a round (``with_feedback``, ``feedback``);
- ``topk_share``: a replica's share of X (k indices of largest magnitude, ascending int32; float16
  values) and the checks a received share must pass;
- ``topk_sum``: a group's shares summed, weighted, in group order (float32);
- ``powersgd``: an averaged P orthonormalized (float64 Gram-Schmidt, rounded to float32) and the
  product P̂ Q̂ᵀ (float64, rounded);
- ``digest``: a small state's digest, frame and sketch (item 6; flattened as item 11 says);
- ``layout``: for each stage of the ``tiny`` preset's 3-stage pipeline with ``mapl`` and with
  ``mapl_vq`` (``vq.update = "step"``), the averaged tensors in order (parameter names and shapes,
  then the step statistics' shapes), the skeleton and tensor headers of the state a round digests,
  and the skeleton and tensor headers of the stage state a joiner downloads (``runtime``, after
  one optimizer step: the optimizers' state as torch's ``state_dict`` lays it out).

The generator draws every input from fixed seeds, so it reproduces the file byte for byte;
``--check`` recomputes every output from the stored inputs alone with the reference
(:mod:`~mapl_swarm.replicas.schemes`, :mod:`~mapl_swarm.replicas.state`), then compares the whole
file with the generator's.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from hivemind.compression import Float16Compression
from hivemind.compression.base import CompressionInfo

from mapl_swarm.replicas.schemes import (check_share, compressible, feedback, low_rank_plan, orthonormal, product,
                                         sparse_decoded, sparse_plan, sparse_share, sparse_sum, with_feedback)
from mapl_swarm.replicas.state import flatten_state, state_summary
from mapl_swarm.wire.golden.vectors import check_manifest_file, manifest_main

__all__ = ["build_manifest", "check_manifest", "main"]

MANIFEST = "manifest.json"
FOLDER = "protocol/vectors/v2/averaging"
COMMAND = "mapl_swarm.replicas.averaging_vectors"
PLAN_SHAPES = [[64, 32], [32], [8, 4, 16], [3, 5, 7, 2], [4, 4], [512, 2], [6, 6], [], [96, 256], [10, 10]]
"""Averaged tensors' shapes for the plans: matrices, vectors, a scalar, 3-D and 4-D tensors, one
too small to save at rank 2, one too narrow (512 x 2), and 100 values (0.07 of them: the double
product 7.000000000000001 rounds up to 8)."""
TOPK_FRACTIONS = (0.01, 0.05, 0.07, 0.3, 1.0)


# ---------------------------------------------------------------------- tensors in JSON
def tensor_json(t: torch.Tensor) -> dict[str, Any]:
    """``t`` as {dtype, shape, hex of its little-endian element bytes}."""
    t = t.detach().cpu().contiguous()
    return {"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape),
            "hex": t.reshape(-1).view(torch.uint8).numpy().tobytes().hex()}


def tensor_of(entry: dict[str, Any]) -> torch.Tensor:
    """The tensor a :func:`tensor_json` entry holds."""
    dtype = getattr(torch, entry["dtype"])
    raw = bytearray(bytes.fromhex(entry["hex"]))
    flat = torch.frombuffer(raw, dtype=dtype) if raw else torch.empty(0, dtype=dtype)
    return flat.reshape(entry["shape"])


def _draw(seed: int, shape: tuple[int, ...], scale: float = 1.0) -> torch.Tensor:
    """Float32 values of distinct magnitudes (no top-k tie to break) drawn from ``seed``."""
    rng = np.random.default_rng(seed)
    n = math.prod(shape)
    magnitudes = rng.permutation(np.arange(1, n + 1, dtype=np.float64)) / n * scale
    signs = rng.choice([-1.0, 1.0], size=n)
    jitter = 1.0 + rng.uniform(0.0, 0.4 / n, size=n)
    return torch.from_numpy((signs * magnitudes * jitter).astype(np.float32)).reshape(shape)


# ---------------------------------------------------------------------- entries
def _plans() -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = [{"scheme": s, "shapes": PLAN_SHAPES, "exact": [4],
                                  "compressed": list(compressible(PLAN_SHAPES, exact=[4]))} for s in ("fp16",)]
    for rank in (1, 2, 8):
        plan = low_rank_plan(PLAN_SHAPES, rank, exact=[4])
        out.append({"scheme": "powersgd", "rank": rank, "shapes": PLAN_SHAPES, "exact": [4],
                    "compressed": list(plan.matrices), "views": [list(v) for v in plan.views],
                    "factor_shapes": [list(s) for s in plan.factor_shapes]})
    for fraction in TOPK_FRACTIONS:
        plan = sparse_plan(PLAN_SHAPES, fraction, exact=[4])
        out.append({"scheme": "topk", "fraction": fraction, "shapes": PLAN_SHAPES, "exact": [4],
                    "compressed": list(plan.tensors), "counts": list(plan.counts)})
    return out


def _fp16_values() -> torch.Tensor:
    return torch.tensor([0.0, -0.0, 1.0, -2.5, 1e-3, 3.0e-8, 6.0e-5, 65504.0, 65519.0, 70000.0, -1e9, 0.1,
                         1.0 / 3.0, 2049.0, 2051.0, -7.7e-6], dtype=torch.float32)


def _fp16(values: torch.Tensor) -> torch.Tensor:
    part = Float16Compression().compress(values, CompressionInfo.from_tensor(values))
    return torch.frombuffer(bytearray(part.buffer), dtype=torch.float16).clone()


def _feedback_case(name: str, g: torch.Tensor, e: torch.Tensor, n: int, total: int,
                   sent: Callable[[torch.Tensor], torch.Tensor], **inputs: torch.Tensor) -> dict[str, Any]:
    x = with_feedback(g.clone(), e, n, total)
    return {"name": name, "g": tensor_json(g), "e": tensor_json(e), "n": n, "M": total,
            **{k: tensor_json(v) for k, v in inputs.items()}, "X": tensor_json(x),
            "sent": tensor_json(sent(x)), "e_after": tensor_json(feedback(x, sent(x), n, total))}


def one_member_low_rank(x: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """What a PowerSGD round of one member carries of its X from factor ``q``: P̂ Q̂'ᵀ, with
    P = X Q orthonormalized and Q̂' = Xᵀ P̂."""
    p_hat = orthonormal(x @ q)
    return product(p_hat, x.t() @ p_hat)


def _topk_share(name: str, x: torch.Tensor, fraction: float) -> dict[str, Any]:
    k = math.ceil(fraction * x.numel())
    idx, values = sparse_share(x, k)
    return {"name": name, "X": tensor_json(x), "fraction": fraction, "k": k, "indices": tensor_json(idx),
            "values": tensor_json(values), "decoded": tensor_json(sparse_decoded(idx, values, x))}


def _shares() -> list[dict[str, Any]]:
    return [_topk_share("matrix_12x8_f0.1", _draw(11, (12, 8)), 0.1),
            _topk_share("tensor_3x4x5_f0.05", _draw(12, (3, 4, 5), scale=1e-3), 0.05),
            _topk_share("large_values_f0.25", _draw(13, (4, 4), scale=1e5), 0.25),
            _topk_share("all_f1.0", _draw(14, (2, 3)), 1.0)]


def _share_checks() -> list[dict[str, Any]]:
    """A received share of a tensor of 20 values, k = 4: accepted, or the reason it fails the round."""
    i32, f16 = torch.int32, torch.float16
    good_idx, good_val = torch.tensor([1, 5, 6, 19], dtype=i32), torch.tensor([0.5, -1.0, 2.0, 3.0], dtype=f16)
    cases = [("valid", good_idx, good_val),
             ("indices_int64", good_idx.long(), good_val),
             ("values_float32", good_idx, good_val.float()),
             ("too_few", good_idx[:3], good_val[:3]),
             ("index_out_of_range", torch.tensor([1, 5, 6, 20], dtype=i32), good_val),
             ("negative_index", torch.tensor([-1, 5, 6, 19], dtype=i32), good_val),
             ("not_ascending", torch.tensor([1, 6, 5, 19], dtype=i32), good_val),
             ("repeated_index", torch.tensor([1, 5, 5, 19], dtype=i32), good_val),
             ("value_inf", good_idx, torch.tensor([0.5, float("inf"), 2.0, 3.0], dtype=f16)),
             ("value_nan", good_idx, torch.tensor([0.5, 1.0, float("nan"), 3.0], dtype=f16))]
    return [{"name": name, "numel": 20, "k": 4, "indices": tensor_json(idx), "values": tensor_json(val),
             "outcome": "accept" if check_share(idx, val, 4, 20) is None else "fail_round"}
            for name, idx, val in cases]


def _topk_sum() -> dict[str, Any]:
    """Four members' shares of a 5 x 6 tensor, overlapping in most indices, with magnitudes far
    apart, so that float32 sums in another order than the group's give other bytes."""
    like = torch.zeros(5, 6)
    members = []
    for seed, (weight, fraction, scale) in enumerate([(2.0, 0.8, 1.0), (0.0, 0.5, 1.0), (1.0, 0.9, 3e-4),
                                                      (3.0, 0.7, 1e3)]):
        x = _draw(20 + seed, tuple(like.shape), scale=scale)
        idx, values = sparse_share(x, math.ceil(fraction * like.numel()))
        members.append((idx, values, weight))
    total = sparse_sum(members, like)
    if torch.equal(total, sparse_sum(members[::-1], like)):
        raise AssertionError("the top-k sum vector must tell the group's order from its reverse")
    return {"name": "group_of_4_one_of_weight_0", "shape": list(like.shape),
            "shares": [{"indices": tensor_json(i), "values": tensor_json(v), "weight": w} for i, v, w in members],
            "sum": tensor_json(total)}


def _powersgd() -> list[dict[str, Any]]:
    out = []
    for name, rows, cols, rank, seed in (("p_20x3", 20, 8, 3, 30), ("p_7x1", 7, 5, 1, 31), ("p_16x4", 16, 16, 4, 32)):
        p = _draw(seed, (rows, rank))
        q = _draw(seed + 100, (cols, rank))
        p_hat = orthonormal(p)
        out.append({"name": name, "P": tensor_json(p), "P_hat": tensor_json(p_hat), "Q": tensor_json(q),
                    "product": tensor_json(product(p_hat, q))})
    dependent = torch.tensor([[1.0, 2.0], [2.0, 4.0], [0.5, 1.0]], dtype=torch.float32)  # second column = 2 x first
    out.append({"name": "rank_deficient", "P": tensor_json(dependent), "P_hat": tensor_json(orthonormal(dependent))})
    return out


def _feedback() -> list[dict[str, Any]]:
    g, e = _draw(40, (4, 6)), _draw(41, (4, 6), scale=0.1)
    big_g, big_e, q = _draw(43, (12, 10)), _draw(44, (12, 10), scale=0.1), _draw(42, (10, 2))
    if low_rank_plan([[12, 10]], 2).matrices != (0,):
        raise AssertionError("the PowerSGD feedback vector's matrix must be one PowerSGD compresses")
    return [_feedback_case("topk_f0.25_n2_of_6", g, e, 2, 6,
                           lambda x: sparse_decoded(*sparse_share(x, math.ceil(0.25 * x.numel())), x)),
            _feedback_case("powersgd_12x10_rank2_n3_of_4", big_g, big_e, 3, 4,
                           lambda x: one_member_low_rank(x, q), Q=q)]


def _state() -> dict[str, Any]:
    return {"params": [_draw(50, (2, 3)), torch.tensor([7, -1, 3], dtype=torch.int64)],
            "optimizer": {"state": {0: {"step": torch.tensor(5.0), "exp_avg": _draw(51, (2, 3), scale=1e-2)}},
                          "param_groups": [{"lr": 0.0003, "betas": (0.9, 0.95), "params": [0], "foreach": None,
                                            "amsgrad": False, "name": "body"}]},
            "codebooks": torch.zeros(0, 4, dtype=torch.float32)}


def _digest() -> dict[str, Any]:
    state = _state()
    skeleton, tensors = flatten_state(state)
    digest, frame, sketch = state_summary(state)
    return {"name": "small_stage_state", "skeleton_repr": repr(skeleton), "tensors": [tensor_json(t) for t in tensors],
            "tensor_headers": _headers(tensors),
            "digest": digest, "frame": frame, "sketch": sketch}


LAYOUT_CODECS: tuple[tuple[str, dict[str, Any]], ...] = (("mapl", {}), ("mapl_vq", {"vq": {"update": "step"}}))
"""The codecs whose stages' layouts are vectors: without and with averaged step statistics."""


def _headers(tensors: list[torch.Tensor]) -> list[str]:
    return [f"{t.dtype}{tuple(t.shape)}" for t in tensors]


@functools.cache
def _layout() -> tuple[dict[str, Any], ...]:
    """What each stage of the ``tiny`` preset averages, digests and serves (built once: a few s)."""
    from mapl_swarm.config.loading import config_from_dict
    from mapl_swarm.pipeline.stage import StageRuntime

    out = []
    for codec, extra in LAYOUT_CODECS:
        cfg = config_from_dict({"preset": "tiny", "pipeline": {"num_stages": 3},
                                "compression": {"codec": codec, **extra}})
        for stage in range(cfg.pipeline.num_stages):
            rt = StageRuntime(cfg, stage)
            names = {id(p): name for name, p in rt.modules.named_parameters()}
            params = rt.optimized_parameters()
            digested, digested_tensors = flatten_state({"modules": rt.modules.state_dict(),
                                                        "codec": rt.codec.replicated_state()})
            for p in params:
                p.grad = torch.zeros_like(p)
            for opt in rt.optimizers:
                opt.step()
            rt.step_count = 1
            served, served_tensors = flatten_state(rt.state_dict())
            out.append({"preset": "tiny", "codec": codec, "compression": extra, "stage": stage,
                        "averaged": [[names[id(p)], list(p.shape)] for p in params],
                        "statistics": [list(t.shape) for t in rt.step_statistics()],
                        "digested_skeleton_repr": repr(digested), "digested_tensor_headers": _headers(digested_tensors),
                        "served_skeleton_repr": repr(served), "served_tensor_headers": _headers(served_tensors)})
    return tuple(out)


def build_manifest() -> dict[str, Any]:
    """Every vector (module docstring), in a fixed order."""
    fp16_in = _fp16_values()
    return {
        "protocol": [2, 1],
        "regenerate": f"python -m {COMMAND} --out {FOLDER}",
        "check": f"python -m {COMMAND} --check {FOLDER}",
        "plans": _plans(),
        "fp16": {"values": tensor_json(fp16_in), "part": tensor_json(_fp16(fp16_in))},
        "feedback": _feedback(),
        "topk_share": _shares(),
        "topk_share_checks": _share_checks(),
        "topk_sum": [_topk_sum()],
        "powersgd": _powersgd(),
        "digest": [_digest()],
        "layout": list(_layout()),
    }


# ---------------------------------------------------------------------- check
def _same(label: str, got: torch.Tensor, want: dict[str, Any]) -> list[str]:
    return [] if tensor_json(got) == want else [f"{label}: the reference computes other bytes"]


def _recompute(stored: dict[str, Any]) -> list[str]:
    """Every output recomputed from its stored inputs alone."""
    problems: list[str] = []
    for e in stored["plans"]:
        if e["scheme"] == "fp16":
            ok = list(compressible(e["shapes"], e["exact"])) == e["compressed"]
        elif e["scheme"] == "powersgd":
            plan = low_rank_plan(e["shapes"], e["rank"], e["exact"])
            ok = list(plan.matrices) == e["compressed"] and [list(v) for v in plan.views] == e["views"]
        else:
            plan = sparse_plan(e["shapes"], e["fraction"], e["exact"])
            ok = list(plan.tensors) == e["compressed"] and list(plan.counts) == e["counts"]
        if not ok:
            problems.append(f"plans/{e['scheme']}: the reference plans otherwise")
    problems += _same("fp16", _fp16(tensor_of(stored["fp16"]["values"])), stored["fp16"]["part"])
    for e in stored["feedback"]:
        x = with_feedback(tensor_of(e["g"]).clone(), tensor_of(e["e"]), e["n"], e["M"])
        problems += _same(f"feedback/{e['name']}/X", x, e["X"])
        if "Q" in e and not torch.allclose(one_member_low_rank(x, tensor_of(e["Q"])), tensor_of(e["sent"]),
                                           rtol=1e-5, atol=1e-6):
            problems.append(f"feedback/{e['name']}/sent: not what a one-member round carries")
        problems += _same(f"feedback/{e['name']}/e_after", feedback(x, tensor_of(e["sent"]), e["n"], e["M"]),
                          e["e_after"])
    for e in stored["topk_share"]:
        x = tensor_of(e["X"])
        idx, values = sparse_share(x, e["k"])
        problems += _same(f"topk_share/{e['name']}/indices", idx, e["indices"])
        problems += _same(f"topk_share/{e['name']}/values", values, e["values"])
        problems += _same(f"topk_share/{e['name']}/decoded", sparse_decoded(idx, values, x), e["decoded"])
    for e in stored["topk_share_checks"]:
        got = check_share(tensor_of(e["indices"]), tensor_of(e["values"]), e["k"], e["numel"])
        if ("accept" if got is None else "fail_round") != e["outcome"]:
            problems.append(f"topk_share_checks/{e['name']}: expected {e['outcome']}")
    for e in stored["topk_sum"]:
        shares = [(tensor_of(s["indices"]), tensor_of(s["values"]), s["weight"]) for s in e["shares"]]
        problems += _same(f"topk_sum/{e['name']}", sparse_sum(shares, torch.zeros(e["shape"])), e["sum"])
    for e in stored["powersgd"]:
        p_hat = orthonormal(tensor_of(e["P"]))
        problems += _same(f"powersgd/{e['name']}/P_hat", p_hat, e["P_hat"])
        if "product" in e:
            problems += _same(f"powersgd/{e['name']}/product", product(tensor_of(e["P_hat"]), tensor_of(e["Q"])),
                              e["product"])
    for e in stored["digest"]:
        # the stored tensors, in the skeleton's order, stand in for the state's own
        tensors = iter(tensor_of(t) for t in e["tensors"])
        state = _state()
        skeleton, _ = flatten_state(state)
        if repr(skeleton) != e["skeleton_repr"]:
            problems.append(f"digest/{e['name']}: the skeleton differs")
            continue
        rebuilt = _replace_tensors(state, tensors)
        if list(state_summary(rebuilt)) != [e["digest"], e["frame"], e["sketch"]]:
            problems.append(f"digest/{e['name']}: the reference digests the stored tensors otherwise")
    return problems


def _replace_tensors(state: Any, tensors: Any) -> Any:
    """``state`` with each tensor, in flattening order, replaced by the next of ``tensors``."""
    if isinstance(state, torch.Tensor):
        return next(tensors)
    if isinstance(state, dict):
        return {k: _replace_tensors(v, tensors) for k, v in state.items()}
    if isinstance(state, (list, tuple)):
        items = [_replace_tensors(v, tensors) for v in state]
        return tuple(items) if isinstance(state, tuple) else items
    return state


def check_manifest(root: Path) -> list[str]:
    """Every problem with the stored vectors under ``root``: each output recomputed by the reference
    from its stored inputs, then the whole file against the generator's."""
    return check_manifest_file(root, MANIFEST, build_manifest, _recompute)


def main(argv: list[str] | None = None) -> int:
    """Command line entry point; returns the exit status."""
    return manifest_main(argv, command=COMMAND, description=__doc__.split("\n")[0], build=build_manifest,
                         check=check_manifest, name=MANIFEST)


if __name__ == "__main__":
    raise SystemExit(main())
