"""The schedule as per-stage action lists (mapl_swarm.step.actions), and the in-process driver
that runs them: every order is deadlock-free and gives the bit-identical step."""

from __future__ import annotations

import itertools

import pytest
import torch

from mapl_swarm.step.actions import Action, Op, stage_actions
from mapl_swarm.pipeline.inprocess import InProcessPipeline

from conftest import micro_config


def _simulate(P: int, M: int, order: str, in_flight: int) -> list[tuple[int, Action]]:
    """Run every stage's list as the messages between them allow (an ACT after the upstream forward,
    a GRAD after the downstream backward); the global order, or an assertion on a deadlock."""
    lists = [stage_actions(s, P, M, order=order, in_flight=in_flight) for s in range(P)]
    done = [0] * P
    forwarded, backwarded = set(), set()
    out = []
    while any(done[s] < len(lists[s]) for s in range(P)):
        ran = False
        for s in range(P):
            while done[s] < len(lists[s]):
                a = lists[s][done[s]]
                ready = (s == 0 or (s - 1, a.micro) in forwarded) if a.op is Op.FORWARD else \
                    ((s, a.micro) in forwarded and (s == P - 1 or (s + 1, a.micro) in backwarded))
                if not ready:
                    break
                (forwarded if a.op is Op.FORWARD else backwarded).add((s, a.micro))
                out.append((s, a))
                done[s] += 1
                ran = True
        assert ran, (P, M, order, in_flight, done)
    return out


@pytest.mark.parametrize("P,M,in_flight", [(P, M, f) for P, M, f in itertools.product((1, 2, 3, 4, 6), (1, 2, 3, 5, 8),
                                                                                     (1, 2, 4, 9)) if f <= 2 * P])
@pytest.mark.parametrize("order", ["1f1b", "gpipe"])
def test_every_stage_runs_each_micro_batch_once_in_order_and_the_swarm_never_deadlocks(P, M, in_flight, order):
    for s in range(P):
        acts = stage_actions(s, P, M, order=order, in_flight=in_flight)
        assert [a.micro for a in acts if a.op is Op.FORWARD] == list(range(M))
        assert [a.micro for a in acts if a.op is Op.BACKWARD] == list(range(M))
        for m in range(M):
            assert acts.index(Action(Op.FORWARD, m)) < acts.index(Action(Op.BACKWARD, m))
    _simulate(P, M, order, in_flight)


def test_1f1b_lists_are_the_textbook_ones():
    text = [" ".join(map(str, stage_actions(s, 4, 6))) for s in range(4)]
    assert text == ["F0 F1 F2 F3 B0 F4 B1 F5 B2 B3 B4 B5",
                    "F0 F1 F2 B0 F3 B1 F4 B2 F5 B3 B4 B5",
                    "F0 F1 B0 F2 B1 F3 B2 F4 B3 F5 B4 B5",
                    "F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5"]
    assert " ".join(map(str, stage_actions(1, 4, 3, order="gpipe"))) == "F0 F1 F2 B0 B1 B2"
    with pytest.raises(ValueError, match="unknown pipeline order 'zb'"):
        stage_actions(0, 2, 2, order="zb")


@pytest.mark.parametrize("codec", ["mapl", "mapl_vq", "none"])
def test_the_in_process_driver_gives_the_same_step_in_every_order(codec):
    cfg = micro_config(compression={"codec": codec}, pipeline={"num_stages": 3, "num_micro_batches": 4})
    gen = torch.Generator().manual_seed(0)
    batches = [[torch.randint(0, cfg.model.vocab_size, (2, cfg.model.context_length + 1), generator=gen)
                for _ in range(4)] for _ in range(2)]
    runs = {}
    for order in ("1f1b", "gpipe"):
        torch.manual_seed(0)
        pipe = InProcessPipeline(cfg, order=order)
        losses = [pipe.train_step(b).loss for b in batches]
        runs[order] = (losses, pipe.state_dicts(), [dict(link.bytes) for link in pipe.links])
    (l1, s1, b1), (l2, s2, b2) = runs["1f1b"], runs["gpipe"]
    assert l1 == l2 and b1 == b2  # bit-identical losses, the same bytes on every link
    for a, b in zip(s1, s2):
        for key, value in a["modules"].items():
            assert torch.equal(value, b["modules"][key]), key
