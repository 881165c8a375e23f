"""A dial-out replica (``net.reachable = "no"``) in a real multi-process swarm on 127.0.0.1: the
middle stage's second replica announces no address and runs its DHT node and averager in
hivemind's client mode (it leads no group and reduces no part; its partner reduces all of every
round, and reaches it over the connections it opened). With ``fp32`` averaging the swarm trains
to the losses of `mapl-swarm train`; with ``topk`` (whose round asks each member for its sparse
share) the two replicas end with the same parameters, bit for bit; and a dial-out replica joins a
running stage by downloading its partner's state. ``fp32`` is ``slow`` (the default run's budget;
``tests/netns/test_lab_nat.py`` runs it behind a NAT router where the machine allows)."""

import re

import pytest
import torch

from mapl_swarm.config import load_config
from mapl_swarm.launch import replica_out_dir
from mapl_swarm.pipeline.checkpoint import load_stage
from mapl_swarm.pipeline.trainer import train

from swarm_helpers import ReplicaSwarm, train_losses, wait_steps

pytestmark = pytest.mark.timeout(300)

STEPS = 3
DIAL_OUT = ("--set", 'net.reachable="no"')


def _tensors(state, prefix=""):
    if isinstance(state, torch.Tensor):
        return {prefix: state}
    if isinstance(state, dict):
        return {k: v for key, sub in state.items() for k, v in _tensors(sub, f"{prefix}/{key}").items()}
    if isinstance(state, (list, tuple)):
        return {k: v for i, sub in enumerate(state) for k, v in _tensors(sub, f"{prefix}/{i}").items()}
    return {}


@pytest.mark.parametrize("scheme", [pytest.param("fp32", marks=pytest.mark.slow), "topk"])  # fp32: tests/netns too
def test_a_dial_out_replica_averages_with_its_partner(tmp_path, scheme):
    with ReplicaSwarm(tmp_path, f"dialout-replica-{scheme}", steps=STEPS, identities=[1, 2, 1],
                      initial=(1, 2, 1)) as swarm:
        if scheme != "fp32":
            swarm.path.write_text(swarm.path.read_text() + f'averaging = "{scheme}"\ntopk_fraction = 0.05\n')
        for s, r in ((0, 0), (1, 0), (1, 1), (2, 0)):
            swarm.start(s, r, *(DIAL_OUT if (s, r) == (1, 1) else ()))
        for p in swarm.procs.values():
            assert p.wait(240) == 0, p.output[-6000:]
            assert "Traceback" not in p.output
    assert "averaging as a dial-out member" in swarm.procs[1, 1].output
    assert "dial-out member" not in swarm.procs[1, 0].output
    results = {key: swarm.result(*key) for key in swarm.procs}
    assert all(res["end"] == "finished" for res in results.values())
    assert all(results[1, r]["averaging"]["rounds"] >= STEPS for r in range(2)), \
        [results[1, r]["averaging"] for r in range(2)]
    if scheme == "fp32":
        train(load_config(swarm.path, {"run": {"out_dir": str(tmp_path / "ref")}}), progress=False)
        assert results[0, 0]["train_losses"] == pytest.approx(train_losses(tmp_path / "ref"), rel=1e-3)
    _same_states(swarm, STEPS)


def _same_states(swarm: ReplicaSwarm, step: int) -> None:
    """The middle stage's two replicas saved the same parameters and optimizer state at ``step``."""
    states = [load_stage(replica_out_dir(swarm.out, r), step, 1) for r in range(2)]
    flat = [{k: v for k, v in _tensors(st).items() if not k.startswith(("/rng", "/averaging/errors"))}
            for st in states]
    assert flat[0].keys() == flat[1].keys()
    assert all(torch.equal(flat[0][k], flat[1][k]) for k in flat[0])


def test_a_dial_out_replica_joins_a_running_stage_by_state_download(tmp_path):
    """The middle stage starts with one replica; once a step is recorded a second one joins
    dialing out: it downloads the stage's state from its partner and averages every later step
    with it, so the two end with the same parameters and the losses stay `train`'s."""
    steps = 30  # the joiner takes seconds to start: the swarm must still be training then
    with ReplicaSwarm(tmp_path, "dialout-join", steps=steps, identities=[1, 2, 1], initial=(1, 1, 1)) as swarm:
        for s in range(3):
            swarm.start(s, 0)
        wait_steps(swarm.out, 1, list(swarm.procs.values()), 180)
        swarm.start(1, 1, "--join", *DIAL_OUT)
        for p in swarm.procs.values():
            assert p.wait(240) == 0, p.output[-6000:]
    joined = re.search(r"joined stage 1 at step (\d+)", swarm.procs[1, 1].output)
    assert joined and "averaging as a dial-out member" in swarm.procs[1, 1].output, swarm.procs[1, 1].output[-3000:]
    results = {key: swarm.result(*key) for key in swarm.procs}
    assert results[1, 1]["averaging"]["rounds"] == steps - int(joined.group(1)), results[1, 1]["averaging"]
    train(load_config(swarm.path, {"run": {"out_dir": str(tmp_path / "ref")}}), progress=False)
    assert results[0, 0]["train_losses"] == pytest.approx(train_losses(tmp_path / "ref"), rel=1e-3)
    _same_states(swarm, steps)
