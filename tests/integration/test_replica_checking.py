"""Replicas check each other's work (issue 46 item 3, SPEC §9.10 item 15), on real hivemind averagers.

Three certified replicas of the middle stage of a 3-stage MAPL pipeline (stages 0 and 2 one
runtime each, in this process, signing every ACT and GRAD as their links do) train with
``replicas.check_fraction = 1``: every step each replica's share is recomputed by both partners
from the inputs it took (ACTs and GRADs with their senders' signatures, asked of it through the
averager's ``work_inputs`` call) and compared with the parts they reduced. Honest replicas' shares
check out. One replica runs modified code: its share is scaled by −10 before its rounds; or its
share is scaled and the GRADs it hands its checkers too, so that they recompute its share as it
sent it; or its share is honest but the ACTs it passes on are doubled. The scaled share, the GRADs
its neighbour never signed, or the ACTs its inputs do not give are found out by both partners,
which exclude it (their averagers refuse it), and the two honest replicas average on without it,
refusing its calls as a stranger's.
"""

from __future__ import annotations

import functools
import logging
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import torch

from mapl_swarm.net.discovery import Discovery, TrustedAuthority
from mapl_swarm.net.identity import issue_local, load_identity
from mapl_swarm.pipeline.tensors import to_wire
from mapl_swarm.pipeline.payload import ACT_WIRE, GRAD_WIRE
from mapl_swarm.pipeline.stage import StageRuntime
from mapl_swarm.step.assignment import replica_share
from mapl_swarm.wire.message import payload_digest

from conftest import micro_config
from test_dht_certified import config, with_bootstrap

pytestmark = pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated:DeprecationWarning")

RUN = "run-replica-checks"
M = 6
DISHONEST = 2


def proof(identity: Any, kind: str, step: int, micro: int, payload: dict[str, torch.Tensor]) -> dict[str, bytes]:
    """What the sender's link signs of a train ACT or GRAD (SPEC §9.10 item 15)."""
    wire = ACT_WIRE if kind == "ACT" else GRAD_WIRE
    digest = payload_digest({wire[k]: to_wire(t.contiguous()) for k, t in payload.items()})
    return {"cert": identity.encoded_cert, "sig": identity.sign_work(kind, step, micro, digest)}


def serve_step(step: int, first: StageRuntime, middle: list[StageRuntime], last: StageRuntime,
               batches: list[torch.Tensor], live: list[int], signers: tuple[Any, Any],
               doubled: int | None = None) -> dict[int, list[int]]:
    """Stage 0 -> the live middle replicas (each its share of the step) -> stage 2 and back, the
    ACTs and GRADs signed by ``signers`` (stage 0's and stage 2's identities); the micro-batches
    each live replica took; the PROJ_GRADs to their senders. ``doubled``: that replica doubles the
    ACTs it passes on (what it keeps of them too)."""
    took = {}
    for i, r in enumerate(live):
        took[r] = [g - step * M for g in replica_share(step, M, i, len(live))]
        for m in took[r]:
            act = first.forward(m, ids=batches[m]).payload
            mid = middle[r].forward(m, payload=act, proof=proof(signers[0], "ACT", step, m, act)).payload
            if r == doubled:
                mid["act"].mul_(2)
            last.forward(m, payload=mid)
            grad = last.backward(m, origin=str(r))
            first.backward(m, middle[r].backward(m, grad, proof=proof(signers[1], "GRAD", step, m, grad)))
        middle[r].add_outbound_projector_grad(last.take_inbound_projector_grad(str(r)))
    first.add_outbound_projector_grad(sum(middle[r].take_inbound_projector_grad() for r in live))
    return took


def pipeline(check_fraction: float) -> tuple[StageRuntime, list[StageRuntime], StageRuntime]:
    """Stage 0, three replicas of stage 1 and stage 2 of a 3-stage MAPL run that checks at ``check_fraction``."""
    cfg = micro_config(pipeline={"num_stages": 3, "micro_batch_size": 2, "num_micro_batches": M},
                       compression={"codec": "mapl"}, replicas={"enabled": True, "check_fraction": check_fraction})
    return StageRuntime(cfg, 0), [StageRuntime(cfg, 1) for _ in range(3)], StageRuntime(cfg, 2)


