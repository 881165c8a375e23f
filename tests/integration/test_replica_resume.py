"""A run with replicas resumes (SPEC §9.10 item 13), as real processes: two replicas of each of two
stages train 3 steps, each saving its own checkpoints; one replica loses its newest file; the
swarm started again with ``--resume`` and ``run.steps = 5`` agrees on the newest step every
replica holds (2), every replica loads its own file of it, and steps 3..5 equal those of one
uninterrupted in-process run."""

from __future__ import annotations

import json

import pytest

from mapl_swarm.config import load_config
from mapl_swarm.launch import launch, replica_out_dir
from mapl_swarm.pipeline.checkpoint import stage_steps
from mapl_swarm.pipeline.trainer import train

from swarm_helpers import train_losses, write_config

pytestmark = pytest.mark.timeout(300)


def test_replicas_resume_from_the_newest_step_every_replica_holds(tmp_path):
    out = tmp_path / "swarm"
    path = write_config(tmp_path / "r.toml", codec="mapl", stages=2, steps=3, cache=tmp_path / "cache", out=out,
                        run_id="replica-resume")
    text = path.read_text().replace("[eval]\n", "[checkpoint]\ninterval_steps = 1\n\n[eval]\n")
    path.write_text(text + "\n[replicas]\nenabled = true\ninitial = [2, 2]\nmatchmaking_s = 1.0\n")
    launch(load_config(path), ["--config", str(path)], progress=False, timeout_s=240)
    for s in range(2):
        for r in range(2):
            assert stage_steps(replica_out_dir(out, r), s) == [1, 2, 3], (s, r)
    lost = replica_out_dir(out, 1) / "checkpoints" / "step_00000003" / "stage_1.pt"
    lost.unlink()  # the second replica of stage 1 lost its newest checkpoint: step 2 is the newest all hold

    more = ["--set", "run.steps=5"]
    resumed = launch(load_config(path, {"run": {"steps": 5}}), ["--config", str(path), *more, "--resume"],
                     progress=False, timeout_s=240)
    results = {(s, r): json.loads((replica_out_dir(out, r) / f"peer_stage{s}.json").read_text())
               for s in range(2) for r in range(2)}
    assert {res["start_step"] for res in results.values()} == {2}, results
    assert all(res["end"] == "finished" and res["bad_frames"] == 0 for res in results.values())
    ref = train(load_config(path, {"run": {"out_dir": str(tmp_path / "ref"), "steps": 5},
                                   "checkpoint": {"interval_steps": 0}}), progress=False)
    assert ref.steps == 5
    assert resumed.train_losses == pytest.approx(train_losses(tmp_path / "ref")[2:], rel=1e-3)
    for s in range(2):  # the stale step 3 went; every replica saved the resumed steps
        for r in range(2):
            assert stage_steps(replica_out_dir(out, r), s) == [1, 2, 3, 4, 5], (s, r)
