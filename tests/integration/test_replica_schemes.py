"""Compressed averaging among a stage's replicas (``replicas.averaging``, SPEC §9.10 item 16) through
the real members-only hivemind averagers: two replicas of each stage of a 2-stage MAPL pipeline,
each feeding its share of every step's micro-batches, for 3 steps.

- ``fp16``: every replica of a stage holds the same bytes after each step (the reducers answer in
  fp16 and keep their own part as the partners decode it); the weight matrices' averaged gradients
  are the fp32 ones within fp16's rounding, the projector's and the vectors' exact; a round sends
  about half of fp32's tensor bytes (measured here).
- ``powersgd``: every replica of a stage holds the same bytes after each step; the averaged
  gradients are exactly what :func:`~mapl_swarm.replicas.schemes.emulate` computes in one process
  from the replicas' gradients plus their error feedback (the quality benchmark's emulation runs
  the same arithmetic); the projector's gradient is the exact mean; each replica's error feedback
  is its part of what compression left out, survives ``own_state``/``load_own_state``, and a
  round sends well under a tenth of fp32's bytes.
- ``topk``: every replica of a stage holds the same bytes after each step; the averaged gradient
  of each sparse tensor is the weighted sum of the replicas' top-k shares of their M (computed here
  apart), the exact ones the exact mean; each replica's error feedback is its part of its M less
  its own share.
- ``topk`` and ``powersgd`` with ``averaged = "updates"``: the matrices Muon trains carry each
  replica's own Muon update (recorded here as it is computed); both replicas hold the same averaged
  updates, which are the scheme's average of the replicas' updates plus their error feedback, and
  the same parameters once they are added.
- ``fp32``, ``powersgd``, ``topk``: then a third replica of each stage joins (state download, zero
  feedback, PowerSGD's first factors) and after one more step all three hold the same bytes.
- ``topk`` with a member that claims ten times its micro-batches in its share: its partner's round
  fails naming it, without taking the result it kept.
- an all-reduce that breaks at both replicas: each learns from the other that it broke there too, so
  the round fails at both as one nobody applied (run again, no step redone), the gradients stay
  each replica's own, and the round run again averages them.
"""

from __future__ import annotations

import copy
import functools
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import torch

from mapl_swarm.net.discovery import Discovery, TrustedAuthority
from mapl_swarm.pipeline.stage import StageRuntime
from mapl_swarm.replicas.gradients import exact_tensors
from mapl_swarm.replicas.schemes import compressible, emulate, sparse_decoded, sparse_share, sparse_sum
from mapl_swarm.step.assignment import replica_share

from conftest import micro_config
from test_dht_certified import config, with_bootstrap
from test_replica_gradients import install_projector, params, pipeline_pass, replica_identities

pytestmark = pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated:DeprecationWarning")

RUN = "run-replica-schemes"
M, STEPS = 4, 3
FP32_ROUND_BYTES: dict[int, int] = {}
"""Tensor bytes one replica of each stage sent in an fp32 round (measured by the ``fp32`` case)."""


def filled(g: Any, micro: list[int]) -> list[torch.Tensor]:
    """What replica ``g`` fills into its averaged tensors for a round over ``micro`` (its gradients
    scaled to the whole batch, its step statistics, its error feedback added), computed apart."""
    scale = M / len(micro)
    out = [(p.grad.detach().float() * scale) if p.grad is not None else torch.zeros(p.shape) for p in g.params]
    out += [t.detach().float() * scale for t in g.runtime.step_statistics()]
    if g.errors is not None:
        for e, i in zip(g.errors, g._compressed):
            out[i] = out[i] + e * scale
    return out


def recording(g: Any) -> list[list[torch.Tensor]]:
    """The updates replica ``g``'s own optimizer computes (``averaged = "updates"``), as they come."""
    got: list[list[torch.Tensor]] = []
    compute = g.updates.compute

    def recorded(*args: Any) -> list[torch.Tensor]:
        got.append([u.clone() for u in compute(*args)])
        return got[-1]

    g.updates.compute = recorded
    return got


