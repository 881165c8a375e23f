"""The step protocol's core (SPEC §9.7, §9.10) in a simulated swarm: every case the slow process tests
reach with real processes (a replica dead mid-step and repaired, a stage-0 replica's death redone, a
death after the round was whole, an unsure all-reduce, a stage's last replica lost, a join, a
re-sync on a digest difference, a validation a replica leaves, a chain's drain), each a scripted
sequence of one seeded interleaving with one fault injected, in milliseconds; and a property test
over random interleavings, topologies and departures: no micro-batch is ever counted twice or lost,
every step is taken once by every live replica with all its tokens."""

from __future__ import annotations

import enum
import logging

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mapl_swarm.step.actions import stage_actions
from mapl_swarm.step.core import Phase

from step_sim import TOKENS, SimSwarm


@pytest.fixture(autouse=True)
def _quiet(caplog):
    caplog.set_level(logging.ERROR, logger="mapl_swarm.step")


class Fault(enum.Enum):
    """What goes wrong, and when (:func:`inject`)."""

    NONE = "none"
    KILL_MID_STEP = "a middle replica dies after its first backward of step 1"
    KILL_STAGE0 = "a stage-0 replica dies while it feeds step 1"
    KILL_AFTER_ROUND = "a middle replica dies once its round of step 1 was whole"
    KILL_LAST = "a last-stage replica dies mid-step"
    UNSURE_ALLREDUCE = "a middle replica's all-reduce of step 1 breaks after it began; its partner keeps the round"
    DIGEST_MISMATCH = "a middle replica holds other parameters at step 1's round"


def inject(sw: SimSwarm, fault: Fault) -> None:
    """Run ``sw`` to the fault's moment, inject it, run to the end."""
    victim = {Fault.KILL_MID_STEP: (1, 1), Fault.KILL_STAGE0: (0, 1), Fault.KILL_AFTER_ROUND: (1, 1),
              Fault.KILL_LAST: (2, 1)}.get(fault)
    peer = sw.peers.get(victim) if victim else None
    if fault in (Fault.KILL_MID_STEP, Fault.KILL_LAST):
        sw.run(until=lambda: any(s == 1 and op == "B" for s, op, *_ in peer.order))
    elif fault is Fault.KILL_STAGE0:
        sw.run(until=lambda: any(s == 1 for s, op, *_ in peer.order))
    elif fault is Fault.KILL_AFTER_ROUND:
        sw.run(until=lambda: peer.core.phase is Phase.COMMIT and peer.core.step == 1)
    elif fault is Fault.UNSURE_ALLREDUCE:
        sw.run(until=lambda: sw.peers[1, 0].core.step == 1)
        sw.rounds[1].unsure_next = True
    elif fault is Fault.DIGEST_MISMATCH:
        sw.run(until=lambda: sw.peers[1, 0].core.step == 1)
        sw.rounds[1].odd = {(1, 1)}
    if victim is not None:
        sw.kill(victim)
    sw.run()


def redone(sw: SimSwarm) -> bool:
    """A step was taken in a later run epoch than 0 somewhere (a redo)."""
    return any(epoch for steps in sw.taken.values() for _, epoch, _ in steps)


def check_run(sw: SimSwarm) -> None:
    """Every live replica took every step once, each with every micro-batch once; stage 0 recorded
    each step's loss once with all its tokens."""
    sw.check_every_micro_batch_once()
    for peer in sw.peers.values():
        if peer.alive:
            assert sw.steps_taken(peer.key) == list(range(sw.steps)), (peer.key, sw.taken[peer.key])
            assert peer.done is not None
            if peer.stage == 0:
                assert [(step, tokens) for step, _, tokens in peer.records] == \
                    [(step, sw.M * TOKENS) for step in range(sw.steps)], peer.records


