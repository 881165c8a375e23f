"""Encoder/decoder behaviour: canonical form, zero copy, codecs, versions, no tags, dtype rules."""

from __future__ import annotations

import dataclasses
import inspect

import msgpack
import numpy as np
import pytest

import mapl_swarm.wire as wire
import mapl_swarm.wire.frames as frames_mod
import mapl_swarm.wire.session as session_mod
from mapl_swarm.errors import MaplError
from mapl_swarm.wire import (
    BadCodec,
    BadDtype,
    FrameTooLarge,
    InvalidMessage,
    MalformedHeader,
    Message,
    MessageType,
    PROTOCOL_VERSION,
    VersionMismatch,
    WireTensor,
    decode,
    decode_header,
    encode,
)
from mapl_swarm.wire import spec
from mapl_swarm.wire.errors import ERRORS_BY_CODE
from mapl_swarm.wire.golden.samples import sample_floats, sample_ids, samples


def act(**tensors) -> Message:
    return Message(type=MessageType.ACT, run_id="run", src=0, dst=1, step=5, micro=2, seq=9,
                   meta={"mode": "train"}, tensors=tensors)


def same_frames(a, b) -> bool:
    return len(a) == len(b) and all(bytes(x) == bytes(y) for x, y in zip(a, b))


@pytest.mark.parametrize("name", sorted(samples()))
def test_every_sample_round_trips_and_reencodes_identically(name):
    msg = samples()[name]
    frames = encode(msg)
    back = decode(frames)
    assert back == msg
    assert same_frames(encode(back), frames)


def test_header_is_canonical():
    msg = samples()["report"]
    head = msgpack.unpackb(encode(msg)[0])
    assert list(head) == ["v", "type", "run", "src", "dst", "step", "micro", "seq", "pver",
                          "cver", "meta", "tensors"]
    assert list(head["meta"]) == sorted(head["meta"])
    raw = encode(msg)[0]
    assert b"\xa4step\x0c" in raw  # 12 as a positive fixint, the smallest width
    assert b"\xa4loss\xcb" in raw  # floats as float64
    shuffled = dict(reversed(list(msg.meta.items())))
    assert encode(Message(**{**msg.__dict__, "meta": shuffled}))[0] == raw


def test_uncompressed_tensor_frame_shares_memory_with_source():
    z = sample_floats(2 * 16 * 8).reshape(2, 16, 8)
    frames = encode(act(z=z))
    assert isinstance(frames[1], memoryview)
    assert np.shares_memory(np.frombuffer(frames[1], dtype=np.uint8), z)
    back = decode(frames)
    assert np.shares_memory(back.tensors["z"].data, np.frombuffer(frames[1], dtype=np.uint8))
    assert not back.tensors["z"].data.flags.writeable


def test_bf16_from_int16_keeps_memory_and_bits():
    bits = np.array([[0x3F80, 0xBF80], [0x7F80, 0x0001]], dtype=np.uint16)
    t = WireTensor("bf16", bits.view(np.int16))
    frames = encode(act(z=t))
    assert np.shares_memory(np.frombuffer(frames[1], dtype=np.uint8), bits)
    out = decode(frames).tensors["z"]
    assert out.dtype == "bf16" and np.array_equal(out.data, bits)


def test_lz4_shrinks_repetitive_ids_and_round_trips():
    ids = sample_ids(8, 513)
    frames = encode(act(ids=ids))
    head = msgpack.unpackb(frames[0])
    d = head["tensors"][0]
    assert d["codec"] == "lz4" and d["nbytes"] < d["rawbytes"] / 4
    assert len(frames[1]) == d["nbytes"]
    assert np.array_equal(decode(frames).tensors["ids"].data, ids)


def test_codec_choice_per_tensor():
    ids, z = sample_ids(2, 65), sample_floats(64).astype(np.float16)
    head = msgpack.unpackb(encode(act(ids=ids, z=z))[0])
    assert [d["codec"] for d in head["tensors"]] == ["lz4", "raw"]
    head = msgpack.unpackb(encode(act(ids=ids, z=z), compress={"ids": "raw"})[0])
    assert [d["codec"] for d in head["tensors"]] == ["raw", "raw"]
    head = msgpack.unpackb(encode(act(ids=ids, z=np.zeros(512, np.float16)), compress="lz4")[0])
    assert [d["codec"] for d in head["tensors"]] == ["lz4", "lz4"]
    noise = ((np.arange(64, dtype=np.uint64) * np.uint64(2654435761)) % np.uint64(255)).astype(np.uint8)
    head = msgpack.unpackb(encode(act(codes=noise))[0])
    assert head["tensors"][0]["codec"] == "raw"  # lz4 would not shrink it
    with pytest.raises(BadCodec):
        encode(act(ids=ids), compress={"ids": "zstd"})


