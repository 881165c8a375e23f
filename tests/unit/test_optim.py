"""Polar Express msign, Muon, SPEL (and the naive baseline's drift) and the lr schedule."""

from __future__ import annotations

import math

import pytest
import torch

from mapl_swarm.compress.stiefel import random_stiefel
from mapl_swarm.optim import (
    POLAR_EXPRESS_COEFFS,
    SPEL,
    Muon,
    lr_multiplier,
    msign,
    muon_scale,
    polar_express_coeffs,
    project_tangent,
    stiefel_error,
)


@pytest.fixture
def single_thread():
    """The SPEL loops run thousands of tiny matmuls: intra-op threads only add contention."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _row_error(X: torch.Tensor) -> float:
    """‖X Xᵀ - I‖_F for a wide matrix (rows orthonormal)."""
    return stiefel_error(X.mT)


# ---------------------------------------------------------------- msign


def test_coefficient_schedule_is_damped_and_repeats_last():
    coeffs = polar_express_coeffs(10)
    a, b, c = POLAR_EXPRESS_COEFFS[0]
    assert coeffs[0] == pytest.approx((a / 1.01, b / 1.01**3, c / 1.01**5), rel=1e-15)
    a, b, c = POLAR_EXPRESS_COEFFS[6]
    assert coeffs[6] == pytest.approx((a / 1.01, b / 1.01**3, c / 1.01**5), rel=1e-15)
    assert coeffs[7:] == [(1.875, -1.25, 0.375)] * 3
    with pytest.raises(ValueError):
        polar_express_coeffs(0)


def test_eight_step_fp32_retraction_lands_on_manifold():
    G = torch.randn(1024, 256, generator=_gen(0))  # tall Gaussian
    assert stiefel_error(msign(G, 8)) <= 1e-5
    assert stiefel_error(msign(G, 7)) > 3e-5  # the 8th step is what lands it (see spel.py)


def test_five_steps_give_singular_values_near_one():
    G = torch.randn(512, 128, generator=_gen(1))
    for dtype in (torch.float32, torch.bfloat16):
        s = torch.linalg.svdvals(msign(G, 5, dtype=dtype))
        assert 0.7 <= s.min().item() and s.max().item() <= 1.2, (dtype, s.min(), s.max())


def test_matches_exact_polar_factor_when_well_conditioned():
    g = _gen(2)
    U = random_stiefel(96, 40, g)  # (96, 40)
    V = random_stiefel(40, 40, g)  # (40, 40)
    s = torch.linspace(0.5, 2.0, 40)
    G = (U * s) @ V.T  # (96, 40), condition number 4
    for M, polar in ((G, U @ V.T), (G.T, V @ U.T)):  # tall and wide
        out = msign(M, 8)
        assert out.shape == M.shape
        torch.testing.assert_close(out, polar, atol=5e-6, rtol=0)


def test_wide_and_tall_are_transposes():
    G = torch.randn(200, 60, generator=_gen(3))
    tall, wide = msign(G, 8), msign(G.T, 8)
    assert tall.shape == (200, 60) and wide.shape == (60, 200)
    assert stiefel_error(tall) <= 1e-5 and _row_error(wide) <= 1e-5
    torch.testing.assert_close(tall, wide.T, atol=1e-6, rtol=0)


def test_batched_matches_per_matrix():
    G = torch.randn(3, 2, 48, 32, generator=_gen(4))  # (3, 2, 48, 32)
    out = msign(G, 8)
    assert out.shape == G.shape
    for i in range(3):
        for j in range(2):
            torch.testing.assert_close(out[i, j], msign(G[i, j], 8), atol=1e-5, rtol=0)
            assert stiefel_error(out[i, j]) <= 1e-5


def test_dtype_handling():
    G = torch.randn(64, 32, generator=_gen(5))
    assert msign(G, 5, dtype=torch.bfloat16).dtype == torch.float32  # bf16 compute, fp32 out
    assert msign(G.bfloat16(), 5).dtype == torch.bfloat16
    assert msign(G.double(), 8).dtype == torch.float64
    assert torch.count_nonzero(msign(torch.zeros(8, 4), 5)) == 0  # no NaN on zero input
    with pytest.raises(ValueError):
        msign(torch.randn(5), 5)


# ---------------------------------------------------------------- Muon


def test_muon_step_is_exact_manual_update():
    lr, beta, wd = 0.05, 0.95, 0.1
    g = _gen(6)
    shapes = [(32, 8), (8, 32), (32, 8)]  # tall (scale 2), wide (scale 1), a second tall (batched)
    params = [torch.nn.Parameter(torch.randn(*s, generator=g)) for s in shapes]
    ref = [p.detach().clone() for p in params]
    bufs = [torch.zeros_like(p) for p in ref]
    opt = Muon(params, lr=lr, momentum=beta, weight_decay=wd, ns_steps=5)
    for _ in range(3):
        grads = [torch.randn(*s, generator=g) for s in shapes]
        for p, gr in zip(params, grads):
            p.grad = gr.clone()
        opt.step()
        for i, gr in enumerate(grads):
            bufs[i] = beta * bufs[i] + (1 - beta) * gr
            u = (1 - beta) * gr + beta * bufs[i]  # Nesterov
            rows, cols = shapes[i]
            scale = max(1.0, rows / cols) ** 0.5
            ref[i] = ref[i] * (1 - lr * wd) - lr * scale * msign(u, 5)
    for p, r in zip(params, ref):
        torch.testing.assert_close(p.detach(), r, atol=1e-5, rtol=0)


def test_muon_shape_scale_and_weight_decay():
    assert muon_scale(32, 8) == 2.0 and muon_scale(8, 32) == 1.0 and muon_scale(16, 16) == 1.0
    # With zero gradient only weight decay acts: p *= 1 - lr*wd exactly.
    p = torch.nn.Parameter(torch.randn(16, 4, generator=_gen(7)))
    p0 = p.detach().clone()
    p.grad = torch.zeros_like(p)
    Muon([p], lr=0.1, weight_decay=0.5).step()
    torch.testing.assert_close(p.detach(), p0 * (1 - 0.1 * 0.5))
    # Without decay the step's singular values are lr * scale * (≈1).
    for rows, cols in ((64, 16), (16, 64)):
        q = torch.nn.Parameter(torch.zeros(rows, cols))
        q.grad = torch.randn(rows, cols, generator=_gen(8))
        Muon([q], lr=0.01, direction_dtype=torch.bfloat16).step()
        s = torch.linalg.svdvals(q.detach()) / (0.01 * muon_scale(rows, cols))
        assert 0.7 <= s.min().item() and s.max().item() <= 1.2


def test_muon_rejects_non_matrix():
    with pytest.raises(ValueError):
        Muon([torch.nn.Parameter(torch.zeros(4))])


# ---------------------------------------------------------------- SPEL

D_MODEL, RANK, BATCH = 64, 16, 128
LR = 0.01


class _LowRankData:
    """Fresh batches from a fixed distribution: rank-16 signal in span(U) plus isotropic noise."""

    def __init__(self, seed: int) -> None:
        self.g = _gen(seed)
        self.U = random_stiefel(D_MODEL, RANK, _gen(100))  # (64, 16) true top subspace
        self.scales = torch.linspace(3.0, 1.5, RANK)

    def batch(self, n: int = BATCH) -> torch.Tensor:
        z = torch.randn(n, RANK, generator=self.g) * self.scales  # (n, 16)
        return z @ self.U.T + 0.3 * torch.randn(n, D_MODEL, generator=self.g)  # (n, 64)


def _energy_loss(X: torch.Tensor, A: torch.Tensor) -> torch.Tensor:
    return -(X @ A).square().sum() / X.shape[0]  # -‖X A‖² per sample


def _recon_loss(X: torch.Tensor, A: torch.Tensor) -> torch.Tensor:
    return (X - X @ A @ A.T).square().sum() / X.shape[0]  # ‖X - X A Aᵀ‖² per sample


def _train(opt_factory, loss_fn, steps: int, check_every: int = 50):
    data = _LowRankData(seed=11)
    A = torch.nn.Parameter(random_stiefel(D_MODEL, RANK, _gen(1)))
    opt = opt_factory(A)
    worst = 0.0
    for step in range(steps):
        opt.zero_grad(set_to_none=True)
        loss_fn(data.batch(), A).backward()
        opt.step()
        if step % check_every == 0 or step == steps - 1:
            worst = max(worst, stiefel_error(A))
    return A.detach(), data, worst


def _captured_fraction(A: torch.Tensor, X: torch.Tensor) -> float:
    """Energy ‖X A‖² relative to the best rank-r capture (sum of the top-r squared singular values)."""
    best = torch.linalg.svdvals(X)[:RANK].square().sum()
    return float((X @ A).square().sum() / best)


@pytest.mark.parametrize("loss_fn", [_energy_loss, _recon_loss], ids=["energy", "reconstruction"])
def test_spel_learns_top_subspace_and_stays_on_manifold(loss_fn, single_thread):
    data0 = _LowRankData(seed=12)
    X_val = data0.batch(4096)  # (4096, 64) held out
    A0 = random_stiefel(D_MODEL, RANK, _gen(1))
    assert _captured_fraction(A0, X_val) < 0.5  # a random start captures little
    A, data, worst = _train(lambda p: SPEL([p], lr=LR), loss_fn, steps=2000)
    assert worst <= 1e-4 and stiefel_error(A) <= 1e-4
    assert _captured_fraction(A, X_val) > 0.98
    alignment = (data.U.T @ A).square().sum().item() / RANK  # 1 = span(A) == span(U)
    assert alignment > 0.99
    assert loss_fn(X_val, A) < loss_fn(X_val, A0)


def test_spel_direction_is_tangent_and_defaults():
    A = random_stiefel(40, 8, _gen(13))
    G = project_tangent(A, torch.randn(40, 8, generator=_gen(14)))
    skew = A.T @ G  # tangent at A  <=>  Aᵀ G is skew-symmetric
    torch.testing.assert_close(skew + skew.T, torch.zeros(8, 8), atol=1e-5, rtol=0)
    d = SPEL([torch.nn.Parameter(A)]).defaults
    assert (d["momentum"], d["direction_steps"], d["retraction_steps"]) == (0.95, 5, 8)
    with pytest.raises(ValueError):
        SPEL([torch.nn.Parameter(torch.zeros(4, 8))])  # d < r


def test_naive_projector_drifts_off_manifold(single_thread):
    # Same start, same signal, same lr, plain Muon without the manifold constraint.
    A, _, _ = _train(lambda p: Muon([p], lr=LR), _energy_loss, steps=300)
    assert stiefel_error(A) > 1.0  # energy is unbounded off the manifold: A just grows
    # Even where the loss itself favours orthonormal A (reconstruction), the path leaves the manifold.
    _, _, worst = _train(lambda p: Muon([p], lr=LR), _recon_loss, steps=300, check_every=10)
    assert worst > 1e-2


def test_random_stiefel():
    A = random_stiefel(30, 7, _gen(15))
    assert A.shape == (30, 7) and A.dtype == torch.float32
    assert stiefel_error(A) <= 1e-5
    torch.testing.assert_close(A, random_stiefel(30, 7, _gen(15)), atol=0, rtol=0)
    with pytest.raises(ValueError):
        random_stiefel(3, 5)


# ---------------------------------------------------------------- schedule


def _lr(step, schedule, total=100, warmup=10, min_ratio=0.1, frac=0.2):
    return lr_multiplier(step, total_steps=total, warmup_steps=warmup, schedule=schedule,
                         min_lr_ratio=min_ratio, wsd_decay_fraction=frac)


@pytest.mark.parametrize("schedule", ["cosine", "wsd", "constant"])
def test_warmup_is_linear_and_starts_nonzero(schedule):
    assert [_lr(s, schedule) for s in range(10)] == pytest.approx([(s + 1) / 10 for s in range(10)])
    assert _lr(10, schedule) == pytest.approx(1.0)


def test_cosine_endpoints_and_midpoint():
    assert _lr(10, "cosine") == pytest.approx(1.0)
    assert _lr(99, "cosine") == pytest.approx(0.1)
    assert _lr(500, "cosine") == pytest.approx(0.1)  # past the end: stays at the floor
    mid = 10 + (99 - 10) / 2
    assert lr_multiplier(int(mid), total_steps=100, warmup_steps=10, schedule="cosine", min_lr_ratio=0.1,
                         wsd_decay_fraction=0.2) == pytest.approx(
        0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (int(mid) - 10) / 89)))
    values = [_lr(s, "cosine") for s in range(10, 100)]
    assert all(a >= b for a, b in zip(values, values[1:]))


def test_wsd_plateau_then_linear_decay():
    assert all(_lr(s, "wsd") == 1.0 for s in range(10, 80))  # last 20% of 100 steps decay
    decay = [_lr(s, "wsd") for s in range(80, 100)]
    assert decay[-1] == pytest.approx(0.1) and decay[0] < 1.0
    steps = [b - a for a, b in zip(decay, decay[1:])]
    assert steps == pytest.approx([-0.9 / 20] * 19)  # linear
    assert _lr(50, "wsd", frac=0.0) == 1.0 and _lr(99, "wsd", frac=0.0) == 1.0


def test_constant_and_validation():
    assert all(_lr(s, "constant") == 1.0 for s in range(10, 200))
    assert _lr(0, "constant", warmup=0) == 1.0
    with pytest.raises(ValueError):
        _lr(0, "linear")
    with pytest.raises(ValueError):
        _lr(-1, "cosine")