# ---------------------------------------------------------------------- a chain
@pytest.mark.parametrize("seed", range(4))
def test_a_chain_runs_each_stages_1f1b_list_and_records_every_step(seed):
    sw = SimSwarm((1, 1, 1, 1), replicas=False, M=5, steps=3, seed=seed, val_interval=2)
    sw.run()
    check_run(sw)
    assert not any(code for p in sw.peers.values() for code, _ in p.rejects)
    for (stage, _), peer in sw.peers.items():  # the in-process driver's order, micro-batch for micro-batch
        want = [(a.op.value, a.micro) for a in stage_actions(stage, 4, 5, in_flight=4)]
        for step in range(3):
            assert [(op, m) for s, op, m, *_ in peer.order if s == step] == want
    assert [step for step, _ in sw.peers[0, 0].vals] == [2, 3]  # after step 2 and after the last
    assert all(p.done == {"reason": "training finished"} for p in sw.peers.values())


def test_a_chain_drains_every_stage_at_one_step():
    sw = SimSwarm((1, 1, 1), replicas=False, steps=10)
    sw.drain_at = 2
    sw.run()
    assert all(sw.steps_taken(key) == [0, 1] for key in sw.peers)
    assert all(p.done == {"reason": "drain"} for p in sw.peers.values())


# ---------------------------------------------------------------------- replicas
@pytest.mark.parametrize("initial", [(2, 2, 2), (2, 1, 2), (1, 2, 1), (3, 2, 2, 2)])
def test_replicas_take_every_step_with_the_whole_batch(initial):
    sw = SimSwarm(initial, M=5, val_interval=1)
    sw.run()
    check_run(sw)
    assert not redone(sw) and not sw.lost
    assert all([s for s, _ in p.vals] == [1, 2, 3] for p in sw.peers.values() if p.stage == 0)
    # stage 0's replicas split each step's micro-batches among themselves
    fed = [{m for s, op, m, *_ in sw.peers[0, r].order if op == "F" and s == 0} for r in range(initial[0])]
    assert sorted(m for f in fed for m in f) == list(range(5))


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("fault", [Fault.KILL_MID_STEP, Fault.KILL_LAST])
def test_a_replica_that_dies_mid_step_is_repaired_without_a_redo(fault, seed):
    """What went through it goes again through its partners (the senders kept the bytes); what its
    neighbours downstream took from it is re-run to them and answered with the GRAD they kept, its
    part of their projector gradient going with the live link's. No step is redone."""
    sw = SimSwarm((2, 2, 2), M=4, seed=seed)
    inject(sw, fault)
    check_run(sw)
    assert not redone(sw), {k: v for k, v in sw.taken.items()}
    assert not sw.lost


@pytest.mark.parametrize("seed", range(8))
def test_a_replica_that_dies_after_its_stages_round_was_whole_costs_at_most_a_redo(seed):
    """Its work counts already (its partners hold the round). Its downstream neighbours, whose round may
    not be whole yet, get the re-runs of what they took from it from its partners and answer them with
    the GRADs they kept; a sender whose own round is not whole sends again what went to it, which the
    partners, past their round, do not serve: after the repair's deadline that sender redoes the step.
    Either way each micro-batch counts once."""
    sw = SimSwarm((2, 2, 2), M=4, seed=seed)
    inject(sw, Fault.KILL_AFTER_ROUND)
    check_run(sw)
    assert not sw.lost


@pytest.mark.parametrize("seed", range(6))
def test_a_stage0_replica_that_dies_mid_step_has_the_step_redone_everywhere(seed):
    """Its share of the step's data is read by no other replica: every stage redoes the step (one run
    epoch later) with stage 0's micro-batches split among the replicas left."""
    sw = SimSwarm((2, 2, 2), M=4, seed=seed)
    inject(sw, Fault.KILL_STAGE0)
    check_run(sw)
    assert redone(sw)
    assert all(epoch == 1 for key, steps in sw.taken.items() for step, epoch, _ in steps if step == 1)
    assert {m for s, op, m, *_ in sw.peers[0, 0].order if op == "F" and s == 2} == set(range(4))  # its share whole