def step_all(pairs: list, grads: dict) -> None:
    """Every replica adds its averaged updates (``averaged = "updates"``) and steps."""
    for g in grads.values():
        g.apply_updates()
    for first, last in pairs:
        first.step()
        last.step()


def scenario(_bootstrap: Any, maddrs: list[str], ids: dict, scheme: str) -> None:
    from mapl_swarm.replicas.gradients import ReplicaGradients

    scheme, _, carried = scheme.partition("/")
    updating = carried == "updates"
    cfg = micro_config(pipeline={"num_stages": 2, "micro_batch_size": 2, "num_micro_batches": M},
                       compression={"codec": "mapl"},
                       replicas={"averaging": scheme, "averaging_rank": 2, "topk_fraction": 0.02,
                                 "averaged": carried or "gradients"})
    gen = torch.Generator().manual_seed(5)
    data = [[torch.randint(0, 256, (2, 17), generator=gen) for _ in range(M)] for _ in range(STEPS)]
    pairs = [(StageRuntime(cfg, 0), StageRuntime(cfg, 1)) for _ in range(2)]
    discs = {key: Discovery(RUN, config(maddrs), membership=ident).start() for key, ident in ids.items()}
    grads: dict[tuple[int, int], Any] = {}
    try:
        for (stage, r), disc in discs.items():
            if r < 2:
                grads[stage, r] = ReplicaGradients(pairs[r][stage], disc.dht, run_id=RUN, replicas=2)
        updates = {key: recording(g) for key, g in grads.items() if updating}
        with ThreadPoolExecutor(6) as pool:
            for step in range(STEPS):
                shares = {r: [g - step * M for g in replica_share(step, M, r, 2)] for r in range(2)}
                for r, (first, last) in enumerate(pairs):
                    pipeline_pass(first, last, [data[step][g] for g in shares[r]])
                before = {key: filled(g, shares[key[1]]) for key, g in grads.items()}
                feedback = {key: [e.clone() for e in g.errors] for key, g in grads.items()} if updating else {}
                factors = {}
                for stage in (0, 1):
                    g = grads[stage, 0]
                    if g.low_rank is not None:
                        with g.averager.get_tensors() as bufs:
                            factors[stage] = [t.clone() for t in bufs[len(bufs) - len(g.low_rank.matrices):]]
                rounds = dict(zip(grads, pool.map(lambda key: grads[key].average(
                    shares[key[1]], step=step, timeout=60, expected=2), grads)))
                assert all(x.group_size == 2 and x.in_sync for x in rounds.values()), rounds
                for key, g in grads.items() if updating else ():  # M: its own update and its feedback
                    fed = dict(zip(g._compressed, feedback[key]))
                    for u, i in zip(updates[key][-1], g._updated):
                        before[key][i] = u + fed[i] * (M / len(shares[key[1]]))
                for stage in (0, 1):
                    g = grads[stage, 0]
                    if updating:  # the compressed matrices' averaged updates wait for apply_updates
                        assert g._updated and set(g._updated) < set(g._compressed)  # Muon's matrices only
                        assert all(grads[stage, r].params[i].grad is None for r in range(2) for i in g._updated)
                        assert all(torch.equal(a, b) for a, b in zip(g._averaged_updates,
                                                                     grads[stage, 1]._averaged_updates))
                        for u, i in zip(g._averaged_updates, g._updated):
                            g.params[i].grad = u.clone()
                    averaged = [p.grad.clone() for p in g.params]
                    assert all(torch.equal(a, p.grad) for a, p in zip(averaged, grads[stage, 1].params)
                               if p.grad is not None), f"step {step}: stage {stage}: the replicas' averages differ"
                    for i in g._updated if updating else ():
                        g.params[i].grad = None
                    weights = [float(len(shares[r])) for r in range(2)]
                    exact = [sum(before[stage, r][i] * (w / sum(weights)) for r, w in enumerate(weights))
                             for i in range(len(averaged))]
                    if scheme == "fp16":  # weight matrices within float16's rounding, the rest exact
                        matrices = compressible([tuple(a.shape) for a in averaged], exact_tensors(g.runtime))
                        for i, (a, x) in enumerate(zip(averaged, exact)):
                            if i in matrices:
                                torch.testing.assert_close(a, x, rtol=2e-3, atol=1e-5)
                            else:
                                torch.testing.assert_close(a, x, rtol=1e-6, atol=1e-9)
                        assert matrices and len(matrices) < len(averaged)
                    elif scheme == "powersgd":
                        expected = emulate([before[stage, r] for r in range(2)], weights, g.low_rank, factors[stage])
                        for i, (a, x) in enumerate(zip(averaged, expected)):
                            torch.testing.assert_close(a, x, rtol=1e-3, atol=1e-6, msg=f"tensor {i}")
                        for i in g.low_rank.exact(len(averaged)):  # the projector's gradient among them
                            torch.testing.assert_close(averaged[i], exact[i], rtol=1e-5, atol=1e-7)
                        for r in range(2):
                            mine = grads[stage, r]
                            for e, i in zip(mine.errors, mine.low_rank.matrices):
                                torch.testing.assert_close(e, (before[stage, r][i] - averaged[i]) * (weights[r] / M),
                                                           rtol=1e-6, atol=1e-9)
                            assert mine.error_norm > 0
                    elif scheme == "topk":
                        plan = g.sparse
                        for i, a in enumerate(averaged):
                            if i in plan.tensors:
                                k = plan.counts[plan.tensors.index(i)]
                                sent = [(*sparse_share(before[stage, r][i], k), weights[r]) for r in range(2)]
                                # the group's order is hivemind's; a sum of two shares is the same either way
                                torch.testing.assert_close(a, sparse_sum(sent, a), rtol=1e-6, atol=1e-9)
                                for r in range(2):
                                    m = before[stage, r][i]
                                    e = grads[stage, r].errors[plan.tensors.index(i)]
                                    torch.testing.assert_close(e, (m - sparse_decoded(*sparse_share(m, k), m)) *
                                                               (weights[r] / M), rtol=1e-6, atol=1e-9)
                            else:
                                torch.testing.assert_close(a, exact[i], rtol=1e-5, atol=1e-7)
                    sent = rounds[stage, 0].sent_bytes
                    if scheme == "fp32":
                        FP32_ROUND_BYTES[stage] = sent
                    elif stage in FP32_ROUND_BYTES:
                        limit = {"fp16": 0.55, "powersgd": 0.1, "topk": 0.25}[scheme]
                        assert sent <= limit * FP32_ROUND_BYTES[stage], (scheme, sent, FP32_ROUND_BYTES[stage])
                step_all(pairs, grads)
                install_projector(pairs[0][0], [last for _, last in pairs])
                for stage in (0, 1):
                    assert all(torch.equal(x, y) for x, y in zip(params(pairs[0][stage]), params(pairs[1][stage])))
            if scheme == "powersgd":  # a checkpoint's own state: error feedback and factors come back
                g = grads[1, 1]
                saved = copy.deepcopy(g.own_state())
                assert saved["scheme"] == "powersgd" and len(saved["errors"]) == len(g.low_rank.matrices)
                for e in g.errors:
                    e.zero_()
                g.load_own_state(saved)
                assert all(torch.equal(a, b) for a, b in zip(g.errors, saved["errors"]))
                g.load_own_state({"scheme": "fp32", "errors": [], "factors": []})  # another scheme's: from zero
                assert g.error_norm == 0.0
            if scheme != "fp16":  # a third replica of each stage joins: zero feedback, its own factors
                join(cfg, pairs, grads, discs, pool)
    finally:
        for disc in discs.values():
            disc.close()
        for g in grads.values():
            g.shutdown()


