"""A NaN/Inf in a stage's own compute is never applied, sent or checkpointed (issue 12, item 4).

The stage checks the step's training losses and its gradients' total norm with one host sync
before the optimizer step, and the peer checks every tensor it is about to send on its host copy;
either raises :class:`NonFiniteError` (exit status 3) naming the step and the tensor.
"""

import pytest
import torch

from mapl_swarm import cli
from mapl_swarm.config import config_from_dict
from mapl_swarm.errors import MaplError, NonFiniteError
from mapl_swarm.peer.host import HostRuntime
from mapl_swarm.pipeline.stage import StageRuntime, check_finite
from mapl_swarm.pipeline.trainer import train

from conftest import micro_config


def _params(rt: StageRuntime) -> list[torch.Tensor]:
    return [p.detach().clone() for p in rt.optimized_parameters()]


def _unchanged(rt: StageRuntime, before: list[torch.Tensor]) -> bool:
    return all(torch.equal(a, b.detach()) for a, b in zip(before, rt.optimized_parameters(), strict=True))


def test_nan_gradient_stops_the_step_before_any_update_and_names_the_parameter():
    cfg = micro_config(pipeline={"num_stages": 2, "micro_batch_size": 2, "num_micro_batches": 1})
    first, last = StageRuntime(cfg, 0), StageRuntime(cfg, 1)
    ids = torch.randint(0, 256, (2, 17))
    res = first.forward(0, ids=ids)
    last.forward(0, payload=res.payload)
    grad = last.backward(0)
    first.backward(0, grad)
    name, param = next(iter(first.model.named_parameters()))
    param.grad[0].fill_(float("nan"))
    before = _params(first)
    with pytest.raises(NonFiniteError, match=rf"stage 0: non-finite .* gradient of model\.{name} at step 0") as err:
        first.step()
    assert err.value.exit_code == 3 and err.value.step == 0
    assert _unchanged(first, before) and first.step_count == 0  # nothing applied
    assert all(not opt.state for opt in first.optimizers)


def test_nan_loss_stops_the_last_stage_before_its_step():
    cfg = micro_config(pipeline={"num_stages": 2, "micro_batch_size": 2, "num_micro_batches": 2})
    first, last = StageRuntime(cfg, 0), StageRuntime(cfg, 1)
    before = _params(last)
    for micro in range(2):
        res = first.forward(micro, ids=torch.randint(0, 256, (2, 17)))
        if micro == 1:
            res.payload["act"][0, 0, 0] = float("inf")  # a bad activation: inf/NaN loss and gradients
        out = last.forward(micro, payload=res.payload)
        last.backward(micro)
    assert not torch.isfinite(out.loss)
    with pytest.raises(NonFiniteError, match=r"stage 1: .* in the loss of micro-batch 1 at step 0"):
        last.step()
    assert _unchanged(last, before)


def test_finite_steps_keep_their_grad_norm_metric():
    cfg = micro_config(pipeline={"num_stages": 1, "micro_batch_size": 2, "num_micro_batches": 1},
                       optim={"grad_clip_norm": 1.0})
    rt = StageRuntime(cfg, 0)
    rt.forward(0, ids=torch.randint(0, 256, (2, 17)))
    rt.backward(0)
    expected = float(torch.nn.utils.get_total_norm([p.grad for p in rt.optimized_parameters()
                                                    if p.grad is not None]))
    metrics = rt.step()
    assert metrics["grad_norm"] == pytest.approx(expected, rel=1e-6) and rt.step_count == 1


def test_outgoing_payloads_are_checked_on_the_host_before_they_are_sent():
    check_finite({"ids": torch.tensor([1, 2], dtype=torch.int32), "z": torch.ones(3)}, stage=0, step=0, what="x")
    with pytest.raises(NonFiniteError, match=r"stage 2: .* in the ACT tensor 'z' at step 7"):
        check_finite({"z": torch.tensor([0.0, float("nan")], dtype=torch.bfloat16)}, stage=2, step=7, what="the ACT")
    cfg = micro_config(pipeline={"num_stages": 2, "micro_batch_size": 2, "num_micro_batches": 1})
    rt = StageRuntime(cfg, 0)
    with torch.no_grad():
        next(rt.model.parameters()).fill_(float("nan"))
    with pytest.raises(NonFiniteError, match=r"stage 0: .* the ACT of micro-batch 3 tensor 'act' at step 0"):
        HostRuntime(rt).forward(3, ids=torch.randint(0, 256, (2, 17)))


def test_in_process_training_stops_with_the_error_and_checkpoints_nothing_non_finite(tmp_path, monkeypatch):
    cfg = config_from_dict({
        "model": {"vocab_size": 320, "hidden_size": 32, "num_layers": 2, "num_heads": 2,
                  "ffn_hidden_size": 64, "context_length": 16},
        "compression": {"codec": "mapl", "rank": 8, "anchor_rank": 8},
        "data": {"source": "stdlib", "vocab_size": 320, "max_corpus_bytes": 60_000, "val_fraction": 0.2,
                 "cache_dir": str(tmp_path / "cache")},
        "run": {"steps": 5, "out_dir": str(tmp_path / "run")},
        "pipeline": {"num_stages": 2, "micro_batch_size": 2, "num_micro_batches": 2},
        "eval": {"interval_steps": 0, "batches": 1},
        "checkpoint": {"interval_steps": 1},
    })
    forward = StageRuntime.forward

    def poisoned(self, micro, **kw):  # stage 1's weights turn NaN during step 2
        if self.stage == 1 and self.step_count == 2 and micro == 1:
            with torch.no_grad():
                next(self.model.parameters()).fill_(float("nan"))
        return forward(self, micro, **kw)

    monkeypatch.setattr(StageRuntime, "forward", poisoned)
    with pytest.raises(NonFiniteError, match=r"stage [01]: .* at step 2"):
        train(cfg, progress=False)
    ckpts = tmp_path / "run" / "checkpoints"
    assert sorted(d.name for d in ckpts.glob("step_*")) == ["step_00000001", "step_00000002"]  # 2 steps done
    for f in ckpts.glob("step_*/stage_*.pt"):
        state = torch.load(f, weights_only=False)
        assert all(torch.isfinite(t).all() for t in state["modules"].values() if t.is_floating_point()), f


def test_cli_exits_with_status_3_on_a_non_finite_error(monkeypatch, capsys):
    def boom(args):
        raise NonFiniteError(stage=1, step=4, tensor="the loss of micro-batch 0")

    parser = cli.build_parser()
    monkeypatch.setattr(cli, "build_parser", lambda: parser)
    parser.set_defaults(func=boom)
    for action in parser._subparsers._group_actions[0].choices.values():  # every subcommand
        action.set_defaults(func=boom)
    assert cli.main(["train", "--config", "x.toml"]) == 3
    assert "stage 1: non-finite values (NaN/Inf) in the loss of micro-batch 0 at step 4" in capsys.readouterr().err
    assert MaplError("x").exit_code == 2