@pytest.mark.parametrize("seed", range(4))
def test_an_all_reduce_that_breaks_after_it_began_redoes_the_step(seed):
    """A member that cannot tell whether its partner kept the round redoes the step; saying nothing of
    its commit, it keeps every replica from taking it."""
    sw = SimSwarm((2, 2, 2), M=4, seed=seed)
    inject(sw, Fault.UNSURE_ALLREDUCE)
    check_run(sw)
    assert all(epoch == 1 for key, steps in sw.taken.items() for step, epoch, _ in steps if step == 1)


def test_a_redo_names_the_replica_that_decided_it_wherever_it_is_carried_out():
    """ROUTE ``redo`` carries its maker's proof (SPEC §9.10 item 10), which every peer that passes it
    on or carries it out sends unchanged: the redo a stage-1 replica decided after its all-reduce
    broke names a stage-1 replica on every link it crosses, so a neighbour's credit of redos is
    spent by their maker, never by the peers that merely obeyed."""
    sw = SimSwarm((2, 2, 2), M=4, seed=1)
    inject(sw, Fault.UNSURE_ALLREDUCE)
    check_run(sw)
    assert sw.redo_makers and {m.rsplit("-", 2)[1] for m in sw.redo_makers} == {"1"}, sw.redo_makers


def test_a_replica_holding_other_parameters_loads_a_partners_and_the_step_is_redone():
    sw = SimSwarm((2, 3, 2), M=4)
    sw.run(until=lambda: sw.peers[1, 0].core.step == 1)
    sw.rounds[1].odd = {(1, 1)}
    sw.run()
    check_run(sw)
    assert sw.peers[1, 1].downloads == ["resync"] and sw.peers[1, 0].downloads == sw.peers[1, 2].downloads == []
    assert redone(sw)


def test_a_replica_whose_parameters_stay_other_loads_the_majoritys_from_a_holder_of_it():
    """Three replicas, one holding other parameters until it loads a partner's state: it loads the
    state of a replica holding the stage's digest (never its own kind's), the step is redone."""
    sw = SimSwarm((1, 3, 1), M=3, steps=3)
    sw.run(until=lambda: sw.peers[1, 0].core.step == 1)
    sw.rounds[1].diverged = {(1, 1): "x", (1, 2): "d"}
    sw.run()
    check_run(sw)
    assert sw.peers[1, 1].downloads == ["resync"] and sw.rounds[1].diverged == {(1, 2): "d"}


@pytest.mark.parametrize("seed", range(8))
def test_a_tie_of_two_replicas_holding_other_parameters_is_settled_by_the_next_rounds_draw(seed):
    """Two replicas of a stage hold different parameters for good (one changed its own): the round
    that finds them tied loads nothing; the next round's draw (nonces committed in the tied round)
    picks one digest, the other replica loads it, and the run ends with every step taken once."""
    sw = SimSwarm((1, 2, 1), M=2, steps=4, seed=seed)
    sw.run(until=lambda: sw.peers[1, 0].core.step == 1)
    sw.rounds[1].diverged = {(1, 1): "x"}
    sw.run()
    check_run(sw)
    loaded = [p.key for p in sw.stage_peers(1) if p.downloads]
    assert len(loaded) == 1 and all(len(p.downloads) <= 1 for p in sw.stage_peers(1)), loaded
    assert len(set(sw.rounds[1].diverged.get(p.key, "d") for p in sw.stage_peers(1))) == 1  # equal again
    assert all(epoch == 2 for step, epoch, _ in sw.taken[0, 0] if step == 1)  # tied, then drawn: two redos