def test_non_contiguous_and_big_endian_inputs():
    a = sample_floats(64).reshape(8, 8)[:, ::2]
    b = a.astype(">f4")
    back = decode(encode(act(a=a, b=b)))
    assert np.array_equal(back.tensors["a"].data, a) and np.array_equal(back.tensors["b"].data, a)
    assert back.tensors["b"].dtype == "fp32"


def test_messages_carry_no_tag_and_the_wire_has_no_keys():
    """Protocol 2 authenticates connections (CURVE with per-peer keys, SPEC §7), not messages."""
    assert PROTOCOL_VERSION == (2, 2)
    for name, msg in samples().items():
        assert "auth" not in msgpack.unpackb(bytes(encode(msg)[0])), name
    assert "auth_failed" not in ERRORS_BY_CODE
    names = [n.lower() for n in (*wire.__all__, *spec.__all__, *dir(spec), *frames_mod.__all__, *dir(frames_mod))]
    assert [n for n in names if any(w in n for w in ("auth", "secret", "session", "mac_", "tag"))] == []
    assert list(inspect.signature(encode).parameters) == ["msg", "compress", "max_header_bytes", "max_frame_bytes"]
    assert list(inspect.signature(decode).parameters) == ["frames", "limits", "max_header_bytes", "max_frame_bytes"]
    assert list(inspect.signature(decode_header).parameters) == ["frames", "limits"]
    assert session_mod.__all__ == ["new_nonce"]
    assert "auth" not in {f.name for f in dataclasses.fields(wire.Header)}


def test_an_auth_key_is_an_unknown_key_and_ignored():
    """A header ``auth`` means nothing in 2.0: whatever it holds and wherever it sits, the message
    decodes as without it (SPEC §2 unknown keys, §7), and re-encoding leaves it out."""
    frames = encode(samples()["act_train"])
    for value in (bytes(32), bytes(range(32)), b"short", "text", None, [1, 2]):
        for last in (True, False):
            head = msgpack.unpackb(bytes(frames[0]))
            if last:
                head["auth"] = value
            else:
                head = {"auth": value, **head}
            back = decode([msgpack.packb(head, use_bin_type=True), *frames[1:]])
            assert back == samples()["act_train"]
            assert same_frames(encode(back), frames)


@pytest.mark.parametrize("peer", [(1, 9), (1, 0), (3, 0), (0, 9), (65535, 65535)])
def test_version_mismatch_names_both_versions(peer):
    head = msgpack.unpackb(encode(samples()["hello"])[0])
    head["v"] = list(peer)
    with pytest.raises(VersionMismatch) as exc:
        decode([msgpack.packb(head)])
    assert str(exc.value) == f"peer speaks {peer[0]}.{peer[1]}, this peer speaks 2.2"
    assert exc.value.peer_version == peer and exc.value.local_version == PROTOCOL_VERSION == (2, 2)
    assert exc.value.code == "version_mismatch" and isinstance(exc.value, MaplError)


def test_a_1_9_hello_is_refused_even_when_its_fields_are_those_of_2_0():
    """Major 1 is refused before any field is read: a well-formed 1.9 HELLO is ``version_mismatch``,
    as are header fields 1.x had (a 1.x tag), with the message naming 1.9 and 2.0."""
    frames = encode(samples()["hello"])
    head = msgpack.unpackb(frames[0])
    head["v"] = [1, 9]
    head["auth"] = bytes(32)
    with pytest.raises(VersionMismatch, match=r"^peer speaks 1\.9, this peer speaks 2\.2$"):
        decode([msgpack.packb(head)])
    with pytest.raises(MalformedHeader, match="1, 9"):  # nor does this peer send one
        encode(Message(**{**samples()["hello"].__dict__, "version": (1, 9)}))


def test_newer_minor_of_major_2_is_accepted():
    for minor in (1, 9, 65535):
        head = msgpack.unpackb(encode(samples()["heartbeat"])[0])
        head["v"] = [2, minor]
        back = decode([msgpack.packb(head)])
        assert back.version == (2, minor)
        back.version = PROTOCOL_VERSION
        assert back == samples()["heartbeat"]


