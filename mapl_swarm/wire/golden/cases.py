"""The golden vector cases of protocol/vectors/v2: valid, accept-only, invalid, codebook and content.

Valid cases are encodings of :func:`mapl_swarm.wire.golden.samples.samples`; accept and invalid cases are those
encodings altered at the msgpack level (one defect each), with CRCs fixed up where the case is about
something else. Codebook cases (SPEC §5.1) are valid frames with a codebook receiver state; the
expected outcome is applied, ignored, or a named codebook error. Content cases (SPEC §6.1) are valid
frames with a run description and a step window (:mod:`.content_cases`); the expected outcome is
accepted or a named content error.
"""

from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass, field
from typing import Any, Callable

import lz4.block
import msgpack
import numpy as np

from mapl_swarm.wire.codebook import slice_message
from mapl_swarm.wire.frames import encode
from mapl_swarm.wire.message import Message, WireTensor
from mapl_swarm.wire.spec import PROTOCOL_VERSION, MessageType

from .content_cases import content_cases, epoch_cases
from .samples import RUN_ID, SAMPLE_INDEX, VQ_LAYOUT, sample_codebook, sample_floats, samples

__all__ = ["Case", "build_cases", "CASES_2_1"]


@dataclass(frozen=True)
class Case:
    """One golden vector."""

    name: str
    kind: str
    """``valid``, ``accept``, ``invalid``, ``codebook`` or ``content``."""
    frames: list[bytes]
    description: str
    error: str | None = None
    """Expected error code (invalid)."""
    equivalent: str | None = None
    """Valid vector that re-encoding the decoded message reproduces (accept)."""
    extra: dict[str, Any] = field(default_factory=dict)
    """Codebook cases: ``receiver`` (state) and ``outcome`` (``apply``, ``ignore`` or an error code);
    content cases: ``run``, ``window``, optionally ``epoch`` (the receiver's run epoch) and ``outcome``
    (``accept`` or a content error code)."""


def _hdr(frames: list[bytes]) -> dict[str, Any]:
    return msgpack.unpackb(frames[0], raw=False)


def _pack(h: Any) -> bytes:
    return msgpack.packb(h, use_bin_type=True)


def _edit(frames: list[bytes], fn: Callable[[dict[str, Any]], Any]) -> list[bytes]:
    """Re-pack the header after ``fn`` edits its dict."""
    h = _hdr(frames)
    fn(h)
    return [_pack(h), *frames[1:]]


def _set(key: str, value: Any) -> Callable[[dict[str, Any]], None]:
    def fn(h: dict[str, Any]) -> None:
        h[key] = value

    return fn


def _desc(i: int, **kv: Any) -> Callable[[dict[str, Any]], None]:
    def fn(h: dict[str, Any]) -> None:
        h["tensors"][i].update(kv)

    return fn


def _meta(**kv: Any) -> Callable[[dict[str, Any]], None]:
    def fn(h: dict[str, Any]) -> None:
        h["meta"].update(kv)
        for k, v in kv.items():
            if v is _DROP:
                del h["meta"][k]

    return fn


_DROP = object()


def _replace_frame(frames: list[bytes], i: int, data: bytes, **desc: Any) -> list[bytes]:
    """Put ``data`` as tensor frame ``i`` with a matching nbytes/crc (plus ``desc`` overrides)."""
    out = [*frames]
    out[1 + i] = data
    return _edit(out, _desc(i, nbytes=len(data), crc=zlib.crc32(data), **desc))


def _flip(b: bytes, pos: int) -> bytes:
    return b[:pos] + bytes([b[pos] ^ 0x01]) + b[pos + 1 :]