def test_a_replica_that_resumed_behind_its_stage_takes_a_current_partners_state():
    """A replica that resumed without the agreed step's file (SPEC §9.10 item 13) says so in the sync
    round: it loads a partner's state (a tie with it is no tie: its digest does not count), and
    nothing is redone."""
    sw = SimSwarm((1, 2, 1), M=4)
    behind = min(sw.stage_peers(1), key=lambda p: p.peer_id)
    behind.core.begin(0, 0, behind=True)
    sw.run()
    check_run(sw)
    assert behind.downloads == ["resync"] and all(p.downloads == [] for p in sw.peers.values() if p is not behind)
    assert not redone(sw)


def _kill_middle_after(sw: SimSwarm, moves: int, found: dict) -> None:
    """Run ``sw`` ``moves`` moves (or to stage 0's step 2), kill middle replica ``(1, seed % 2)``, each
    neighbour finding it gone after ``found[neighbour]`` s, and run to the end."""
    n = [0]

    def until() -> bool:
        n[0] += 1
        return n[0] >= moves or sw.peers[0, 0].core.step >= 2

    sw.run(until=until)
    sw.kill((1, sw.seed % 2), found)
    sw.run()


@pytest.mark.parametrize("seed, moves, found", [
    (0, 110, {(0, 0): 0.06, (2, 0): 0.06}),  # stage 0 still commits step 0 while the others begin step 1
    (0, 95, {(0, 0): 0.05, (2, 0): 3.0}),  # stage 2 finds it gone a step after stage 0 did
])
def test_a_middle_replica_found_gone_at_different_steps_by_its_neighbours_is_not_a_redo(seed, moves, found):
    """The operator's setting (one replica at stages 0 and 2, two at stage 1, two micro-batches): a
    neighbour that finds the dead replica gone a step after the other asks the survivor's word on
    it, and gets it (its upstream said so in an earlier step, or before the survivor began the
    step): no step is redone (issue 45)."""
    sw = SimSwarm((1, 2, 1), M=2, steps=4, seed=seed)
    _kill_middle_after(sw, moves, found)
    check_run(sw)
    assert not redone(sw)


@pytest.mark.parametrize("seed", range(6))
def test_a_middle_replica_that_dies_in_its_round_is_repaired_by_a_sender_waiting_for_the_commit(seed):
    """It died in its averaging round, after every GRAD and PROJ_GRAD of its micro-batches reached
    stage 0, whose own round is whole: stage 0 sends what went through it again (reopen, the kept
    bytes, a fresh end) for its partner's round and awaits nothing of it back (its gradients,
    projector's included, count them already). The partner's round becomes whole: no redo (issue
    45: the operator's kill of a middle replica was redone)."""
    sw = SimSwarm((1, 2, 1), M=2, steps=4, seed=seed)
    victim = sw.peers[1, seed % 2]
    sw.run(until=lambda: victim.core.phase is Phase.AVERAGE and victim.core.step == 1
           and sw.peers[0, 0].core.phase is Phase.COMMIT)
    sw.kill(victim.key, {(0, 0): 0.06, (2, 0): 0.06})
    sw.run()
    check_run(sw)
    assert not redone(sw)


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("found", [{(0, 0): 0.06, (2, 0): 0.06}, {(0, 0): 0.05, (2, 0): 3.0},
                                   {(0, 0): 3.0, (2, 0): 0.05}])
def test_a_middle_replica_killed_at_any_moment_never_stalls_the_swarm(seed, found):
    """Whenever one of two middle replicas dies and whichever neighbour finds it first, the swarm
    finishes with every micro-batch once (repaired, or redone where the survivor's round cannot be
    made whole): a ``ready`` answered ``end`` 0 before a reopen is routed to again, so the re-sends
    never wait for a link that will not say ``ready`` again."""
    for moves in range(5, 200, 8):
        sw = SimSwarm((1, 2, 1), M=2, steps=4, seed=seed)
        _kill_middle_after(sw, moves, found)
        check_run(sw)


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("found", [{(0, 0): 3.0, (0, 1): 0.3, (2, 0): 0.05, (2, 1): 0.3},
                                   {(0, 0): 1.0, (0, 1): 3.0, (2, 0): 0.3, (2, 1): 3.0},
                                   {(0, 0): 3.0, (0, 1): 1.0, (2, 0): 0.3, (2, 1): 1.0}])
