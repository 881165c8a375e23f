"""Deterministic sample messages, one per message type, for the golden vectors and tests.

Tensor contents come from integer arithmetic only (no RNG, no transcendental functions), so the
bytes are identical on every platform and numpy version.
"""

from __future__ import annotations

import hashlib

import numpy as np

from mapl_swarm.wire.codebook import slice_message
from mapl_swarm.wire.message import Message, WireTensor
from mapl_swarm.wire.spec import MessageType

__all__ = ["HELLO_NONCE", "WELCOME_NONCE", "RUN_ID", "FINGERPRINT", "VQ_LAYOUT", "sample_floats", "sample_ids",
           "sample_codebook", "samples"]

HELLO_NONCE = hashlib.sha256(b"mapl-swarm golden hello nonce").digest()[:16]
"""``meta.nonce`` of the samples' HELLOs (and ``hello_nonce`` of the WELCOME and REJECTs answering them)."""
WELCOME_NONCE = hashlib.sha256(b"mapl-swarm golden welcome nonce").digest()[:16]
"""``meta.nonce`` of the samples' WELCOME."""

RUN_ID = "vectors-run-0001"
FINGERPRINT = hashlib.sha256(b"mapl-swarm example config").hexdigest()
_OTHER_FINGERPRINT = hashlib.sha256(b"mapl-swarm other config").hexdigest()


def sample_floats(n: int, salt: int = 0) -> np.ndarray:
    """``n`` float32 values in [-2, 2) from a multiplicative hash (exact IEEE arithmetic)."""
    k = (np.arange(n, dtype=np.uint64) + np.uint64(salt)) * np.uint64(2654435761)
    u = (k % np.uint64(2**24)).astype(np.float32)
    return u / np.float32(2**22) - np.float32(2.0)


def _bf16(x: np.ndarray) -> np.ndarray:
    """bf16 bit patterns of float32 values (truncation)."""
    return (x.astype("<f4").view("<u4") >> 16).astype("<u2")


def sample_ids(b: int, t: int, dtype: str = "<i8") -> np.ndarray:
    """A (b, t) id tensor repeating a short sentence, as BPE ids of text do."""
    sentence = np.array([464, 2068, 7586, 21831, 18045, 625, 262, 16931, 3290, 13], dtype=dtype)
    return np.resize(sentence, b * t).reshape(b, t)


def _stage_hello(mtype: MessageType) -> Message:
    """HELLO from stage 1 to stage 0, or stage 0's WELCOME answering it, of a 4-stage run (M=4, B=2, E=2)."""
    hello = mtype is MessageType.HELLO
    nonces = {"nonce": HELLO_NONCE} if hello else {"nonce": WELCOME_NONCE, "hello_nonce": HELLO_NONCE}
    return Message(
        type=mtype,
        run_id=RUN_ID,
        src=1 if hello else 0,
        dst=0 if hello else 1,
        meta={
            "fingerprint": FINGERPRINT,
            "num_stages": 4,
            "capabilities": [],
            **nonces,
            "num_micro_batches": 4,
            "micro_batch_size": 2,
            "eval_batches": 2,
            "components": {
                "model": hashlib.sha256(b"model").hexdigest()[:16],
                "codec": "mapl r=8 bf16",
                "tokenizer_sha256": hashlib.sha256(b"tokenizer.json").hexdigest(),
                "vocab_size": 50257,
            },
            "peer": "stage1@host-b" if hello else "stage0@host-a",
        },
    )


VQ_LAYOUT = (2, 2, 16, 2)
"""(R, r/G, K, G) of the VQ samples: 2 rounds, r = 4 in 2 groups of 2, 16 codes."""

SAMPLE_INDEX = np.array([[[1, 5, 9], [0, 2, 15]], [[3, 4, 7], [8, 11, 12]]], dtype="u1")
"""(R, r/G, n=3) positions of an indexed slice's codes: rows strictly increasing, < K."""


def sample_codebook(start: int, n: int, salt: int, rounds: int = 2, groups: int = 2,
                    group_size: int = 2) -> np.ndarray:
    """fp32 codes ``start .. start+n-1`` of sample codebooks, shape (rounds, groups, n, group_size)."""
    return sample_floats(rounds * groups * n * group_size, salt + 1000 * start).reshape(
        rounds, groups, n, group_size)