def join(cfg: Any, pairs: list, grads: dict, discs: dict, pool: ThreadPoolExecutor) -> None:
    """A third replica of each stage downloads its stage's state and averages one step with the
    others: all three hold the same bytes after it (any warm-start factors give the same round)."""
    from mapl_swarm.replicas.gradients import ReplicaGradients
    from mapl_swarm.replicas.state import prime_optimizers

    joiners = (StageRuntime(cfg, 0), StageRuntime(cfg, 1))
    for stage in (0, 1):
        grads[stage, 2] = g = ReplicaGradients(joiners[stage], discs[stage, 2].dht, run_id=RUN, replicas=3)
        prime_optimizers(joiners[stage].optimizers)
        joiners[stage].load_state_dict(g.averager.download_state(joiners[stage].state_dict(), timeout=20))
        assert g.error_norm == 0.0
    pairs.append(joiners)
    gen = torch.Generator().manual_seed(9)
    data = [torch.randint(0, 256, (2, 17), generator=gen) for _ in range(M)]
    shares = {r: [g - STEPS * M for g in replica_share(STEPS, M, r, 3)] for r in range(3)}
    for r, (first, last) in enumerate(pairs):
        pipeline_pass(first, last, [data[g] for g in shares[r]])
    rounds = list(pool.map(lambda key: grads[key].average(shares[key[1]], step=STEPS, timeout=60, expected=3), grads))
    assert all(x.group_size == 3 and x.in_sync for x in rounds), rounds
    step_all(pairs, grads)
    for stage in (0, 1):
        ref = params(pairs[0][stage])
        assert all(all(torch.equal(x, y) for x, y in zip(ref, params(pair[stage]))) for pair in pairs[1:]), stage


