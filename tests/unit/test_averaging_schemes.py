"""``replicas.averaging`` (SPEC §9.10 item 16): which tensors PowerSGD compresses, its arithmetic,
and the configs it refuses."""

from __future__ import annotations

import math

import pytest
import torch

from mapl_swarm.config import load_config
from mapl_swarm.errors import ConfigError
from mapl_swarm.pipeline.stage import StageRuntime
from mapl_swarm.replicas.schemes import (check_share, emulate, feedback, initial_factors, low_rank_plan,
                                         matrix_view, orthonormal, part_compression, product, sparse_decoded,
                                         sparse_plan, sparse_share, sparse_sum)

from conftest import micro_config


def test_the_plan_compresses_matrices_whose_factors_save_half_and_leaves_the_rest_exact() -> None:
    shapes = [(64, 64), (64,), (256, 8), (4, 4, 16), (16, 64), (3, 3)]
    plan = low_rank_plan(shapes, 4, exact=[4])
    # (64,64): 4*128 <= 2048; (256,8): 4*264 > 1024; (4,4,16) -> 16 x 16: 4*32 <= 128; (3,3): too small
    assert plan.matrices == (0, 3) and plan.views == ((64, 64), (16, 16))
    assert plan.exact(len(shapes)) == [1, 2, 4, 5]
    assert plan.factor_shapes == [(64, 4), (16, 4)]
    sent, dense = plan.values([64 * 64, 64, 256 * 8, 256, 16 * 64, 9])
    assert sent == 4 * 128 + 4 * 32 + 64 + 256 * 8 + 16 * 64 + 9 and dense == 4096 + 64 + 2048 + 256 + 1024 + 9
    assert matrix_view((2, 3, 5, 7)) == (30, 7)  # hivemind merges the adjacent pair of smallest product
    with pytest.raises(ValueError, match="rank must be >= 1"):
        low_rank_plan(shapes, 0)


def test_the_first_factors_are_the_same_for_every_replica_of_a_run() -> None:
    plan = low_rank_plan([(32, 32), (32, 16)], 2)
    a, b = initial_factors(plan, 7), initial_factors(plan, 7)
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert not torch.equal(a[0], initial_factors(plan, 8)[0])


def test_orthonormal_and_product_are_float64_rounded() -> None:
    gen = torch.Generator().manual_seed(0)
    p = torch.randn(50, 3, generator=gen)
    o = orthonormal(p)
    assert o.dtype == torch.float32
    torch.testing.assert_close(o.t() @ o, torch.eye(3), atol=1e-5, rtol=0)
    q = torch.randn(20, 3, generator=gen)
    assert torch.equal(product(o, q), (o.double() @ q.double().t()).float())


def test_a_rank_r_round_reproduces_a_mean_of_rank_r_and_error_feedback_recovers_what_it_left_out() -> None:
    gen = torch.Generator().manual_seed(1)
    u, v = torch.randn(40, 2, generator=gen), torch.randn(2, 30, generator=gen)
    low = u @ v  # rank 2: a rank-2 power iteration from any start captures it
    plan = low_rank_plan([(40, 30), (30,)], 2)
    qs = initial_factors(plan, 0)
    shares = [[low * 0.5, torch.ones(30)], [low * 1.5, torch.zeros(30)]]
    out = emulate(shares, [1.0, 1.0], plan, qs)
    torch.testing.assert_close(out[0], low, rtol=1e-4, atol=1e-4)
    assert torch.equal(out[1], torch.full((30,), 0.5))
    # a full-rank gradient: error feedback makes the running sum of what was applied track the true one
    g = torch.randn(40, 30, generator=gen)
    plan = low_rank_plan([(40, 30)], 2)
    for feedback, bound in ((True, lambda x: x < 0.05), (False, lambda x: x > 0.5)):
        qs, err, applied = initial_factors(plan, 0), torch.zeros(40, 30), torch.zeros(40, 30)
        for _ in range(200):
            m = g + err
            approx = emulate([[m]], [1.0], plan, qs)[0]
            err = m - approx if feedback else err
            applied += approx
        assert bound(float((applied / 200 - g).norm() / g.norm())), feedback