def _codes(b: int, t: int, salt: int) -> np.ndarray:
    """(b, t, R, r/G) uint8 VQ codes below K = 16."""
    R, NG, K, _ = VQ_LAYOUT
    k = (np.arange(b * t * R * NG, dtype=np.uint64) + np.uint64(salt)) * np.uint64(40503)
    return (k % np.uint64(K)).astype("u1").reshape(b, t, R, NG)


def _vq_samples(b: int, t: int) -> dict[str, Message]:
    """Codebook streaming messages of SPEC §5.1."""
    common = dict(run_id=RUN_ID, step=12, micro=3, seq=42, pver=12)
    out: dict[str, Message] = {}
    slices = dict(run_id=RUN_ID, step=12, micro=3, seq=42, pver=12)  # the production slice encoder
    out["codebook_slice_stream"] = slice_message(
        src=0, dst=1, stream="act", version=6, start=4, full=False, codes=sample_codebook(4, 4, 11), **slices)
    out["codebook_slice_full"] = slice_message(
        src=2, dst=1, stream="grad", version=9, start=0, full=True, codes=sample_codebook(0, 16, 12), **slices)
    out["resync_stream"] = Message(
        type=MessageType.RESYNC, run_id=RUN_ID, src=1, dst=0, seq=11,
        meta={"stream": "act", "have": 5, "reason": "future_slice"})
    out["act_vq_rounds"] = Message(
        type=MessageType.ACT, src=0, dst=1, cver=6, meta={"mode": "train"},
        tensors={"ids": WireTensor("uint16", sample_ids(b, t + 1, "<u2")),
                 "codes": WireTensor("uint8", _codes(b, t, 1))}, **common)
    out["grad_vq"] = Message(
        type=MessageType.GRAD, src=2, dst=1, cver=9,
        tensors={"codes": WireTensor("uint8", _codes(b, t, 2))}, **common)
    out["codebook_slice_indexed"] = slice_message(  # each codebook its own 3 codes
        src=0, dst=1, stream="act", version=6, start=0, full=False, codes=sample_codebook(0, 3, 13),
        index=SAMPLE_INDEX, **slices)
    out["resync_retransmit"] = Message(
        type=MessageType.RESYNC, run_id=RUN_ID, src=1, dst=0, step=12, micro=3, seq=43,
        meta={"stream": "act", "have": 5, "reason": "codebook_version_mismatch", "retransmit": True,
              "mode": "eval"})
    return out