def liar_scenario(_bootstrap: Any, maddrs: list[str], ids: dict) -> None:
    from unittest import mock

    from mapl_swarm.replicas import gradients
    from mapl_swarm.replicas.averaging import StageAverager
    from mapl_swarm.replicas.errors import AveragingFailed

    class Heavier(StageAverager):  # modified peer code: its share outweighs its partner's
        async def _sparse_round(self, *args: Any, weight: float = 1.0, **kwargs: Any) -> Any:
            return await super()._sparse_round(*args, weight=10 * weight, **kwargs)

    Heavier.__name__ = StageAverager.__name__  # hivemind names RPC handlers after the class: the same ones

    cfg = micro_config(pipeline={"num_stages": 2, "micro_batch_size": 2, "num_micro_batches": M},
                       compression={"codec": "mapl"}, replicas={"averaging": "topk", "topk_fraction": 0.02})
    runtimes = [StageRuntime(cfg, 0) for _ in range(2)]
    discs = [Discovery(RUN, config(maddrs), membership=ids[0, r]).start() for r in range(2)]
    grads = []
    try:
        grads.append(gradients.ReplicaGradients(runtimes[0], discs[0].dht, run_id=RUN, replicas=2))
        with mock.patch.object(gradients, "StageAverager", Heavier):
            grads.append(gradients.ReplicaGradients(runtimes[1], discs[1].dht, run_id=RUN, replicas=2))
        gen = torch.Generator().manual_seed(2)
        for rt in runtimes:
            for p in rt.optimized_parameters():
                p.grad = torch.randn(p.shape, generator=gen)
        before = [p.grad.clone() for p in runtimes[0].optimized_parameters()]
        def average(r: int) -> Any:  # as the peer does: a round that formed no group is tried again
            for _ in range(10):
                try:
                    return grads[r].average([2 * r, 2 * r + 1], step=0, timeout=60, expected=2)
                except AveragingFailed as exc:
                    if exc.unsure:
                        raise
            raise AssertionError("no group formed in 10 tries")

        with ThreadPoolExecutor(2) as pool:
            honest, liar = (pool.submit(average, r) for r in range(2))
            with pytest.raises(AveragingFailed, match="after its all-reduce began"):
                honest.result()
            liar.result()  # its own round counted: it summed with the weight it claimed
        assert grads[0].averager.culprits == [grads[1].me]
        assert all(torch.equal(a, p.grad) for a, p in zip(before, runtimes[0].optimized_parameters()))
    finally:
        for disc in discs:
            disc.close()
        for g in grads:
            g.shutdown()


