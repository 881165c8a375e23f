"""MAPL+VQ: residual quantization math, codebook streaming, named slice rejections, byte accounting."""

import dataclasses

import pytest
import torch

from mapl_swarm.compress import boundary_bytes, config_boundary_bytes
from mapl_swarm.compress.codebook_sync import CodebookSlice, VQReceiver, VQSender, stream_generator
from mapl_swarm.compress.vq import decode_codes, nearest_codes, quantize, to_groups
from mapl_swarm.config import CompressionConfig, VQConfig
from mapl_swarm.errors import ConfigError
from mapl_swarm.pipeline.inprocess import InProcessPipeline
from mapl_swarm.wire import decode, encode
from mapl_swarm.wire.codebook_rules import MAX_SLICE_SKIP
from mapl_swarm.wire.codebook import (
    BadCodes,
    CodebookVersionMismatch,
    FutureSlice,
    SliceIndexOutOfRange,
    SliceMalformed,
    SliceShapeMismatch,
    StaleSlice,
)


def _settings(**kw) -> VQConfig:
    vq = dict(codebook_size=32, slice_fraction=0.25, kmeans_iters=4)
    vq.update(kw)
    return CompressionConfig(codec="mapl_vq", rank=8, vq=VQConfig(**vq)).vq


def _mixture(gen: torch.Generator, n: int, centers: torch.Tensor, noise: float = 0.2) -> torch.Tensor:
    """n points (1, n, r) of a fixed Gaussian mixture."""
    pick = torch.randint(0, centers.shape[0], (n,), generator=gen)
    return (centers[pick] + noise * torch.randn(n, centers.shape[1], generator=gen)).unsqueeze(0)


def _pair(s: VQConfig, stream: str = "act") -> tuple[VQSender, VQReceiver]:
    return VQSender(s, stream, stream_generator(0, 0, stream)), VQReceiver(s, stream)


def _rel(z: torch.Tensor, zh: torch.Tensor) -> float:
    return float((z - zh).pow(2).sum() / z.pow(2).sum())


def test_nearest_codes_chunked_equals_brute_force():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(300, 4, 2, generator=gen)
    cb = torch.randn(4, 16, 2, generator=gen)
    brute = torch.cdist(x.transpose(0, 1), cb).argmin(-1).T  # (N, NG)
    tiny = nearest_codes(x, cb, max_distance_bytes=4 * 16 * 4 * 7)  # 7 tokens per chunk
    assert torch.equal(tiny, brute) and torch.equal(nearest_codes(x, cb, 1 << 30), brute)


def test_decode_is_round_ordered_sum_of_codes():
    gen = torch.Generator().manual_seed(1)
    cb = torch.randn(2, 3, 8, 2, generator=gen)
    x = torch.randn(5, 3, 2, generator=gen)
    codes, residuals = quantize(x, cb, 1 << 20)
    out = decode_codes(codes.to(torch.uint8).reshape(1, 5, 2, 3), cb)  # (1, 5, 6)
    manual = cb[0, torch.arange(3), codes[:, 0]] + cb[1, torch.arange(3), codes[:, 1]]  # (5, 3, 2)
    torch.testing.assert_close(out.reshape(5, 3, 2), manual, rtol=0, atol=0)
    torch.testing.assert_close(x - manual, residuals[-1], rtol=0, atol=1e-6)


def test_residual_rounds_help_and_error_falls_as_codebooks_learn():
    s = _settings(kmeans_iters=1, ema_decay=0.9)
    tx, rx = _pair(s)
    gen = torch.Generator().manual_seed(2)
    centers = 2 * torch.randn(24, 8, generator=gen)
    held_out = _mixture(gen, 512, centers)
    errors, round1 = [], []
    for i in range(120):
        tx.encode(_mixture(gen, 256, centers), learn=True)
        for sl in tx.take_slices():
            rx.apply(sl)
        if i in (0, 30, 119):
            codes = tx.encode(held_out, learn=False)
            errors.append(_rel(held_out, rx.decode(codes, tx.version)))
            one = rx.codebooks[:1]  # first round only
            c1 = quantize(to_groups(held_out, 2), one, 1 << 20)[0]
            round1.append(_rel(held_out, decode_codes(c1.reshape(1, -1, 1, 4), one)))
    assert all(e < r for e, r in zip(errors, round1)), (errors, round1)  # residual rounds help
    assert errors[2] < errors[1] < errors[0], errors  # learning on a fixed distribution
    assert errors[2] < 0.7 * errors[0]