def samples() -> dict[str, Message]:
    """Sample messages by vector name (B=2 sequences, T=4 tokens, d=8, r=4), every one at the
    encoder's version, :data:`~mapl_swarm.wire.spec.PROTOCOL_VERSION`."""
    b, t, d, r = 2, 4, 8, 4
    z = _bf16(sample_floats(b * t * r, 1)).reshape(b, t, r)
    out: dict[str, Message] = {}
    out["hello"] = _stage_hello(MessageType.HELLO)
    out["welcome"] = _stage_hello(MessageType.WELCOME)
    out["reject"] = Message(
        type=MessageType.REJECT,
        run_id=RUN_ID,
        src=0,
        dst=1,
        meta={
            "code": "fingerprint_mismatch",
            "reason": f"fingerprint mismatch: peer {_OTHER_FINGERPRINT}, this peer {FINGERPRINT}",
            "local": FINGERPRINT,
            "remote": _OTHER_FINGERPRINT,
        },
    )
    common = dict(run_id=RUN_ID, step=12, micro=3, seq=41, pver=12)
    out["act_train"] = Message(
        type=MessageType.ACT,
        src=0,
        dst=1,
        meta={"mode": "train"},
        tensors={"ids": WireTensor("int64", sample_ids(b, t + 1)), "z": WireTensor("bf16", z)},
        **common,
    )
    out["act_train_signed"] = Message(
        type=MessageType.ACT,
        src=0,
        dst=1,
        meta={"mode": "train", "sig": bytes(range(128, 192))},
        tensors={"ids": WireTensor("int64", sample_ids(b, t + 1)), "z": WireTensor("bf16", z)},
        **common,
    )
    out["act_eval"] = Message(
        type=MessageType.ACT,
        src=1,
        dst=2,
        meta={"mode": "eval"},
        tensors={
            "ids": WireTensor("int32", sample_ids(b, t + 1, "<i4")),
            "z": WireTensor("fp16", sample_floats(b * t * r, 2).astype("<f2").reshape(b, t, r)),
        },
        **common,
    )
    codes = ((np.arange(b * t * r, dtype=np.uint64) * np.uint64(40503)) % np.uint64(251)).astype("u1")
    out["act_vq"] = Message(
        type=MessageType.ACT,
        src=2,
        dst=3,
        cver=77,
        meta={"mode": "train"},
        tensors={
            "ids": WireTensor("int64", sample_ids(b, t + 1)),
            "codes": WireTensor("uint8", codes.reshape(b, t, r)),
        },
        **common,
    )
    out["grad"] = Message(
        type=MessageType.GRAD,
        src=1,
        dst=0,
        tensors={"dz": WireTensor("bf16", _bf16(sample_floats(b * t * r, 3)).reshape(b, t, r))},
        **common,
    )
    out["proj_grad"] = Message(
        type=MessageType.PROJ_GRAD,
        src=1,
        dst=0,
        meta={"micro_batches": 4},
        tensors={"grad": WireTensor("fp32", sample_floats(d * r, 4).reshape(d, r))},
        **{**common, "micro": 0},
    )
    out["proj"] = Message(
        type=MessageType.PROJ,
        src=0,
        dst=1,
        tensors={"proj": WireTensor("fp32", sample_floats(d * r, 5).reshape(d, r))},
        **{**common, "micro": 0, "pver": 13},
    )
    out["report"] = Message(
        type=MessageType.REPORT,
        src=3,
        dst=2,
        meta={
            "loss": 3.25,
            "tokens": 4096,
            "mode": "train",
            "metrics": {"grad_norm": 1.5, "lr": 0.001, "tokens_per_s": 1200},
        },
        **common,
    )
    out["codebook_slice"] = Message(
        type=MessageType.CODEBOOK_SLICE,
        src=0,
        dst=1,
        cver=78,
        tensors={"codes": WireTensor("fp32", sample_floats(16 * 2, 6).reshape(16, 2))},
        **common,
    )
    out["resync"] = Message(type=MessageType.RESYNC, run_id=RUN_ID, src=1, dst=0, seq=9)
    out["heartbeat"] = Message(
        type=MessageType.HEARTBEAT, run_id=RUN_ID, src=0, dst=1, seq=7, meta={"sent_ns": 1234567890123}
    )
    out["bye"] = Message(
        type=MessageType.BYE, run_id=RUN_ID, src=0, dst=1, seq=8, meta={"reason": "shutdown"}
    )
    out["error"] = Message(
        type=MessageType.ERROR,
        run_id=RUN_ID,
        src=1,
        dst=0,
        seq=10,
        meta={"code": "checksum_mismatch", "message": "tensor 'z': CRC-32 mismatch", "ref_seq": 17},
    )
    out["all_dtypes"] = Message(
        type=MessageType.ACT,
        meta={"mode": "train"},
        src=0,
        dst=1,
        tensors={
            "bf16": WireTensor("bf16", _bf16(sample_floats(6, 7)).reshape(2, 3)),
            "fp16": WireTensor("fp16", sample_floats(3, 8).astype("<f2")),
            "fp32": WireTensor("fp32", sample_floats(1, 9).reshape(())),
            "fp64": WireTensor("fp64", sample_floats(4, 10).astype("<f8").reshape(2, 1, 2)),
            "uint8": WireTensor("uint8", np.arange(5, dtype="u1")),
            "uint16": WireTensor("uint16", np.array([0, 1, 65535], dtype="<u2")),
            "uint32": WireTensor("uint32", np.array([0, 2**32 - 1], dtype="<u4")),
            "int32": WireTensor("int32", np.array([-(2**31), -1, 0, 2**31 - 1], dtype="<i4")),
            "int64": WireTensor("int64", np.array([-(2**63), 2**63 - 1], dtype="<i8")),
            "empty": WireTensor("fp32", np.zeros((0, 3), dtype="<f4")),
        },
        **common,
    )
    out["large_ints"] = Message(
        type=MessageType.GRAD,
        run_id=RUN_ID,
        src=65535,
        dst=65534,
        step=2**40 + 1,
        micro=2**32 - 1,
        seq=2**64 - 1,
        pver=2**63,
        cver=2**16,
    )
    out["meta_free"] = Message(
        type=MessageType.ACT,
        run_id="run-ünïcödé-✓",
        src=0,
        dst=1,
        meta={
            "mode": "eval",
            "zeta": [1, -1, -200, 70000, -(2**63), 2**64 - 1],
            "alpha": {"b": None, "a": True, "c": False},
            "blob": b"\x00\x01\xfe\xff",
            "pi": 3.141592653589793,
            "nested": {"z": [{"y": 1.5, "x": "é"}]},
        },
    )
    out.update(_vq_samples(b, t))
    out.update(_checkpoint_samples())
    out.update(_handshake_samples())
    out.update(_rejoin_samples(b, t))
    out.update(_unsaved_samples())
    out.update(_anchored_samples())
    out.update(_certified_samples())
    out.update(_dialback_samples())
    out.update(_replica_samples())
    return out


