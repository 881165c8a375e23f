"""The run epoch in the header, the rejoin fields of BYE and CHECKPOINT, ``stale_epoch`` (SPEC §2, §9.6)."""

from __future__ import annotations

import msgpack
import pytest

import mapl_swarm.wire as wire
from mapl_swarm.wire import (
    InvalidMessage,
    MalformedHeader,
    Message,
    MessageType,
    decode,
    decode_header,
    encode,
)
from mapl_swarm.wire import spec
from mapl_swarm.wire.codebook import resync_message, slice_message
from mapl_swarm.wire.content import CONTENT_CODES, ContentError, check_epoch
from mapl_swarm.wire.golden.samples import sample_codebook

MT = MessageType


def heartbeat(**kw) -> Message:
    fields = dict(type=MT.HEARTBEAT, run_id="run", src=0, dst=1, seq=5, meta={"sent_ns": 7})
    return Message(**{**fields, **kw})


def header_map(frames) -> dict:
    return msgpack.unpackb(bytes(frames[0]), raw=False)


def repack(frames, **changes) -> list[bytes]:
    h = header_map(frames)
    h.update(changes)
    return [msgpack.packb(h, use_bin_type=True), *frames[1:]]


def test_version_and_rejoin_names():
    assert spec.PROTOCOL_VERSION == wire.PROTOCOL_VERSION == (2, 2)
    assert wire.REJOIN_CAPABILITY == spec.REJOIN_CAPABILITY == "rejoin"
    assert wire.REJOIN_REASON == spec.REJOIN_REASON == "rejoin"
    assert spec.EPOCH_KEY == "epoch" and spec.OPTIONAL_HEADER_KEYS == ("epoch",)
    for name in ("REJOIN_CAPABILITY", "REJOIN_REASON", "EPOCH_KEY", "OPTIONAL_HEADER_KEYS"):
        assert name in spec.__all__
    assert "check_epoch" in wire.__all__ and wire.check_epoch is check_epoch
    assert Message(type=MT.BYE, run_id="r", src=0, dst=1).epoch == 0
    assert Message(type=MT.BYE, run_id="r", src=0, dst=1).version == spec.PROTOCOL_VERSION


def test_epoch_zero_is_left_out():
    frames = encode(heartbeat())
    assert "epoch" not in header_map(frames)
    assert list(header_map(frames)) == list(spec.HEADER_KEYS)
    back = decode(frames)
    assert back.epoch == 0 and back == heartbeat()


@pytest.mark.parametrize("epoch", [1, 3, 255, 2**32, 2**64 - 1])
def test_non_zero_epoch_round_trips_right_after_cver(epoch):
    msg = heartbeat(epoch=epoch)
    frames = encode(msg)
    keys = list(header_map(frames))
    assert keys == ["v", "type", "run", "src", "dst", "step", "micro", "seq", "pver", "cver", "epoch",
                    "meta", "tensors"]
    back = decode(frames)
    assert back.epoch == epoch and back == msg
    assert [bytes(f) for f in encode(back)] == [bytes(f) for f in frames]
    header, _ = decode_header(frames)
    assert header.epoch == epoch


def test_a_written_epoch_0_and_other_key_orders_decode():
    frames = encode(heartbeat())
    assert decode(repack(frames, epoch=0)) == heartbeat()
    h = header_map(encode(heartbeat(epoch=4)))
    epoch = h.pop("epoch")
    h["epoch"] = epoch  # after tensors: not canonical, still valid
    assert decode([msgpack.packb(h, use_bin_type=True)]).epoch == 4
    newer = repack(encode(heartbeat()), v=[2, 3], epoch=6)  # a newer minor's header: read the same
    assert decode(newer).epoch == 6 and decode(newer).version == (2, 3)


@pytest.mark.parametrize("bad", [-1, -(2**63), "2", 2.0, float(2**64), True, None, [1], b"\x01"])
def test_a_bad_epoch_is_a_malformed_header(bad):
    with pytest.raises(MalformedHeader, match="epoch"):
        decode(repack(encode(heartbeat()), epoch=bad))


