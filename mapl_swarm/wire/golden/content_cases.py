"""Content vectors (SPEC §6.1): valid frames, a run description and a step window.

Each case is a message that decodes, a :class:`~mapl_swarm.wire.content.RunShapes` (stage 1 of a
4-stage run with B=2, T=4, d=8, r=4, V=32000; or its VQ / fixed-projector / unconstrained-projector
variants) and a
:class:`~mapl_swarm.wire.content.Window` (steps 12..13, projector version 12). The expected outcome
is ``accept`` or the content error code the receiver drops it with, checked in the order of SPEC
§6.1: :func:`~mapl_swarm.wire.content.check_declared` on the header, decoding with the run's
limits, then :func:`~mapl_swarm.wire.content.check_content`.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import numpy as np

from mapl_swarm.wire.codebook import slice_message
from mapl_swarm.wire.content import RunShapes, Window
from mapl_swarm.wire.frames import encode
from mapl_swarm.wire.message import Message, WireTensor
from mapl_swarm.wire.spec import MessageType

from .samples import RUN_ID, sample_codebook, sample_floats, sample_ids

__all__ = ["RUN", "VQ_RUN", "FIXED_RUN", "UNCONSTRAINED_RUN", "WINDOW", "RECEIVER_EPOCH", "STIEFEL",
           "content_cases", "epoch_cases"]

MT = MessageType
B, T, D, R_ = 2, 4, 8, 4

RUN = RunShapes(micro_batch_size=B, context_length=T, hidden_size=D, width=R_, vocab_size=32000,
                wire_dtype="bf16", id_dtype="uint16", num_micro_batches=4, eval_batches=2, num_stages=4, stage=1)
"""Stage 1 of a 4-stage MAPL run."""
VQ_RUN = replace(RUN, vq_rounds=2, vq_group_size=2, vq_codebook_size=16)
"""The same run with MAPL+VQ (R=2, G=2, K=16: codes (B, T, 2, 2) uint8)."""
FIXED_RUN = replace(RUN, trainable_projector=False)
"""The same run with a fixed projector (no PROJ / PROJ_GRAD)."""
UNCONSTRAINED_RUN = replace(RUN, orthonormal_projector=False)
"""The same run with a projector learned off the manifold (``naive``): PROJ need not be orthonormal."""
WINDOW = Window(low=12, high=13, pver=12)
"""Steps 12 and 13 accepted; the link's projector is at version 12."""
UNSAVED = {"phase": "unsaved", "step": 12, "reason": "stage 2: checkpoint step 12 not saved under /data/run"}
"""CHECKPOINT ``unsaved`` meta: stage 2 could not save step 12."""
RECEIVER_EPOCH = 2
"""The receiving peer's run epoch in :func:`epoch_cases` (SPEC §9.6)."""

BF16_NAN, BF16_INF = 0x7FC0, 0x7F80


def _bf16(x: np.ndarray) -> np.ndarray:
    return (x.astype("<f4").view("<u4") >> 16).astype("<u2")


def _z(salt: int, shape: tuple[int, ...] = (B, T, R_)) -> WireTensor:
    return WireTensor("bf16", _bf16(sample_floats(int(np.prod(shape)), salt)).reshape(shape))


def _ids(shape: tuple[int, int] = (B, T + 1), dtype: str = "<u2") -> np.ndarray:
    return sample_ids(*shape, dtype)


def _frames(msg: Message) -> list[bytes]:
    return [bytes(f) for f in encode(msg)]


def _act(*, src: int = 0, dst: int = 1, step: int = 12, micro: int = 3, pver: int = 12, mode: str = "train",
         tensors: dict[str, Any] | None = None, cver: int = 0, epoch: int | None = None) -> list[bytes]:
    """An ACT, at run epoch ``epoch`` (default 0)."""
    if tensors is None:
        tensors = {"ids": WireTensor("uint16", _ids()), "z": _z(40)}
    return _frames(Message(type=MT.ACT, run_id=RUN_ID, src=src, dst=dst, step=step, micro=micro, seq=20,
                           pver=pver, cver=cver, epoch=epoch or 0, meta={"mode": mode}, tensors=tensors))


