"""Replicas check each other's work (issue 46 item 3, SPEC §9.10 item 16), on real hivemind averagers.

Three certified replicas of the middle stage of a 3-stage MAPL pipeline (stages 0 and 2 one
runtime each, in this process) train with ``replicas.check_fraction = 1``: every step each
replica's share is recomputed by both partners from the inputs it took (ACTs and GRADs, asked of
it through the averager's ``work_inputs`` call) and compared with the parts they reduced. Honest
replicas' shares check out; one replica whose share is scaled by −10 before its rounds (modified
code) is found wrong by both partners, excluded by both (its partners' averagers refuse it), and
the two honest replicas average on without it, refusing its calls as a stranger's.
"""

from __future__ import annotations

import functools
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import torch

from mapl_swarm.net.discovery import Discovery, TrustedAuthority
from mapl_swarm.net.identity import issue_local, load_identity
from mapl_swarm.pipeline.stage import StageRuntime
from mapl_swarm.step.assignment import replica_share

from conftest import micro_config
from test_dht_certified import config, with_bootstrap

pytestmark = pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated:DeprecationWarning")

RUN = "run-replica-checks"
M = 6
DISHONEST = 2


def serve_step(step: int, first: StageRuntime, middle: list[StageRuntime], last: StageRuntime,
               batches: list[torch.Tensor], live: list[int]) -> dict[int, list[int]]:
    """Stage 0 -> the live middle replicas (each its share of the step) -> stage 2 and back; the
    micro-batches each live replica took; the PROJ_GRADs to their senders."""
    took = {}
    for i, r in enumerate(live):
        took[r] = [g - step * M for g in replica_share(step, M, i, len(live))]
        for m in took[r]:
            act = first.forward(m, ids=batches[m]).payload
            mid = middle[r].forward(m, payload=act).payload
            last.forward(m, payload=mid)
            first.backward(m, middle[r].backward(m, last.backward(m, origin=str(r))))
        middle[r].add_outbound_projector_grad(last.take_inbound_projector_grad(str(r)))
    first.add_outbound_projector_grad(sum(middle[r].take_inbound_projector_grad() for r in live))
    return took


def scenario(_bootstrap: Any, maddrs: list[str], ids: list) -> None:
    from mapl_swarm.replicas.gradients import ReplicaGradients

    cfg = micro_config(pipeline={"num_stages": 3, "micro_batch_size": 2, "num_micro_batches": M},
                       compression={"codec": "mapl"}, replicas={"enabled": True, "check_fraction": 1.0})
    gen = torch.Generator().manual_seed(5)
    first, last = StageRuntime(cfg, 0), StageRuntime(cfg, 2)
    middle = [StageRuntime(cfg, 1) for _ in range(3)]
    discs = [Discovery(RUN, config(maddrs), membership=ident).start() for ident in ids]
    grads: list[Any] = []
    try:
        for r, disc in enumerate(discs):
            grads.append(ReplicaGradients(middle[r], disc.dht, run_id=RUN, replicas=3))
        peer = [g.me for g in grads]
        live = [0, 1, 2]
        with ThreadPoolExecutor(3) as pool:
            for step in range(5):
                batches = [torch.randint(0, 256, (2, 17), generator=gen) for _ in range(M)]
                took = serve_step(step, first, middle, last, batches, live)
                if DISHONEST in live:
                    for p in grads[DISHONEST].params:  # its share, scaled: the rest of what it sends is honest
                        if p.grad is not None:
                            p.grad.mul_(-10.0)
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
                for r in live:  # each share of the step is checked before the next round gathers the verdicts
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
            # the honest two average on without it: it is refused as a stranger
            live = [0, 1]
            took = serve_step(step + 1, first, middle, last, [torch.randint(0, 256, (2, 17), generator=gen)
                                                              for _ in range(M)], live)
            rounds = dict(zip(live, pool.map(lambda r: grads[r].average(
                took[r], step=step + 1, timeout=60, expected=2), live)))
            assert all(x.group == tuple(sorted(peer[:2])) and x.problem(M) is None for x in rounds.values())
            # and an excluded member's calls are refused as a stranger's
            refused = grads[0].averager.refused["work_inputs"]
            assert grads[DISHONEST].averager.fetch_inputs(peer[0], step, 0, timeout=10) is None
            assert grads[0].averager.refused["work_inputs"] == refused + 1
    finally:
        for disc in discs:
            disc.close()
        for g in grads:
            g.shutdown()


@pytest.mark.timeout(300)
def test_partners_recompute_each_share_and_exclude_a_replica_whose_share_is_not_its_work(tmp_path, monkeypatch) -> None:
    local = issue_local(tmp_path / "ids", run_id=RUN, num_stages=3, replicas=[1, 3, 1])
    ids = [load_identity(local.key_file(1, r), local.cert_file(1, r), run_id=RUN, stage=1) for r in range(3)]
    with_bootstrap(monkeypatch, TrustedAuthority(RUN, local.authority.public), functools.partial(scenario, ids=ids))