def close(discs: list[Any], grads: list[Any]) -> None:
    """The DHT nodes first: an averager gone first leaves its requests in its node's pipe."""
    for disc in discs:
        disc.close()
    for g in grads:
        g.shutdown()


def run(tmp_path: Any, patch: Any, scenario_fn: Any, **kwargs: Any) -> None:
    """``scenario_fn`` with the three stage-1 replicas' identities (``ids``) and stages 0's and 2's
    (``signers``), inside a certified bootstrap node."""
    local = issue_local(tmp_path / "ids", run_id=RUN, num_stages=3, replicas=[1, 3, 1])
    ids = [load_identity(local.key_file(1, r), local.cert_file(1, r), run_id=RUN, stage=1) for r in range(3)]
    signers = tuple(load_identity(local.key_file(s), local.cert_file(s), run_id=RUN, stage=s) for s in (0, 2))
    with_bootstrap(patch, TrustedAuthority(RUN, local.authority.public),
                   functools.partial(scenario_fn, ids=ids, signers=signers, **kwargs))


def scenario(_bootstrap: Any, maddrs: list[str], ids: list, signers: tuple[Any, Any], attack: str,
             caplog: Any) -> None:
    from mapl_swarm.replicas.gradients import ReplicaGradients

    first, middle, last = pipeline(1.0)
    gen = torch.Generator().manual_seed(5)
    discs = [Discovery(RUN, config(maddrs), membership=ident).start() for ident in ids]
    grads: list[Any] = []
    try:
        for r, disc in enumerate(discs):
            grads.append(ReplicaGradients(middle[r], disc.dht, run_id=RUN, replicas=3, identity=ids[r]))
        peer = [g.me for g in grads]
        live = [0, 1, 2]
        with ThreadPoolExecutor(3) as pool:
            for step in range(5):
                batches = [torch.randint(0, 256, (2, 17), generator=gen) for _ in range(M)]
                took = serve_step(step, first, middle, last, batches, live, signers,
                                  DISHONEST if attack == "act" and DISHONEST in live else None)
                if DISHONEST in live and attack != "act":
                    for p in grads[DISHONEST].params:  # its share, scaled: the rest of what it sends is honest
                        if p.grad is not None:
                            p.grad.mul_(-10.0)
                    if attack == "share-and-inputs":  # and the GRADs it hands over, to match (unsigned)
                        for kept in middle[DISHONEST]._inputs.values():
                            kept["bwd"]["grad"] = kept["bwd"]["grad"] * -10
                rounds = dict(zip(live, pool.map(lambda r: grads[r].average(
                    took[r], step=step, timeout=60, expected=len(live)), live)))
                assert all(x.group_size == len(live) and x.problem(M) is None for x in rounds.values()), rounds
                for r in live:
                    middle[r].step()
                first.step()
                last.step()
                proj = first.outbound_projector()
                for r in range(3):
                    middle[r].load_inbound_projector(*proj)
                last.load_inbound_projector(*middle[0].outbound_projector())
                for r in (0, 1):  # each honest check of the step ends before the next round gathers the verdicts
                    assert grads[r].checker.settled(60)
                if any(grads[r].excluded for r in live if r != DISHONEST):
                    break
            # both honest replicas excluded the dishonest one, in the same round, each naming the other
            # as an accuser; nobody found an honest share wrong
            assert step <= 3, step
            for r in (0, 1):
                assert [(p, accusers) for p, _contact, _step, accusers in grads[r].take_excluded()] == \
                    [(peer[DISHONEST], frozenset({peer[0], peer[1]}))]
                assert grads[r].checker.counters["shares_wrong"] >= 1
                assert grads[r].checker.counters["shares_checked"] > grads[r].checker.counters["shares_wrong"]
                for s in range(step + 1):
                    assert not grads[r].accusations.accusers(peer[1 - r], s)
            # what found it out: the recomputation, or (its GRADs forged to match) their signatures
            found = [r.getMessage() for r in caplog.records
                     if "is not its work" in r.getMessage() and peer[DISHONEST] in r.getMessage()]
            why = {"share": "of the recomputation's norm away", "share-and-inputs": "is not what a member of stage 2 "
                   "signed", "act": "the ACT it passed on for micro-batch"}[attack]
            assert found and all(why in m for m in found), found
            # the honest two average on without it: it is refused as a stranger
            live = [0, 1]
            took = serve_step(step + 1, first, middle, last, [torch.randint(0, 256, (2, 17), generator=gen)
                                                              for _ in range(M)], live, signers)
            rounds = dict(zip(live, pool.map(lambda r: grads[r].average(
                took[r], step=step + 1, timeout=60, expected=2), live)))
            assert all(x.group == tuple(sorted(peer[:2])) and x.problem(M) is None for x in rounds.values())
            # and an excluded member's calls are refused as a stranger's
            refused = grads[0].averager.refused["work_inputs"]
            assert grads[DISHONEST].averager.fetch_inputs(peer[0], step, 0, timeout=10) is None
            assert grads[0].averager.refused["work_inputs"] == refused + 1
    finally:
        close(discs, grads)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("attack", ["share", "share-and-inputs", "act"])