def test_mirror_and_receiver_identical_after_every_slice_and_resync():
    s = _settings()
    tx, rx = _pair(s)
    gen = torch.Generator().manual_seed(3)
    centers = torch.randn(16, 8, generator=gen)
    for i in range(40):
        codes = tx.encode(_mixture(gen, 64, centers), learn=True)
        slices = tx.take_slices()
        assert len(slices) == 1 and slices[0].full == (i == 0)
        for sl in slices:
            assert rx.apply(sl) == "apply"
            assert rx.digest() == tx.digest()
        assert torch.equal(rx.decode(codes, tx.version), decode_codes(codes, tx.mirror))
    # a receiver that lost its state asks for a resync and ignores partial slices until the full one
    fresh = VQReceiver(s, "act")
    fresh.request_resync()
    tx.encode(_mixture(gen, 64, centers), learn=True)
    assert fresh.apply(tx.take_slices()[0]) == "ignore" and fresh.version == 0
    tx.request_resync()
    codes = tx.encode(_mixture(gen, 64, centers), learn=False)  # eval encodes still send a resync
    (sl,) = tx.take_slices()
    assert sl.full and fresh.apply(sl) == "apply" and fresh.digest() == tx.digest()
    assert torch.equal(fresh.decode(codes, tx.version), decode_codes(codes, tx.mirror))


@pytest.mark.parametrize("order", ["round_robin", "priority"])
def test_a_resync_changes_no_codebook_and_no_code_of_the_stream(order):
    """A RESYNC (honest, or a neighbour's flood of them) brings the mirror whole at its version
    before the encode's own slice; the codes, the learned codebooks and the mirror are those of a
    sender that was never asked, and a receiver that lost its state is whole again."""
    s = _settings(slice_order=order)
    asked, quiet = (VQSender(s, "act", stream_generator(0, 0, "act")) for _ in range(2))
    rx, fresh = VQReceiver(s, "act"), VQReceiver(s, "act")
    gen = torch.Generator().manual_seed(5)
    centers = torch.randn(16, 8, generator=gen)
    for i in range(30):
        z = _mixture(gen, 64, centers)
        if i >= 5 and i % 2:
            asked.request_resync()
        codes = asked.encode(z, learn=True)
        assert torch.equal(codes, quiet.encode(z, learn=True)), i
        assert torch.equal(asked.mirror, quiet.mirror) and asked.version == quiet.version, i
        assert torch.equal(asked.learner.live, quiet.learner.live), i
        slices, honest = asked.take_slices(), quiet.take_slices()
        assert len(slices) == len(honest) + (1 if i >= 5 and i % 2 else 0), i
        if i == 20:
            fresh.request_resync()
        for sl in slices:
            assert rx.apply(sl) in ("apply", "ignore")
            if i >= 20:
                fresh.apply(sl)
        assert rx.digest() == asked.digest() and torch.equal(rx.decode(codes, asked.version), decode_codes(codes, asked.mirror))
    assert fresh.digest() == asked.digest()


def test_a_full_slice_of_the_receivers_version_and_codebooks_to_rounding_is_the_same_slice():
    """Replicas upstream each send their full slice of a version (SPEC §9.10 item 12); on other
    kernels they learned it to other last bits. A full slice at the receiver's version whose codes
    are its codebooks within rounding is ignored, not applied nor rejected; one that differs more
    is a stale slice."""
    s = _settings()
    tx, rx = _pair(s)
    gen = torch.Generator().manual_seed(6)
    tx.encode(torch.randn(1, 64, 8, generator=gen), learn=True)
    for sl in tx.take_slices():
        rx.apply(sl)
    held, v = rx.codebooks.clone(), rx.version
    rounded = held * (1 + 6e-8 * torch.randn(held.shape, generator=gen))
    assert not torch.equal(rounded, held)
    assert rx.apply(CodebookSlice("act", v, 0, True, rounded)) == "ignore" and torch.equal(rx.codebooks, held)
    with pytest.raises(StaleSlice):
        rx.apply(CodebookSlice("act", v, 0, True, held + 1e-2))
    assert torch.equal(rx.codebooks, held) and rx.version == v


