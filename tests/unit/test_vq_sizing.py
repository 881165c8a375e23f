"""MAPL+VQ sized by device (issue 10 item 4): distance budget, unchunked fused search, warm-up,
named compile failures with one logged reason; and the no-sync check on a real GPU."""

from __future__ import annotations

import logging
import math

import pytest
import torch
from torch._dynamo.exc import BackendCompilerFailed

from mapl_swarm.compress import vq
from mapl_swarm.compress.codebook_sync import VQSender, stream_generator
from mapl_swarm.compress.vq import chunk_tokens, distance_budget_bytes, nearest_codes
from mapl_swarm.compress.vq_stage import StageVQ
from mapl_swarm.config import CompressionConfig, VQConfig
from mapl_swarm.errors import ConfigError
from mapl_swarm.pipeline.inprocess import InProcessPipeline

GiB, MiB = 1 << 30, 1 << 20
PRESET_150M = dict(tokens=8192, groups=128, K=256)  # 4 x 2048 tokens, r = 256 in groups of 2

def _compression(**kw) -> CompressionConfig:
    """A CompressionConfig from flat ``vq_*`` keywords (the [compression.vq] table's keys, prefixed)."""
    vq = {k.removeprefix("vq_"): kw.pop(k) for k in [k for k in kw if k.startswith("vq_")]}
    return CompressionConfig(**kw, vq=VQConfig(**vq))



def _chunks(budget: int, tokens=8192, groups=128, K=256) -> int:
    return math.ceil(tokens / chunk_tokens(budget, groups, K))


def test_distance_budget_follows_the_device():
    h200 = distance_budget_bytes("cuda", free_bytes=130 * GiB)  # a fake free-memory figure
    assert h200 == GiB and _chunks(h200) == 1  # the whole 150M search in one chunk (8 MiB: 128)
    assert distance_budget_bytes("cuda", free_bytes=3 * GiB) == 512 * MiB  # a quarter, power of two
    assert _chunks(distance_budget_bytes("cuda", free_bytes=3 * GiB)) == 2
    assert distance_budget_bytes("cuda", free_bytes=10 * MiB) == 8 * MiB  # the floor on a full device
    assert distance_budget_bytes("cpu") == vq.CPU_DISTANCE_BYTES == 8 * MiB and _chunks(8 * MiB) == 128
    assert distance_budget_bytes("cuda", override_mib=8, free_bytes=130 * GiB) == 8 * MiB  # override wins
    assert _chunks(8 * MiB) == 128
    s = _compression(codec="mapl_vq").vq
    assert s.max_distance_mib == 0 and distance_budget_bytes("cpu", override_mib=s.max_distance_mib) == 8 * MiB
    assert distance_budget_bytes("cuda", override_mib=s.max_distance_mib, free_bytes=130 * GiB) == GiB
    tiny = _compression(codec="mapl_vq", vq_max_distance_mib=0.5).vq
    assert distance_budget_bytes("cpu", override_mib=tiny.max_distance_mib) == MiB // 2
    with pytest.raises(ConfigError, match="max_distance_mib"):
        _compression(codec="mapl_vq", vq_max_distance_mib=-1)


def test_fused_search_is_not_chunked(monkeypatch):
    calls = []

    def fake(xt, cb):
        calls.append(tuple(xt.shape))
        return vq._fused_argmin(xt, cb)

    monkeypatch.setattr(vq, "_FUSED", fake)
    gen = torch.Generator().manual_seed(0)
    x, cb = torch.randn(300, 4, 2, generator=gen), torch.randn(4, 16, 2, generator=gen)
    out = nearest_codes(x, cb, 4 * 16 * 4 * 7, fused=True)  # a 7-token budget: ignored
    assert calls == [(4, 300, 2)]
    assert torch.equal(out, torch.cdist(x.transpose(0, 1), cb).argmin(-1).T)


def test_compile_failures_are_named_logged_once_and_fall_back(monkeypatch, caplog):
    def failing(fn, **kw):
        def run(*a):
            raise BackendCompilerFailed(fn, RuntimeError("Cannot find a working triton installation"), None)
        return run

    monkeypatch.setattr(vq, "_FUSED", vq._FusedSearch())
    monkeypatch.setattr(torch, "compile", failing)
    gen = torch.Generator().manual_seed(1)
    x, cb = torch.randn(50, 4, 2, generator=gen), torch.randn(4, 16, 2, generator=gen)
    with caplog.at_level(logging.WARNING, logger="mapl_swarm.compress.vq"):
        for _ in range(3):
            assert torch.equal(nearest_codes(x, cb, fused=True), nearest_codes(x, cb))
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "triton" in warnings[0].getMessage()
    assert "BackendCompilerFailed" in vq.fused_search_disabled_reason()

    def buggy(fn, **kw):  # anything that is not a compile failure is a bug: raised, not hidden
        def run(*a):
            raise ValueError("a bug in the search")
        return run

    monkeypatch.setattr(vq, "_FUSED", vq._FusedSearch())
    monkeypatch.setattr(torch, "compile", buggy)
    with pytest.raises(ValueError, match="a bug"):
        nearest_codes(x, cb, fused=True)