def test_a_middle_replica_killed_while_it_serves_is_repaired_whoever_finds_it_when(seed, found):
    """Two replicas at every stage (the slow process test's setting), the middle one killed at any
    moment of a step before its round is whole, each neighbour finding it gone at its own time:
    what it had not passed on comes again through its partner, routed to either next-stage
    replica, so both wait for the partner's word on it (their ``end`` from the dead one came or
    not), and the partner passes a ``reopen`` on before its word: no step is redone (issue 45)."""
    for extra in range(0, 40, 3):
        sw = SimSwarm((2, 2, 2), M=6, steps=4, seed=seed)
        victim = sw.peers[1, seed % 2]
        backwards = [0]

        def until() -> bool:
            backwards[0] += any(s >= 1 and op == "B" for s, op, *_ in victim.order)
            return backwards[0] > extra

        sw.run(until=until)
        if victim.core.phase not in (Phase.SERVE, Phase.FLUSH, Phase.AVERAGE):
            continue  # its round was whole: its partner serves nothing more of the step (at most a redo)
        sw.kill(victim.key, found)
        sw.run()
        check_run(sw)
        assert not redone(sw), (extra, victim.core.phase)


def test_a_stages_last_replica_lost_is_the_peers_a_re_form():
    """A neighbour's death that leaves its stage without a replica is not the core's to repair: it says
    so (the peer pauses and the swarm re-forms from checkpoints, SPEC §9.10 item 10)."""
    sw = SimSwarm((2, 1, 2), M=3)
    sw.run(until=lambda: sw.peers[1, 0].core.step == 1)
    sw.kill((1, 0))
    sw.run(until=lambda: len(sw.lost) == 4)
    assert sorted(sw.lost) == [((0, 0), (1, 0)), ((0, 1), (1, 0)), ((2, 0), (1, 0)), ((2, 1), (1, 0))]


@pytest.mark.parametrize("seed", range(4))
def test_a_replica_joins_downloads_its_stages_state_and_takes_every_step_after(seed):
    sw = SimSwarm((2, 1, 2), M=4, steps=5, seed=seed)
    sw.run(until=lambda: sw.peers[1, 0].core.step == 2)
    joiner = sw.join(1)
    sw.run()
    check_run_from(sw, joiner.key)
    first = sw.steps_taken(joiner.key)[0]
    assert joiner.downloads == ["join"] and 2 <= first <= 3
    assert sw.steps_taken(joiner.key) == list(range(first, 5))
    # the joiner computed micro-batches of the steps after its first (stage 0 routes to it)
    assert any(op == "F" and s > first for s, op, *_ in joiner.order)


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("ticks", [0, 3, 40, 200])
def test_a_replica_that_joins_right_after_a_partner_died_takes_its_place(seed, ticks):
    """Issue 45: a ``--join`` started to replace a killed replica, before its neighbours found it
    gone (0, 3 ticks: they find it after 6) or after (40, 200): the joiner's round waits only for
    the live replicas. Its state's sender named the dead one as a partner (it did not know yet, or
    its list was the last round's); a contact known gone is never waited for, so the stage's rounds
    form and every stage takes every step."""
    sw = SimSwarm((1, 2, 1), M=4, steps=6, seed=seed)
    sw.run(until=lambda: sw.peers[1, 0].core.step == 2)
    sw.kill((1, 1))
    for _ in range(ticks):
        sw.tick()
    joiner = sw.join(1)
    sw.run()
    assert sw.steps_taken((0, 0)) == sw.steps_taken((1, 0)) == sw.steps_taken((2, 0)) == list(range(6))
    first = sw.steps_taken(joiner.key)[0]
    assert joiner.downloads == ["join"] and sw.steps_taken(joiner.key) == list(range(first, 6))
    sw.check_every_micro_batch_once()


