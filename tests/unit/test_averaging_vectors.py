"""Golden vectors of the averaging arithmetic (protocol/vectors/v2/averaging, SPEC §9.10 items 6 and
16): the stored file is what the generator writes and the reference recomputes it; a changed byte is
reported; and every output follows from its inputs by SPEC's words alone, recomputed here with
numpy and hashlib as an implementation without torch would."""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path

import numpy as np

from mapl_swarm.replicas import averaging_vectors as V
from mapl_swarm.wire.golden.vectors import manifest_text

ROOT = Path(__file__).resolve().parents[2] / V.FOLDER
STORED = json.loads((ROOT / V.MANIFEST).read_text(encoding="utf-8"))
NP = {"float32": np.float32, "float16": np.float16, "int32": np.int32, "int64": np.int64, "float64": np.float64}


def arr(entry: dict) -> np.ndarray:
    return np.frombuffer(bytes.fromhex(entry["hex"]), dtype=np.dtype(NP[entry["dtype"]]).newbyteorder("<")
                         ).reshape(entry["shape"])


def test_the_stored_vectors_pass_their_check():
    assert V.check_manifest(ROOT) == []
    assert V.main(["--check", str(ROOT)]) == 0


def test_a_changed_byte_is_reported(tmp_path):
    bad = json.loads(json.dumps(STORED))
    for entry in (bad["topk_sum"][0]["sum"], bad["powersgd"][0]["P_hat"], bad["fp16"]["part"]):
        raw = bytearray.fromhex(entry["hex"])
        raw[0] ^= 1
        entry["hex"] = raw.hex()
    bad["digest"][0]["digest"] = "0" * 64
    (tmp_path / V.MANIFEST).write_text(manifest_text(bad), encoding="utf-8")
    problems = V.check_manifest(tmp_path)
    for name in ("topk_sum/", "powersgd/p_20x3/P_hat", "fp16", "digest/"):
        assert any(p.startswith(name) for p in problems), (name, problems)


def test_plans_follow_the_spec():
    """fp16/topk: the tensors of two dimensions or more not kept exact; powersgd: those whose matrix
    view (adjacent pair of smallest product merged) has r (a + b) <= ab / 2; topk: ceil(f n) values."""
    def view(shape: list[int]) -> tuple[int, int]:
        dims = list(shape)
        while len(dims) > 2:
            i = min(range(len(dims) - 1), key=lambda j: dims[j] * dims[j + 1])
            dims[i:i + 2] = [dims[i] * dims[i + 1]]
        return dims[0], dims[1]

    for e in STORED["plans"]:
        matrices = [i for i, s in enumerate(e["shapes"]) if len(s) >= 2 and i not in e["exact"]]
        if e["scheme"] == "powersgd":
            r = e["rank"]
            chosen = [i for i in matrices if r * sum(view(e["shapes"][i])) <= math.prod(e["shapes"][i]) / 2]
            assert e["compressed"] == chosen and e["views"] == [list(view(e["shapes"][i])) for i in chosen]
        else:
            assert e["compressed"] == matrices
        if e["scheme"] == "topk":
            assert e["counts"] == [math.ceil(e["fraction"] * math.prod(e["shapes"][i])) for i in matrices]


def test_fp16_parts_are_the_clamped_values_rounded_to_nearest():
    values = arr(STORED["fp16"]["values"])
    assert arr(STORED["fp16"]["part"]).tobytes() == np.clip(values, -65504, 65504).astype(np.float16).tobytes()


def test_topk_shares_hold_the_largest_magnitudes_ascending():
    for e in STORED["topk_share"]:
        x = arr(e["X"]).reshape(-1)
        idx, values = arr(e["indices"]), arr(e["values"])
        assert e["k"] == math.ceil(e["fraction"] * x.size) == idx.size
        assert list(idx) == sorted(np.argsort(-np.abs(x), kind="stable")[:e["k"]])
        assert values.tobytes() == np.clip(x[idx], -65504, 65504).astype(np.float16).tobytes()
        dense = np.zeros(x.size, np.float32)
        dense[idx] = values.astype(np.float32)
        assert arr(e["decoded"]).tobytes() == dense.tobytes()
    assert {e["name"]: e["outcome"] for e in STORED["topk_share_checks"]}["valid"] == "accept"
    assert sum(e["outcome"] == "fail_round" for e in STORED["topk_share_checks"]) == len(STORED["topk_share_checks"]) - 1