def _grad(*, src: int = 2, dst: int = 1, step: int = 12, micro: int = 3, pver: int = 12,
          tensors: dict[str, Any] | None = None) -> list[bytes]:
    return _frames(Message(type=MT.GRAD, run_id=RUN_ID, src=src, dst=dst, step=step, micro=micro, seq=21,
                           pver=pver, tensors=tensors or {"dz": _z(41)}))


def _fp32(salt: int, shape: tuple[int, ...] = (D, R_), poison: float | None = None) -> WireTensor:
    a = sample_floats(int(np.prod(shape)), salt).reshape(shape)
    if poison is not None:
        a = a.copy()
        a.flat[5] = poison
    return WireTensor("fp32", a)


def _stiefel() -> np.ndarray:
    """An exactly orthonormal, dense (d, r) = (8, 4) fp32 matrix from integer arithmetic: the first r
    columns of a product of three Householder reflections ``I - 2 v vᵀ`` with unit vectors
    ``v = w / 4``, w integer with ``w·w = 16``. ``8 (I - 2 v vᵀ) = 8 I - w wᵀ``, so the product is an
    integer matrix / 512: every entry is exact in fp32 and ``AᵀA = I`` holds exactly in fp64."""
    out = np.eye(D, dtype=np.int64)
    for w in ((3, 1, -1, 1, 1, -1, 1, 1), (0, 1, -1, 2, 1, -2, 2, -1), (1, 2, -2, 0, 1, 1, -2, 1)):
        w = np.array(w, dtype=np.int64)
        out = out @ (8 * np.eye(D, dtype=np.int64) - np.outer(w, w))  # (8, 8), integer
    return (out[:, :R_] / 512).astype("<f4")  # (d, r)


STIEFEL = _stiefel()
"""The content vectors' orthonormal projector (d, r) = (8, 4), fp32."""


def _proj(*, src: int = 0, step: int = 13, pver: int = 13, tensor: WireTensor | None = None) -> list[bytes]:
    return _frames(Message(type=MT.PROJ, run_id=RUN_ID, src=src, dst=1, step=step, seq=22, pver=pver,
                           tensors={"proj": tensor or _fp32(42)}))


def _stiefel_proj(a: np.ndarray | None = None, **kw: Any) -> list[bytes]:
    """A PROJ carrying ``a`` (default :data:`STIEFEL`): version 13 for step 13."""
    return _proj(tensor=WireTensor("fp32", STIEFEL if a is None else a), **kw)


def _proj_grad(*, pver: int = 12, tensor: WireTensor | None = None) -> list[bytes]:
    return _frames(Message(type=MT.PROJ_GRAD, run_id=RUN_ID, src=2, dst=1, step=12, seq=23, pver=pver,
                           meta={"micro_batches": 4}, tensors={"grad": tensor or _fp32(43)}))


def _report(*, src: int = 2, loss: float = 3.25, step: int = 12, tokens: int = B * T * 4) -> list[bytes]:
    return _frames(Message(type=MT.REPORT, run_id=RUN_ID, src=src, dst=1, step=step, seq=24,
                           meta={"mode": "train", "loss": loss, "tokens": tokens}))


def _route(phase: str, *, src: int, step: int = 12) -> list[bytes]:
    """A ROUTE (2.1, SPEC §9.10): ``ready`` from downstream, ``end`` (3 ACTs) from upstream, ..."""
    extra = {"acts": 3} if phase == "end" else {"gone": ["tcp://10.0.0.7:5002"]} if phase in ("gone", "redo") else {}
    return _frames(Message(type=MT.ROUTE, run_id=RUN_ID, src=src, dst=1, step=step, seq=25,
                           meta={"phase": phase, **extra}))