def test_bad_slices_are_rejected_by_name_and_never_corrupt_the_codebooks():
    s = _settings()
    tx, rx = _pair(s)
    gen = torch.Generator().manual_seed(4)
    for _ in range(3):
        tx.encode(torch.randn(1, 64, 8, generator=gen), learn=True)
        for sl in tx.take_slices():
            rx.apply(sl)
    good = rx.digest()
    v, R, NG, K, G = rx.version, 2, 4, 32, 2
    ok = torch.randn(R, NG, 8, G, generator=gen)
    nan = ok.clone()
    nan[0, 1, 2, 0] = float("nan")
    huge = ok.clone()
    huge[1, 0, 3, 1] = -1e30  # finite, beyond ±SLICE_VALUE_BOUND
    whole = torch.randn(R, NG, K, G, generator=gen)
    bad = [
        (CodebookSlice("act", v, 0, False, ok), StaleSlice),
        (CodebookSlice("act", v - 2, 0, False, ok), StaleSlice),
        (CodebookSlice("act", v + 2, 0, False, ok), FutureSlice),
        (CodebookSlice("act", v + 1, 0, False, torch.randn(R, NG, 8, 3)), SliceShapeMismatch),
        (CodebookSlice("act", v + 1, 0, False, torch.randn(R + 1, NG, 8, G)), SliceShapeMismatch),
        (CodebookSlice("act", v + 1, 0, True, ok), SliceShapeMismatch),  # full slice of 8 of 32 codes
        (CodebookSlice("act", v + 1, 28, False, ok), SliceIndexOutOfRange),
        (CodebookSlice("act", v + 1, 32, False, ok[:, :, :1]), SliceIndexOutOfRange),
        (CodebookSlice("act", v + 1, 0, False, nan), SliceMalformed),
        (CodebookSlice("act", v + 1, 0, False, huge), SliceMalformed),
        (CodebookSlice("act", v + MAX_SLICE_SKIP + 1, 0, True, whole), FutureSlice),  # version 10^6 and the like
        (CodebookSlice("grad", v + 1, 0, False, ok), SliceMalformed),
    ]
    for sl, err in bad:
        with pytest.raises(err):
            rx.apply(sl)
        assert rx.digest() == good and rx.version == v
    assert sum(rx.rejected.values()) == len(bad) and rx.rejected["stale_slice"] == 2
    codes = tx.encode(torch.randn(1, 4, 8, generator=gen), learn=False)
    with pytest.raises(CodebookVersionMismatch):
        rx.decode(codes, v + 1)
    with pytest.raises(BadCodes):
        rx.decode(codes.reshape(1, 4, 1, 8), v)
    with pytest.raises(BadCodes):
        rx.decode(torch.full_like(codes, K), v)  # code 32 of 32
    # the same slice round-trips the wire and is then applied
    tx.encode(torch.randn(1, 64, 8, generator=gen), learn=True)
    (sl,) = tx.take_slices()
    back = CodebookSlice.from_message(decode(encode(sl.to_message(run_id="r", src=0, dst=1))))
    assert rx.apply(back) == "apply" and rx.digest() == tx.digest()


def test_full_sync_sends_whole_codebooks_every_micro_batch():
    s = _settings(sync="full")
    tx, rx = _pair(s)
    for i in range(5):
        tx.encode(torch.randn(1, 64, 8), learn=True)
        (sl,) = tx.take_slices()
        assert sl.full and sl.nbytes == s.slice_bytes(32) and rx.apply(sl) == "apply"
    assert s.slice_bytes_per_micro == 4 * 2 * 8 * 32


def test_dead_codes_are_replaced():
    s = _settings(dead_code_ratio=0.5, ema_decay=0.5)
    tx, _ = _pair(s)
    gen = torch.Generator().manual_seed(5)
    tx.encode(torch.randn(1, 256, 8, generator=gen), learn=True)
    for _ in range(10):  # the distribution moves far away: most codes stop being used
        tx.encode(10 + 0.1 * torch.randn(1, 256, 8, generator=gen), learn=True)
    assert tx.learner.dead_replaced > 0 and tx.metrics()["dead_replaced"] > 0


def test_vq_config_is_validated():
    with pytest.raises(ConfigError, match="divisible"):
        CompressionConfig(codec="mapl_vq", rank=9)
    for bad in (dict(slice_fraction=0.0), dict(sync="sometimes"), dict(codebook_size=1),
                dict(slice_order="random"),
                dict(ema_decay=1.0), dict(rounds=0)):
        with pytest.raises(ConfigError):
            CompressionConfig(codec="mapl_vq", vq=VQConfig(**bad))