def broken_scenario(_bootstrap: Any, maddrs: list[str], ids: dict) -> None:
    from unittest import mock

    from mapl_swarm.replicas import gradients
    from mapl_swarm.replicas.errors import AveragingFailed

    from test_replica_averaging import breakable

    cfg = micro_config(pipeline={"num_stages": 2, "micro_batch_size": 2, "num_micro_batches": M},
                       compression={"codec": "mapl"})
    runtimes = [StageRuntime(cfg, 0) for _ in range(2)]
    discs = [Discovery(RUN, config(maddrs), membership=ids[0, r]).start() for r in range(2)]
    grads = []
    try:
        with mock.patch.object(gradients, "StageAverager", breakable()):
            grads = [gradients.ReplicaGradients(rt, disc.dht, run_id=RUN, replicas=2)
                     for rt, disc in zip(runtimes, discs)]
        gen = torch.Generator().manual_seed(3)
        for rt in runtimes:
            for p in rt.optimized_parameters():
                p.grad = torch.randn(p.shape, generator=gen)
        before = [[p.grad.clone() for p in rt.optimized_parameters()] for rt in runtimes]

        def average(r: int) -> Any:  # as the peer does: a round that formed no group is tried again
            for _ in range(10):
                try:
                    return grads[r].average([2 * r, 2 * r + 1], step=0, timeout=60, expected=2)
                except AveragingFailed as exc:
                    if exc.unsure or "broke at every member" in str(exc):
                        return exc
            raise AssertionError("no group formed in 10 tries")

        for g in grads:
            g.averager.breaks.value = 1
        with ThreadPoolExecutor(2) as pool:
            failed = list(pool.map(average, range(2)))
        assert all(isinstance(e, AveragingFailed) and not e.unsure for e in failed), failed  # run again, no redo
        for rt, mine in zip(runtimes, before):
            assert all(torch.equal(a, p.grad) for a, p in zip(mine, rt.optimized_parameters()))
        for g in grads:
            g.averager.breaks.value = 0
        with ThreadPoolExecutor(2) as pool:
            rounds = list(pool.map(average, range(2)))
        assert all(not isinstance(r, AveragingFailed) for r in rounds), rounds
        for a, b, x, y in zip(*(rt.optimized_parameters() for rt in runtimes), *before):
            assert torch.equal(a.grad, b.grad) and torch.allclose(a.grad, x + y, atol=1e-5)  # each scaled by M / 2
    finally:
        for disc in discs:
            disc.close()
        for g in grads:
            g.shutdown()


@pytest.mark.timeout(300)
@pytest.mark.parametrize("scheme", ["fp32", "fp16", "powersgd", "topk", "topk/updates", "powersgd/updates"])
def test_compressed_averaging_keeps_replicas_bitwise_equal(tmp_path, monkeypatch, scheme) -> None:
    local, ids = replica_identities(tmp_path / "ids", RUN)
    with_bootstrap(monkeypatch, TrustedAuthority(RUN, local.authority.public),
                   functools.partial(scenario, ids=ids, scheme=scheme))


@pytest.mark.timeout(300)
def test_a_lying_or_broken_member_fails_the_round(tmp_path, monkeypatch) -> None:
    local, ids = replica_identities(tmp_path / "ids", RUN)
    with_bootstrap(monkeypatch, TrustedAuthority(RUN, local.authority.public),
                   functools.partial(liar_scenario, ids=ids))
    with_bootstrap(monkeypatch, TrustedAuthority(RUN, local.authority.public),
                   functools.partial(broken_scenario, ids=ids))