def _valid(v: dict[str, list[bytes]]) -> list[Case]:
    text = {
        "hello": "HELLO from stage 1 to stage 0: fingerprint components, nonce, num_micro_batches, "
                 "micro_batch_size, eval_batches",
        "welcome": "WELCOME answering the HELLO: its own nonce and the HELLO's as hello_nonce",
        "reject": "REJECT fingerprint_mismatch naming both fingerprints",
        "act_train": "ACT train: int64 ids (lz4) and bf16 z (raw)",
        "act_eval": "ACT eval: int32 ids (lz4) and fp16 z (raw)",
        "act_vq": "ACT with uint8 VQ codes (lz4 does not pay: sent raw)",
        "grad": "GRAD with bf16 dz",
        "act_train_signed": "2.1: ACT train with its sender's sig (replicas.check_fraction: Ed25519 over \"mapl-work "
                            "v1\\0\" + msgpack [run, \"ACT\", step, micro, SHA-256 of the tensors, SPEC §9.10 item 15])",
        "proj_grad": "PROJ_GRAD with fp32 (8, 4) gradient",
        "proj": "PROJ with fp32 (8, 4) projector, pver 13",
        "report": "REPORT loss, tokens, mode and metrics",
        "codebook_slice": "CODEBOOK_SLICE of fp32 codes (16, 2) without meta: a valid frame (codebook "
                          "receivers refuse it, codebook/slice_no_meta)",
        "resync": "RESYNC, no meta",
        "heartbeat": "HEARTBEAT with sent_ns",
        "bye": "BYE with reason",
        "error": "ERROR with code, message, ref_seq",
        "all_dtypes": "one tensor of every dtype, a scalar and an empty tensor",
        "large_ints": "largest src/micro/seq, 64-bit step/pver",
        "meta_free": "free meta: nested maps sorted, bin, nil, bools, negative and 64-bit ints",
        "codebook_slice_stream": "CODEBOOK_SLICE of the act stream: codes 4..7, version 6",
        "codebook_slice_full": "full CODEBOOK_SLICE of the grad stream (16 codes), version 9",
        "resync_stream": "RESYNC of the act stream, receiver at version 5",
        "act_vq_rounds": "ACT: uint16 ids and uint8 codes (B, T, R=2, r/G=2) at cver 6",
        "grad_vq": "GRAD: uint8 codes (B, T, R=2, r/G=2) at cver 9",
        "codebook_slice_indexed": "indexed CODEBOOK_SLICE: each of the 4 codebooks its own 3 codes",
        "resync_retransmit": "RESYNC asking for eval ACT step 12 micro 3 re-encoded after a full slice",
        "checkpoint_saved": "CHECKPOINT saved: the last stage has saved step 40",
        "checkpoint_complete": "CHECKPOINT complete: every stage has step 40",
        "checkpoint_offer": "CHECKPOINT offer: steps stages 1 and 2 both hold, and what each has",
        "checkpoint_resume": "CHECKPOINT resume from step 30",
        "checkpoint_resume_refused": "CHECKPOINT resume refused: step nil and the reason every stage stops with",
        "checkpoint_resume_missing": "2.1: CHECKPOINT resume refused because stage 2 lost its files (missing): "
                                     "after a rejoin the other stages pause and wait for another replacement",
        "reject_stage_taken": "REJECT stage_taken echoing the HELLO's nonce",
        "meta_depth_8": "meta nested 8 deep (meta map + 7 arrays; the scalar is no level)",
        "heartbeat_rtt": "HEARTBEAT with round-trip timestamps: sent_ns, and the echo of the neighbour's "
                         "sent_ns held 1.25 s",
        "checkpoint_drain_request": "CHECKPOINT drain_request from the last stage (capability drain)",
        "checkpoint_drain": "CHECKPOINT drain: every stage stops after step 42 and saves it",
        "checkpoint_drain_signed": "2.1: CHECKPOINT drain relayed by stage 1 with stage 0's certificate and "
                                   "signature of the decision (a certified run; the bytes here are placeholders: "
                                   "the wire checks only their kinds)",
        "bye_drain": "BYE reason drain after 42 steps: a planned departure",
        "hello_rejoin": "HELLO of a re-formed peer at epoch 2 advertising rejoin",
        "act_epoch": "ACT at epoch 3: epoch right after cver",
        "bye_rejoin": "BYE reason rejoin, lost 1, at epoch 1: stage 2 re-forms after stage 1 departed",
        "checkpoint_offer_epoch": "CHECKPOINT offer carrying the largest epoch of the stages it covers",
        "checkpoint_resume_epoch": "CHECKPOINT resume from step 30 at epoch 2 (every stage takes it)",
        "epoch_max": "HEARTBEAT at the largest epoch, 2^64-1 (uint64)",
        "checkpoint_unsaved": "CHECKPOINT unsaved: stage 2 could not save step 40, and why (capability "
                              "checkpoint_unsaved)",
        "hello_config": "HELLO with the sender's config (settings by TOML name), anchored and max_in_flight",
        "reject_config_unanchored": "REJECT fingerprint_mismatch naming the setting, anchored false: the "
                                    "dialer retries",
        "heartbeat_anchored": "HEARTBEAT from stage 0 saying it is anchored",
        "checkpoint_abandoned": "CHECKPOINT abandoned: stage 0 gave step 40 up (stage 2 could not save it), "
                                "every stage deletes its files of it (capability checkpoint_abandoned)",
        "hello_cert": "HELLO of a certified peer: its certificate in cert (opaque to the decoder, checked by "
                      "the peer)",
        "hello_replica": "2.1: HELLO of a replica (capability replicas) naming its contact",
        "hello_dial_out": "2.2: HELLO of a dial-out peer of stage 1 (SPEC §1.2): its contact names its CURVE key "
                          "and no address; stage 0 sends to it on this connection",
        "hello_reform": "2.1: HELLO of a replica whose swarm re-forms (run epoch 2): 1 replica of its stage was "
                        "live at its pause, stage 2 lost its last replica",
        "route_ready": "2.1: ROUTE ready from stage 2: it takes stage 1's train ACTs of step 12",
        "route_end": "2.1: ROUTE end from stage 0: its 3 train ACTs of step 12 on this link, and no more",
        "route_commit": "2.1: ROUTE commit from stage 0: its round of step 12 and every downstream replica's are "
                        "whole (to stage 1; from stage 1 on: step 12 is taken)",
        "route_redo": "2.1: ROUTE redo from stage 2: step 12 runs again in run epoch 1, without the replica gone",
        "route_redo_signed": "2.1: ROUTE redo relayed by stage 2 with its maker's certificate and signature of "
                             "the decision (§9.10 item 10; the bytes are the peer's to check, not the decoder's)",
        "route_exclude": "2.1: ROUTE exclude from stage 1: this replica and most of its partners found the "
                         "replica at the contact's gradient share wrong (it is excluded)",
        "route_taken": "2.1: ROUTE taken from stage 1 to stage 0: step 12 (run epoch 1) is taken",
        "route_gone_held": "2.1: ROUTE gone from stage 2: the replica at the contact left; this stage-2 replica "
                           "holds micro-batches 3 and 8 of step 12 that came through it",
        "route_reopen": "2.1: ROUTE reopen from stage 0: more train ACTs of step 12 come on this link after its "
                        "end (a replica of stage 1 left; a fresh end follows)",
        "bye_leave": "2.1: BYE reason leave from a replica of stage 1 that took 13 steps and leaves while its "
                     "stage goes on (SPEC §9.10 item 14)",
        "dialback_request": "2.1: DIALBACK request of a member of stage 2 to a live peer of stage 1: its "
                            "certificate, the contact to dial, a nonce (SPEC §9.11)",
        "dialback": "2.1: DIALBACK from the live peer on its dial to that contact, echoing the nonce",
    }
    return [Case(n, "valid", f, text[n]) for n, f in v.items()]