@pytest.mark.parametrize("order", ["priority", "round_robin"])
def test_pipeline_codes_and_bytes_match_accounting(make_config, order):
    cfg = make_config(compression={"codec": "mapl_vq", "vq": {"codebook_size": 32, "slice_fraction": 0.25,
                                                              "slice_order": order}})
    pipe = InProcessPipeline(cfg)
    gen = torch.Generator().manual_seed(0)
    n_micro = 3
    _, tokens = pipe.accumulate([torch.randint(0, 256, (2, 17), generator=gen) for _ in range(n_micro)])
    s = pipe.stages[0].vq.s
    exp = config_boundary_bytes(cfg)
    assert exp.forward_act_bytes == exp.backward_bytes == 2 * 8 == s.code_bytes_per_token  # r=16: 16 B/token
    assert exp == dataclasses.replace(boundary_bytes("mapl_vq", 64, 16, "bf16", 256, 16, vq=s,
                                                     tokens_per_micro=32, tokens_per_step=cfg.tokens_per_step))
    partial = s.slice_bytes(8, indexed=order == "priority")  # 8 codes of 32, + 1-byte index if priority
    assert exp.codebook_bytes == partial / 32  # per token of a 32-token micro-batch
    slice_bytes = s.slice_bytes(32) + (n_micro - 1) * partial  # the k-means init slice is full
    for b, link in enumerate(pipe.links):
        assert link.bytes["act"] == exp.forward_act_bytes * tokens
        assert link.bytes["ids"] == exp.forward_ids_bytes * tokens
        assert link.bytes["grad"] == exp.backward_bytes * tokens
        assert link.bytes["codebook"] == link.bytes["grad_codebook"] == slice_bytes
        a, c = pipe.stages[b].vq, pipe.stages[b + 1].vq
        assert a.tx["act"].digest() == c.rx["act"].digest() and c.tx["grad"].digest() == a.rx["grad"].digest()
        assert a.tx["act"].version == n_micro
    payload = pipe.stages[0].forward(99, ids=torch.randint(0, 256, (2, 17), generator=gen), train=False).payload
    assert payload["codes"].dtype == torch.uint8 and payload["codes"].shape == (2, 16, 2, 8)
    assert pipe.stages[0].take_slices("act") == []  # eval sends no slices


def test_checkpoint_resume_is_exact_with_vq(make_config, tmp_path):
    cfg = make_config(compression={"codec": "mapl_vq", "vq": {"codebook_size": 16}})
    gen = torch.Generator().manual_seed(1)
    data = [[torch.randint(0, 256, (2, 17), generator=gen) for _ in range(2)] for _ in range(2)]
    ref = InProcessPipeline(cfg)
    ref_losses = [ref.train_step(mbs).loss for mbs in data]
    first = InProcessPipeline(cfg)
    first.train_step(data[0])
    states = first.state_dicts()
    resumed = InProcessPipeline(cfg)
    for stage, st in zip(resumed.stages, states):
        stage.load_state_dict(st)
    assert [resumed.train_step(mbs).loss for mbs in data[1:]] == pytest.approx(ref_losses[1:], rel=1e-6)


@pytest.mark.slow  # torch.compile takes about a minute on the 2-core machine
def test_fused_compiled_search_matches_eager():
    gen = torch.Generator().manual_seed(6)
    x = torch.randn(700, 8, 2, generator=gen)
    cb = torch.randn(8, 64, 2, generator=gen)
    eager = nearest_codes(x, cb, 8 * 64 * 4 * 100)
    fused = nearest_codes(x, cb, 8 * 64 * 4 * 100, fused=True)  # 100-token chunks
    d = torch.cdist(x.transpose(0, 1), cb)  # (NG, N, K)
    best = d.min(-1).values
    chosen = d.gather(-1, fused.T.unsqueeze(-1)).squeeze(-1)
    assert torch.allclose(chosen, best, atol=1e-5)  # nearest up to float ties
    assert (fused != eager).float().mean() < 1e-3