def test_partners_recompute_each_share_and_exclude_a_replica_whose_share_is_not_its_work(
        tmp_path, monkeypatch, caplog, attack) -> None:
    # the checkers' findings are logged: captured whatever level an earlier in-process peer set
    with caplog.at_level(logging.INFO, logger="mapl_swarm.replicas.checker"):
        run(tmp_path, monkeypatch, scenario, attack=attack, caplog=caplog)


def breaking_scenario(_bootstrap: Any, maddrs: list[str], ids: list, signers: tuple[Any, Any],
                      monkeypatch: Any) -> None:
    """Replica 2's averager joins every group and sends none of its parts (modified code): each
    round's all-reduce breaks at its partners (its parts time out), who exclude it at the second
    in a row and then average without it."""
    import mapl_swarm.replicas.gradients as gradients_module
    from mapl_swarm.replicas.averaging import StageAverager
    from mapl_swarm.replicas.errors import AveragingFailed

    class Silent(StageAverager):
        async def _run_allreduce_inplace_(self, tensors: Any, group_info: Any, group_id: Any = None,
                                          **kwargs: Any) -> None:
            raise ConnectionError("sends no part (on purpose)")

    Silent.__name__ = StageAverager.__name__  # hivemind names the RPC handlers after the class

    first, middle, last = pipeline(0.01)
    gen = torch.Generator().manual_seed(6)
    discs = [Discovery(RUN, config(maddrs), membership=ident).start() for ident in ids]
    grads: list[Any] = []
    try:
        for r, disc in enumerate(discs):
            with monkeypatch.context() as patch:
                if r == DISHONEST:
                    patch.setattr(gradients_module, "StageAverager", Silent)
                grads.append(gradients_module.ReplicaGradients(middle[r], disc.dht, run_id=RUN, replicas=3,
                                                               identity=ids[r], next_chunk_timeout=3.0))
        peer = [g.me for g in grads]
        batches = [torch.randint(0, 256, (2, 17), generator=gen) for _ in range(M)]
        with ThreadPoolExecutor(3) as pool:
            for attempt in range(2):  # the step, and its redo: each round's all-reduce breaks
                for rt in middle:
                    rt.abandon_step()
                took = serve_step(0, first, middle, last, batches, [0, 1, 2], signers)
                futures = [pool.submit(grads[r].average, took[r], step=0, epoch=attempt, timeout=60, expected=3)
                           for r in range(3)]
                for f in futures:
                    with pytest.raises(AveragingFailed):
                        f.result()
                assert all(not grads[r].excluded for r in (0, 1)) == (attempt == 0)
            for r in (0, 1):
                assert [(p, s) for p, _c, s, _a in grads[r].take_excluded()] == [(peer[DISHONEST], 0)]
            # the honest two average without it
            for rt in middle:
                rt.abandon_step()
            took = serve_step(0, first, middle, last, batches, [0, 1], signers)
            rounds = list(pool.map(lambda r: grads[r].average(took[r], step=0, epoch=2, timeout=60, expected=2),
                                   (0, 1)))
            assert all(x.group == tuple(sorted(peer[:2])) and x.problem(M) is None for x in rounds)
    finally:
        close(discs, grads)


@pytest.mark.timeout(300)
def test_a_replica_that_breaks_its_stages_all_reduce_twice_in_a_row_is_excluded(tmp_path, monkeypatch) -> None:
    run(tmp_path, monkeypatch, breaking_scenario, monkeypatch=monkeypatch)
