"""A stage's state as replicas exchange it: flattened to a msgpack skeleton and tensors, rebuilt only
when it fits the receiver's own state, and compared by digest."""

from __future__ import annotations

import msgpack
import pytest
import torch

from mapl_swarm.pipeline.stage import StageRuntime
from mapl_swarm.replicas.state import StateMismatch, flatten_state, prime_optimizers, restore_like, state_digest


@pytest.mark.parametrize("codec", ["mapl", "mapl_vq"])
def test_a_fresh_replica_takes_a_trained_replicas_state_and_then_holds_the_same(make_config, codec):
    cfg = make_config(compression={"codec": codec})
    live, fresh = StageRuntime(cfg, 1), StageRuntime(cfg, 1)
    prime_optimizers(live.optimizers)
    with torch.no_grad():
        for i, p in enumerate(live.modules.parameters()):
            p.add_(0.01 * (i + 1))
    live.step_count = 7
    sent = {**live.state_dict(), "data": {"cursor": 41, "epoch": 0}}
    skeleton, tensors = flatten_state(sent)
    skeleton = msgpack.unpackb(msgpack.packb(skeleton))  # what crosses the network: msgpack, no pickle
    assert state_digest(fresh.state_dict()) != state_digest(live.state_dict())

    prime_optimizers(fresh.optimizers)
    got = restore_like(skeleton, [t.clone() for t in tensors], {**fresh.state_dict(), "data": {"cursor": 0, "epoch": 0}})
    fresh.load_state_dict(got)
    assert got["data"] == {"cursor": 41, "epoch": 0} and fresh.step_count == 7
    assert state_digest(fresh.state_dict()) == state_digest(live.state_dict())
    for a, b in zip(live.modules.state_dict().values(), fresh.modules.state_dict().values()):
        assert torch.equal(a, b)


def _pipeline_step(first: StageRuntime, last: StageRuntime, seed: int) -> None:
    """Forward and backward of 2 micro-batches through ``first`` -> ``last``, and the projector
    gradient handed to the sender (what a step's flush does)."""
    gen = torch.Generator().manual_seed(seed)
    for micro in range(2):
        ids = torch.randint(0, 256, (2, 17), generator=gen)
        last.forward(micro, payload=first.forward(micro, ids=ids).payload)
        first.backward(micro, last.backward(micro))
    first.add_outbound_projector_grad(last.take_inbound_projector_grad())


def test_a_joined_sender_steps_its_projector_to_the_same_bits(make_config):
    """SPEL's momentum is laid out as its (transposed) projector; a state that travels contiguous is
    rebuilt in the receiver's layout, so the joined replica's next SPEL step is bitwise the live one's."""
    cfg = make_config(pipeline={"num_stages": 2, "micro_batch_size": 2, "num_micro_batches": 2},
                      compression={"codec": "mapl"})
    live, receiver = StageRuntime(cfg, 0), StageRuntime(cfg, 1)
    _pipeline_step(live, receiver, 0)
    live.step()
    receiver.step()
    receiver.load_inbound_projector(*live.outbound_projector())
    joined = StageRuntime(cfg, 0)
    prime_optimizers(joined.optimizers)
    skeleton, tensors = flatten_state(live.state_dict())
    joined.load_state_dict(restore_like(skeleton, [t.clone() for t in tensors], joined.state_dict()))
    momentum_live, momentum_joined = (next(opt.state[rt.outbound.projector]["momentum_buffer"] for opt in rt.optimizers
                                           if rt.outbound.projector in opt.state) for rt in (live, joined))
    assert not momentum_live.is_contiguous() and momentum_joined.stride() == momentum_live.stride()
    _pipeline_step(live, receiver, 1)
    for p, q in zip(live.optimized_parameters(), joined.optimized_parameters(), strict=True):
        q.grad = None if p.grad is None else p.grad.clone()
    live.step()
    joined.step()
    for (name, p), q in zip(live.modules.named_parameters(), joined.modules.parameters(), strict=True):
        assert torch.equal(p, q), name


def test_a_state_that_does_not_fit_is_refused_naming_where():
    like = {"w": torch.zeros(2, 3), "opt": [{"lr": 0.1, "betas": (0.9, 0.95)}], "step": 3}
    skeleton, tensors = flatten_state(like)
    assert restore_like(skeleton, tensors, like)["opt"][0]["betas"] == (0.9, 0.95)

    def refused(state, tensors=None, match=""):
        sk, ts = flatten_state(state)
        with pytest.raises(StateMismatch, match=match):
            restore_like(sk, ts if tensors is None else tensors, like)

    refused({**like, "w": torch.zeros(3, 2)}, match=r"state\.w: torch.float32 \(3, 2\)")
    refused({**like, "w": torch.zeros(2, 3, dtype=torch.float64)}, match="float64")
    refused({**like, "w": torch.full((2, 3), float("nan"))}, match="not finite")
    refused({"w": like["w"], "opt": like["opt"]}, match="keys")
    refused({**like, "step": 3.0}, match=r"state\.step: a int was expected")
    refused({**like, "opt": [{"lr": 0.1, "betas": [0.9, 0.95]}]}, match="tuple")
    refused({**like, "opt": [{"lr": float("inf"), "betas": (0.9, 0.95)}]}, match="not finite")
    refused(like, tensors=[torch.zeros(2, 3), torch.zeros(10**3)], match="beyond")
    with pytest.raises(StateMismatch, match="not a state node"):
        restore_like(["x"], [], like)
    with pytest.raises(TypeError, match="only tensors"):
        flatten_state({"f": object()})
