"""Compression diagnostics give known answers on constructed inputs; the live probe reports them."""

import math

import pytest
import torch

from mapl_swarm.metrics import health
from mapl_swarm.compress.stiefel import random_stiefel
from mapl_swarm.pipeline.inprocess import InProcessPipeline


def _basis(d=32, r=8, seed=0):
    return random_stiefel(d, r, torch.Generator().manual_seed(seed))


def test_principal_angles_identical_rotated_and_orthogonal_subspaces():
    a = _basis()
    assert health.mean_principal_angle(a, a) == pytest.approx(0.0, abs=1e-3)
    rot = random_stiefel(8, 8, torch.Generator().manual_seed(1))  # same span, other basis
    assert health.mean_principal_angle(a, a @ rot) == pytest.approx(0.0, abs=1e-3)
    q = random_stiefel(32, 16, torch.Generator().manual_seed(2))
    assert health.mean_principal_angle(q[:, :8], q[:, 8:]) == pytest.approx(90.0, abs=1e-6)
    angles = health.principal_angles(q[:, :8], torch.cat([q[:, :4], q[:, 8:12]], 1))
    assert torch.allclose(angles, torch.tensor([0.0] * 4 + [90.0] * 4, dtype=angles.dtype), atol=1e-3)
    m = health.pairwise_mean_angles([q[:, :8], q[:, 8:], q[:, :8]])
    assert m[0][1] == pytest.approx(90.0, abs=1e-6) and m[0][2] == pytest.approx(0.0, abs=1e-3)
    assert m[1][0] == m[0][1] and m[1][1] == 0.0


def test_energy_captured_and_fidelity_inside_and_orthogonal_to_subspace():
    q = random_stiefel(32, 16, torch.Generator().manual_seed(3))
    a, other = q[:, :8], q[:, 8:]
    coords = torch.randn(4, 10, 8, generator=torch.Generator().manual_seed(4))
    inside = coords @ a.T  # (B, T, d) in span(A)
    assert health.energy_captured(inside, a) == pytest.approx(1.0, abs=1e-6)
    assert health.energy_captured(coords @ other.T, a) == pytest.approx(0.0, abs=1e-6)
    mixed = inside + coords @ other.T  # equal energy in and out of span(A)
    assert health.energy_captured(mixed, a) == pytest.approx(0.5, abs=1e-6)
    assert health.gradient_fidelity(inside, a) == pytest.approx(1.0, abs=1e-6)
    assert health.gradient_fidelity(mixed, a) == pytest.approx(1 / math.sqrt(2), abs=1e-6)
    assert health.orthonormality_error(a) < 1e-5
    assert health.orthonormality_error(2 * a) == pytest.approx(3 * math.sqrt(8), rel=1e-5)


def test_cosine_preservation_exact_inside_subspace():
    a = _basis(d=64, r=16)
    x = torch.randn(300, 16, generator=torch.Generator().manual_seed(5), dtype=torch.float64) @ a.double().T
    before, after, r = health.cosine_pairs(x, a, num_pairs=400)
    assert torch.allclose(before, after, atol=1e-6)
    assert r == pytest.approx(1.0, abs=1e-9)
    noisy = x + torch.randn(x.shape, generator=torch.Generator().manual_seed(6), dtype=torch.float64)
    assert health.cosine_pairs(noisy, a, num_pairs=400)[2] < 0.999


def test_spectrum_of_low_rank_data_and_vq_stats():
    x = torch.randn(200, 5, generator=torch.Generator().manual_seed(7)) @ _basis(d=32, r=5).T
    cum = health.cumulative_energy(x)
    assert len(cum) == 32 and cum[-1] == pytest.approx(1.0)
    assert health.rank_for_energy(cum, 0.999999) == 5
    z = torch.randn(8, 4)
    assert health.quantization_stats(z, z) == {"vq_cos": pytest.approx(1.0), "vq_rel_error": 0.0}
    assert health.dead_code_fraction(torch.tensor([[3, 0], [0, 1]])) == 0.5


def _batches(n, vocab=256, T=16, B=2):
    gen = torch.Generator().manual_seed(0)
    return [torch.randint(0, vocab, (B, T + 1), generator=gen) for _ in range(n)]


@pytest.mark.parametrize("codec", ["fixed", "mapl"])
def test_stage_probe_reports_health_on_interval(make_config, codec):
    cfg = make_config(compression={"codec": codec}, pipeline={"num_stages": 3}, metrics={"health_interval_steps": 2})
    pipe = InProcessPipeline(cfg)
    first = pipe.train_step(_batches(2)).metrics
    assert not any("health" in k for k in first)
    m = pipe.train_step(_batches(2)).metrics
    for b in range(2):
        sender, receiver = f"stage{b}/health/b{b}/", f"stage{b + 1}/health/b{b}/"
        assert 0.0 < m[sender + "energy_captured"] < 1.0
        assert m[sender + "orth_error"] < 1e-4
        assert 0.0 < m[receiver + "grad_fidelity"] <= 1.0 + 1e-6
    off = InProcessPipeline(make_config(compression={"codec": codec}, pipeline={"num_stages": 3}))
    assert not any("health" in k for k in off.train_step(_batches(2)).metrics)


