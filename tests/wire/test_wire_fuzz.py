"""Hypothesis fuzzing: the decoder raises only WireError subclasses, whatever the bytes."""

from __future__ import annotations

import json
from pathlib import Path

import msgpack
import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mapl_swarm.wire import Message, MessageType, WireError, WireTensor, decode, encode
from mapl_swarm.wire.spec import DTYPES, HEADER_KEYS, OPTIONAL_HEADER_KEYS
from mapl_swarm.wire.golden.vectors import unpack_container

ROOT = Path(__file__).resolve().parents[2] / "protocol" / "vectors" / "v2"
_MANIFEST = json.loads((ROOT / "manifest.json").read_text(encoding="utf-8"))["vectors"]
GOOD = [unpack_container((ROOT / e["file"]).read_bytes()) for e in _MANIFEST if e["expect"] in ("valid", "accept")]

FUZZ = settings(max_examples=300, deadline=None, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


def decode_or_wire_error(frames):
    """Decode; only a Message or a WireError is an acceptable outcome."""
    try:
        out = decode(frames)
    except WireError as e:
        assert isinstance(e.code, str) and e.code != "wire_error"
        return e
    assert isinstance(out, Message)
    return out


@FUZZ
@given(st.lists(st.binary(max_size=300), max_size=5))
def test_random_bytes(frames):
    decode_or_wire_error(frames)


msgpack_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats()
    | st.text(max_size=12) | st.binary(max_size=12),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=8,
)
field_values = st.one_of(
    msgpack_values,
    st.integers(0, 2**64 - 1),
    st.sampled_from([[1, 9], [2, 0], [2, 1], [3, 0], -1, 2**32, "train", "eval", *DTYPES, "raw", "lz4"]),
    st.lists(st.integers(-2, 2**40), max_size=9),
)
DESCRIPTOR_KEYS = ["name", "dtype", "shape", "codec", "nbytes", "rawbytes", "crc"]


@FUZZ
@given(st.sampled_from(GOOD), st.data())
def test_valid_headers_with_random_field_values(good, data):
    """Start from a valid header, replace a few fields."""
    frames = good
    head = msgpack.unpackb(frames[0], raw=False)
    for _ in range(data.draw(st.integers(1, 3))):
        where = data.draw(st.sampled_from(["header", "meta", "descriptor"]))
        if where == "header":
            key = data.draw(st.sampled_from([*HEADER_KEYS, *OPTIONAL_HEADER_KEYS, "auth", "x"]))
            head[key] = data.draw(field_values)
        elif where == "meta" and isinstance(head.get("meta"), dict):
            keys = ["mode", "loss", "tokens", "fingerprint", "num_stages", "capabilities", "code"]
            head["meta"][data.draw(st.sampled_from(keys))] = data.draw(field_values)
        elif isinstance(head.get("tensors"), list) and head["tensors"]:
            d = data.draw(st.sampled_from(head["tensors"]))
            if isinstance(d, dict):
                d[data.draw(st.sampled_from(DESCRIPTOR_KEYS))] = data.draw(field_values)
    decode_or_wire_error([msgpack.packb(head, use_bin_type=True), *frames[1:]])


@st.composite
def mutated(draw):
    frames = [bytearray(f) for f in draw(st.sampled_from(GOOD))]
    for _ in range(draw(st.integers(1, 4))):
        op = draw(st.sampled_from(["flip", "truncate", "insert", "drop", "dup", "set"]))
        if not frames:
            break
        i = draw(st.integers(0, len(frames) - 1))
        f = frames[i]
        if op == "flip" and f:
            pos = draw(st.integers(0, len(f) - 1))
            f[pos] ^= 1 << draw(st.integers(0, 7))
        elif op == "set" and f:
            f[draw(st.integers(0, len(f) - 1))] = draw(st.integers(0, 255))
        elif op == "truncate":
            del f[draw(st.integers(0, len(f))):]
        elif op == "insert":
            pos = draw(st.integers(0, len(f)))
            f[pos:pos] = draw(st.binary(min_size=1, max_size=8))
        elif op == "drop":
            del frames[i]
        elif op == "dup":
            frames.insert(i, bytearray(f))
    return [bytes(f) for f in frames]


@FUZZ
@given(mutated())
def test_mutated_valid_vectors(frames):
    decode_or_wire_error(frames)


@FUZZ
@given(st.sampled_from(GOOD), st.data())
def test_every_single_bit_flip_in_a_tensor_frame_is_caught(good, data):
    frames = good
    if len(frames) < 2 or not any(frames[1:]):
        return
    i = data.draw(st.sampled_from([k for k in range(1, len(frames)) if frames[k]]))
    f = bytearray(frames[i])
    pos = data.draw(st.integers(0, len(f) - 1))
    f[pos] ^= 1 << data.draw(st.integers(0, 7))
    out = decode_or_wire_error([*frames[:i], bytes(f), *frames[i + 1:]])
    assert isinstance(out, WireError)


@FUZZ
@given(
    st.lists(
        st.tuples(st.sampled_from(sorted(DTYPES)), st.lists(st.integers(0, 5), max_size=3),
                  st.integers(0, 2**32 - 1), st.sampled_from(["raw", "lz4"])),
        max_size=4,
    ),
)
def test_random_tensors_round_trip(specs):
    tensors, codecs = {}, {}
    for n, (tag, shape, seed, codec) in enumerate(specs):
        size = int(np.prod(shape)) * DTYPES[tag].itemsize
        raw = np.random.default_rng(seed).integers(0, 4, size=size, dtype=np.uint8)
        tensors[f"t{n}"] = WireTensor(tag, raw.view(DTYPES[tag].numpy).reshape(shape))
        codecs[f"t{n}"] = codec
    msg = Message(type=MessageType.ACT, run_id="fuzz", src=0, dst=1, meta={"mode": "eval"},
                  tensors=tensors)
    frames = encode(msg, compress=codecs)
    back = decode(frames)
    assert back == msg
    assert [bytes(f) for f in encode(back, compress=codecs)] == [bytes(f) for f in frames]
