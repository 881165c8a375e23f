"""Replicas of each stage of a 2-stage MAPL pipeline, each replica pair feeding its share of every
step's global micro-batches, average their gradients through the real members-only hivemind
averagers and step: every replica of a stage holds the same bytes after each step, and the
replicated run equals one pipeline that processed the whole global batch (the learned projector
included: each sender averages the projector gradient its receivers sent it, and every receiver
installs the same next version). Two pairs train two steps; then a third replica of each stage
joins, downloads its stage's state from a live replica (parameters, optimizer, projector
versions, step), and from its first step holds the others' bytes. A round that cannot make its
step sends no tensor bytes. Before training, a resumed run's round gathers each replica's
checkpoint steps."""

from __future__ import annotations

import functools
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import torch

from mapl_swarm.errors import MaplError
from mapl_swarm.net.discovery import Discovery, TrustedAuthority
from mapl_swarm.net.identity import create_peer_key, issue, issue_local, load_identity, make_request, write_signed
from mapl_swarm.pipeline.stage import StageRuntime
from mapl_swarm.step.assignment import replica_share

from conftest import micro_config
from test_dht_certified import config, with_bootstrap

pytestmark = pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated:DeprecationWarning")

RUN = "run-replica-grads"
M, STEPS = 4, 2


def pipeline_pass(first: StageRuntime, last: StageRuntime, batches: list[torch.Tensor]) -> list[float]:
    """Forward and backward of ``batches`` through one pipeline; the PROJ_GRAD to the sender."""
    losses = []
    for micro, ids in enumerate(batches):
        out = last.forward(micro, payload=first.forward(micro, ids=ids).payload)
        losses.append(float(out.loss))
        first.backward(micro, last.backward(micro))
    g = last.take_inbound_projector_grad()
    if g is not None:
        first.add_outbound_projector_grad(g)
    return losses


def install_projector(first: StageRuntime, receivers: list[StageRuntime]) -> None:
    proj = first.outbound_projector()
    for r in receivers:
        r.load_inbound_projector(*proj)


def params(rt: StageRuntime) -> list[torch.Tensor]:
    return [p.detach().clone() for p in rt.optimized_parameters()]


def train_step(step: int, pairs: list, grads: dict, pool: ThreadPoolExecutor, batches: list[torch.Tensor]) -> list[float]:
    """One step of the replicated pipeline: pair r feeds its share of the global micro-batches, every
    stage's replicas average, every replica steps, every receiver installs the sender's projector."""
    losses = []
    for r, (first, last) in enumerate(pairs):
        share = replica_share(step, M, r, len(pairs))
        losses += pipeline_pass(first, last, [batches[g - step * M] for g in share])
    rounds = list(pool.map(lambda key: grads[key].average([g - step * M for g in replica_share(step, M, key[1],
                                                                                                 len(pairs))],
                                                          step=step, timeout=60, expected=len(pairs)), grads))
    assert all(x.group_size == len(pairs) and x.in_sync for x in rounds), rounds
    for first, last in pairs:
        first.step()
        last.step()
    install_projector(pairs[0][0], [last for _, last in pairs])
    return losses