@pytest.mark.parametrize("bad", [-1, 2**64, True, 1.0, "1"])
def test_encoder_refuses_a_bad_epoch(bad):
    with pytest.raises(MalformedHeader, match="epoch"):
        encode(heartbeat(epoch=bad))


def checkpoint(meta: dict, src: int = 2) -> Message:
    return Message(type=MT.CHECKPOINT, run_id="run", src=src, dst=1, meta=meta)


def test_checkpoint_offer_and_resume_carry_an_optional_epoch():
    for meta in ({"phase": "offer", "steps": [10, 20], "epoch": 2}, {"phase": "resume", "step": 20, "epoch": 7},
                 {"phase": "offer", "steps": [10]}, {"phase": "resume", "step": None, "reason": "x", "epoch": 0}):
        msg = checkpoint(meta)
        assert decode(encode(msg)) == msg
    for bad in (-1, "2", 2.0, True, None):
        for meta in ({"phase": "offer", "steps": [10], "epoch": bad}, {"phase": "resume", "step": 3, "epoch": bad}):
            with pytest.raises(InvalidMessage, match="epoch"):
                encode(checkpoint(meta))
    with pytest.raises(InvalidMessage, match="steps"):  # the other rules hold
        encode(checkpoint({"phase": "offer", "epoch": 2}))
    with pytest.raises(InvalidMessage, match="step"):
        encode(checkpoint({"phase": "resume", "epoch": 2}))


def test_bye_rejoin_carries_the_lost_stage():
    msg = Message(type=MT.BYE, run_id="run", src=2, dst=3, step=35, epoch=1,
                  meta={"reason": spec.REJOIN_REASON, "lost": 1})
    assert decode(encode(msg)) == msg
    assert decode(encode(Message(type=MT.BYE, run_id="run", src=2, dst=3, meta={"lost": 0}))).meta == {"lost": 0}
    for bad in (-1, "1", 1.5, True, [1]):
        with pytest.raises(InvalidMessage, match="lost"):
            encode(Message(type=MT.BYE, run_id="run", src=2, dst=3, meta={"reason": "rejoin", "lost": bad}))
        frames = repack(encode(msg), meta={"reason": "rejoin", "lost": bad})
        with pytest.raises(InvalidMessage, match="lost"):
            decode(frames)


def test_stale_epoch_drops_all_but_the_handshake():
    assert "stale_epoch" in CONTENT_CODES
    for mtype, meta in ((MT.HEARTBEAT, {}), (MT.BYE, {"reason": "rejoin", "lost": 3}), (MT.ACT, {"mode": "train"}),
                        (MT.CHECKPOINT, {"phase": "offer", "steps": [1]})):
        for epoch, stale in ((0, True), (1, True), (2, False), (3, False)):
            msg = Message(type=mtype, run_id="r", src=2, dst=1, epoch=epoch, meta=meta)
            header, _ = decode_header(encode(msg))
            for m in (msg, header):
                if stale:
                    with pytest.raises(ContentError) as exc:
                        check_epoch(m, 2)
                    assert exc.value.code == "stale_epoch" and "epoch" in exc.value.text
                else:
                    check_epoch(m, 2)
    for mtype in spec.HANDSHAKE_TYPES:  # a replacement process starts at 0
        check_epoch(Message(type=mtype, run_id="r", src=0, dst=1), 2**64 - 1)


def test_codebook_messages_take_the_epoch():
    s = slice_message(run_id="r", src=0, dst=1, stream="act", version=3, start=0, full=False,
                      codes=sample_codebook(0, 2, 1), epoch=4)
    r = resync_message(run_id="r", src=1, dst=0, stream="act", have=2, epoch=4)
    assert decode(encode(s)).epoch == decode(encode(r)).epoch == 4