def _codes(top: int | None = None, shape: tuple[int, ...] = (B, T, 2, 2), dtype: str = "u1") -> WireTensor:
    n = int(np.prod(shape))
    a = ((np.arange(n, dtype=np.uint64) * np.uint64(40503)) % np.uint64(16)).astype(dtype).reshape(shape)
    if top is not None:
        a.flat[3] = top
    return WireTensor("uint8" if dtype == "u1" else "uint16", a)


def _slice(*, n: int = 4, index: np.ndarray | None = None, poison: bool = False) -> list[bytes]:
    codes = sample_codebook(0 if index is not None else 4, n, 44)
    if poison:
        codes[1, 0, 2, 1] = np.float32("nan")
    msg = slice_message(run_id=RUN_ID, src=0, dst=1, stream="act", version=6, start=0 if index is not None else 4,
                        full=False, codes=codes, step=12, micro=3, seq=25, index=index)
    return _frames(msg)


def _checkpoint(*, src: int, meta: dict) -> list[bytes]:
    return _frames(Message(type=MT.CHECKPOINT, run_id=RUN_ID, src=src, dst=1, step=meta.get("step") or 0, seq=30,
                           meta=meta))


def _bf16_with(value: int) -> WireTensor:
    z = _z(45).data.copy()
    z[1, 2, 3] = value
    return WireTensor("bf16", z)


