"""A replica's death mid-run (SPEC §9.10 "Replicas that leave"), as real processes: two replicas of
each of three stages, one replica of the middle stage killed (SIGKILL) once training runs. Its
neighbours find it silent, drop its links and tell its partner; a step it had a part in is redone by
every stage, so each micro-batch counts once per stage: the run ends with every step's tokens and
the losses of one in-process pipeline over the whole batch (``train``), and no survivor pauses
(every one ends ``finished``, none waits for a replacement).

Marked ``slow`` (run with ``-m slow``; ~35-60 s) to keep the default suite's share of the replica
tests within its budget. It used to hang in some runs (a round kept by one member of a pair and
failed at the other; a hivemind round cancelled mid-matchmaking that locked the next); since every
replica's round must be whole for a commit (ROUTE ``taken``), an unsure round redoes the step and
rounds are never cancelled mid-way, it passed every run of the final code (BENCHMARKS.md counts).
With ``mapl_vq`` (codebooks learned per step) the redone step's codebook statistics are dropped with
its gradients, so the codebooks too are those of the whole batch."""

from __future__ import annotations

import re

import pytest

from mapl_swarm.config import load_config
from mapl_swarm.pipeline.trainer import train

from swarm_helpers import ReplicaSwarm, kill_when_logged, train_losses, wait_steps

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]

STEPS = 5
MIDDLE = ((1, 0), (1, 1))
WORKING = re.compile(r"step [1-9] micro-batch \d+ backward \(1 of the step\)")


@pytest.mark.parametrize("codec", ["mapl", "mapl_vq"])
def test_killing_a_middle_replica_mid_run_loses_no_micro_batch_and_counts_none_twice(tmp_path, codec):
    with ReplicaSwarm(tmp_path, f"replica-fail-{codec}", steps=STEPS, identities=[2, 2, 2], codec=codec) as swarm:
        for stage in range(3):
            for r in range(2):
                swarm.start(stage, r, "--set", "net.heartbeat_interval_s=0.5", "--set", "net.liveness_floor_s=5.0",
                            # the middle replicas log their backwards: one is killed amid a step's
                            *(["--log-level", "DEBUG"] if (stage, r) in MIDDLE else []))
        wait_steps(swarm.out, 1, list(swarm.procs.values()), 180)
        # mid-step: the middle replica that ran a backward of a step after the first (its gradients
        # hold a micro-batch the step needs) is killed at once
        survivors = kill_when_logged(swarm.procs, MIDDLE, WORKING, "a backward of step 1 or later at stage 1")
    results = {key: swarm.result(*key) for key in survivors}
    assert all(res["end"] == "finished" for res in results.values())
    # the middle stage's neighbours dropped the dead replica and went on; its partner was told
    for key in ((0, 0), (0, 1), (2, 0), (2, 1)):
        assert "left (silent" in survivors[key].output, survivors[key].output[-3000:]
    # what the dead replica had accumulated was lost: its step ran again everywhere (said by a
    # neighbour it owed GRADs, or that owed it some, on finding it gone, or by a round not whole)
    assert all("runs again in run epoch 1" in p.output for p in survivors.values())
    # what came of the earlier epoch after a survivor moved on was dropped unread, not taken as a
    # message of the redone step (a GRAD of it used to be, and was counted as out of window)
    assert all(res["rejects"].get("out_of_window", 0) == 0 for res in results.values()), \
        {key: res["rejects"] for key, res in results.items()}
    ref = tmp_path / "ref"
    train(load_config(swarm.path, {"run": {"out_dir": str(ref)}}), progress=False)
    for r in range(2):  # every step once, with all its tokens, at the losses of the whole batch
        assert len(results[0, r]["train_losses"]) == STEPS
        assert results[0, r]["tokens"] == STEPS * swarm.cfg.tokens_per_step
        assert results[0, r]["train_losses"] == pytest.approx(train_losses(ref), rel=1e-3)
