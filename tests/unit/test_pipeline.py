"""Single-process pipeline: equivalence with the unsplit model, projector exchange, checkpoints."""

import pytest
import torch

from mapl_swarm.optim import stiefel_error
from mapl_swarm.pipeline import checkpoint
from mapl_swarm.pipeline.inprocess import InProcessPipeline


def _batches(n, seed=0, vocab=256, T=16, B=2):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (B, T + 1), generator=gen) for _ in range(n)]


def _named_grads(pipe):
    """Gradients keyed by a partition-independent name (global layer index)."""
    out = {}
    for stage in pipe.stages:
        m = stage.model
        if m.embed_tokens is not None:
            out["embed"] = m.embed_tokens.weight.grad
        for layer in m.layers:
            for n, p in layer.named_parameters():
                out[f"layer{layer.self_attn.layer_idx}.{n}"] = p.grad
        if m.lm_head is not None:
            out["head"] = m.lm_head.weight.grad
            out["norm"] = m.norm.weight.grad
    return out


@pytest.mark.parametrize("stages", [1, 4])
def test_none_fp32_pipeline_equals_unsplit_model(make_config, stages):
    base = InProcessPipeline(make_config(compression={"codec": "none", "wire_dtype": "fp32"},
                                         pipeline={"num_stages": 1}))
    split = InProcessPipeline(make_config(compression={"codec": "none", "wire_dtype": "fp32"},
                                          pipeline={"num_stages": stages}))
    mbs = _batches(2)
    loss_a, _ = base.accumulate(mbs)
    loss_b, _ = split.accumulate(mbs)
    assert loss_a == pytest.approx(loss_b, rel=1e-6)
    ga, gb = _named_grads(base), _named_grads(split)
    assert ga.keys() == gb.keys() and len(ga) > 10
    for k in ga:
        torch.testing.assert_close(gb[k], ga[k], rtol=1e-4, atol=1e-6, msg=k)
    base.finish_step(), split.finish_step()
    r1, r2 = base.train_step(mbs), split.train_step(mbs)
    assert r1.loss == pytest.approx(r2.loss, rel=1e-5)


def test_mapl_projectors_stay_on_manifold_and_in_sync(make_config):
    pipe = InProcessPipeline(make_config(compression={"codec": "mapl"}))
    before = pipe.stages[0].outbound.projector.detach().clone()
    for mbs in (_batches(2, seed=s) for s in range(5)):
        pipe.train_step(mbs)
    for b in range(3):
        send, recv = pipe.stages[b].outbound, pipe.stages[b + 1].inbound
        assert send.version == recv.version == 5
        torch.testing.assert_close(send.projector, recv.projector, rtol=0, atol=0)
        assert stiefel_error(send.projector.detach()) < 1e-4
    assert not torch.allclose(before, pipe.stages[0].outbound.projector)


def test_fixed_projector_never_changes(make_config):
    pipe = InProcessPipeline(make_config(compression={"codec": "fixed"}))
    before = pipe.stages[1].outbound.projector.clone()
    pipe.train_step(_batches(2))
    torch.testing.assert_close(pipe.stages[1].outbound.projector, before, rtol=0, atol=0)


def test_checkpoint_resume_is_exact(make_config, tmp_path):
    cfg = make_config(compression={"codec": "mapl"})
    data = [_batches(2, seed=s) for s in range(4)]
    ref = InProcessPipeline(cfg)
    ref_losses = [ref.train_step(mbs).loss for mbs in data]

    first = InProcessPipeline(cfg)
    for mbs in data[:2]:
        first.train_step(mbs)
    for s, state in enumerate(first.state_dicts()):
        checkpoint.save_stage(tmp_path, 2, s, state)
    assert checkpoint.latest_complete_step(tmp_path, 4) == 2
    resumed = InProcessPipeline(cfg)
    for s, stage in enumerate(resumed.stages):
        stage.load_state_dict(checkpoint.load_stage(tmp_path, 2, s))
    losses = [resumed.train_step(mbs).loss for mbs in data[2:]]
    assert losses == pytest.approx(ref_losses[2:], rel=1e-6)


def test_incomplete_checkpoint_is_not_resumed(tmp_path):
    checkpoint.save_stage(tmp_path, 4, 0, {"x": torch.zeros(1)})
    checkpoint.save_stage(tmp_path, 2, 0, {"x": torch.zeros(1)})
    checkpoint.save_stage(tmp_path, 2, 1, {"x": torch.zeros(1)})
    assert checkpoint.latest_complete_step(tmp_path, 2) == 2
    (tmp_path / "checkpoints" / "step_00000002" / "stage_1.pt").write_bytes(b"garbage")
    with pytest.raises(Exception, match="cannot read checkpoint"):
        checkpoint.load_stage(tmp_path, 2, 1)