def test_a_topk_sum_adds_each_share_times_its_weight_over_the_sum_in_float32_in_group_order():
    e = STORED["topk_sum"][0]
    total = sum(s["weight"] for s in e["shares"])

    def summed(shares: list[dict]) -> bytes:
        out = np.zeros(math.prod(e["shape"]), np.float32)
        for s in shares:
            if s["weight"] > 0:
                scale = np.float32(s["weight"] / total)  # the weight's share, rounded to float32
                np.add.at(out, arr(s["indices"]), arr(s["values"]).astype(np.float32) * scale)
        return out.tobytes()

    assert arr(e["sum"]).tobytes() == summed(e["shares"])
    assert arr(e["sum"]).tobytes() != summed(e["shares"][::-1])  # the vector tells the order apart


def test_powersgd_orthonormalizes_and_multiplies_in_float64_rounded_to_float32():
    for e in STORED["powersgd"]:
        m = arr(e["P"]).astype(np.float64).copy()
        for i in range(m.shape[1]):
            m[:, i] /= math.sqrt(float(np.sum(m[:, i] ** 2))) + 1e-8
            for j in range(i + 1, m.shape[1]):
                m[:, j] -= float(np.sum(m[:, i] * m[:, j])) * m[:, i]
        p_hat = arr(e["P_hat"])
        # summation order inside float64 is free; rounded to float32 it lands on the same values
        assert np.array_equal(p_hat, m.astype(np.float32)), e["name"]
        if "product" in e:
            product = (p_hat.astype(np.float64) @ arr(e["Q"]).astype(np.float64).T).astype(np.float32)
            assert np.array_equal(arr(e["product"]), product), e["name"]
            gram = p_hat.astype(np.float64).T @ p_hat.astype(np.float64)
            assert np.allclose(gram, np.eye(gram.shape[0]), atol=1e-6)


def test_error_feedback_is_x_minus_what_was_sent_times_n_over_m():
    """A replica's own arithmetic: no partner compares it, so float32 within rounding (a fused
    multiply-add kernel rounds once) is all SPEC asks."""
    for e in STORED["feedback"]:
        g, fb, x = arr(e["g"]), arr(e["e"]), arr(e["X"])
        assert np.allclose(x, g + fb * (e["M"] / e["n"]), rtol=1e-6, atol=1e-7), e["name"]
        after = (x.astype(np.float64) - arr(e["sent"])) * (e["n"] / e["M"])
        assert np.allclose(arr(e["e_after"]), after, rtol=1e-6, atol=1e-7), e["name"]
        if "Q" in e:  # PowerSGD: what a round of this one member carries, from its factor Q
            p = np.linalg.qr(x.astype(np.float64) @ arr(e["Q"]))[0]
            sent = p @ (x.astype(np.float64).T @ p).T
            assert np.allclose(arr(e["sent"]), sent, rtol=1e-5, atol=1e-6), e["name"]


def test_the_digest_frame_and_sketch_follow_from_the_skeleton_and_the_tensors():
    e = STORED["digest"][0]
    digest = hashlib.sha256(e["skeleton_repr"].encode())
    frame = hashlib.sha256(e["skeleton_repr"].encode())
    sketch = []
    for header, t in zip(e["tensor_headers"], e["tensors"], strict=True):
        raw = bytes.fromhex(t["hex"])
        digest.update(header.encode() + raw)
        frame.update(header.encode())
        if t["dtype"].startswith("float"):
            x = arr(t).astype(np.float64)
            sketch += [math.fsum(x.reshape(-1)), math.fsum((x * x).reshape(-1))]
        else:
            frame.update(raw)
    assert (digest.hexdigest(), frame.hexdigest()) == (e["digest"], e["frame"])
    assert np.allclose(sketch, e["sketch"], rtol=1e-12, atol=0)
    shapes = [f"torch.{t['dtype']}({', '.join(map(str, t['shape']))}{',' if len(t['shape']) == 1 else ''})"
              for t in e["tensors"]]
    assert shapes == e["tensor_headers"]


def test_each_layout_names_every_averaged_tensor_in_the_state_it_digests_and_serves():
    """The averaged gradients are the digested parameters' (by name, float32, same shape), the
    statistics come only with ``mapl_vq``, and the served ``runtime`` holds the same modules."""
    import ast

    def modules(text: str) -> dict[str, int]:
        node = dict(ast.literal_eval(text)[1])["modules"]  # ['d', [[name, ['t', index]], ...]]
        return {name: leaf[1] for name, leaf in node[1]}

    assert {(e["codec"], e["stage"]) for e in STORED["layout"]} == {(c, s) for c in ("mapl", "mapl_vq")
                                                                    for s in range(3)}
    for e in STORED["layout"]:
        digested, served = modules(e["digested_skeleton_repr"]), modules(e["served_skeleton_repr"])
        assert list(digested) == list(served)
        for name, shape in e["averaged"]:
            assert e["digested_tensor_headers"][digested[name]] == f"torch.float32{tuple(shape)}", name
        assert len({name for name, _ in e["averaged"]}) == len(e["averaged"])
        assert bool(e["statistics"]) == (e["codec"] == "mapl_vq")