def _accept(v: dict[str, list[bytes]]) -> list[Case]:
    def unknown_key(h: dict[str, Any]) -> None:
        h["v"] = [2, 3]
        h["route"] = {"via": "relay-7", "ttl": 3}

    def reverse(h: dict[str, Any]) -> None:
        items = list(h.items())[::-1]
        h.clear()
        h.update(items)

    def unsorted_meta(h: dict[str, Any]) -> None:
        h["meta"] = dict(reversed(list(h["meta"].items())))
        h["meta"]["metrics"] = dict(reversed(list(h["meta"]["metrics"].items())))

    def auth_key(h: dict[str, Any]) -> None:
        h["auth"] = bytes(range(32))

    def epoch_zero(h: dict[str, Any]) -> None:
        items = list(h.items())
        h.clear()
        for k, x in items:
            h[k] = x
            if k == "cver":
                h["epoch"] = 0

    rep = v["report"][0]
    wide = rep.replace(b"\xa4step\x0c", b"\xa4step\xcf" + struct.pack(">Q", 12))
    wide = wide.replace(b"\xa6tokens\xcd\x10\x00", b"\xa6tokens\xce\x00\x00\x10\x00")
    f32 = rep.replace(b"\xa4loss\xcb" + struct.pack(">d", 3.25), b"\xa4loss\xca" + struct.pack(">f", 3.25))
    assert wide != rep and f32 != rep
    A = "accept"
    return [
        Case("unknown_header_key", A, _edit(v["hello"], unknown_key),
             "version 2.3 header with an unknown key: ignored", equivalent="hello"),
        Case("unknown_descriptor_key", A, _edit(v["act_train"], _desc(0, layout="bt")),
             "tensor descriptor with an unknown key: ignored", equivalent="act_train"),
        Case("newer_minor", A, _edit(v["heartbeat"], _set("v", [2, 1])),
             "version 2.1 with nothing new: decoded as 2.1", equivalent="heartbeat"),
        Case("key_order_reversed", A, _edit(v["hello"], reverse),
             "header keys in reverse order", equivalent="hello"),
        Case("wide_integers", A, [wide],
             "step as uint64 and tokens as uint32 instead of the smallest width", equivalent="report"),
        Case("float32_loss", A, [f32], "loss as msgpack float32", equivalent="report"),
        Case("meta_unsorted", A, _edit(v["report"], unsorted_meta),
             "meta and nested map keys not sorted", equivalent="report"),
        Case("auth_key_ignored", A, _edit(v["act_train"], auth_key),
             "header ending in an auth key holding 32 bytes: no key of this version, ignored like any "
             "unknown key (messages carry no tag)", equivalent="act_train"),
        Case("epoch_zero_written", A, _edit(v["heartbeat"], epoch_zero),
             "header writing epoch 0, which a canonical encoder leaves out", equivalent="heartbeat"),
    ]