def test_warm_up_compiles_on_real_shapes_and_changes_nothing(monkeypatch):
    seen = []

    def fake_compile(fn, **kw):
        def run(xt, cb):
            seen.append((tuple(xt.shape), tuple(cb.shape)))
            return fn(xt, cb)
        return run

    monkeypatch.setattr(vq, "_FUSED", vq._FusedSearch())
    monkeypatch.setattr(torch, "compile", fake_compile)
    s = _compression(codec="mapl_vq", rank=8, vq_codebook_size=32, vq_compile=True).vq
    tx, ref = (VQSender(s, "act", stream_generator(0, 0, "act")) for _ in range(2))
    gen_state = tx.draw_gen.get_state()
    info = tx.warm_up(96)
    assert seen == [((4, 96, 2), (4, 32, 2))] and info["fused"] == 1.0 and info["chunks"] == 1.0
    assert torch.equal(tx.draw_gen.get_state(), gen_state) and tx.digest() == ref.digest()
    z = torch.randn(2, 48, 8, generator=torch.Generator().manual_seed(2))
    for learn in (True, True, False):
        assert torch.equal(tx.encode(z, learn=learn), ref.encode(z, learn=learn))  # same codes as unwarmed
    eager = _compression(codec="mapl_vq", rank=8, vq_codebook_size=32).vq
    info = StageVQ(eager, 1, has_inbound=True, has_outbound=True, seed=0).warm_up(96)
    assert set(info) == {"act", "grad"} and info["act"]["fused"] == 0.0 and info["act"]["chunks"] == 1.0


def test_codec_warm_up_hook(make_config):
    pipe = InProcessPipeline(make_config(compression={"codec": "mapl_vq", "vq": {"codebook_size": 16}}))
    assert set(pipe.stages[1].codec.warm_up(32)) == {"act", "grad"}
    assert InProcessPipeline(make_config(compression={"codec": "mapl"})).stages[1].codec.warm_up(32) == {}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_no_sync_in_cuda_encode_apply_decode():
    """The real check behind the CPU proxy of test_vq_syncs: CUDA's sync debug mode raises on any
    synchronising call in a steady-state encode, an in-process slice apply and decode, and a
    decode of host codes (the wire's)."""
    s = _compression(codec="mapl_vq", rank=16, vq_codebook_size=64,
                                                 vq_dead_code_ratio=0.5, vq_ema_decay=0.5).vq
    dev = torch.device("cuda")
    up = StageVQ(s, 1, has_inbound=False, has_outbound=True, seed=3, device=dev)
    down = StageVQ(s, 2, has_inbound=True, has_outbound=False, seed=3, device=dev)
    wire = StageVQ(s, 2, has_inbound=True, has_outbound=False, seed=3, device=dev)
    up.warm_up(2 * 256)
    up.encode("act", torch.randn(2, 256, 16, device=dev), learn=True, key=0)  # k-means init may sync
    for sl in up.take_slices("act"):
        down.apply_slice(sl)
        wire.apply_slice(type(sl)(sl.stream, sl.version, sl.start, sl.full, sl.codes.cpu()))
    for i in range(1, 6):
        z = torch.randn(2, 256, 16, device=dev) + (3.0 if i > 2 else 0.0)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            codes = up.encode("act", z, learn=True, key=i)
            slices = up.take_slices("act")
            for sl in slices:
                down.apply_slice(sl)
            down.decode("act", codes, up.version("act"))
        finally:
            torch.cuda.set_sync_debug_mode("default")
        host = [(type(sl)(sl.stream, sl.version, sl.start, sl.full, sl.codes.cpu(),
                          None if sl.index is None else sl.index.cpu())) for sl in slices]
        host_codes = codes.cpu()
        torch.cuda.set_sync_debug_mode("error")
        try:
            for sl in host:
                wire.apply_slice(sl)
            out = wire.decode("act", host_codes, up.version("act"))
        finally:
            torch.cuda.set_sync_debug_mode("default")
        assert torch.equal(out, down.decode("act", codes, up.version("act")))
    assert up.metrics()["vq_act_dead_replaced"] > 0
    assert up.tx["act"].digest() == down.rx["act"].digest() == wire.rx["act"].digest()