def test_priority_slices_send_the_most_drifted_codes_and_stay_bit_identical():
    s = _settings(slice_order="priority", slice_fraction=0.125)  # 4 of 32 codes per slice
    tx, rx = _pair(s)
    gen = torch.Generator().manual_seed(6)
    centers = 3 * torch.randn(10, 8, generator=gen)
    tx.encode(_mixture(gen, 256, centers), learn=True)
    for sl in tx.take_slices():
        assert sl.full and sl.index is None and rx.apply(sl) == "apply"
    # a known drift: one code per codebook moves, weighted by its share
    R, NG, K, G = s.layout.shape
    moved = torch.randint(0, K, (R, NG), generator=gen)
    tx.learner.share.fill_(1.0 / K)
    tx.learner.live.copy_(tx.mirror)
    tx.learner.live[torch.arange(R)[:, None], torch.arange(NG), moved] += 5.0
    tx._emit_priority(s.slice_codes)
    (sl,) = tx.take_slices()
    assert sl.index.dtype == torch.uint8 and sl.index.shape == (R, NG, 4) and sl.start == 0 and not sl.full
    assert bool((sl.index == moved[..., None]).any(-1).all())  # every moved code is in its codebook's slice
    assert bool((sl.index.long().diff(dim=-1) > 0).all())
    assert sl.nbytes == s.slice_bytes(4, indexed=True) == R * NG * 4 * (4 * G + 1)
    back = CodebookSlice.from_message(decode(encode(sl.to_message(run_id="r", src=0, dst=1))))
    assert torch.equal(back.index, sl.index) and rx.apply(back) == "apply" and rx.digest() == tx.digest()
    for _ in range(40):  # training: the receiver stays bit-identical to the mirror after every slice
        codes = tx.encode(_mixture(gen, 64, centers), learn=True)
        for sl in tx.take_slices():
            assert sl.index is not None and rx.apply(sl) == "apply"
            assert rx.digest() == tx.digest()
        assert torch.equal(rx.decode(codes, tx.version), decode_codes(codes, tx.mirror))
    assert s.slice_bytes_per_micro == s.slice_bytes(4, indexed=True)


def test_bad_indexed_slices_are_rejected_by_name():
    s = _settings(slice_order="priority")
    tx, rx = _pair(s)
    gen = torch.Generator().manual_seed(7)
    tx.encode(torch.randn(1, 64, 8, generator=gen), learn=True)
    for sl in tx.take_slices():
        rx.apply(sl)
    good, v = rx.digest(), rx.version
    R, NG, K, G = s.layout.shape
    codes = torch.randn(R, NG, 3, G, generator=gen)
    ok = torch.tensor([1, 5, 9], dtype=torch.uint8).expand(R, NG, 3).contiguous()
    swapped = ok.clone()
    swapped[1, 2] = torch.tensor([5, 1, 9])
    beyond = ok.clone()
    beyond[0, 3, 2] = K
    bad = [
        (CodebookSlice("act", v + 1, 0, False, codes, index=swapped), SliceMalformed),
        (CodebookSlice("act", v + 1, 4, False, codes, index=ok), SliceMalformed),  # start must be 0
        (CodebookSlice("act", v + 1, 0, False, codes, index=ok.to(torch.uint16)), SliceMalformed),
        (CodebookSlice("act", v + 1, 0, False, codes, index=ok[:, :, :2]), SliceShapeMismatch),
        (CodebookSlice("act", v + 1, 0, False, codes, index=beyond), SliceIndexOutOfRange),
    ]
    for sl, err in bad:
        with pytest.raises(err):
            rx.apply(sl)
        assert rx.digest() == good and rx.version == v
    assert rx.apply(CodebookSlice("act", v + 1, 0, False, codes, index=ok)) == "apply"
    assert torch.equal(rx.codebooks[:, :, [1, 5, 9]], codes)


def test_uint16_indices_above_256_codes_round_trip_the_wire():
    s = _settings(slice_order="priority", codebook_size=512, slice_fraction=0.01, kmeans_iters=2)
    tx, rx = _pair(s)
    gen = torch.Generator().manual_seed(8)
    for _ in range(3):
        codes = tx.encode(torch.randn(1, 600, 8, generator=gen), learn=True)
        for sl in tx.take_slices():
            back = CodebookSlice.from_message(decode(encode(sl.to_message(run_id="r", src=0, dst=1))))
            assert rx.apply(back) == "apply"
    assert sl.index.dtype == torch.uint16 and codes.dtype == torch.uint16 and rx.digest() == tx.digest()
