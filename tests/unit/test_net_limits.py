"""The derived message bound (mapl_swarm.net.limits) against what peers really encode: one training
micro-batch, its backward, the projector exchange and the codebook slices of a 2-stage run, encoded
with the wire as a peer encodes them, for none, mapl and mapl_vq."""

from __future__ import annotations

import sys
import subprocess

import pytest
import torch

from mapl_swarm.config import config_from_dict
from mapl_swarm.net.limits import SLACK_FRACTION, derived_max_message_bytes, max_message_bytes, payload_bounds
from mapl_swarm.net.transport import TransportConfig
from mapl_swarm.pipeline.tensors import to_wire
from mapl_swarm.pipeline.payload import ACT_WIRE, GRAD_WIRE, WireName
from mapl_swarm.pipeline.stage import StageRuntime
from mapl_swarm.wire import Message, MessageType as MT, encode
from mapl_swarm.wire.codebook import slice_parts
from mapl_swarm.wire.spec import DEFAULT_MAX_HEADER_BYTES

SMALL = {"model": {"vocab_size": 512, "hidden_size": 64, "num_layers": 2, "num_heads": 4, "ffn_hidden_size": 128,
                   "context_length": 32},
         "compression": {"rank": 16, "anchor_rank": 16, "vq": {"codebook_size": 32}},
         "pipeline": {"num_stages": 2, "micro_batch_size": 3, "num_micro_batches": 1},
         "runtime": {"threads": 1}}


def small_config(codec: str, **net):
    return config_from_dict({**SMALL, "compression": {**SMALL["compression"], "codec": codec}, "net": net})


def frames_of(mtype: MT, tensors: dict[str, torch.Tensor], meta: dict | None = None) -> list:
    """``tensors`` encoded as a peer encodes them (lz4 where it helps)."""
    msg = Message(type=mtype, run_id="limits", src=0, dst=1, step=1, micro=0, seq=7, pver=1, cver=1,
                  meta=meta or {}, tensors={k: to_wire(v.contiguous()) for k, v in tensors.items()})
    return encode(msg)


def encoded_messages(cfg) -> dict[str, list[list]]:
    """Every message type with tensors that one training and one eval micro-batch produce."""
    torch.manual_seed(0)
    s0, s1 = StageRuntime(cfg, 0), StageRuntime(cfg, 1)
    B, T, V = cfg.pipeline.micro_batch_size, cfg.model.context_length, cfg.model.vocab_size
    out: dict[str, list[list]] = {"ACT": [], "GRAD": [], "PROJ": [], "PROJ_GRAD": [], "CODEBOOK_SLICE": []}

    def slices(stage: StageRuntime, stream: str, to: StageRuntime) -> None:
        for sl in stage.take_slices(stream):
            p = slice_parts(stream=sl.stream, version=sl.version, start=sl.start, full=sl.full, codes=sl.codes,
                            index=sl.index)
            out["CODEBOOK_SLICE"].append(frames_of(MT.CODEBOOK_SLICE, p.tensors, p.meta))
            to.apply_slice(sl)

    for micro, train in ((0, True), (-1, False)):
        ids = torch.randint(0, V, (B, T + 1))
        with torch.set_grad_enabled(train):
            act = s0.forward(micro, ids=ids, train=train).payload
            slices(s0, "act", s1)
            out["ACT"].append(frames_of(MT.ACT, {ACT_WIRE[k]: v for k, v in act.items()}, {"mode": "train"}))
            s1.forward(micro, payload=act, train=train, cver=s0.codebook_version("act"))
    grad = s1.backward(0)
    slices(s1, "grad", s0)
    out["GRAD"].append(frames_of(MT.GRAD, {GRAD_WIRE[k]: v for k, v in grad.items()}))
    s0.backward(0, grad, cver=s1.codebook_version("grad"))
    g = s1.take_inbound_projector_grad()
    if g is not None:
        out["PROJ_GRAD"].append(frames_of(MT.PROJ_GRAD, {WireName.PROJ_GRAD: g}, {"micro_batches": 1}))
        s0.add_outbound_projector_grad(g)
    s0.step()
    s1.step()
    proj = s0.outbound_projector()
    if proj is not None:
        out["PROJ"].append(frames_of(MT.PROJ, {WireName.PROJ: proj[0]}))
    return {k: v for k, v in out.items() if v}


@pytest.mark.parametrize("codec", ["none", "mapl", "mapl_vq"])
def test_bound_covers_every_encoded_message_and_is_tight(codec):
    cfg = small_config(codec)
    bounds = payload_bounds(cfg)
    messages = encoded_messages(cfg)
    assert set(messages) == set(bounds), "the bound must name exactly the types the codec sends"
    limit = max_message_bytes(cfg)
    for mtype, encoded in messages.items():
        for frames in encoded:
            tensor_bytes = sum(len(f) for f in frames[1:])
            assert tensor_bytes <= bounds[mtype], mtype
            assert len(frames[0]) + tensor_bytes <= limit and max(len(f) for f in frames) <= limit, mtype
        raw = max(sum(t.nbytes for t in frames_raw) for frames_raw in
                  [[memoryview(f) for f in frames[1:]] for frames in encoded])
        if mtype in ("GRAD", "PROJ", "PROJ_GRAD"):  # fixed shapes, raw frames: the bound is exact
            assert raw == bounds[mtype], mtype
    if codec == "mapl_vq":  # the k-means initialisation sends full slices, the bound's codes part
        full = max(sum(len(f) for f in frames[1:]) for frames in messages["CODEBOOK_SLICE"])
        vq = cfg.compression.vq
        assert full == vq.slice_bytes(vq.codebook_size) < bounds["CODEBOOK_SLICE"]
    # the ACT bound is its boundary tensor plus raw ids (lz4 only ever shrinks the ids frame)
    B, T = cfg.pipeline.micro_batch_size, cfg.model.context_length
    assert bounds["ACT"] == bounds["GRAD"] + B * (T + 1) * 2
    largest = max(bounds.values()) + DEFAULT_MAX_HEADER_BYTES
    assert largest * (1 + SLACK_FRACTION) <= derived_max_message_bytes(cfg) < largest * (1 + SLACK_FRACTION) + 4096


def test_explicit_setting_wins_and_reaches_the_transport():
    assert max_message_bytes(small_config("mapl", max_message_bytes=1 << 20)) == 1 << 20
    cfg = small_config("mapl", zmq_heartbeat_s=4.0)
    t = TransportConfig.for_run(cfg, None)
    assert t.max_message_bytes == derived_max_message_bytes(cfg) and t.zmq_heartbeat_s == 4.0 and t.curve is None


def test_paper_presets_bounds():
    """The paper-sized runs: 150M MAPL a few MiB, 1B uncompressed tens of MiB (under the 256 MiB frame limit)."""
    for preset, codec, lo, hi in (("150M", "mapl", 1 << 20, 16 << 20), ("1B", "none", 16 << 20, 64 << 20)):
        cfg = config_from_dict({"preset": preset, "compression": {"codec": codec}})
        assert lo < derived_max_message_bytes(cfg) < hi, (preset, codec)


def test_limits_module_imports_no_torch():
    code = "import sys, mapl_swarm.net.limits; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)