def _replica_samples() -> dict[str, Message]:
    """2.1, several peers per stage (SPEC §9.10, capability ``replicas``): a replica's HELLO naming
    its contact (and, re-forming the swarm, its stage's live replicas and the stage lost), a
    receiver's ROUTE ``ready`` for step 12 and a sender's ROUTE ``end`` announcing its 3 train ACTs
    of step 12 on the link."""
    hello = _stage_hello(MessageType.HELLO)
    hello.meta.update(capabilities=["1f1b", "checkpoint_agreement", "drain", "replicas"],
                      contact="tcp://10.0.0.2:5002#" + "ab" * 32)
    reform = _stage_hello(MessageType.HELLO)
    reform.epoch = 2
    reform.meta.update(hello.meta, stage_replicas=1, lost=2)
    dial_out = _stage_hello(MessageType.HELLO)
    dial_out.meta.update(capabilities=["1f1b", "checkpoint_agreement", "drain"], contact="dialout#" + "ab" * 32)
    return {
        "hello_replica": hello,
        "hello_reform": reform,
        "hello_dial_out": dial_out,
        "route_ready": Message(type=MessageType.ROUTE, run_id=RUN_ID, src=2, dst=1, step=12, seq=40,
                               meta={"phase": "ready"}),
        "route_end": Message(type=MessageType.ROUTE, run_id=RUN_ID, src=0, dst=1, step=12, seq=41,
                             meta={"phase": "end", "acts": 3}),
        "route_commit": Message(type=MessageType.ROUTE, run_id=RUN_ID, src=0, dst=1, step=12, seq=42,
                                meta={"phase": "commit"}),
        "route_redo": Message(type=MessageType.ROUTE, run_id=RUN_ID, src=2, dst=1, step=12, seq=43, epoch=1,
                              meta={"phase": "redo", "gone": ["tcp://10.0.0.7:5002#" + "cd" * 32]}),
        "route_redo_signed": Message(type=MessageType.ROUTE, run_id=RUN_ID, src=2, dst=1, step=12, seq=43, epoch=1,
                                     meta={"phase": "redo", "gone": [],
                                           "cert": b"\x82\xa4body\xc4\x03abc\xa3sig\xc4\x40" + bytes(64),
                                           "sig": bytes(range(64, 128))}),
        "route_exclude": Message(type=MessageType.ROUTE, run_id=RUN_ID, src=1, dst=2, step=12, seq=45, epoch=0,
                                 meta={"phase": "exclude", "gone": ["tcp://10.0.0.9:5001#" + "ef" * 32]}),
        "route_taken": Message(type=MessageType.ROUTE, run_id=RUN_ID, src=1, dst=0, step=12, seq=44, epoch=1,
                               meta={"phase": "taken"}),
        "route_gone_held": Message(type=MessageType.ROUTE, run_id=RUN_ID, src=2, dst=1, step=12, seq=45,
                                   meta={"phase": "gone", "gone": ["tcp://10.0.0.7:5002#" + "cd" * 32],
                                         "held": [3, 8]}),
        "route_reopen": Message(type=MessageType.ROUTE, run_id=RUN_ID, src=0, dst=1, step=12, seq=46,
                                meta={"phase": "reopen"}),
        "bye_leave": Message(type=MessageType.BYE, run_id=RUN_ID, src=1, dst=0, step=13, seq=47,
                             meta={"reason": "leave"}),
    }


def _certified_samples() -> dict[str, Message]:
    """A certified peer's HELLO (SPEC §7.2): its certificate in ``cert``, a well-formed ``{"body",
    "sig"}`` map whose bytes are opaque to the decoder (the peer checks it, §7.2 item 3)."""
    hello = _stage_hello(MessageType.HELLO)
    body = hashlib.sha256(b"mapl-swarm golden certificate body").digest() * 6
    sig = hashlib.sha512(b"mapl-swarm golden certificate sig").digest()
    hello.meta.update(capabilities=["1f1b", "checkpoint_agreement", "drain", "rejoin"],
                      cert=b"\x82\xa4body\xc4" + bytes([len(body)]) + body + b"\xa3sig\xc4\x40" + sig)
    return {"hello_cert": hello}