def test_probe_energy_matches_direct_computation(make_config):
    """The logged energy is ‖R A‖²/‖R‖² of micro-batch 0's residual at the step's projector."""
    cfg = make_config(compression={"codec": "fixed", "wire_dtype": "fp32"},
                      pipeline={"num_stages": 2}, metrics={"health_interval_steps": 1})
    pipe = InProcessPipeline(cfg)
    mbs = _batches(2)
    st = pipe.stages[0]
    with torch.no_grad():
        tokens = mbs[0][:, :-1]
        emb = st.model.embed(tokens)
        x = st.model.run_layers(emb)
        expected = health.energy_captured(x - emb, st.outbound.projector)
    m = pipe.train_step(mbs).metrics
    assert m["stage0/health/b0/energy_captured"] == pytest.approx(expected, rel=1e-5)


def test_codec_health_hook_and_peer_stream(make_config, tmp_path):
    """A codec's ``health()`` dict is merged under health/b{index}/ (the VQ hook); peers append
    their stage's health records to metrics_stage{S}.jsonl."""
    import json

    from mapl_swarm.pipeline.probe import append_health

    pipe = InProcessPipeline(make_config(compression={"codec": "mapl"},
                                         pipeline={"num_stages": 2}, metrics={"health_interval_steps": 1}))
    pipe.stages[0].outbound.health = lambda: {"vq_cos": 0.9, "dead_code_fraction": 0.25}
    m = pipe.train_step(_batches(2)).metrics
    assert m["stage0/health/b0/vq_cos"] == 0.9 and m["stage0/health/b0/dead_code_fraction"] == 0.25
    from types import SimpleNamespace

    from mapl_swarm.pipeline.probe import BoundaryProbe

    probe = BoundaryProbe(1)  # a stage-level codec (StageRuntime.vq) names the boundary itself
    probe.on_send(probe.due(0, 0, True), torch.ones(1, 2, 4), None, torch.zeros(1, 2, dtype=torch.long))
    got = probe.collect(None, None, None, SimpleNamespace(health=lambda: {"b2/vq_rel_error": 0.1}))
    assert got == {"health/b2/vq_rel_error": 0.1}
    assert probe.collect(None, None, SimpleNamespace(health=lambda: {"b2/x": 1.0})) == {}  # not a health step
    append_health(tmp_path, 1, 7, {"lr_mult": 1.0, "health/b0/grad_fidelity": 0.5})
    append_health(tmp_path, 1, 8, {"lr_mult": 1.0})  # no health keys: nothing written
    lines = (tmp_path / "metrics_stage1.jsonl").read_text().splitlines()
    assert len(lines) == 1
    rec = json.loads(lines[0])
    assert rec["step"] == 7 and rec["stage"] == 1 and rec["health/b0/grad_fidelity"] == 0.5 and "lr_mult" not in rec


def test_vq_health_exact_codebook_and_live_probe(make_config):
    from mapl_swarm.compress.codebook_sync import VQSender
    from mapl_swarm.pipeline.probe import vq_stream_health

    cfg = make_config(compression={"codec": "mapl_vq", "vq": {"codebook_size": 16}},
                      pipeline={"num_stages": 3}, metrics={"health_interval_steps": 2})
    s = cfg.compression.vq  # r=16, G=2, R=2, K=16
    sender = VQSender(s, "act", torch.Generator().manual_seed(0), "cpu")
    codes = torch.randn(16, 2, generator=torch.Generator().manual_seed(1))
    sender.mirror.zero_()
    sender.mirror[0] = codes  # round 0: the same 16 codes in every group; round 1: zeros
    pick = torch.randint(0, 8, (50, 8), generator=torch.Generator().manual_seed(2))  # codes 0..7 only
    z = codes[pick].reshape(50, 16)  # (N, r): every group exactly a code
    h = vq_stream_health(sender, z)
    assert h["vq_cos"] == pytest.approx(1.0) and h["vq_rel_error"] == pytest.approx(0.0, abs=1e-6)
    assert 0.5 <= h["vq_dead_code_fraction"] < 1.0  # round 0 uses <= 8 of 16 codes, round 1 one

    pipe = InProcessPipeline(cfg)
    pipe.train_step(_batches(2))
    m = pipe.train_step(_batches(2)).metrics
    for b in range(2):
        for key in (f"stage{b}/health/b{b}/vq_act_cos", f"stage{b + 1}/health/b{b}/vq_grad_cos"):
            assert 0.0 < m[key] <= 1.0 + 1e-6, key
        assert 0.0 <= m[f"stage{b}/health/b{b}/vq_act_dead_code_fraction"] <= 1.0
        assert m[f"stage{b}/health/b{b}/vq_act_rel_error"] >= 0.0
        assert f"stage{b}/health/b{b}/energy_captured" in m