def check_run_from(sw: SimSwarm, joiner: tuple[int, int]) -> None:
    sw.check_every_micro_batch_once()
    for peer in sw.peers.values():
        if peer.key != joiner:
            assert sw.steps_taken(peer.key) == list(range(sw.steps)), (peer.key, sw.taken[peer.key])


@pytest.mark.parametrize("victim", [(1, 0), (2, 0), (0, 1)])
def test_a_replica_that_dies_during_a_validation_has_it_served_again(victim):
    """The eval ACTs that went through it go again (its neighbour forwards again what it kept, stage 0
    sends them all again when one of its own neighbours left); the last stage counts each once."""
    sw = SimSwarm((2, 2, 2), M=3, steps=3, val_interval=1, val_batches=3)
    sw.run(until=lambda: sw.peers[0, 0].core.phase is Phase.VALIDATE and sw.peers[0, 0].core.step == 2
           and any(p.inbox.items for p in sw.peers.values() if p.stage == 2))
    sw.kill(victim)
    sw.run()
    check_run(sw)
    survivors = [p for p in sw.peers.values() if p.stage == 0 and p.alive]
    assert all([s for s, _ in p.vals] == [1, 2, 3] for p in survivors)


# ---------------------------------------------------------------------- stopping on purpose
@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("victim", [(1, 1), (0, 1), (2, 0)])
def test_a_signalled_replica_leaves_at_a_step_boundary_and_its_stage_goes_on_without_a_redo(victim, seed):
    """It says so in its stage's next round, takes that round's step and says BYE ``leave``; its
    partners (stage 0: splitting the next step among themselves) and neighbours go on without it, and
    nothing is repaired or redone."""
    sw = SimSwarm((2, 2, 2), M=4, steps=5, seed=seed)
    leaver = sw.peers[victim]
    sw.run(until=lambda: leaver.core.step == 1)
    leaver.core.stopping.stop("SIGTERM")
    sw.run()
    assert leaver.done == {"reason": "leave"}
    left_after = len(sw.taken[victim])
    assert 2 <= left_after < 5 and sw.steps_taken(victim) == list(range(left_after))
    sw.check_every_micro_batch_once()
    assert not redone(sw) and not sw.lost
    for peer in sw.peers.values():
        if peer is not leaver:
            assert sw.steps_taken(peer.key) == list(range(5)) and peer.done == {"reason": "training finished"}
    if victim[0] == 0:  # its partner fed every micro-batch of the steps after
        partner = sw.peers[0, 1 - victim[1]]
        assert {m for s, op, m, *_ in partner.order if op == "F" and s == left_after} == set(range(4))


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("initial,signalled", [((2, 2, 2), "all"), ((2, 1, 2), [(1, 0)]), ((1, 2, 1), [(0, 0)]),
                                              ((2, 2, 2), [(2, 0), (2, 1)])])