def test_every_field_the_spec_requires_is_required():
    """HELLO's and WELCOME's nonce and pipeline fields are required, whatever the minor."""
    for name in ("hello", "welcome"):
        msg = samples()[name]
        required = ["nonce", "num_micro_batches", "micro_batch_size", "eval_batches"]
        required += ["hello_nonce"] if name == "welcome" else []
        for field in required:
            m = Message(**{**msg.__dict__, "meta": {k: v for k, v in msg.meta.items() if k != field}})
            with pytest.raises(InvalidMessage, match=field):
                encode(m)
            head = msgpack.unpackb(encode(msg)[0])
            head["v"] = [2, 1]
            del head["meta"][field]
            with pytest.raises(InvalidMessage, match=field):
                decode([msgpack.packb(head)])


def test_unknown_keys_of_same_major_are_ignored():
    frames = encode(samples()["act_train"])
    head = msgpack.unpackb(frames[0])
    head["v"] = list(PROTOCOL_VERSION)
    head["future"] = {"x": [1, 2]}
    head["tensors"][0]["future_desc"] = True
    back = decode([msgpack.packb(head), *frames[1:]])
    assert back.version == PROTOCOL_VERSION
    assert back == samples()["act_train"]
    assert same_frames(encode(back), frames)


@pytest.mark.parametrize("mtype", [MessageType.PROJ, MessageType.PROJ_GRAD, MessageType.CODEBOOK_SLICE])
@pytest.mark.parametrize("dtype", ["bf16", "fp16", "fp64"])
def test_fp32_enforced_for_projector_types(mtype, dtype):
    bad = WireTensor(dtype, np.zeros((8, 4), dtype={"bf16": np.uint16}.get(dtype, dtype.replace("fp", "float"))))
    msg = Message(type=mtype, run_id="run", src=1, dst=0, tensors={"t": bad})
    with pytest.raises(BadDtype):
        encode(msg)
    good = Message(type=mtype, run_id="run", src=1, dst=0, tensors={"t": np.zeros((8, 4), np.float32)})
    frames = encode(good)
    head = msgpack.unpackb(frames[0])
    head["tensors"][0].update(dtype=dtype, shape=[8, 8] if dtype != "fp64" else [8, 2])
    with pytest.raises(BadDtype):
        decode([msgpack.packb(head), frames[1]])


def test_per_type_meta_rules_on_encode():
    with pytest.raises(InvalidMessage):
        encode(Message(type=MessageType.ACT, run_id="r", src=0, dst=1, meta={"mode": "test"}))
    with pytest.raises(InvalidMessage):
        encode(Message(type=MessageType.REPORT, run_id="r", src=1, dst=0, meta={"loss": 1.0}))
    with pytest.raises(InvalidMessage):
        encode(Message(type=MessageType.BYE, run_id="r", src=0, dst=1, tensors={"x": np.zeros(1)}))
    with pytest.raises(MalformedHeader):
        encode(Message(type=MessageType.BYE, run_id="r", src=0, dst=1, meta={"x": {1, 2}}))
    loss = np.float32(2.5)  # numpy scalars become plain floats
    m = Message(type=MessageType.REPORT, run_id="r", src=1, dst=0, meta={"loss": loss, "tokens": 3})
    assert decode(encode(m)).meta["loss"] == 2.5


def test_limits_are_configurable():
    frames = encode(act(z=np.zeros(1024, np.float32)))
    with pytest.raises(FrameTooLarge):
        decode(frames, max_frame_bytes=1000)
    with pytest.raises(FrameTooLarge):
        decode(frames, max_header_bytes=16)
    with pytest.raises(FrameTooLarge):
        encode(act(z=np.zeros(1024, np.float32)), max_frame_bytes=1000)
    assert decode(frames, max_frame_bytes=4096).tensors["z"].shape == (1024,)


def test_decodes_zmq_frames_without_copy():
    zmq = pytest.importorskip("zmq")
    ctx = zmq.Context()
    a, b = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
    try:
        for s in (a, b):
            s.setsockopt(zmq.LINGER, 0)
        a.bind("inproc://wire-test")
        b.connect("inproc://wire-test")
        msg = samples()["act_train"]
        a.send_multipart(encode(msg), copy=False)
        assert b.poll(5000)
        frames = b.recv_multipart(copy=False)
        assert decode(frames) == msg
    finally:
        a.close()
        b.close()
        ctx.term()
