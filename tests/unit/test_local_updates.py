"""``replicas.averaged = "updates"`` (SPEC §9.10 item 16): a replica's own optimizer step of its
compressed matrices, taken aside on shadow copies and committed with the stage's averaged update."""

from __future__ import annotations

import pytest
import torch

from mapl_swarm.errors import NonFiniteError
from mapl_swarm.optim.muon import Muon
from mapl_swarm.pipeline.stage import StageRuntime
from mapl_swarm.replicas.gradients import exact_tensors
from mapl_swarm.replicas.schemes import compressible
from mapl_swarm.replicas.updates import LocalUpdates

from conftest import micro_config


def stage_with_grads(seed: int) -> tuple[StageRuntime, list[int], list[torch.Tensor]]:
    """Stage 1 of a micro pipeline, its compressed matrices (indices) and a gradient for each."""
    torch.manual_seed(0)
    rt = StageRuntime(micro_config(compression={"codec": "mapl"}, optim={"warmup_steps": 1}), 1)
    params = rt.optimized_parameters()
    chosen = list(compressible([tuple(p.shape) for p in params], exact_tensors(rt)))
    gen = torch.Generator().manual_seed(seed)
    return rt, chosen, [torch.randn(params[i].shape, generator=gen) for i in chosen]


def optimizer_state(rt: StageRuntime, chosen: list[int]) -> list[dict]:
    params = rt.optimized_parameters()
    return [{k: v.clone() if torch.is_tensor(v) else v for k, v in opt.state[params[i]].items()}
            for i in chosen for opt in rt.optimizers if params[i] in opt.state]


def plain_step(rt: StageRuntime, chosen: list[int], grads: list[torch.Tensor]) -> list[torch.Tensor]:
    """What the stage's own optimizers change the chosen matrices by, stepping them in place."""
    params = rt.optimized_parameters()
    before = [params[i].detach().clone() for i in chosen]
    for i, g in zip(chosen, grads):
        params[i].grad = g.clone()
    mult = rt.lr_multiplier()
    for opt in rt.optimizers:
        for group in opt.param_groups:
            group["lr"] = group["base_lr"] * mult
        opt.step()
        opt.zero_grad(set_to_none=True)
    return [params[i].detach() - b for i, b in zip(chosen, before)]


def test_an_update_is_the_optimizers_step_taken_aside_and_committed_with_the_average() -> None:
    rt, chosen, grads = stage_with_grads(1)
    twin, _, _ = stage_with_grads(1)
    assert all(torch.equal(p, q) for p, q in zip(rt.optimized_parameters(), twin.optimized_parameters()))
    params = rt.optimized_parameters()
    updates = LocalUpdates(rt.optimizers, [params[i] for i in chosen], rt.stage)
    live = [p.detach().clone() for p in params]
    for step in range(3):  # Muon's momentum and AdamW's moments carry over from commit to commit
        grads = [g * (step + 1) for g in grads]
        got = updates.compute(grads, rt.lr_multiplier())
        assert all(torch.equal(p, q) for p, q in zip(params, live)), "compute changed a live parameter"
        assert len(optimizer_state(rt, chosen)) == (0 if step == 0 else len(chosen)), "compute changed the state"
        again = updates.compute(grads, rt.lr_multiplier())  # a retried round: the same step from the same state
        assert all(torch.equal(a, b) for a, b in zip(got, again))
        want = plain_step(twin, chosen, grads)
        for u, w in zip(got, want):
            torch.testing.assert_close(u, w, rtol=0, atol=1e-7)
        updates.commit(got, step)
        twin_params = twin.optimized_parameters()
        for i in chosen:
            torch.testing.assert_close(params[i], twin_params[i], rtol=0, atol=1e-6)
        for a, b in zip(optimizer_state(rt, chosen), optimizer_state(twin, chosen)):
            assert a.keys() == b.keys()
            for k in a:
                torch.testing.assert_close(torch.as_tensor(a[k]), torch.as_tensor(b[k]), rtol=0, atol=1e-6)
        live = [p.detach().clone() for p in params]
        rt.step_count += 1
        twin.step_count += 1


def test_a_parameter_without_a_gradient_takes_no_step_and_a_non_finite_average_changes_nothing() -> None:
    rt, chosen, grads = stage_with_grads(2)
    params = rt.optimized_parameters()
    updates = LocalUpdates(rt.optimizers, [params[i] for i in chosen], rt.stage)
    got = updates.compute([None, *grads[1:]], rt.lr_multiplier())
    assert not got[0].any() and got[1].abs().sum() > 0
    before = [p.detach().clone() for p in params]
    bad = [u.clone() for u in got]
    bad[1][0, 0] = float("nan")
    with pytest.raises(NonFiniteError, match="stage 1: non-finite values .* the averaged update of a .* at step 4"):
        updates.commit(bad, 4)
    assert all(torch.equal(p, q) for p, q in zip(params, before)) and not optimizer_state(rt, chosen)
    updates.commit(got, 4)
    assert params[chosen[0]] not in next(o for o in rt.optimizers if any(
        p is params[chosen[0]] for g in o.param_groups for p in g["params"])).state
    assert len(optimizer_state(rt, chosen)) == len(chosen) - 1


def test_tensors_no_optimizer_trains_are_refused() -> None:
    rt, _, _ = stage_with_grads(3)
    with pytest.raises(ValueError, match="no optimizer trains the tensors of shapes \\[\\(3, 3\\)\\]"):
        LocalUpdates(rt.optimizers, [torch.zeros(3, 3)], rt.stage)


def test_the_live_optimizers_are_not_touched_while_an_update_is_computed(monkeypatch) -> None:
    """A served state may be read from the live optimizers meanwhile (another thread): the step is
    taken by optimizers of the same kind over the shadows."""
    rt, chosen, grads = stage_with_grads(4)
    params = rt.optimized_parameters()

    def groups() -> list[list[int]]:
        return [[id(p) for p in g["params"]] for opt in rt.optimizers for g in opt.param_groups]

    live, seen, step = groups(), [], Muon.step

    def spy(self: Muon, *args, **kwargs):
        seen.append((self in rt.optimizers, groups(), {id(p) for opt in rt.optimizers for p in opt.state}))
        return step(self, *args, **kwargs)

    monkeypatch.setattr(Muon, "step", spy)
    LocalUpdates(rt.optimizers, [params[i] for i in chosen], rt.stage).compute(grads, 1.0)
    assert seen and all(not ours and now == live and not state for ours, now, state in seen)
