"""Content checks (SPEC §6.1, wire.content): run shapes, step window, projector version, values."""

from __future__ import annotations

import math
import pickle
from dataclasses import replace

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mapl_swarm.pipeline.payload import WireName
from mapl_swarm.wire import Message, MessageType, WireTensor, decode, decode_header, encode
from mapl_swarm.wire.content import (
    CONTENT_CODES,
    TENSOR_NAMES,
    ContentError,
    RunShapes,
    Window,
    check_content,
    check_declared,
    check_header,
)
from mapl_swarm.wire.golden.content_cases import RUN, STIEFEL, VQ_RUN, WINDOW

MT = MessageType
PROPS = settings(max_examples=50, deadline=None, database=None,
                 suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


def code_of(fn, *args) -> str:
    try:
        fn(*args)
    except ContentError as e:
        assert e.code in CONTENT_CODES and e.text
        return e.code
    return "accept"


def bf16(x: np.ndarray) -> np.ndarray:
    return (np.asarray(x, "<f4").view("<u4") >> 16).astype("<u2")


def act_for(shapes: RunShapes, *, rng: np.random.Generator, step: int = 5, micro: int = 0, pver: int = 5,
            mode: str = "train") -> Message:
    """A train/eval ACT from upstream that fits ``shapes``."""
    B, T, w = shapes.micro_batch_size, shapes.context_length, shapes.width
    ids = rng.integers(0, shapes.vocab_size, size=(B, T + 1)).astype(np.dtype(_np(shapes.id_dtype)))
    if shapes.vq:
        payload = {"codes": WireTensor(shapes.code_dtype, rng.integers(0, shapes.vq_codebook_size,
                                       size=(B, T, shapes.vq_rounds, shapes.vq_groups)).astype(_np(shapes.code_dtype)))}
    else:
        z = rng.standard_normal((B, T, w)).astype("<f4")
        payload = {"z": WireTensor(shapes.wire_dtype, bf16(z) if shapes.wire_dtype == "bf16"
                                   else z.astype(_np(shapes.wire_dtype)))}
    return Message(type=MT.ACT, run_id="r", src=shapes.stage - 1, dst=shapes.stage, step=step, micro=micro,
                   pver=pver, meta={"mode": mode}, tensors={"ids": WireTensor(shapes.id_dtype, ids), **payload})


def _np(tag: str) -> str:
    from mapl_swarm.wire.spec import DTYPES
    return DTYPES[tag].numpy.str


run_shapes = st.builds(
    lambda B, T, d, w, V, wire, ids, vq, M, P, s: RunShapes(
        micro_batch_size=B, context_length=T, hidden_size=d, width=w * (2 if vq else 1), vocab_size=V,
        wire_dtype=wire, id_dtype=ids, vq_rounds=2 if vq else 0, vq_group_size=2 if vq else 0,
        vq_codebook_size=vq or 0, num_micro_batches=M, eval_batches=2, num_stages=P, stage=min(s, P - 1) or 1),
    st.integers(1, 3), st.integers(1, 6), st.integers(1, 8), st.integers(1, 4), st.integers(2, 70000),
    st.sampled_from(["bf16", "fp16", "fp32"]), st.sampled_from(["uint16", "uint32", "int32", "int64"]),
    st.sampled_from([None, 16, 256, 300]), st.integers(1, 4), st.integers(2, 5), st.integers(1, 4))


def test_tensor_names_are_the_payload_wire_names():
    assert set(TENSOR_NAMES[MT.ACT]) == {WireName.IDS, WireName.Z, WireName.CODES}
    assert set(TENSOR_NAMES[MT.GRAD]) == {WireName.DZ, WireName.CODES}
    assert TENSOR_NAMES[MT.PROJ] == (WireName.PROJ,) and TENSOR_NAMES[MT.PROJ_GRAD] == (WireName.PROJ_GRAD,)
    assert set(TENSOR_NAMES[MT.CODEBOOK_SLICE]) == {WireName.CODES, WireName.INDEX}


@PROPS
@given(run_shapes, st.integers(0, 2**32 - 1), st.booleans())
def test_a_fitting_act_is_accepted_and_survives_the_wire(shapes, seed, eval_mode):
    rng = np.random.default_rng(seed)
    msg = act_for(shapes, rng=rng, micro=1 if eval_mode else shapes.num_micro_batches - 1,
                  mode="eval" if eval_mode else "train")
    window = Window(low=5, high=6, pver=5)
    check_content(msg, shapes, window)
    frames = encode(msg)
    header, _ = decode_header(frames)
    check_header(header, shapes, window)
    check_declared(header, shapes)
    check_content(decode(frames, limits=shapes.decode_limits()), shapes, window)


@PROPS
@given(run_shapes, st.integers(0, 2**32 - 1), st.sampled_from(["id", "nan", "inf", "shape", "dtype", "code",
                                                               "micro", "step", "pver", "sender"]))
def test_one_defect_gives_its_code(shapes, seed, defect):
    rng = np.random.default_rng(seed)
    msg = act_for(shapes, rng=rng)
    t = {k: v.data.copy() for k, v in msg.tensors.items()}
    tags = {k: v.dtype for k, v in msg.tensors.items()}
    expect = {"id": "id_out_of_range", "nan": "non_finite", "inf": "non_finite", "shape": "wrong_shape",
              "dtype": "wrong_dtype", "code": "code_out_of_range", "micro": "out_of_window",
              "step": "out_of_window", "pver": "stale_projector", "sender": "not_allowed"}[defect]
    if defect == "id":
        if shapes.vocab_size > np.iinfo(t["ids"].dtype).max:
            return
        t["ids"].flat[rng.integers(t["ids"].size)] = shapes.vocab_size
    elif defect in ("nan", "inf"):
        if shapes.vq:
            return
        z = t["z"]
        bad = {"bf16": {"nan": 0x7FC0, "inf": 0xFF80}, "fp16": {"nan": np.nan, "inf": -np.inf},
               "fp32": {"nan": np.nan, "inf": np.inf}}[tags["z"]][defect]
        z.flat[rng.integers(z.size)] = bad
    elif defect == "shape":
        t["ids"] = t["ids"][:, :-1].copy()
    elif defect == "dtype":
        tags["ids"] = {"uint16": "fp16", "uint32": "fp32", "int32": "uint32", "int64": "fp64"}[tags["ids"]]
        t["ids"] = t["ids"].view(_np(tags["ids"]))
    elif defect == "code":
        if not shapes.vq or shapes.vq_codebook_size > np.iinfo(t["codes"].dtype).max:
            return  # K = 256 in uint8: every code fits
        t["codes"].flat[rng.integers(t["codes"].size)] = shapes.vq_codebook_size
    elif defect == "micro":
        msg.micro = shapes.num_micro_batches
    elif defect == "step":
        msg.step = 7
    elif defect == "pver":
        msg.pver = 4
    elif defect == "sender":
        msg.src = shapes.stage + 1 if shapes.stage + 1 < shapes.num_stages else shapes.stage
    msg.tensors = {k: WireTensor(tags[k], v) for k, v in t.items()}
    assert code_of(check_content, msg, shapes, Window(low=5, high=6, pver=5)) == expect


messages = st.builds(
    lambda mtype, src, dst, step, micro, pver, tensors, mode: Message(
        type=mtype, run_id="r", src=src, dst=dst, step=step, micro=micro, pver=pver,
        meta={"mode": mode, "loss": float("nan"), "tokens": 1, "stream": "act"}, tensors=tensors),
    st.sampled_from(list(MT)), st.integers(0, 5), st.integers(0, 5), st.integers(0, 20), st.integers(0, 9),
    st.integers(0, 20),
    st.dictionaries(st.sampled_from(["ids", "z", "dz", "codes", "proj", "grad", "index", "x"]),
                    st.builds(lambda tag, shape, seed: WireTensor(
                        tag, np.random.default_rng(seed).integers(0, 256, size=int(np.prod(shape)) *
                                                                 int(np.dtype(_np(tag)).itemsize),
                                                                 dtype=np.uint8).view(_np(tag)).reshape(shape)),
                              st.sampled_from(["bf16", "fp16", "fp32", "fp64", "uint8", "uint16", "uint32",
                                               "int32", "int64"]),
                              st.lists(st.integers(0, 5), max_size=5), st.integers(0, 2**32 - 1)),
                    max_size=3),
    st.sampled_from(["train", "eval"]))


@PROPS
@given(messages, run_shapes, st.integers(0, 20), st.integers(0, 3), st.one_of(st.none(), st.integers(0, 20)))
def test_check_content_raises_only_content_errors(msg, shapes, low, span, pver):
    window = Window(low=low, high=low + span, pver=pver)
    assert code_of(check_content, msg, shapes, window) in (*CONTENT_CODES, "accept")


def test_projector_rules():
    proj = Message(type=MT.PROJ, run_id="r", src=0, dst=1, step=13, pver=13, tensors={"proj": STIEFEL})
    for pver, code in ((12, "accept"), (13, "accept"), (11, "stale_projector"), (14, "stale_projector")):
        assert code_of(check_content, replace_msg(proj, pver=pver), RUN, WINDOW if pver != 13 else
                       Window(low=12, high=13, pver=12)) == code
    assert code_of(check_content, proj, RUN, Window(low=12, high=13, pver=None)) == "accept"  # not checked
    fixed = replace(RUN, trainable_projector=False)
    assert code_of(check_content, proj, fixed, WINDOW) == "not_allowed"


def replace_msg(msg: Message, **kv) -> Message:
    return Message(**{**msg.__dict__, **kv})


def test_report_numbers_and_direction():
    rep = Message(type=MT.REPORT, run_id="r", src=2, dst=1, step=12,
                  meta={"mode": "train", "loss": 3.0, "tokens": 32, "metrics": {"lr": math.inf}})
    assert code_of(check_content, rep, RUN, WINDOW) == "non_finite"
    rep.meta["metrics"] = {"lr": 0.1}
    assert code_of(check_content, rep, RUN, WINDOW) == "accept"
    assert code_of(check_content, replace_msg(rep, src=0), RUN, WINDOW) == "not_allowed"
    last = replace(RUN, stage=3)
    assert code_of(check_content, replace_msg(rep, src=4, dst=3), last, WINDOW) == "not_allowed"


def test_checkpoint_and_resync_directions():
    ck = Message(type=MT.CHECKPOINT, run_id="r", src=2, dst=1, meta={"phase": "saved", "step": 4})
    assert code_of(check_sender_only, ck) == "accept"
    assert code_of(check_sender_only, replace_msg(ck, src=0)) == "not_allowed"
    ck.meta = {"phase": "complete", "step": 4}
    assert code_of(check_sender_only, replace_msg(ck, src=0)) == "accept"
    rs = Message(type=MT.RESYNC, run_id="r", src=2, dst=1, meta={"stream": "act", "have": 3})
    assert code_of(check_content, rs, VQ_RUN, WINDOW) == "accept"  # the act stream's receiver asks
    assert code_of(check_content, replace_msg(rs, src=0), VQ_RUN, WINDOW) == "not_allowed"
    assert code_of(check_content, rs, RUN, WINDOW) == "not_allowed"  # no codebooks in this run
    hb = Message(type=MT.HEARTBEAT, run_id="r", src=0, dst=1)
    assert code_of(check_content, hb, RUN, WINDOW) == "accept"
    assert code_of(check_content, replace_msg(hb, src=3), RUN, WINDOW) == "not_allowed"


def check_sender_only(msg: Message) -> None:
    check_header(msg, RUN, WINDOW)


def test_declared_sizes_are_checked_on_the_header_alone():
    big = Message(type=MT.ACT, run_id="r", src=0, dst=1, step=12, micro=0, pver=12, meta={"mode": "train"},
                  tensors={"ids": np.zeros((2, 1 << 16), "<u2"), "z": np.zeros((2, 4, 4), "<u2")})
    frames = encode(big)
    assert len(frames[1]) < 2048  # lz4: a small frame claiming 256 KiB
    header, _ = decode_header(frames[:1] + [b"garbage"] * (len(frames) - 1), None)  # tensors untouched
    assert code_of(check_declared, header, RUN) == "size_mismatch"
    limits = RUN.decode_limits()
    assert limits.max_rawbytes["ids"] == 2 * 5 * 2 and limits.max_rawbytes["z"] == 2 * 4 * 4 * 2
    assert limits.rawbytes_limit("unknown") == 0


def test_run_shapes_and_window_validate():
    with pytest.raises(ValueError, match="stage"):
        replace(RUN, stage=4)
    with pytest.raises(ValueError, match="divisible"):
        replace(VQ_RUN, width=5)
    with pytest.raises(ValueError, match="wire_dtype"):
        replace(RUN, wire_dtype="uint8")
    with pytest.raises(ValueError, match="need vq_rounds"):
        replace(RUN, vq_codebook_size=16)
    with pytest.raises(ValueError, match="orthonormal_projector must be a bool"):
        replace(RUN, orthonormal_projector=1)
    with pytest.raises(ValueError, match="low"):
        Window(low=3, high=2)
    assert RunShapes.from_dict(VQ_RUN.to_dict()) == VQ_RUN and Window.from_dict(WINDOW.to_dict()) == WINDOW
    assert VQ_RUN.code_dtype == "uint8" and replace(VQ_RUN, vq_codebook_size=300).code_dtype == "uint16"


def test_content_error_is_named_and_picklable():
    e = ContentError("non_finite", "z holds NaN")
    assert e.code == "non_finite" and str(e) == "non_finite: z holds NaN"
    back = pickle.loads(pickle.dumps(e))
    assert back.code == e.code and back.text == e.text
    with pytest.raises(ValueError):
        ContentError("nonsense", "x")