def _dialback_samples() -> dict[str, Message]:
    """2.1, a dial-back (SPEC §9.11): a member's request (its certificate, the contact it wants
    dialed, a nonce) and the live peer's dial to that contact, echoing the nonce."""
    cert = b"\x82\xa4body\xc4\x03abc\xa3sig\xc4\x40" + bytes(64)
    nonce = hashlib.sha256(b"mapl-swarm golden dial-back nonce").digest()[:16]
    return {
        "dialback_request": Message(type=MessageType.DIALBACK, run_id=RUN_ID, src=2, dst=1,
                                    meta={"nonce": nonce, "cert": cert,
                                          "contact": "tcp://203.0.113.7:5555#" + "ab" * 32}),
        "dialback": Message(type=MessageType.DIALBACK, run_id=RUN_ID, src=1, dst=2, meta={"nonce": nonce}),
    }


def _handshake_samples() -> dict[str, Message]:
    """A REJECT echoing its HELLO's nonce, ``meta`` nested as deep as SPEC §2 allows, and a drain."""
    reject = Message(type=MessageType.REJECT, run_id=RUN_ID, src=0, dst=1,
                     meta={"code": "stage_taken", "hello_nonce": HELLO_NONCE,
                           "reason": "stage 1 is taken: a live session with stage1.0a1b2c3d, this HELLO "
                                     "came from stage1.9f8e7d6c"})
    deep: object = 8
    for _ in range(7):  # meta (depth 1) + 7 nested arrays = depth 8, the most SPEC §2 allows
        deep = [deep]
    depth8 = Message(type=MessageType.HEARTBEAT, run_id=RUN_ID, src=0, dst=1, seq=3, meta={"deep": deep})
    return {
        "reject_stage_taken": reject,
        "meta_depth_8": depth8,
        **_drain_samples(),
    }


def _drain_samples() -> dict[str, Message]:
    """Round-trip timestamps (SPEC §9.5) and a graceful drain (§5.2, capability ``drain``), in a
    3-stage swarm."""
    checkpoint = dict(type=MessageType.CHECKPOINT, run_id=RUN_ID)
    return {
        "heartbeat_rtt": Message(type=MessageType.HEARTBEAT, run_id=RUN_ID, src=2, dst=1, seq=57,
                                 meta={"sent_ns": 88_000_123_456_789, "echo_ns": 1_234_567_890_999,
                                       "held_ns": 1_250_000_000}),
        "checkpoint_drain_request": Message(src=2, dst=1, seq=58, meta={"phase": "drain_request",
                                                                        "reason": "SIGTERM at stage 2"},
                                            **checkpoint),
        "checkpoint_drain": Message(src=0, dst=1, step=42, seq=410, meta={"phase": "drain", "step": 42,
                                                                          "reason": "SIGTERM at stage 2"},
                                    **checkpoint),
        "checkpoint_drain_signed": Message(src=1, dst=2, step=42, seq=411, meta={
            "phase": "drain", "step": 42, "reason": "SIGTERM at stage 2",
            "cert": b"\x82\xa4body\xc4\x03abc\xa3sig\xc4\x40" + bytes(64), "sig": bytes(range(64))},
            **checkpoint),
        "bye_drain": Message(type=MessageType.BYE, run_id=RUN_ID, src=0, dst=1, step=42, seq=412,
                             meta={"reason": "drain"}),
    }


def _checkpoint_samples() -> dict[str, Message]:
    """CHECKPOINT messages of SPEC §5.2 (a 3-stage swarm)."""
    common = dict(type=MessageType.CHECKPOINT, run_id=RUN_ID)
    return {
        "checkpoint_saved": Message(src=2, dst=1, step=40, seq=300, meta={"phase": "saved", "step": 40}, **common),
        "checkpoint_complete": Message(src=0, dst=1, step=40, seq=301, meta={"phase": "complete", "step": 40},
                                       **common),
        "checkpoint_offer": Message(src=1, dst=0, seq=2, meta={"phase": "offer", "steps": [20, 30],
                                                               "have": {"1": [20, 30], "2": [20, 30, 40]}},
                                    **common),
        "checkpoint_resume": Message(src=0, dst=1, step=30, seq=2, meta={"phase": "resume", "step": 30}, **common),
        "checkpoint_resume_refused": Message(
            src=0, dst=1, seq=2, meta={"phase": "resume", "step": None,
                                       "reason": "no checkpoint step every stage has: stage 0 has [10], "
                                                 "stage 1 has [20, 30], stage 2 has [20, 30, 40]"},
            **common),
        "checkpoint_resume_missing": Message(
            src=0, dst=1, seq=2, epoch=1, meta={"phase": "resume", "step": None, "missing": [2],
                                                "reason": "stage 2 has no checkpoint of this run, but every stage "
                                                          "saved step 30: copy checkpoints/step_00000030/stage_2.pt"},
            **common),
    }