def scenario(_bootstrap: Any, maddrs: list[str], ids: dict) -> None:
    from mapl_swarm.replicas.gradients import ReplicaGradients
    from mapl_swarm.replicas.state import prime_optimizers, state_digest

    cfg = micro_config(pipeline={"num_stages": 2, "micro_batch_size": 2, "num_micro_batches": M},
                       compression={"codec": "mapl"})
    gen = torch.Generator().manual_seed(3)
    data = [[torch.randint(0, 256, (2, 17), generator=gen) for _ in range(M)] for _ in range(STEPS + 1)]
    ref = (StageRuntime(cfg, 0), StageRuntime(cfg, 1))
    pairs = [(StageRuntime(cfg, 0), StageRuntime(cfg, 1)) for _ in range(3)]
    discs = {key: Discovery(RUN, config(maddrs), membership=ident).start() for key, ident in ids.items()}
    grads = {}
    try:
        # the first two pairs' averagers start before any thread; the joining pair's later, as a joiner's would
        for (stage, r), disc in discs.items():
            if r < 2:
                grads[stage, r] = ReplicaGradients(pairs[r][stage], disc.dht, run_id=RUN, replicas=3)
        with ThreadPoolExecutor(6) as pool:
            # a resumed run's round (SPEC §9.10 item 13): every starting replica of a stage gets each
            # one's usable checkpoint steps and reason; a replica that starts fresh among resuming
            # ones stops both with a message instead of training from another step
            saved = {(0, 0): [2, 4], (0, 1): [4], (1, 0): [2, 4], (1, 1): []}
            why = {(1, 1): "stage 1: written with another config"}
            got = dict(zip(saved, pool.map(lambda key: grads[key].resume_round(
                saved[key], why.get(key, ""), timeout=60, expected=2), saved)))
            for (stage, _), by_peer in got.items():
                assert sorted(by_peer.values()) == sorted((saved[stage, q], why.get((stage, q), "")) for q in (0, 1))
            mixed = [pool.submit(grads[0, 0].resume_round, [4], "", timeout=60, expected=2),
                     pool.submit(grads[0, 1].sync, timeout=60, expected=2)]
            for future in mixed:
                with pytest.raises(MaplError, match="start every replica of the run with --resume, or none"):
                    future.result()
            for step in range(STEPS + 1):
                ref_losses = pipeline_pass(*ref, data[step])
                for rt in ref:
                    rt.step()
                install_projector(ref[0], [ref[1]])
                if step == STEPS:  # a third replica of each stage joins: it downloads its stage's state
                    for stage in (0, 1):
                        joiner = pairs[2][stage]
                        grads[stage, 2] = ReplicaGradients(joiner, discs[stage, 2].dht, run_id=RUN, replicas=3)
                        prime_optimizers(joiner.optimizers)
                        joiner.load_state_dict(grads[stage, 2].averager.download_state(joiner.state_dict(), timeout=20))
                        assert state_digest(joiner.modules.state_dict()) == state_digest(
                            pairs[0][stage].modules.state_dict())
                live = pairs if step == STEPS else pairs[:2]
                losses = train_step(step, live, grads, pool, data[step])
                assert losses == pytest.approx(ref_losses, rel=1e-5)  # the global batch, split among the pairs
                for stage in (0, 1):
                    first = params(live[0][stage])
                    for other in live[1:]:
                        assert all(torch.equal(x, y) for x, y in zip(first, params(other[stage]))), \
                            f"step {step}: stage {stage} replicas differ"
                    for x, y in zip(first, params(ref[stage])):
                        torch.testing.assert_close(x, y, rtol=1e-4, atol=1e-5)
                assert live[-1][0].outbound.version == ref[0].outbound.version == step + 1
            # a round that cannot make its step (micro-batches 0 and 3 in nobody's list, as after a
            # replica left with them) forms, runs no all-reduce and leaves every replica's gradients
            before = {key: [p.grad for p in g.params] for key, g in grads.items()}
            doomed = dict(zip(grads, pool.map(lambda key: grads[key].average(
                [key[1]] if key[1] else [], step=STEPS + 1, timeout=60, expected=3), grads)))
            for key, round_ in doomed.items():
                assert round_.group_size == 3 and "2 missing" in round_.problem(M)
                assert round_.sent_bytes == round_.received_bytes == 0
                assert all(a is b for a, b in zip(before[key], (p.grad for p in grads[key].params)))
    finally:  # the DHT nodes first: an averager gone first leaves its requests in its DHT node's pipe,
        for disc in discs.values():  # which then takes its whole shutdown timeout (15 s) to stop
            disc.close()
        for g in grads.values():
            g.shutdown()


def replica_identities(folder: Any, run_id: str, replicas: int = 3) -> tuple[Any, dict]:
    """A local authority of ``run_id`` with 2 stages and certified identities of ``replicas``
    replicas of each, by (stage, replica)."""
    local = issue_local(folder, run_id=run_id, num_stages=2)
    ids = {}
    for stage in (0, 1):
        ids[stage, 0] = load_identity(local.key_file(stage), local.cert_file(stage), run_id=run_id, stage=stage)
        for r in range(1, replicas):
            name = folder / f"stage{stage}r{r}"
            key = create_peer_key(name.with_suffix(".key"))
            write_signed(name.with_suffix(".cert"), issue(local.authority, make_request(key, name.name, [stage]),
                                                          run_id=run_id, valid_s=3600))
            ids[stage, r] = load_identity(name.with_suffix(".key"), name.with_suffix(".cert"), run_id=run_id,
                                          stage=stage)
    return local, ids


@pytest.mark.timeout(240)
def test_replicas_average_to_the_global_batch_step_stay_bitwise_equal_and_a_joiner_catches_up(tmp_path, monkeypatch) -> None:
    local, ids = replica_identities(tmp_path / "ids", RUN)
    with_bootstrap(monkeypatch, TrustedAuthority(RUN, local.authority.public), functools.partial(scenario, ids=ids))
