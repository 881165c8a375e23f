"""Robust aggregation of a stage's replicas' shares (issue 46 item 2, :mod:`mapl_swarm.replicas.robust`).
CenteredClip: honest shares give their weighted mean; one dishonest share of three moves the result
by a bound of the order of the honest spread, whatever its size. Trimmed mean: with one dishonest
share every coordinate stays within the honest shares' range. The part reducer returns the
aggregate to every member."""

from __future__ import annotations

import asyncio

import pytest
import torch

from mapl_swarm.replicas.exact_allreduce import RobustPartReducer
from mapl_swarm.replicas.robust import CLIP_SCALE, ITERATIONS, centered_clip, trimmed_mean


def _honest(n: int = 3, size: int = 4096, seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    signal = torch.randn(size, generator=gen)
    return [signal + 0.1 * torch.randn(size, generator=gen) for _ in range(n)]  # the same gradient, sampling noise


def test_close_honest_shares_give_their_weighted_mean():
    shares = _honest(4)
    weights = [1.0, 2.0, 1.0, 3.0]
    mean = sum(w * x for w, x in zip(weights, shares)) / sum(weights)
    assert torch.allclose(centered_clip(shares, weights), mean, atol=1e-5)
    assert torch.equal(centered_clip(shares[:2], weights[:2]), (shares[0] + 2 * shares[1]) / 3)  # < 3: the mean
    assert torch.equal(centered_clip([shares[0], torch.full_like(shares[0], 1e6)], [1.0, 0.0]), shares[0])


@pytest.mark.parametrize("attack", ["scaled_-10", "sign_flip", "noise", "bias"])
def test_one_dishonest_share_of_three_moves_the_result_by_a_bounded_amount(attack):
    honest = _honest(2)
    x = honest[0]
    bad = {"scaled_-10": -10 * x, "sign_flip": -x, "noise": torch.randn(x.shape) * x.norm() / x.numel() ** 0.5 * 100,
           "bias": x + 0.1 * x.norm() * torch.ones_like(x) / x.numel() ** 0.5}[attack]
    honest_mean = (honest[0] + honest[1]) / 2
    naive = (honest[0] + honest[1] + bad) / 3
    robust = centered_clip([*honest, bad], [1.0, 1.0, 1.0])
    v0 = torch.stack([*honest, bad]).median(dim=0).values
    tau = CLIP_SCALE * float(torch.stack([(s - v0).norm() for s in (*honest, bad)]).median())
    bound = ITERATIONS * tau / 3 + (honest[0] - honest[1]).norm()  # its terms, and the honest spread
    assert float((robust - honest_mean).norm()) <= float(bound)
    if attack in ("scaled_-10", "noise"):  # a large attack: the mean is moved far, CenteredClip is not
        assert float((robust - honest_mean).norm()) < 0.1 * float((naive - honest_mean).norm())


def test_the_part_reducer_returns_the_clipped_aggregate_of_every_senders_share():
    async def main():
        reducer = RobustPartReducer([torch.Size([8]), torch.Size([8])], num_senders=3, aggregate=centered_clip)
        parts = [[torch.full((8,), float(v)) for v in (s, s + 1)] for s in (1.0, 1.1, 50.0)]
        got = await asyncio.gather(*(reducer.accumulate_part(i, p, parts[i][p]) for p in range(2) for i in range(3)))
        return parts, got

    parts, got = asyncio.run(main())
    for p in range(2):
        expected = centered_clip([parts[i][p] for i in range(3)], [1.0, 1.0, 1.0])
        assert all(torch.equal(g, expected) for g in got[3 * p:3 * p + 3])  # every sender gets the same bytes
        assert float(expected.max()) < 5.0  # the outlier (50) is clipped


@pytest.mark.parametrize("attack", ["scaled_-10", "sign_flip", "noise", "bias"])
def test_with_one_dishonest_share_the_trimmed_mean_stays_within_the_honest_range(attack):
    honest = _honest(3)
    x = honest[0]
    bad = {"scaled_-10": -10 * x, "sign_flip": -x, "noise": torch.randn(x.shape) * 100,
           "bias": x + 0.1 * x.norm() * torch.ones_like(x) / x.numel() ** 0.5}[attack]
    got = trimmed_mean([*honest, bad], [1.0, 1.0, 1.0, 1.0])
    low, high = torch.stack(honest).min(dim=0).values, torch.stack(honest).max(dim=0).values
    assert bool(((got >= low) & (got <= high)).all())
    # three shares: the coordinate-wise median; under three, or with weight 0, the weighted mean
    assert torch.equal(trimmed_mean(honest, [1.0, 1.0, 1.0]), torch.stack(honest).median(dim=0).values)
    assert torch.equal(trimmed_mean([x, bad], [1.0, 0.0]), x)
    assert torch.allclose(trimmed_mean(honest[:2], [1.0, 3.0]), (honest[0] + 3 * honest[1]) / 4)