def _invalid(v: dict[str, list[bytes]]) -> list[Case]:
    hello, act, rep = v["hello"], v["act_train"], v["report"]
    h0 = hello[0]
    ids_raw = samples()["act_train"].tensors["ids"].wire_array().tobytes()
    half = lz4.block.compress(ids_raw[: len(ids_raw) // 2], store_size=False)

    def drop(key: str) -> Callable[[dict[str, Any]], None]:
        return lambda h: h.pop(key)

    def deep(h: dict[str, Any]) -> None:
        x: Any = 1
        for _ in range(9):
            x = [x]
        h["meta"]["deep"] = x

    def many(h: dict[str, Any]) -> None:
        h["tensors"] = [dict(h["tensors"][0], name=f"t{i}") for i in range(65)]

    def dup_names(h: dict[str, Any]) -> None:
        h["tensors"][1]["name"] = "ids"

    def hb_tensor(h: dict[str, Any]) -> None:
        h["tensors"] = [{"name": "x", "dtype": "uint8", "shape": [1], "codec": "raw",
                         "nbytes": 1, "rawbytes": 1, "crc": zlib.crc32(b"\x07")}]

    M, T, D, FC = "malformed_header", "unknown_message_type", "bad_dtype", "frame_count_mismatch"
    L, C, S, IM = "length_mismatch", "checksum_mismatch", "bad_shape", "invalid_message"
    cases: list[tuple[str, list[bytes], str, str]] = [
        ("not_msgpack", [b"\xc1"], M, "header byte 0xc1 is never used by msgpack"),
        ("header_not_map", [_pack([1, 0])], M, "header is an array"),
        ("header_truncated", [h0[:-5]], M, "header cut short"),
        ("header_trailing_bytes", [h0 + b"\x00"], M, "a byte after the header map"),
        ("duplicate_key", [bytes([h0[0] + 1]) + h0[1:] + b"\xa4step\x00"], M, "key 'step' twice"),
        ("integer_key", [bytes([h0[0] + 1]) + h0[1:] + b"\x01\x02"], M, "an integer map key"),
        ("missing_run", _edit(hello, drop("run")), M, "required key 'run' missing"),
        ("missing_tensors", _edit(hello, drop("tensors")), M, "required key 'tensors' missing"),
        ("step_string", _edit(hello, _set("step", "12")), M, "step is a string"),
        ("step_negative", _edit(hello, _set("step", -1)), M, "step is negative"),
        ("step_float", _edit(hello, _set("step", 12.0)), M, "step is a float"),
        ("micro_too_large", _edit(hello, _set("micro", 2**32)), M, "micro above 2^32-1"),
        ("src_too_large", _edit(hello, _set("src", 65536)), M, "src above 65535"),
        ("run_empty", _edit(hello, _set("run", "")), M, "empty run id"),
        ("run_too_long", _edit(hello, _set("run", "r" * 129)), M, "run id of 129 bytes"),
        ("version_string", _edit(hello, _set("v", "2.0")), M, "v is a string"),
        ("version_short", _edit(hello, _set("v", [1])), M, "v has one element"),
        ("meta_not_map", _edit(hello, _set("meta", [1])), M, "meta is an array"),
        ("meta_ext_type", _edit(hello, _meta(t=msgpack.ExtType(5, b"x"))), M, "msgpack ext value"),
        ("meta_too_deep", _edit(rep, deep), M, "meta nested 10 deep"),
        ("tensors_not_array", _edit(hello, _set("tensors", {})), M, "tensors is a map"),
        ("too_many_tensors", _edit(act, many), M, "65 tensor descriptors"),
        ("duplicate_tensor_name", _edit(act, dup_names), M, "two tensors named 'ids'"),
        ("descriptor_not_map", _edit(act, lambda h: h["tensors"].__setitem__(0, 5)), M,
         "descriptor is an integer"),
        ("descriptor_missing_crc", _edit(act, lambda h: h["tensors"][0].pop("crc")), M,
         "descriptor lacks crc"),
        ("tensor_name_empty", _edit(act, _desc(0, name="")), M, "empty tensor name"),
        ("crc_too_large", _edit(act, _desc(0, crc=2**32)), M, "crc above 2^32-1"),
        ("version_major_1", _edit(hello, _set("v", [1, 9])), "version_mismatch",
         "a 1.9 HELLO: 'peer speaks 1.9, this peer speaks 2.0'"),
        ("version_major_3", _edit(hello, _set("v", [3, 0])), "version_mismatch",
         "major 3: 'peer speaks 3.0, this peer speaks 2.0'"),
        ("version_major_0", _edit(hello, _set("v", [0, 9])), "version_mismatch", "major 0"),
        ("type_unknown", _edit(hello, _set("type", 99)), T, "type 99"),
        ("type_reserved", _edit(hello, _set("type", 15)), T, "type 15, reserved"),
        ("type_zero", _edit(hello, _set("type", 0)), T, "type 0"),
        ("type_string", _edit(hello, _set("type", "HELLO")), M, "type given by name"),
        ("no_frames", [], FC, "zero frames"),
        ("missing_frame", act[:-1], FC, "two descriptors, one tensor frame"),
        ("extra_frame", [*act, b"\x00"], FC, "a frame without descriptor"),
        ("dtype_unknown", _edit(act, _desc(1, dtype="fp8")), D, "dtype fp8 is no tag"),
        ("dtype_not_string", _edit(act, _desc(1, dtype=2)), D, "dtype is an integer"),
        ("proj_bf16", _edit(v["proj"], _desc(0, dtype="bf16", shape=[8, 8])), D,
         "PROJ tensor in bf16"),
        ("proj_grad_fp16", _edit(v["proj_grad"], _desc(0, dtype="fp16", shape=[8, 8])), D,
         "PROJ_GRAD tensor in fp16"),
        ("codebook_fp64", _edit(v["codebook_slice"], _desc(0, dtype="fp64", shape=[16, 1])), D,
         "CODEBOOK_SLICE tensor in fp64"),
        ("shape_negative", _edit(act, _desc(1, shape=[2, -4, 4])), S, "negative dimension"),
        ("shape_9_dims", _edit(act, _desc(1, shape=[1] * 7 + [8, 4])), S, "9 dimensions"),
        ("shape_float", _edit(act, _desc(1, shape=[2.0, 4, 4])), S, "float dimension"),
        ("shape_not_array", _edit(act, _desc(1, shape=32)), S, "shape is an integer"),
        ("codec_unknown", _edit(act, _desc(1, codec="zstd")), "bad_codec", "codec zstd"),
        ("rawbytes_wrong", _edit(act, _desc(1, rawbytes=130, nbytes=130)), L,
         "rawbytes 130 for a (2, 4, 4) bf16 tensor"),
        ("raw_nbytes_differs", _edit(act, _desc(1, nbytes=63)), L, "raw codec, nbytes != rawbytes"),
        ("frame_shorter", [*act[:2], act[2][:-1]], L, "tensor frame one byte short"),
        ("lz4_short_output", _replace_frame(act, 0, half), L,
         "lz4 block decompressing to half of rawbytes"),
        ("checksum_header", _edit(act, _desc(1, crc=(_hdr(act)["tensors"][1]["crc"] + 1) % 2**32)),
         C, "crc field off by one"),
        ("checksum_bitflip", [*act[:2], _flip(act[2], 5)], C, "one bit of z flipped"),
        ("lz4_garbage", _replace_frame(act, 0, b"\xff" * 24), "decompression_failed",
         "lz4 frame that is not an LZ4 block (crc matches)"),
        ("header_too_large", _edit(v["heartbeat"], _meta(pad="x" * 65536)), "frame_too_large",
         "header over 64 KiB"),
        ("nbytes_too_large", _edit(act, _desc(0, nbytes=2**28 + 1)), "frame_too_large",
         "declared on-wire size over 256 MiB"),
        ("rawbytes_too_large", _edit(act, _desc(0, shape=[2**25 + 1], rawbytes=2**28 + 8)),
         "frame_too_large", "declared decoded size over 256 MiB (decompression bomb)"),
        ("act_mode_bad", _edit(act, _meta(mode="test")), IM, "ACT mode 'test'"),
        ("act_mode_missing", _edit(act, _meta(mode=_DROP)), IM, "ACT without mode"),
        ("report_loss_string", _edit(rep, _meta(loss="3.25")), IM, "REPORT loss is a string"),
        ("report_loss_int", _edit(rep, _meta(loss=3)), IM, "REPORT loss is an integer"),
        ("report_tokens_float", _edit(rep, _meta(tokens=4096.0)), IM, "REPORT tokens is a float"),
        ("report_tokens_bool", _edit(rep, _meta(tokens=True)), IM, "REPORT tokens is a bool"),
        ("hello_no_fingerprint", _edit(hello, _meta(fingerprint=_DROP)), IM, "HELLO lacks fingerprint"),
        ("hello_zero_stages", _edit(hello, _meta(num_stages=0)), IM, "HELLO num_stages 0"),
        ("error_no_code", _edit(v["error"], _meta(code=_DROP)), IM, "ERROR lacks code"),
        ("heartbeat_with_tensor", _edit([*v["heartbeat"], b"\x07"], hb_tensor), IM,
         "HEARTBEAT carrying a tensor"),
        ("codebook_start_string", _edit(v["codebook_slice_stream"], _meta(start="4")), IM,
         "CODEBOOK_SLICE start is a string"),
        ("codebook_stream_unknown", _edit(v["codebook_slice_stream"], _meta(stream="fwd")), IM,
         "CODEBOOK_SLICE stream 'fwd'"),
        ("codebook_full_int", _edit(v["codebook_slice_full"], _meta(full=1)), IM,
         "CODEBOOK_SLICE full is an integer"),
        ("resync_have_negative", _edit(v["resync_stream"], _meta(have=-1)), IM,
         "RESYNC have is negative"),
        ("codebook_index_int32", _edit(v["codebook_slice_indexed"], _desc(1, dtype="int32", shape=[3])), D,
         "CODEBOOK_SLICE index tensor int32 (uint8/uint16 only)"),
        ("codebook_index_float", _edit(v["codebook_slice_indexed"], _desc(1, dtype="fp32", shape=[3])), D,
         "CODEBOOK_SLICE index tensor fp32 (uint8/uint16 only)"),
        ("resync_retransmit_int", _edit(v["resync_retransmit"], _meta(retransmit=1)), IM,
         "RESYNC retransmit is an integer"),
        ("resync_mode_unknown", _edit(v["resync_retransmit"], _meta(mode="test")), IM,
         "RESYNC mode 'test'"),
        ("checkpoint_phase_unknown", _edit(v["checkpoint_saved"], _meta(phase="done")), IM,
         "CHECKPOINT phase 'done'"),
        ("checkpoint_saved_no_step", _edit(v["checkpoint_saved"], _meta(step=_DROP)), IM,
         "CHECKPOINT saved without a step"),
        ("checkpoint_offer_not_increasing", _edit(v["checkpoint_offer"], _meta(steps=[30, 20])), IM,
         "CHECKPOINT offer steps 30, 20"),
        ("checkpoint_resume_nil_no_reason", _edit(v["checkpoint_resume_refused"], _meta(reason=_DROP)), IM,
         "CHECKPOINT resume with step nil and no reason"),
        ("checkpoint_resume_missing_not_uints", _edit(v["checkpoint_resume_missing"], _meta(missing=["2"])), IM,
         "2.1: CHECKPOINT resume whose missing stages are not unsigned integers"),
        ("checkpoint_with_tensor", _edit([*v["checkpoint_saved"], b"\x07"], hb_tensor), IM,
         "CHECKPOINT carrying a tensor"),
        ("checkpoint_drain_no_step", _edit(v["checkpoint_drain"], _meta(step=_DROP)), IM,
         "CHECKPOINT drain without a step"),
        ("checkpoint_drain_nil_step", _edit(v["checkpoint_drain"], _meta(step=None)), IM,
         "CHECKPOINT drain with step nil"),
        ("checkpoint_drain_sig_short", _edit(v["checkpoint_drain_signed"], _meta(sig=bytes(63))), IM,
         "2.1: CHECKPOINT drain whose sig is 63 bytes, not an Ed25519 signature's 64"),
        ("heartbeat_echo_negative", _edit(v["heartbeat_rtt"], _meta(echo_ns=-5)), IM,
         "HEARTBEAT echo_ns negative"),
        ("heartbeat_held_float", _edit(v["heartbeat_rtt"], _meta(held_ns=1.25)), IM,
         "HEARTBEAT held_ns is a float"),
    ]
    return [Case(n, "invalid", f, d, error=e) for n, f, e, d in cases] + _invalid_handshake(v) + _invalid_epoch(v) \
        + _invalid_config(v)


def _invalid_handshake(v: dict[str, list[bytes]]) -> list[Case]:
    """Handshake fields, meta depth, an LZ4 block longer than rawbytes."""
    hello, welcome, reject = v["hello"], v["welcome"], v["reject_stage_taken"]
    ids_raw = samples()["act_train"].tensors["ids"].wire_array().tobytes()
    double = lz4.block.compress(ids_raw * 2, store_size=False)

    def deep9(h: dict[str, Any]) -> None:
        x: Any = 9
        for _ in range(8):  # meta + 8 nested arrays: depth 9
            x = [x]
        h["meta"]["deep"] = x

    IM = "invalid_message"
    cases: list[tuple[str, list[bytes], str, str]] = [
        ("hello_no_nonce", _edit(hello, _meta(nonce=_DROP)), IM, "HELLO without nonce"),
        ("hello_nonce_short", _edit(hello, _meta(nonce=bytes(15))), IM, "HELLO nonce of 15 bytes"),
        ("hello_nonce_string", _edit(hello, _meta(nonce="00" * 16)), IM, "HELLO nonce as hex text"),
        ("hello_no_micro_batches", _edit(hello, _meta(num_micro_batches=_DROP)), IM,
         "HELLO without num_micro_batches"),
        ("hello_micro_batch_size_zero", _edit(hello, _meta(micro_batch_size=0)), IM, "HELLO micro_batch_size 0"),
        ("hello_eval_batches_negative", _edit(hello, _meta(eval_batches=-1)), IM, "HELLO eval_batches -1"),
        ("welcome_no_hello_nonce", _edit(welcome, _meta(hello_nonce=_DROP)), IM, "WELCOME without hello_nonce"),
        ("welcome_no_nonce", _edit(welcome, _meta(nonce=_DROP)), IM, "WELCOME without its nonce"),
        ("reject_hello_nonce_long", _edit(reject, _meta(hello_nonce=bytes(17))), IM, "REJECT hello_nonce of 17 bytes"),
        ("meta_depth_9", _edit(v["meta_depth_8"], deep9), "malformed_header",
         "meta nested 9 deep (meta map + 8 arrays)"),
        ("lz4_long_output", _replace_frame(v["act_train"], 0, double), "decompression_failed",
         "lz4 block decompressing to 2x rawbytes: fails in a buffer of rawbytes (never allocated larger)"),
    ]
    return [Case(n, "invalid", f, d, error=e) for n, f, e, d in cases]


def _invalid_config(v: dict[str, list[bytes]]) -> list[Case]:
    """Configuration refusals and certificates: ``config`` is a map, ``anchored`` a bool, ``cert`` a bin."""
    IM = "invalid_message"
    cases: list[tuple[str, list[bytes], str, str]] = [
        ("hello_config_list", _edit(v["hello_config"], _meta(config=["compression.rank", 4])), IM,
         "HELLO config is an array, not a map"),
        ("reject_anchored_int", _edit(v["reject_config_unanchored"], _meta(anchored=0)), IM,
         "REJECT anchored is 0, not false"),
        ("heartbeat_anchored_string", _edit(v["heartbeat_anchored"], _meta(anchored="yes")), IM,
         "HEARTBEAT anchored is a string"),
        ("checkpoint_abandoned_no_reason", _edit(v["checkpoint_abandoned"], _meta(reason=_DROP)), IM,
         "CHECKPOINT abandoned without a reason"),
        ("hello_cert_string", _edit(v["hello_cert"], _meta(cert="a certificate")), IM,
         "HELLO cert is a string, not a bin"),
    ]
    return [Case(n, "invalid", f, d, error=e) for n, f, e, d in cases] + _invalid_replicas(v)


def _invalid_replicas(v: dict[str, list[bytes]]) -> list[Case]:
    """2.1: ROUTE's phase and acts, HELLO's contact."""
    IM = "invalid_message"

    def route_tensor(h: dict[str, Any]) -> None:
        h["tensors"] = [{"name": "x", "dtype": "uint8", "shape": [1], "codec": "raw", "nbytes": 1, "rawbytes": 1,
                         "crc": zlib.crc32(b"\x07")}]

    cases: list[tuple[str, list[bytes], str, str]] = [
        ("route_phase_unknown", _edit(v["route_ready"], _meta(phase="go")), IM, "2.1: ROUTE phase 'go'"),
        ("route_end_no_acts", _edit(v["route_end"], _meta(acts=_DROP)), IM, "2.1: ROUTE end without acts"),
        ("route_acts_negative", _edit(v["route_end"], _meta(acts=-3)), IM, "2.1: ROUTE end with acts -3"),
        ("route_with_tensor", _edit([*v["route_ready"], b"\x07"], route_tensor), IM, "2.1: ROUTE carrying a tensor"),
        ("route_redo_no_gone", _edit(v["route_redo"], _meta(gone=_DROP)), IM, "2.1: ROUTE redo without gone"),
        ("act_sig_short", _edit(v["act_train_signed"], _meta(sig=bytes(63))), IM, "2.1: ACT with a 63-byte sig"),
        ("route_exclude_no_gone", _edit(v["route_exclude"], _meta(gone=_DROP)), IM, "2.1: ROUTE exclude without gone"),
        ("dialback_no_nonce", _edit(v["dialback"], _meta(nonce=_DROP)), IM, "2.1: DIALBACK without a nonce"),
        ("dialback_contact_bin", _edit(v["dialback_request"], _meta(contact=b"tcp://h:1")), IM,
         "2.1: DIALBACK with a bin contact"),
        ("route_held_not_gone", _edit(v["route_redo"], _meta(held=[3])), IM, "2.1: ROUTE redo with held "
         "(only gone names held micro-batches)"),
        ("route_held_not_uints", _edit(v["route_gone_held"], _meta(held=[-1])), IM, "2.1: ROUTE gone with a "
         "negative held micro-batch"),
        ("route_gone_not_strings", _edit(v["route_redo"], _meta(phase="gone", gone=[7])), IM,
         "2.1: ROUTE gone listing a number, not a contact"),
        ("route_redo_sig_short", _edit(v["route_redo_signed"], _meta(sig=bytes(63))), IM,
         "2.1: ROUTE redo whose sig is 63 bytes, not an Ed25519 signature's 64"),
        ("route_ready_signed", _edit(v["route_redo_signed"], _meta(phase="ready", gone=_DROP)), IM,
         "2.1: ROUTE ready with a cert and sig (only redo carries a decision's proof)"),
        ("hello_contact_bin", _edit(v["hello_replica"], _meta(contact=b"tcp://10.0.0.2:5002")), IM,
         "2.1: HELLO contact is a bin, not a string"),
        ("hello_stage_replicas_zero", _edit(v["hello_reform"], _meta(stage_replicas=0)), IM,
         "2.1: HELLO stage_replicas 0 (a re-forming stage has at least its sender)"),
    ]
    return [Case(n, "invalid", f, d, error=e) for n, f, e, d in cases]


def _invalid_epoch(v: dict[str, list[bytes]]) -> list[Case]:
    """The header's run epoch (uint64), the rejoin fields of BYE and CHECKPOINT, and CHECKPOINT
    ``unsaved`` without its step or reason."""
    base = v["epoch_max"]
    M, IM = "malformed_header", "invalid_message"
    cases: list[tuple[str, list[bytes], str, str]] = [
        ("epoch_negative", _edit(base, _set("epoch", -1)), M, "header epoch -1"),
        ("epoch_string", _edit(base, _set("epoch", "2")), M, "header epoch is a string"),
        ("epoch_too_large", _edit(base, _set("epoch", float(2**64))), M,
         "header epoch 2^64: above uint64, so msgpack can only carry it as a float"),
        ("bye_lost_string", _edit(v["bye_rejoin"], _meta(lost="1")), IM, "BYE lost is a string"),
        ("checkpoint_offer_epoch_negative", _edit(v["checkpoint_offer_epoch"], _meta(epoch=-2)), IM,
         "CHECKPOINT offer epoch -2"),
        ("checkpoint_resume_epoch_float", _edit(v["checkpoint_resume_epoch"], _meta(epoch=2.0)), IM,
         "CHECKPOINT resume epoch is a float"),
        ("checkpoint_unsaved_no_step", _edit(v["checkpoint_unsaved"], _meta(step=_DROP)), IM,
         "CHECKPOINT unsaved without a step"),
        ("checkpoint_unsaved_no_reason", _edit(v["checkpoint_unsaved"], _meta(reason=_DROP)), IM,
         "CHECKPOINT unsaved without a reason"),
    ]
    return [Case(n, "invalid", f, d, error=e) for n, f, e, d in cases]


def _receiver(version: int = 5, awaiting: bool = False, stream: str = "act") -> dict[str, Any]:
    R, NG, K, G = VQ_LAYOUT
    return {"stream": stream, "version": version, "awaiting_resync": awaiting, "rounds": R,
            "groups": NG, "codebook_size": K, "group_size": G}


def _slice(version: int, start: int, n: int, *, full: bool = False, stream: str = "act",
           shape: tuple[int, ...] | None = None, salt: int = 20) -> list[bytes]:
    if shape is None:
        codes = sample_codebook(start, n, salt)
    else:  # a wrong shape
        codes = sample_floats(int(np.prod(shape)), salt).reshape(shape)
    msg = slice_message(run_id=RUN_ID, src=0, dst=1, stream=stream, version=version, start=start,
                        full=full, codes=codes, step=12, micro=3, seq=50)
    return [bytes(f) for f in encode(msg)]


def _codebook(v: dict[str, list[bytes]]) -> list[Case]:
    """Valid frames checked by a codebook receiver (SPEC §5.1): applied, ignored or rejected."""
    R, NG, K, G = VQ_LAYOUT
    nan = sample_codebook(4, 4, 21)
    nan[1, 0, 2, 1] = float("nan")
    huge = sample_codebook(4, 4, 26)
    huge[0, 1, 1, 0] = 1e30  # finite, far beyond any honest codebook
    huge_msg = slice_message(run_id=RUN_ID, src=0, dst=1, stream="act", version=6, start=4, full=False,
                             codes=huge, step=12, micro=3, seq=50)
    nan_msg = slice_message(run_id=RUN_ID, src=0, dst=1, stream="act", version=6, start=4, full=False,
                            codes=nan, step=12, micro=3)
    two = slice_message(run_id=RUN_ID, src=0, dst=1, stream="act", version=6, start=4, full=False,
                        codes=sample_codebook(4, 4, 22), step=12, micro=3)
    two.tensors["more"] = WireTensor("fp32", sample_codebook(8, 1, 23))
    full_start = slice_message(run_id=RUN_ID, src=0, dst=1, stream="act", version=9, start=4, full=True,
                               codes=sample_codebook(0, K, 24), step=12, micro=3)

    def indexed(index: Any, *, start: int = 0, full: bool = False, n: int | None = None) -> list[bytes]:
        """An indexed slice at version 6 with ``index`` (R, r/G, n) positions."""
        index = np.asarray(index)
        m = slice_message(run_id=RUN_ID, src=0, dst=1, stream="act", version=9 if full else 6, start=start,
                          full=full, codes=sample_codebook(0, index.shape[-1] if n is None else n, 25), step=12,
                          micro=3, index=index)
        return [bytes(f) for f in encode(m)]

    ix = SAMPLE_INDEX
    swapped, repeated, beyond = ix.copy(), ix.copy(), ix.copy()
    swapped[1, 0] = [4, 3, 7]
    repeated[0, 1] = [2, 2, 15]
    beyond[1, 1, 2] = K

    def act(cver: int, codes: Any, dtype: str = "uint8") -> list[bytes]:
        m = Message(type=MessageType.ACT, run_id=RUN_ID, src=0, dst=1, step=12, micro=3, seq=51, pver=12,
                    cver=cver, meta={"mode": "train"},
                    tensors={"ids": v_ids, "codes": WireTensor(dtype, codes)})
        return [bytes(f) for f in encode(m)]

    v_ids = samples()["act_vq_rounds"].tensors["ids"]
    good_codes = samples()["act_vq_rounds"].tensors["codes"].wire_array()
    big = good_codes.copy()
    big[1, 2, 1, 0] = K
    rx, SM, SS, SI = _receiver(), "slice_malformed", "slice_shape_mismatch", "slice_index_out_of_range"
    cases: list[tuple[str, list[bytes], dict[str, Any], str, str]] = [
        ("slice_next_version", v["codebook_slice_stream"], rx, "apply",
         "partial slice at version v+1: applied"),
        ("slice_full_newer", _slice(9, 0, K, full=True), rx, "apply", "full slice at version 9 > 5: applied"),
        ("slice_full_while_awaiting", _slice(3, 0, K, full=True), _receiver(awaiting=True), "apply",
         "full slice while awaiting a resync: applied whatever its version"),
        ("slice_partial_while_awaiting", v["codebook_slice_stream"], _receiver(awaiting=True), "ignore",
         "partial slice while awaiting a resync: ignored"),
        ("slice_grad_stream", v["codebook_slice_full"], _receiver(stream="grad"), "apply",
         "full slice of the grad stream to its receiver"),
        ("slice_stale_replay", _slice(5, 4, 4), rx, "stale_slice", "version 5 == receiver's 5 (replay)"),
        ("slice_stale_old", _slice(1, 4, 4), rx, "stale_slice", "version 1 < receiver's 5"),
        ("slice_full_stale", _slice(5, 0, K, full=True), rx, "stale_slice", "full slice not newer"),
        ("slice_full_replica_copy", _slice(5, 0, K, full=True), {**rx, "holds_slice": True}, "ignore",
         "2.1: full slice at the receiver's version, its codebooks equal to it (another replica's copy)"),
        ("slice_future_gap", _slice(7, 4, 4), rx, "future_slice", "version 7 skips 6: slices lost"),
        ("slice_rounds_mismatch", _slice(6, 4, 4, shape=(3, NG, 4, G)), rx, SS, "3 rounds, receiver has 2"),
        ("slice_groups_mismatch", _slice(6, 4, 4, shape=(R, 4, 4, G)), rx, SS, "4 groups, receiver has 2"),
        ("slice_group_size_mismatch", _slice(6, 4, 4, shape=(R, NG, 4, 3)), rx, SS, "group size 3, not 2"),
        ("slice_three_dims", _slice(6, 4, 4, shape=(R, NG, 8)), rx, SS, "codes with 3 dimensions"),
        ("slice_empty", _slice(6, 4, 0), rx, SS, "slice of zero codes"),
        ("slice_full_short", _slice(9, 0, 8, full=True), rx, SS, "full slice of 8 codes, K = 16"),
        ("slice_index_beyond_end", _slice(6, 14, 4), rx, SI, "codes 14..17 of 16"),
        ("slice_start_past_end", _slice(6, 16, 1), rx, SI, "start 16 of 16 codes"),
        ("slice_wrong_stream", _slice(6, 4, 4, stream="grad"), rx, SM, "grad slice to the act receiver"),
        ("slice_no_meta", v["codebook_slice"], rx, SM, "no meta: stream and start missing"),
        ("slice_nan", [bytes(f) for f in encode(nan_msg)], rx, SM, "a NaN among the codes"),
        ("slice_value_beyond_bound", [bytes(f) for f in encode(huge_msg)], rx, SM,
         "a code value of 1e30, beyond ±65504"),
        ("slice_full_far_future", _slice(5 + 4097, 0, K, full=True), rx, "future_slice",
         "full slice 4097 versions beyond the receiver's 5 (at most 4096)"),
        ("slice_full_far_while_awaiting", _slice(5 + 4097, 0, K, full=True), _receiver(awaiting=True),
         "future_slice", "full slice 4097 versions beyond, while awaiting a resync"),
        ("slice_full_skip_bound", _slice(5 + 4096, 0, K, full=True), rx, "apply",
         "full slice exactly 4096 versions beyond: applied"),
        ("slice_two_tensors", [bytes(f) for f in encode(two)], rx, SM, "a second tensor"),
        ("slice_full_nonzero_start", [bytes(f) for f in encode(full_start)], rx, SM, "full slice at start 4"),
        ("slice_indexed_next_version", v["codebook_slice_indexed"], rx, "apply",
         "indexed slice at version v+1: applied"),
        ("slice_indexed_full", indexed(np.tile(np.arange(K, dtype="u1"), (R, NG, 1)), full=True), rx, SM,
         "a full slice with an index"),
        ("slice_indexed_nonzero_start", indexed(ix, start=4), rx, SM, "indexed slice at start 4"),
        ("slice_indexed_uint16", indexed(ix.astype("<u2")), rx, SM, "uint16 index for K = 16"),
        ("slice_indexed_shape", indexed(ix[:, :, :2], n=3), rx, SS, "index of 2 positions for 3 codes"),
        ("slice_indexed_beyond_end", indexed(beyond), rx, SI, "index 16 of 16 codes"),
        ("slice_indexed_not_increasing", indexed(swapped), rx, SM, "index row 4, 3, 7"),
        ("slice_indexed_repeated", indexed(repeated), rx, SM, "index row 2, 2, 15"),
        ("codes_current_version", v["act_vq_rounds"], _receiver(version=6), "apply",
         "ACT codes at the receiver's version: decoded"),
        ("codes_old_version", v["act_vq_rounds"], rx, "codebook_version_mismatch",
         "ACT codes at version 6, receiver at 5"),
        ("codes_out_of_range", act(6, big), _receiver(version=6), "bad_codes", "a code equal to K"),
        ("codes_wrong_shape", act(6, good_codes.reshape(2, 4, 4, 1)), _receiver(version=6), "bad_codes",
         "codes (B, T, 4, 1) for R=2, r/G=2"),
        ("codes_wrong_dtype", act(6, good_codes.astype("<u2"), "uint16"), _receiver(version=6), "bad_codes",
         "uint16 codes for K = 16"),
    ]
    return [Case(n, "codebook", f, d, extra={"receiver": r, "outcome": o}) for n, f, r, o, d in cases]


CASES_2_1 = frozenset({"hello_replica", "route_ready", "route_end", "route_phase_unknown", "route_end_no_acts",
                       "route_acts_negative", "route_with_tensor", "hello_contact_bin", "route_ready_fits",
                       "route_end_fits", "route_ready_from_upstream", "route_end_out_of_window", "route_commit",
                       "route_redo", "route_redo_no_gone", "route_gone_not_strings", "route_commit_from_downstream",
                       "route_redo_from_downstream_fits", "route_taken", "route_taken_fits",
                       "route_taken_from_upstream", "route_gone_held", "route_reopen", "route_held_not_gone",
                       "route_held_not_uints", "route_reopen_from_downstream", "hello_reform",
                       "hello_stage_replicas_zero", "bye_leave", "route_redo_signed", "route_redo_sig_short",
                       "route_ready_signed", "dialback_request", "dialback", "dialback_no_nonce",
                       "dialback_contact_bin"})
"""The vectors protocol 2.1 added (at version 2.1)."""
CASES_2_2 = frozenset({"hello_dial_out"})
"""The vectors protocol 2.2 added (at version 2.2; those of neither set stay at 2.0)."""


def at_minor(frames: list[bytes], minor: int) -> list[bytes]:
    """``frames`` of this encoder as one of version ``2.<minor>`` wrote them: its header's ``v`` (the
    first key, right after the map header) rewritten. A minor version adds vectors and never changes
    existing ones (SPEC §10): each keeps the version it was added at, and the cases made from it too."""
    ours = b"\xa1v\x92" + bytes(PROTOCOL_VERSION)
    head = frames[0] if frames else b""
    at = head.find(ours, 0, 1 + 2 + len(ours))  # after a map header of up to 3 bytes
    if at < 0:
        return frames
    return [head[:at] + b"\xa1v\x92" + bytes((PROTOCOL_VERSION[0], minor)) + head[at + len(ours):], *frames[1:]]


def added_at(name: str) -> int:
    """The minor version that added the vector ``name``."""
    return 2 if name in CASES_2_2 else 1 if name in CASES_2_1 else 0


def build_cases() -> list[Case]:
    """Every golden vector: valid, accept, invalid, codebook, then content (some with the receiver's
    epoch); each at the version that added it (:func:`added_at`)."""
    def frames(name: str, msg_frames: list[bytes]) -> list[bytes]:
        return at_minor(msg_frames, added_at(name))

    v = {name: frames(name, [bytes(f) for f in encode(m)]) for name, m in samples().items()}
    content = [Case(n, "content", frames(n, f), d, extra={"run": r.to_dict(), "window": w.to_dict(), "outcome": o})
               for n, f, d, r, w, o in content_cases()]
    content += [Case(n, "content", frames(n, f), d,
                     extra={"run": r.to_dict(), "window": w.to_dict(), "epoch": e, "outcome": o})
                for n, f, d, r, w, e, o in epoch_cases()]
    cases = _valid(v) + _accept(v) + _invalid(v) + _codebook(v) + content
    # the cases encoded here from scratch too (an accept case's version is what it is about)
    return [c if c.kind == "accept" else Case(c.name, c.kind, frames(c.name, c.frames), c.description, c.error,
                                              c.equivalent, c.extra) for c in cases]
