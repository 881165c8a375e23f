"""Two-phase decoding, decode limits, LZ4 sizing, handshake nonces and fields."""

from __future__ import annotations

import lz4.block
import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import mapl_swarm.wire.frames as frames_mod
from mapl_swarm.wire import (
    DecodeLimits,
    DecompressionFailed,
    FrameTooLarge,
    InvalidMessage,
    MalformedHeader,
    Message,
    MessageType,
    WireError,
    decode,
    decode_header,
    decode_tensors,
    encode,
    new_nonce,
)
from mapl_swarm.wire.golden.samples import HELLO_NONCE, WELCOME_NONCE, samples

MT = MessageType
PROPS = settings(max_examples=50, deadline=None, database=None,
                 suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


def ids_act(n: int) -> Message:
    ids = np.resize(np.array([464, 2068, 7586, 13], "<u2"), (2, n))
    return Message(type=MT.ACT, run_id="r", src=0, dst=1, meta={"mode": "train"}, tensors={"ids": ids})


class Spy:
    """Records lz4.block.decompress calls, then runs the real one."""

    def __init__(self, monkeypatch):
        self.calls: list[int] = []
        real = lz4.block.decompress

        def spy(buf, uncompressed_size=-1, **kw):
            self.calls.append(uncompressed_size)
            return real(buf, uncompressed_size=uncompressed_size, **kw)

        monkeypatch.setattr(frames_mod.lz4.block, "decompress", spy)


def test_decode_is_header_then_tensors():
    msg = samples()["act_train"]
    frames = encode(msg)
    header, raw = decode_header(frames)
    assert header.run == msg.run_id and header.type is MT.ACT and raw == header.tensors
    assert decode_tensors(header, frames) == decode(frames) == decode(frames, DecodeLimits()) == msg


def test_phase_one_never_reads_tensor_frames(monkeypatch):
    spy = Spy(monkeypatch)
    frames = encode(ids_act(4096))
    header, _ = decode_header([frames[0], b"\xff" * 3])  # a broken tensor frame: not looked at
    assert header.seq == 0 and spy.calls == []


def test_declared_size_over_the_name_limit_is_refused_before_inflating(monkeypatch):
    spy = Spy(monkeypatch)
    frames = encode(ids_act(1 << 16))  # 256 KiB of ids, lz4 makes it ~1 KiB
    assert len(frames[1]) < 2048
    limits = DecodeLimits(max_rawbytes={"ids": 2 * 2049 * 2})
    with pytest.raises(FrameTooLarge, match="this run's limit"):
        decode(frames, limits=limits)
    with pytest.raises(FrameTooLarge):
        decode(frames, limits=DecodeLimits(max_rawbytes={"z": 10}))  # a name the run does not have
    assert spy.calls == []
    assert len(decode(frames, limits=DecodeLimits(max_rawbytes={"ids": 1 << 18})).tensors["ids"].data) == 2


def test_lz4_block_longer_than_rawbytes_fails_within_rawbytes(monkeypatch):
    spy = Spy(monkeypatch)
    frames = encode(ids_act(1024))
    head = msgpack.unpackb(frames[0])
    raw = np.resize(np.array([464, 2068, 7586, 13], "<u2"), 2 * 1024 * 255).tobytes()  # 255x the tensor
    bomb = lz4.block.compress(raw, store_size=False)
    head["tensors"][0].update(nbytes=len(bomb), crc=__import__("zlib").crc32(bomb))
    with pytest.raises(DecompressionFailed):
        decode([msgpack.packb(head), bomb])
    assert spy.calls == [2 * 1024 * 2]  # the destination is exactly rawbytes, never more


def test_limits_validate():
    with pytest.raises(ValueError):
        DecodeLimits(max_frame_bytes=0)
    with pytest.raises(ValueError):
        DecodeLimits(max_rawbytes={"ids": -1})
    lim = DecodeLimits(max_frame_bytes=100, max_rawbytes={"ids": 1000})
    assert lim.rawbytes_limit("ids") == 100 and lim.rawbytes_limit("z") == 0
    assert DecodeLimits().rawbytes_limit("anything") == DecodeLimits().max_frame_bytes


def test_nonces_are_fresh_16_bytes_and_name_the_hello():
    assert len(new_nonce()) == 16 and new_nonce() != new_nonce()
    hello, welcome = samples()["hello"], samples()["welcome"]
    assert hello.meta["nonce"] == HELLO_NONCE == welcome.meta["hello_nonce"] != welcome.meta["nonce"] == WELCOME_NONCE
    assert decode(encode(hello)) == hello and decode(encode(welcome)) == welcome


def test_handshake_fields_are_required():
    hello = samples()["hello"]
    for field in ("nonce", "num_micro_batches", "micro_batch_size", "eval_batches"):
        m = Message(**{**hello.__dict__, "meta": {k: v for k, v in hello.meta.items() if k != field}})
        with pytest.raises(InvalidMessage, match=field):
            encode(m)
    welcome = samples()["welcome"]
    bad = Message(**{**welcome.__dict__, "meta": {**welcome.meta, "hello_nonce": b"x" * 15}})
    with pytest.raises(InvalidMessage, match="hello_nonce"):
        encode(bad)


def test_meta_depth_counts_containers_not_the_scalar():
    def nested(n: int) -> object:
        x: object = 1
        for _ in range(n):
            x = [x]
        return x

    ok = Message(type=MT.BYE, run_id="r", src=0, dst=1, meta={"d": nested(7)})  # meta + 7 arrays = 8
    assert decode(encode(ok)) == ok
    with pytest.raises(MalformedHeader, match="deeper than 8"):
        encode(Message(type=MT.BYE, run_id="r", src=0, dst=1, meta={"d": nested(8)}))
    deep_map = {"a": {"b": {"c": {"d": {"e": {"f": {"g": 1}}}}}}}  # meta + 7 maps
    assert decode(encode(Message(type=MT.BYE, run_id="r", src=0, dst=1, meta=deep_map))).meta == deep_map


@PROPS
@given(st.lists(st.binary(max_size=200), min_size=1, max_size=4), st.integers(1, 300),
       st.one_of(st.none(), st.dictionaries(st.sampled_from(["ids", "z", "codes"]), st.integers(0, 300))))
def test_two_phase_decoding_raises_only_wire_errors(frames, max_frame, per_name):
    limits = DecodeLimits(max_frame_bytes=max_frame, max_rawbytes=per_name)
    try:
        header, _ = decode_header(frames, limits)
        decode_tensors(header, frames, limits)
    except WireError as e:
        assert e.code != "wire_error"


@PROPS
@given(st.sampled_from(sorted(samples())), st.integers(0, 2**32 - 1), st.integers(1, 64))
def test_mutated_samples_under_tight_limits_raise_only_wire_errors(name, seed, cap):
    rng = np.random.default_rng(seed)
    frames = [bytearray(f) for f in encode(samples()[name])]
    for _ in range(rng.integers(0, 3)):
        f = frames[rng.integers(len(frames))]
        if f:
            f[rng.integers(len(f))] ^= 1 << int(rng.integers(8))
    limits = DecodeLimits(max_frame_bytes=cap * 16, max_rawbytes={"ids": cap, "z": cap * 2, "codes": cap})
    try:
        decode([bytes(f) for f in frames], limits=limits)
    except WireError as e:
        assert e.code != "wire_error"
