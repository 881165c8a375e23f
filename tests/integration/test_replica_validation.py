"""A replica that dies during a validation (SPEC §9.10 item 8), as real processes: two replicas of
each of three stages validate every 2 steps over 96 eval micro-batches; the middle replica that
forwards them is killed (SIGKILL) at its first. What went through it is lost, so once its
neighbours find it silent the stage-0 replica of rank 0 sends the validation again, on the link of
the middle replica left; the last stage counts each eval micro-batch once. The run goes on: every
survivor ends ``finished``, and the train and validation losses are those of one in-process
pipeline (``train``). Marked ``slow`` (~40-60 s)."""

from __future__ import annotations

import json
import re

import pytest

from mapl_swarm.config import load_config
from mapl_swarm.pipeline.trainer import train

from swarm_helpers import ReplicaSwarm, kill_when_logged, train_losses, wait_steps

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]

STEPS, EVAL_BATCHES = 4, 96
MIDDLE = ((1, 0), (1, 1))
FORWARDING = re.compile(r"eval micro-batch \d+ of the validation after step 2 forwarded")


def test_a_replica_dying_during_a_validation_has_it_sent_again_and_the_run_goes_on(tmp_path):
    evals = ("--set", "eval.interval_steps=2", "--set", f"eval.batches={EVAL_BATCHES}")
    with ReplicaSwarm(tmp_path, "replica-val", steps=STEPS, identities=[2, 2, 2]) as swarm:
        for stage in range(3):
            for r in range(2):
                swarm.start(stage, r, *evals, "--set", "net.heartbeat_interval_s=0.5",
                            "--set", "net.liveness_floor_s=5.0",
                            *(["--log-level", "DEBUG"] if (stage, r) in MIDDLE else []))
        wait_steps(swarm.out, 1, list(swarm.procs.values()), 180)
        survivors = kill_when_logged(swarm.procs, MIDDLE, FORWARDING, "an eval ACT of the validation after step 2 "
                                                                      "at stage 1")
    results = {key: swarm.result(*key) for key in survivors}
    assert all(res["end"] == "finished" for res in results.values())
    assert any("its eval ACTs go again" in survivors[0, r].output for r in range(2)), survivors[0, 0].output[-3000:]
    ref = tmp_path / "ref"
    train(load_config(swarm.path, {"run": {"out_dir": str(ref)},
                                   "eval": {"interval_steps": 2, "batches": EVAL_BATCHES}}), progress=False)
    records = [json.loads(line) for line in (ref / "metrics.jsonl").read_text().splitlines()]
    ref_val = [(r["step"], r["val_loss"]) for r in records if "val_loss" in r and r["step"] > 0]
    for r in range(2):
        assert results[0, r]["tokens"] == STEPS * swarm.cfg.tokens_per_step
        assert results[0, r]["train_losses"] == pytest.approx(train_losses(ref), rel=1e-3)
        got = results[0, r]["val_history"]
        assert [s for s, _ in got] == [s for s, _ in ref_val] == [2, 4], (got, ref_val)
        assert [v for _, v in got] == pytest.approx([v for _, v in ref_val], rel=1e-3)