def _unsaved_samples() -> dict[str, Message]:
    """CHECKPOINT ``unsaved`` (SPEC §5.2, capability ``checkpoint_unsaved``): stage 2 of
    a 3-stage swarm could not save step 40."""
    return {
        "checkpoint_unsaved": Message(
            type=MessageType.CHECKPOINT, run_id=RUN_ID, src=2, dst=1, step=40, seq=302,
            meta={"phase": "unsaved", "step": 40,
                  "reason": "stage 2: checkpoint step 40 not saved under /data/run (1.2 MB free of 20.0 GB there)"}),
    }


def _anchored_samples() -> dict[str, Message]:
    """Configuration refusals (SPEC §9.2): HELLO with the sender's ``config`` and ``anchored``, a configuration
    REJECT that is not anchored (to be retried) and a HEARTBEAT saying its sender is anchored."""
    hello = _stage_hello(MessageType.HELLO)
    hello.meta.update(capabilities=["1f1b", "checkpoint_agreement", "drain", "rejoin"], anchored=True, max_in_flight=4,
                      config={"compression.codec": "mapl", "compression.rank": 4, "model.hidden_size": 8,
                              "model.rms_norm_eps": 1e-05, "pipeline.num_stages": 4, "run.seed": 0})
    return {
        "hello_config": hello,
        "reject_config_unanchored": Message(
            type=MessageType.REJECT, run_id=RUN_ID, src=2, dst=1,
            meta={"code": "fingerprint_mismatch", "hello_nonce": HELLO_NONCE, "anchored": False,
                  "reason": "config differs: compression.rank (stage 1 has 4, stage 2 8)"}),
        "checkpoint_abandoned": Message(
            type=MessageType.CHECKPOINT, run_id=RUN_ID, src=0, dst=1, step=40, seq=303,
            meta={"phase": "abandoned", "step": 40,
                  "reason": "stage 2: checkpoint step 40 not saved under /data/run (1.2 MB free of 20.0 GB there)"}),
        "heartbeat_anchored": Message(type=MessageType.HEARTBEAT, run_id=RUN_ID, src=0, dst=1, seq=5,
                                      meta={"sent_ns": 1234567892000, "anchored": True}),
    }


def _rejoin_samples(b: int, t: int) -> dict[str, Message]:
    """The run epoch in the header and the messages of a rejoin (SPEC §9.6), in the 4-stage swarm of
    the handshake samples after stage 1 departed and was replaced."""
    hello = _stage_hello(MessageType.HELLO)
    hello.meta.update(capabilities=["1f1b", "checkpoint_agreement", "drain", "rejoin"])
    hello.epoch = 2
    z = _bf16(sample_floats(b * t * 4, 61)).reshape(b, t, 4)
    checkpoint = dict(type=MessageType.CHECKPOINT, run_id=RUN_ID)
    return {
        "hello_rejoin": hello,
        "act_epoch": Message(type=MessageType.ACT, run_id=RUN_ID, src=1, dst=2, step=30, micro=0, seq=1, pver=30,
                             epoch=3, meta={"mode": "train"},
                             tensors={"ids": WireTensor("uint16", sample_ids(b, t + 1, "<u2")),
                                      "z": WireTensor("bf16", z)}),
        "bye_rejoin": Message(type=MessageType.BYE, run_id=RUN_ID, src=2, dst=3, step=35, seq=880, epoch=1,
                              meta={"reason": "rejoin", "lost": 1}),
        "checkpoint_offer_epoch": Message(src=2, dst=1, seq=2, epoch=2,
                                          meta={"phase": "offer", "steps": [20, 30], "epoch": 2,
                                                "have": {"2": [20, 30], "3": [20, 30, 40]}}, **checkpoint),
        "checkpoint_resume_epoch": Message(src=0, dst=1, step=30, seq=3, epoch=2,
                                           meta={"phase": "resume", "step": 30, "epoch": 2}, **checkpoint),
        "epoch_max": Message(type=MessageType.HEARTBEAT, run_id=RUN_ID, src=0, dst=1, seq=4, epoch=2**64 - 1,
                             meta={"sent_ns": 1234567891000}),
    }
