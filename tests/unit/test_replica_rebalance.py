"""Which stage a replica started without ``--stage`` joins (SPEC §9.10 item 11, SWARM's rebalancing):
the stage of least total capacity among those it may join, by the capacities the replicas publish."""

from __future__ import annotations

from types import SimpleNamespace

from mapl_swarm.replicas.rebalance import pick_stage


def peer(capacity: float | None, contact: str = "tcp://h:1") -> SimpleNamespace:
    return SimpleNamespace(contact=contact, status={} if capacity is None else {"capacity": capacity})


def test_the_stage_of_least_total_capacity_is_joined():
    peers = {0: [peer(900.0), peer(900.0)], 1: [peer(500.0), peer(600.0)], 2: [peer(2000.0)]}
    stage, loads = pick_stage(peers, [0, 1, 2])
    assert stage == 1
    assert [(s.stage, s.replicas, s.capacity) for s in loads] == [(0, 2, 1800.0), (1, 2, 1100.0), (2, 1, 2000.0)]


def test_only_candidates_with_a_live_replica_are_weighed():
    peers = {0: [peer(100.0)], 1: [peer(50.0, contact="")], 2: [peer(400.0)]}
    assert pick_stage(peers, [1, 2])[0] == 2  # stage 1's only record is withdrawn; stage 0 is not allowed
    assert pick_stage(peers, [1]) == (None, [])


def test_a_replica_without_a_capacity_yet_counts_as_the_mean_and_ties_go_to_fewer_replicas():
    stage, loads = pick_stage({0: [peer(None), peer(300.0)], 1: [peer(300.0), peer(300.0)]}, [0, 1])
    assert [s.capacity for s in loads] == [600.0, 600.0]  # the unknown one counts as the mean, 300
    assert stage == 0  # a tie of equal replica counts: the lower stage
    assert pick_stage({0: [peer(300.0), peer(300.0)], 1: [peer(600.0)]}, [0, 1])[0] == 1  # fewer replicas
    assert pick_stage({0: [peer(None)], 1: [peer(None), peer(None)]}, [0, 1])[0] == 0  # nothing known yet