def test_topk_sends_the_largest_values_of_every_matrix_and_sums_shares_in_order() -> None:
    plan = sparse_plan([(10, 10), (10,), (4, 5), (3, 3)], 0.05, exact=[3])
    assert plan.tensors == (0, 2) and plan.counts == (5, 1) and plan.exact(4) == [1, 3]
    assert plan.values([100, 10, 20, 9]) == (math.ceil(1.5 * 6) + 1 + 19, 139)
    m = torch.tensor([[0.1, -5.0, 0.2], [3.0, 0.0, -0.3]])
    idx, values = sparse_share(m, 2)
    assert idx.tolist() == [1, 3] and idx.dtype == torch.int32 and values.dtype == torch.float16
    assert values.tolist() == [-5.0, 3.0]
    assert torch.equal(sparse_decoded(idx, values, m), torch.tensor([[0.0, -5.0, 0.0], [3.0, 0.0, 0.0]]))
    other = (torch.tensor([1, 5], dtype=torch.int32), torch.tensor([1.0, 2.0], dtype=torch.float16))
    out = sparse_sum([(idx, values, 3.0), (*other, 1.0), (*other, 0.0)], m)  # weight 0: nothing
    assert torch.equal(out, torch.tensor([[0.0, -5.0 * 0.75 + 0.25, 0.0], [2.25, 0.0, 0.5]]))
    assert check_share(idx, values, 2, 6) is None
    assert "out of range" in check_share(torch.tensor([1, 6], dtype=torch.int32), values, 2, 6)
    assert "ascending" in check_share(torch.tensor([3, 3], dtype=torch.int32), values, 2, 6)
    assert "not finite" in check_share(idx, torch.tensor([1.0, float("inf")], dtype=torch.float16), 2, 6)
    assert "share of" in check_share(idx.long(), values, 2, 6)
    with pytest.raises(ValueError, match="within"):
        sparse_plan([(4, 4)], 1.5)


def test_a_value_beyond_float16_is_sent_clamped_and_error_feedback_keeps_the_rest() -> None:
    """A share of inf would fail every partner's round (values not finite) for as long as error
    feedback holds the value: it goes clamped to 65504, and the rest stays in the feedback."""
    x = torch.tensor([1e5, -2e5, 1.0, 0.5])
    idx, values = sparse_share(x, 2)
    assert idx.tolist() == [0, 1] and values.tolist() == [65504.0, -65504.0]
    assert check_share(idx, values, 2, 4) is None
    left = feedback(x.clone(), sparse_decoded(idx, values, x), 1, 1)
    assert left.tolist() == [1e5 - 65504.0, -2e5 + 65504.0, 1.0, 0.5]


def test_part_compression_per_scheme() -> None:
    assert type(part_compression("fp16")).__name__ == "Float16Compression"
    assert {type(part_compression(s)).__name__ for s in ("fp32", "powersgd", "topk")} == {"NoCompression"}
    with pytest.raises(ValueError, match="unknown averaging scheme"):
        part_compression("int4")


def test_a_stage_keeps_its_projector_gradient_and_statistics_exact() -> None:
    cfg = micro_config(pipeline={"num_stages": 2, "micro_batch_size": 2, "num_micro_batches": 2},
                       compression={"codec": "mapl"})
    rt = StageRuntime(cfg, 0)
    from mapl_swarm.replicas.gradients import exact_tensors

    params = list(rt.optimized_parameters())
    exact = exact_tensors(rt)
    assert [i for i, p in enumerate(params) if p is rt.outbound.projector] == exact[:1]
    plan = low_rank_plan([tuple(p.shape) for p in params], 4, exact=exact)
    assert exact[0] not in plan.matrices and plan.matrices  # the weight matrices are compressed


@pytest.mark.parametrize("setting, message", [
    ('averaging_rank = 0', "replicas.averaging_rank must be an integer >= 1"),
    ('averaging = "int4"', "replicas.averaging must be one of"),
    ('error_feedback = "yes"', "error_feedback must be bool"),
    ('averaging = "fp16"\ncheck_fraction = 0.5', "replicas.check_fraction needs replicas.averaging = 'fp32'"),
    ('averaging = "powersgd"\naggregation = "centered_clip"', "needs dense averaging"),
    ('averaging = "topk"\naggregation = "trimmed_mean"', "needs dense averaging"),
    ('topk_fraction = 1.5', "replicas.topk_fraction must be a number within"),
    ('topk_fraction = 0.0', "replicas.topk_fraction must be a number within"),
    ('averaged = "moments"', "replicas.averaged must be one of"),
    ('averaged = "updates"', "replicas.averaged = 'updates' needs a scheme with error feedback .* got "
                             "replicas.averaging = 'fp32'"),
    ('averaging = "topk"\naveraged = "updates"\n[optim]\ngrad_clip_norm = 1.0',
     "replicas.averaged = 'updates' with optim.grad_clip_norm = 1: a replica steps"),
])
def test_bad_averaging_settings_are_one_line_config_errors(tmp_path, setting, message) -> None:
    path = tmp_path / "bad.toml"
    path.write_text(f"[pipeline]\nnum_stages = 2\n[replicas]\nenabled = true\n{setting}\n")
    with pytest.raises(ConfigError, match=message) as err:
        load_config(path)
    assert "\n" not in str(err.value)