def content_cases() -> list[tuple[str, list[bytes], str, RunShapes, Window, str]]:
    """(name, frames, description, run, window, outcome) of every content vector."""
    ids_vocab = _ids()
    ids_vocab[0, 2] = RUN.vocab_size  # one past the last id
    index_k = np.array([[[1, 5, 9], [0, 2, 15]], [[3, 4, 7], [8, 11, 16]]], dtype="u1")
    index_ok = np.array([[[1, 5, 9], [0, 2, 15]], [[3, 4, 7], [8, 11, 12]]], dtype="u1")
    W, OK = WINDOW, "accept"
    fits = {"ids": WireTensor("uint16", _ids()), "codes": _codes()}
    cases: list[tuple[str, list[bytes], str, RunShapes, Window, str]] = [
        # accepted
        ("act_fits", _act(), "train ACT of step 12 micro 3 at projector version 12", RUN, W, OK),
        ("act_eval_fits", _act(mode="eval", micro=1), "eval ACT micro 1 of 2", RUN, W, OK),
        ("act_next_step_fits", _act(step=13, micro=0), "ACT of step 13 (the window's newest)", RUN, W, OK),
        ("grad_fits", _grad(), "GRAD from downstream with the ACT's projector version", RUN, W, OK),
        ("proj_next_fits", _stiefel_proj(), "PROJ version 13 (the next) for step 13, exactly orthonormal: "
         "||A^T A - I||_F = 0", RUN, W, OK),
        ("proj_resend_fits", _stiefel_proj(pver=12, step=12), "PROJ version 12 again (a re-send)", RUN, W, OK),
        ("proj_grad_fits", _proj_grad(), "PROJ_GRAD of step 12 at version 12", RUN, W, OK),
        ("report_fits", _report(), "REPORT of step 12 from downstream", RUN, W, OK),
        ("act_vq_fits", _act(tensors=fits, cver=6), "VQ ACT: uint8 codes (B, T, R, r/G) below K", VQ_RUN, W, OK),
        ("slice_fits", _slice(), "act CODEBOOK_SLICE of 4 codes from upstream", VQ_RUN, W, OK),
        ("slice_indexed_fits", _slice(n=3, index=index_ok), "indexed act slice, indices below K", VQ_RUN, W, OK),
        ("heartbeat_fits", _frames(Message(type=MT.HEARTBEAT, run_id=RUN_ID, src=2, dst=1, seq=9)),
         "HEARTBEAT from downstream: no content rules", RUN, W, OK),
        ("drain_request_fits", _checkpoint(src=2, meta={"phase": "drain_request", "reason": "SIGINT at stage 3"}),
         "CHECKPOINT drain_request from downstream", RUN, W, OK),
        ("drain_fits", _checkpoint(src=0, meta={"phase": "drain", "step": 12}),
         "CHECKPOINT drain (step 12) from upstream", RUN, W, OK),
        ("unsaved_fits", _checkpoint(src=2, meta=UNSAVED),
         "CHECKPOINT unsaved (step 12) from downstream", RUN, W, OK),
        # not_allowed: who may say what
        ("act_from_downstream", _act(src=2), "ACT from stage 2 to stage 1", RUN, W, "not_allowed"),
        ("act_for_another_stage", _act(dst=2), "ACT addressed to stage 2 reaching stage 1", RUN, W, "not_allowed"),
        ("grad_from_upstream", _grad(src=0), "GRAD from upstream", RUN, W, "not_allowed"),
        ("report_from_upstream", _report(src=0), "REPORT from upstream", RUN, W, "not_allowed"),
        ("proj_from_downstream", _proj(src=2), "PROJ from downstream", RUN, W, "not_allowed"),
        ("proj_fixed_projector", _proj(), "PROJ in a run whose projector does not learn", FIXED_RUN, W,
         "not_allowed"),
        ("slice_without_vq", _slice(), "CODEBOOK_SLICE in a run without VQ", RUN, W, "not_allowed"),
        ("drain_request_from_upstream", _checkpoint(src=0, meta={"phase": "drain_request", "reason": "x"}),
         "CHECKPOINT drain_request from upstream (it travels upstream only)", RUN, W, "not_allowed"),
        ("drain_from_downstream", _checkpoint(src=2, meta={"phase": "drain", "step": 12}),
         "CHECKPOINT drain from downstream (stage 0's decision travels downstream only)", RUN, W,
         "not_allowed"),
        ("unsaved_from_upstream", _checkpoint(src=0, meta=UNSAVED),
         "CHECKPOINT unsaved from upstream (it travels upstream only, like saved)", RUN, W, "not_allowed"),
        # out_of_window
        ("act_old_step", _act(step=11), "ACT of step 11, window 12..13", RUN, W, "out_of_window"),
        ("act_future_step", _act(step=14), "ACT of step 14, window 12..13", RUN, W, "out_of_window"),
        ("act_micro_too_large", _act(micro=4), "ACT micro 4 of a 4-micro-batch step", RUN, W, "out_of_window"),
        ("act_eval_micro_too_large", _act(mode="eval", micro=2), "eval ACT micro 2 of 2", RUN, W,
         "out_of_window"),
        ("grad_micro_too_large", _grad(micro=7), "GRAD micro 7 of 4", RUN, W, "out_of_window"),
        ("report_future_step", _report(step=40), "REPORT of step 40 (an injected report)", RUN, W,
         "out_of_window"),
        # stale_projector
        ("act_old_projector", _act(pver=11), "ACT made with projector 11, link at 12", RUN, W, "stale_projector"),
        ("act_future_projector", _act(pver=99), "ACT claiming projector 99", RUN, W, "stale_projector"),
        ("grad_projector_zero", _grad(pver=0), "GRAD with pver 0 (must echo the ACT's 12)", RUN, W,
         "stale_projector"),
        ("proj_skips_version", _proj(pver=14), "PROJ version 14 skipping 13", RUN, W, "stale_projector"),
        ("proj_old_version", _proj(pver=11, step=12), "PROJ version 11 (older than the link)", RUN, W,
         "stale_projector"),
        ("proj_grad_old_projector", _proj_grad(pver=11), "PROJ_GRAD at version 11", RUN, W, "stale_projector"),
        # tensors: names, dtypes, shapes
        ("act_no_ids", _act(tensors={"z": _z(46)}), "ACT without ids", RUN, W, "wrong_shape"),
        ("act_z_narrower", _act(tensors={"ids": WireTensor("uint16", _ids()), "z": _z(47, (B, T, R_ - 1))}),
         "ACT z of shape (B, T, r-1)", RUN, W, "wrong_shape"),
        ("act_ids_short", _act(tensors={"ids": WireTensor("uint16", _ids((B, T))), "z": _z(48)}),
         "ACT ids of shape (B, T) instead of (B, T+1)", RUN, W, "wrong_shape"),
        ("act_z_transposed", _act(tensors={"ids": WireTensor("uint16", _ids()), "z": _z(49, (T, B, R_))}),
         "ACT z of shape (T, B, r): same size, wrong shape", RUN, W, "wrong_shape"),
        ("act_z_fp16", _act(tensors={"ids": WireTensor("uint16", _ids()),
                                     "z": WireTensor("fp16", sample_floats(B * T * R_, 50).astype("<f2")
                                                     .reshape(B, T, R_))}),
         "ACT z in fp16, the run's wire dtype is bf16", RUN, W, "wrong_dtype"),
        ("act_ids_fp16", _act(tensors={"ids": WireTensor("fp16", _ids().astype("<f2")), "z": _z(51)}),
         "ACT ids as fp16", RUN, W, "wrong_dtype"),
        ("act_vq_sends_z", _act(), "ACT with z in a VQ run (codes expected): z is no tensor of this run",
         VQ_RUN, W, "size_mismatch"),
        ("act_vq_codes_shape", _act(tensors={"ids": WireTensor("uint16", _ids()),
                                             "codes": _codes(shape=(B, T, 4, 1))}, cver=6),
         "VQ codes (B, T, 4, 1) for R=2, r/G=2", VQ_RUN, W, "wrong_shape"),
        ("proj_transposed", _proj(tensor=_fp32(52, (R_, D))), "PROJ of shape (r, d)", RUN, W, "wrong_shape"),
        ("slice_too_many_codes", _slice(n=17), "act slice of 17 codes, K = 16", VQ_RUN, W, "size_mismatch"),
        # declared sizes, before anything is inflated
        ("act_z_wider", _act(tensors={"ids": WireTensor("uint16", _ids()), "z": _z(53, (B, T, R_ + 1))}),
         "ACT z of shape (B, T, r+1): declares more bytes than the run's z", RUN, W, "size_mismatch"),
        ("act_ids_huge", _act(tensors={"ids": WireTensor("uint16", _ids((B, 4097))), "z": _z(54)}),
         "ACT ids (B, 4097), lz4-compressed small: declared size too large, refused before inflating",
         RUN, W, "size_mismatch"),
        ("act_ids_int64", _act(tensors={"ids": WireTensor("int64", _ids(dtype="<i8")), "z": _z(55)}),
         "ACT ids in int64 (4x the run's uint16 bytes)", RUN, W, "size_mismatch"),
        ("act_extra_tensor", _act(tensors={"ids": WireTensor("uint16", _ids()), "z": _z(56),
                                           "extra": WireTensor("uint8", np.arange(8, dtype="u1"))}),
         "ACT with a third tensor 'extra'", RUN, W, "size_mismatch"),
        # values
        ("act_id_equal_vocab", _act(tensors={"ids": WireTensor("uint16", ids_vocab), "z": _z(57)}),
         "ACT with token id V = 32000", RUN, W, "id_out_of_range"),
        ("act_z_nan", _act(tensors={"ids": WireTensor("uint16", _ids()), "z": _bf16_with(BF16_NAN)}),
         "ACT z with one bf16 NaN", RUN, W, "non_finite"),
        ("act_z_inf", _act(tensors={"ids": WireTensor("uint16", _ids()), "z": _bf16_with(BF16_INF)}),
         "ACT z with one bf16 +Inf", RUN, W, "non_finite"),
        ("grad_nan", _grad(tensors={"dz": _bf16_with(BF16_NAN | 0x8000)}), "GRAD dz with a negative NaN",
         RUN, W, "non_finite"),
        ("grad_dz_huge", _grad(tensors={"dz": _bf16_with(0x7149)}), "GRAD dz with a finite bf16 ~1e30",
         RUN, W, "value_out_of_range"),
        ("act_z_2p24", _act(tensors={"ids": WireTensor("uint16", _ids()), "z": _bf16_with(0xCB80)}),
         "ACT z with -2^24 (bf16 0xCB80): the bound itself", RUN, W, "value_out_of_range"),
        ("act_z_below_2p24", _act(tensors={"ids": WireTensor("uint16", _ids()), "z": _bf16_with(0x4B7F)}),
         "ACT z with 16,711,680 (bf16 0x4B7F), just below 2^24", RUN, W, "accept"),
        ("proj_grad_huge", _proj_grad(tensor=_fp32(60, poison=3e19)), "PROJ_GRAD with a finite 3e19", RUN, W,
         "value_out_of_range"),
        ("proj_nan", _proj(tensor=_fp32(58, poison=float("nan"))), "PROJ with a NaN at the current version",
         RUN, W, "non_finite"),
        ("proj_grad_inf", _proj_grad(tensor=_fp32(59, poison=float("-inf"))), "PROJ_GRAD with -Inf", RUN, W,
         "non_finite"),
        ("report_loss_nan", _report(loss=float("nan")), "REPORT loss NaN", RUN, W, "non_finite"),
        ("report_loss_absurd", _report(loss=1e308), "REPORT loss 1e308: finite, above 10 ln V", RUN, W,
         "implausible"),
        ("report_loss_negative", _report(loss=-0.5), "REPORT loss -0.5: a cross-entropy is >= 0", RUN, W,
         "implausible"),
        ("report_tokens_too_many", _report(tokens=B * T * 4 + 1), "REPORT of more tokens than the step's "
         "M x B x T = 32", RUN, W, "implausible"),
        ("act_vq_code_equal_k", _act(tensors={"ids": WireTensor("uint16", _ids()), "codes": _codes(top=16)},
                                     cver=6), "VQ code 16 with K = 16", VQ_RUN, W, "code_out_of_range"),
        ("slice_index_equal_k", _slice(n=3, index=index_k), "indexed slice with index 16, K = 16", VQ_RUN, W,
         "code_out_of_range"),
        ("slice_nan", _slice(poison=True), "act slice with a NaN code", VQ_RUN, W, "non_finite"),
    ]
    cases += [  # 2.1, several peers per stage (SPEC §9.10)
        ("route_ready_fits", _route("ready", src=2), "2.1: ROUTE ready of step 12 from downstream", RUN, W, OK),
        ("route_end_fits", _route("end", src=0, step=13), "2.1: ROUTE end of step 13 from upstream", RUN, W, OK),
        ("route_ready_from_upstream", _route("ready", src=0), "2.1: ROUTE ready from upstream (only a receiver "
         "says it takes ACTs)", RUN, W, "not_allowed"),
        ("route_end_out_of_window", _route("end", src=0, step=14), "2.1: ROUTE end of step 14, beyond the window",
         RUN, W, "out_of_window"),
        ("route_commit_from_downstream", _route("commit", src=2), "2.1: ROUTE commit from downstream (only an "
         "upstream replica says a step is taken)", RUN, W, "not_allowed"),
        ("route_redo_from_downstream_fits", _route("redo", src=2), "2.1: ROUTE redo of step 12 from downstream "
         "(either neighbour may say it)", RUN, W, OK),
        ("route_taken_fits", _route("taken", src=2), "2.1: ROUTE taken of step 12 from downstream", RUN, W, OK),
        ("route_taken_from_upstream", _route("taken", src=0), "2.1: ROUTE taken from upstream (only a "
         "downstream replica says a step is taken)", RUN, W, "not_allowed"),
        ("route_reopen_from_downstream", _route("reopen", src=2), "2.1: ROUTE reopen from downstream (only "
         "an upstream replica sends ACTs after an end)", RUN, W, "not_allowed"),
    ]
    dup = STIEFEL.copy()
    dup[:, 1] = dup[:, 0]  # rank 3: ‖AᵀA − I‖_F = sqrt(2)
    cases += [  # rule 15, PROJ_ORTHONORMAL_TOL = 1e-3
        ("proj_scaled_by_2", _stiefel_proj(STIEFEL * 2),
         "PROJ of 2x an orthonormal projector: ||A^T A - I||_F = 6", RUN, W, "not_orthonormal"),
        ("proj_duplicate_column", _stiefel_proj(dup),
         "PROJ whose column 1 repeats column 0 (rank 3): ||A^T A - I||_F = sqrt(2)", RUN, W, "not_orthonormal"),
        ("proj_unconstrained_fits", _stiefel_proj(STIEFEL * 2),
         "PROJ of 2x an orthonormal projector in a run whose projector learns off the manifold (naive)",
         UNCONSTRAINED_RUN, W, OK),
    ]
    return cases