def test_a_swarm_with_replicas_drains_every_replica_at_one_step(initial, signalled, seed):
    """A stage none of whose replicas would stay (every one signalled, or its only one) drains the
    swarm: stage 0's replicas stop after one round's step (a later stage asks them first), every
    replica takes exactly the steps before it and ends with BYE ``drain``."""
    sw = SimSwarm(initial, M=3, steps=50, seed=seed)
    keys = list(sw.peers) if signalled == "all" else signalled
    sw.run(until=lambda: all(sw.peers[k].core.step >= 1 for k in keys))
    for key in keys:
        sw.peers[key].core.stopping.stop("SIGINT")
    sw.run()
    taken = {key: sw.steps_taken(key) for key in sw.peers}
    drained_at = len(taken[0, 0])
    assert 2 <= drained_at < 50
    assert all(steps == list(range(drained_at)) for steps in taken.values()), taken
    assert all(p.done == {"reason": "drain"} for p in sw.peers.values())
    sw.check_every_micro_batch_once()
    assert not redone(sw) and not sw.lost


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("stage", [0, 1, 2])
def test_partners_signalled_a_round_apart_drain_the_swarm_instead_of_one_leaving(stage, seed):
    """A Ctrl-C reaches a stage's replicas at about one moment, yet one of them may say ``leave`` a
    round before the other: the first goes only a round later (``going``), so the second's ``leave``
    in that round makes it a drain of the whole swarm, not a leave and then a drain."""
    sw = SimSwarm((2, 2, 2), M=3, steps=50, seed=seed)
    first, second = sw.peers[stage, 0], sw.peers[stage, 1]
    sw.run(until=lambda: first.core.step >= 1)
    first.core.stopping.stop("SIGINT")
    sw.run(until=lambda: first.core.stopping.going)  # a round said its leave and kept a replica
    second.core.stopping.stop("SIGINT")
    sw.run()
    taken = {key: sw.steps_taken(key) for key in sw.peers}
    drained_at = len(taken[0, 0])
    assert all(steps == list(range(drained_at)) for steps in taken.values()), taken
    assert all(p.done == {"reason": "drain"} for p in sw.peers.values())
    sw.check_every_micro_batch_once()
    assert not redone(sw) and not sw.lost


# ---------------------------------------------------------------------- the property
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 2 ** 32 - 1), data=st.data())
def test_no_interleaving_or_departure_counts_a_micro_batch_twice_or_loses_one(seed, data):
    """Random delivery orders, topologies, step sizes, validations and up to one departure per stage
    at random moments: every step is taken once by every live replica with each micro-batch exactly
    once in its gradients, and stage 0 records every step with all its tokens."""
    initial = data.draw(st.sampled_from([(2, 2, 2), (2, 1, 2), (1, 2, 1), (2, 2), (3, 2, 2, 2), (2, 3, 2)]))
    sw = SimSwarm(initial, M=data.draw(st.integers(2, 5)), steps=data.draw(st.integers(2, 4)), seed=seed,
                  in_flight=data.draw(st.sampled_from([None, 1, 2])), val_interval=data.draw(st.integers(0, 2)))
    stages = [s for s, n in enumerate(initial) if n > 1]
    dying = data.draw(st.lists(st.sampled_from(stages), unique=True, max_size=2)) if stages else []
    for stage in dying:
        moment = data.draw(st.integers(10, 1500))
        ticks = [0]

        def later(moment: int = moment) -> bool:
            ticks[0] += 1
            return ticks[0] >= moment

        sw.run(until=later)
        sw.kill((stage, data.draw(st.integers(0, initial[stage] - 1))))
    sw.run()
    check_run(sw)
    assert not sw.lost


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("initial, victim, by", [((2, 2, 2), (1, 1), (0, 0)), ((2, 2, 2), (1, 0), (2, 1)),
                                                 ((1, 2, 1), (1, 1), (0, 0))])
def test_a_live_replica_one_neighbour_takes_for_gone_leaves_and_the_swarm_goes_on(initial, victim, by, seed):
    """A neighbour whose messages from a live replica were held back past its liveness deadline takes
    it for gone, and the swarm follows that word; the replica, told so on that neighbour's link,
    leaves (its other neighbours find it gone as any replica that left) instead of serving on
    while nobody counts its work: every step is taken once by every replica left."""
    for moves in (5, 40, 120):
        sw = SimSwarm(initial, M=4, steps=4, seed=seed)
        ticks = [0]

        def until() -> bool:
            ticks[0] += 1
            return ticks[0] > moves

        sw.run(until=until)
        sw.suspect(victim, by, 0.05)
        sw.run()
        check_run(sw)
        peer = sw.peers[victim]
        assert not peer.alive and peer.left is not None and "gone" in peer.left, (moves, peer.left)
