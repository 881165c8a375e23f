"""Encoder/decoder behaviour: canonical form, zero copy, codecs, auth, versions, dtype rules."""

from __future__ import annotations

import msgpack
import numpy as np
import pytest

from mapl_swarm.errors import MaplError
from mapl_swarm.wire import (
    AuthFailed,
    BadCodec,
    BadDtype,
    FrameTooLarge,
    InvalidMessage,
    MalformedHeader,
    Message,
    MessageType,
    PROTOCOL_VERSION,
    VersionMismatch,
    WireError,
    WireTensor,
    decode,
    encode,
)
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


def test_hmac_pass_and_fail():
    msg = samples()["act_train"]
    frames = encode(msg, secret=b"s3cret")
    assert decode(frames, secret=b"s3cret") == msg
    with pytest.raises(AuthFailed):
        decode(frames, secret=b"other")
    with pytest.raises(AuthFailed):
        decode(frames)
    with pytest.raises(AuthFailed):
        decode(encode(msg), secret=b"s3cret")
    z = bytearray(bytes(frames[2]))
    z[0] ^= 0x80
    with pytest.raises(WireError):
        decode([frames[0], frames[1], bytes(z)], secret=b"s3cret")


def test_secret_must_be_explicit_bytes():
    with pytest.raises(TypeError):
        encode(samples()["bye"], secret="text")
    with pytest.raises(ValueError):
        encode(samples()["bye"], secret=b"")


def test_version_mismatch_names_both_versions():
    head = msgpack.unpackb(encode(samples()["hello"])[0])
    head["v"] = [2, 0]
    with pytest.raises(VersionMismatch) as exc:
        decode([msgpack.packb(head)])
    major, minor = PROTOCOL_VERSION
    assert str(exc.value) == f"peer speaks 2.0, this peer speaks {major}.{minor}"
    assert exc.value.peer_version == (2, 0) and exc.value.local_version == PROTOCOL_VERSION
    assert exc.value.code == "version_mismatch" and isinstance(exc.value, MaplError)


def test_unknown_keys_of_same_major_are_ignored():
    frames = encode(samples()["act_train"])
    head = msgpack.unpackb(frames[0])
    head["v"] = list(PROTOCOL_VERSION)
    head["future"] = {"x": [1, 2]}
    head["tensors"][0]["future_desc"] = True
    back = decode([msgpack.packb(head), *frames[1:]])
    assert back.version == PROTOCOL_VERSION
    back.version = (1, 0)
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
        a.send_multipart(encode(msg, secret=b"k"), copy=False)
        assert b.poll(5000)
        frames = b.recv_multipart(copy=False)
        assert decode(frames, secret=b"k") == msg
    finally:
        a.close()
        b.close()
        ctx.term()