def epoch_cases() -> list[tuple[str, list[bytes], str, RunShapes, Window, int, str]]:
    """(name, frames, description, run, window, receiver epoch, outcome) of the vectors of
    ``stale_epoch`` (SPEC §6.1 rule 3, §9.6): the receiver is at :data:`RECEIVER_EPOCH`."""
    E, W, OK = RECEIVER_EPOCH, WINDOW, "accept"
    hello = Message(type=MT.HELLO, run_id=RUN_ID, src=0, dst=1,
                    meta={"fingerprint": "0" * 32, "num_stages": 4, "capabilities": ["rejoin"],
                          "nonce": bytes(range(16)), "num_micro_batches": 4, "micro_batch_size": B,
                          "eval_batches": 2})
    bye = Message(type=MT.BYE, run_id=RUN_ID, src=2, dst=1, seq=31, epoch=E - 1,
                  meta={"reason": "rejoin", "lost": 3})
    return [
        ("act_current_epoch", _act(epoch=E), "ACT at the receiver's epoch 2", RUN, W, E, OK),
        ("act_newer_epoch", _act(epoch=E + 1), "ACT at epoch 3, above the receiver's 2: not stale", RUN, W, E, OK),
        ("act_stale_epoch", _act(epoch=E - 1), "ACT at epoch 1, sent before the swarm re-formed", RUN, W, E,
         "stale_epoch"),
        ("act_stale_epoch_old_step", _act(epoch=E - 1, step=40),
         "ACT at epoch 1 of step 40: stale_epoch (rule 3) comes before out_of_window (rule 5)", RUN, W, E,
         "stale_epoch"),
        ("act_stale_epoch_from_downstream", _act(epoch=E - 1, src=2),
         "ACT at epoch 1 from downstream: not_allowed (rule 1) comes before stale_epoch", RUN, W, E,
         "not_allowed"),
        ("heartbeat_epoch_zero", _frames(Message(type=MT.HEARTBEAT, run_id=RUN_ID, src=2, dst=1, seq=9)),
         "HEARTBEAT without epoch (0) at a receiver at epoch 2", RUN, W, E, "stale_epoch"),
        ("bye_rejoin_stale_epoch", _frames(bye), "BYE rejoin sent at epoch 1, the receiver already at 2",
         RUN, W, E, "stale_epoch"),
        ("hello_epoch_zero", _frames(hello), "HELLO at epoch 0 (a replacement process): accepted at any epoch",
         RUN, W, E, OK),
    ]
