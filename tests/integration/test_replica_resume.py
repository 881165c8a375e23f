"""A run with replicas resumes (SPEC §9.10 item 13), as real processes: two replicas of each of two
stages train 3 steps, each saving its own checkpoints; one replica loses its newest file; the
swarm started again with ``--resume`` and ``run.steps = 5`` does not roll back to that replica:
it resumes from the newest step (3) its stages' current replicas hold, the one behind loads a
partner's state in the sync round, nothing is moved aside, and steps 4..5 equal those of one
uninterrupted in-process run. A replica whose file holds other parameters than its partners'
(SPEC §9.10 item 6) loads the state most of its stage's replicas hold instead of stopping the run."""

from __future__ import annotations

import json

import pytest

from mapl_swarm.config import load_config
from mapl_swarm.launch import launch, replica_out_dir
from mapl_swarm.pipeline.checkpoint import load_stage, save_stage, stage_steps
from mapl_swarm.pipeline.trainer import train

from swarm_helpers import train_losses, write_config

pytestmark = pytest.mark.timeout(300)


def replica_config(tmp_path, initial: list[int], steps: int):
    path = write_config(tmp_path / "r.toml", codec="mapl", stages=2, steps=steps, cache=tmp_path / "cache",
                        out=tmp_path / "swarm", run_id="replica-resume")
    text = path.read_text().replace("[eval]\n", "[checkpoint]\ninterval_steps = 1\n\n[eval]\n")
    path.write_text(text + f"\n[replicas]\nenabled = true\ninitial = {initial}\nmatchmaking_s = 1.0\n")
    return path


def resume(path, steps: int):
    return launch(load_config(path, {"run": {"steps": steps}}),
                  ["--config", str(path), "--set", f"run.steps={steps}", "--resume"], progress=False, timeout_s=240)


def reference_losses(tmp_path, path, steps: int) -> list[float]:
    ref = train(load_config(path, {"run": {"out_dir": str(tmp_path / "ref"), "steps": steps},
                                   "checkpoint": {"interval_steps": 0}}), progress=False)
    assert ref.steps == steps
    return train_losses(tmp_path / "ref")


def test_replicas_resume_from_the_newest_step_every_replica_holds(tmp_path):
    out = tmp_path / "swarm"
    path = replica_config(tmp_path, [2, 2], 3)
    launch(load_config(path), ["--config", str(path)], progress=False, timeout_s=240)
    for s in range(2):
        for r in range(2):
            assert stage_steps(replica_out_dir(out, r), s) == [1, 2, 3], (s, r)
    lost = replica_out_dir(out, 1) / "checkpoints" / "step_00000003" / "stage_1.pt"
    lost.unlink()  # the second replica of stage 1 lost its newest checkpoint: it is behind its partner

    resumed = resume(path, 5)
    results = {(s, r): json.loads((replica_out_dir(out, r) / f"peer_stage{s}.json").read_text())
               for s in range(2) for r in range(2)}
    assert {res["start_step"] for res in results.values()} == {3}, results
    assert all(res["end"] == "finished" and res["bad_frames"] == 0 for res in results.values())
    assert [results[1, r]["averaging"].get("resyncs", 0) for r in range(2)] == [0, 1]  # the one behind
    assert resumed.train_losses == pytest.approx(reference_losses(tmp_path, path, 5)[3:], rel=1e-3)
    for s in range(2):  # nothing rolled back or moved aside; every replica saved the resumed steps
        for r in range(2):
            assert stage_steps(replica_out_dir(out, r), s) == [1, 2, 3, 4, 5], (s, r)
            assert not (replica_out_dir(out, r) / "checkpoints.rolled_back").exists()
    assert not lost.exists()  # the replica behind wrote nothing over the step it lacks


def test_a_replica_whose_parameters_differ_loads_those_most_of_its_stage_hold(tmp_path):
    out = tmp_path / "swarm"
    path = replica_config(tmp_path, [1, 3], 2)
    launch(load_config(path), ["--config", str(path)], progress=False, timeout_s=240)
    root = replica_out_dir(out, 2)  # the third replica of stage 1: its step-2 file gets other parameters
    manifest = json.loads((root / "checkpoints" / "step_00000002" / "stage_1.manifest.json").read_text())
    state = load_stage(root, 2, 1)
    name, weight = next((k, v) for k, v in state["modules"].items() if v.is_floating_point())
    state["modules"][name] = weight + 0.01
    save_stage(root, 2, 1, state, meta={k: manifest[k] for k in ("driver", "config_fingerprint")})

    resumed = resume(path, 4)
    results = {r: json.loads((replica_out_dir(out, r) / "peer_stage1.json").read_text()) for r in range(3)}
    assert [results[r]["averaging"].get("resyncs", 0) for r in range(3)] == [0, 0, 1]
    assert all(res["start_step"] == 2 and res["end"] == "finished" for res in results.values())
    assert resumed.train_losses == pytest.approx(reference_losses(tmp_path, path, 4)[2:], rel=1e-3)
