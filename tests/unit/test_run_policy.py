"""The run policy shared by ``train`` and swarm peers: pruning rule, fresh runs own their folder,
checkpoint metadata, and the new user's resume sequence (issue 9)."""

import json

import pytest
import torch

from mapl_swarm.errors import CheckpointError
from mapl_swarm.pipeline import checkpoint
from mapl_swarm.pipeline.run_records import MetricsLog
from mapl_swarm.pipeline.checkpoint import StageCheckpoints, choose_resume_step, start_fresh
from mapl_swarm.pipeline.trainer import train

from conftest import stdlib_run_config


@pytest.mark.parametrize("local, complete, keep, doomed", [
    ([], [], 2, []),
    ([2, 4, 6], [], 2, []),                     # nothing complete: keep everything
    ([2, 4, 6], [2, 4, 6], 2, [2]),
    ([2, 4, 6, 8], [2, 4, 6], 2, [2]),          # 8 is newer than the newest complete: kept
    ([2, 4, 6, 8], [2, 4, 6], 1, [2, 4]),
    ([1, 2, 3, 4, 5], [2, 4], 2, [1, 3]),       # incomplete steps older than the newest complete go
    ([6, 40], [40], 2, [6]),
    ([2, 4], [2, 4], 5, []),
])
def test_prune_plan(local, complete, keep, doomed):
    assert checkpoint.prune_plan(local, complete, keep) == doomed


def _store(root, stage, driver="swarm", fp="a" * 32, keep=2):
    return StageCheckpoints(root, stage, driver=driver, fingerprint=fp, keep=keep)


def test_stage_checkpoints_prune_only_own_files_and_never_the_newest_complete(tmp_path):
    s0, s1 = _store(tmp_path, 0), _store(tmp_path, 1)
    for step in (2, 4, 6):
        s0.save(step, {"x": torch.zeros(1)})
        s1.save(step, {"x": torch.zeros(1)})
    assert s0.mark_complete(2) == [] and s0.mark_complete(4) == []
    assert s0.mark_complete(6) == [2]
    assert s0.local_steps() == [4, 6] and s1.local_steps() == [2, 4, 6]  # stage 1 not told yet
    assert checkpoint.read_complete(tmp_path, 0) == [4, 6]
    assert _store(tmp_path, 0).complete == [4, 6]  # survives a restart
    meta = checkpoint.read_meta(tmp_path, 6, 0)
    assert meta == {"driver": "swarm", "config_fingerprint": "a" * 32, "step": 6, "stage": 0}


def test_resume_refuses_other_driver_config_and_exhausted_runs(tmp_path):
    _store(tmp_path, 0).save(40, {"x": torch.zeros(1)})
    with pytest.raises(CheckpointError, match="driver swarm vs train"):
        _store(tmp_path, 0, driver="train").usable_steps()
    with pytest.raises(CheckpointError, match=f"fingerprint {'a' * 32} vs {'b' * 32}"):
        _store(tmp_path, 0, fp="b" * 32).usable_steps()
    with pytest.raises(CheckpointError,
                       match=r"checkpoint at step 40 >= run.steps 12: nothing to train; raise run.steps"):
        choose_resume_step({0: [40], 1: [20, 40]}, 12, "x")
    with pytest.raises(CheckpointError, match=r"no checkpoint step that every stage has \(stage 0 has \[4, 6\], "
                                              r"stage 1 has \[2\]\)"):
        choose_resume_step({0: [4, 6], 1: [2]}, 12, "x")
    with pytest.raises(CheckpointError, match="no checkpoint to resume from"):
        choose_resume_step({0: [], 1: []}, 12, "x")
    assert choose_resume_step({0: [2, 4, 6], 1: [2, 4], 2: [4, 6]}, 12, "x") == 4
    checkpoint.save_stage(tmp_path, 50, 0, {"x": torch.zeros(1)})
    (tmp_path / "checkpoints" / "step_00000050" / "stage_0.manifest.json").unlink()  # a save that did not finish
    assert _store(tmp_path, 0).usable_steps() == [40]  # skipped (with a warning), not an error


def test_fresh_start_moves_earlier_checkpoints_and_metrics_restart(tmp_path):
    old = _store(tmp_path, 0)
    for step in (20, 40):
        old.save(step, {"x": torch.zeros(1)})
        old.mark_complete(step)
    older = tmp_path / "checkpoints.previous" / "step_00000099"  # an older run's .previous
    older.mkdir(parents=True)
    (older / "stage_0.pt").write_bytes(b"old")
    assert start_fresh(tmp_path, [0]) == [20, 40]
    assert checkpoint.stage_steps(tmp_path, 0) == []
    prev = sorted(p.name for p in (tmp_path / "checkpoints.previous").iterdir())
    assert prev == ["complete_stage0.json", "step_00000020", "step_00000040"]

    path = tmp_path / "metrics.jsonl"
    with MetricsLog(path, resume_from=None) as m:
        for step in (1, 2, 3, 4):
            m.write({"step": step})
    with MetricsLog(path, resume_from=2) as m:  # resumed at 2: the interrupted run's 3, 4 dropped
        m.write({"step": 3})
    assert [json.loads(l)["step"] for l in path.read_text().splitlines()] == [1, 2, 3]
    MetricsLog(path, resume_from=None).close()
    assert path.read_text() == ""


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("cache")


_cfg = stdlib_run_config


def test_new_user_resume_sequence(tmp_path, cache):
    out = tmp_path / "demo"
    # another run's newer checkpoints (like the demo's step 20/40)
    train(_cfg(cache, out, 10, interval_steps=5), progress=False)
    assert checkpoint.complete_steps(out, 2) == [5, 10]
    # fresh 6 steps into the same folder: keeps its own step-6 checkpoint
    six = train(_cfg(cache, out, 6), progress=False)
    assert checkpoint.complete_steps(out, 2) == [6]
    assert checkpoint.complete_steps(out / "checkpoints.previous", 2) == []  # not a run root
    assert sorted(p.name for p in (out / "checkpoints.previous").glob("step_*")) == ["step_00000005", "step_00000010"]
    records = [json.loads(l) for l in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "loss" in r] == [1, 2, 3, 4, 5, 6]  # started anew
    # resume to 12 continues from 6 (run.steps may change across a resume; the lr schedule follows it)
    resumed = train(_cfg(cache, out, 12), resume=True, progress=False)
    assert resumed.steps == 12 and json.loads((out / "manifest.json").read_text())["resumed_from"] == 6
    records = [json.loads(l) for l in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "loss" in r] == list(range(1, 13))
    assert checkpoint.complete_steps(out, 2) == [6, 12]
    assert six.steps == 6
    # resume at run.steps: a clear error, nothing "trained"
    with pytest.raises(CheckpointError, match=r"checkpoint at step 12 >= run.steps 12: nothing to train"):
        train(_cfg(cache, out, 12), resume=True, progress=False)
    # nothing to resume
    with pytest.raises(CheckpointError, match="no checkpoint to resume from"):
        train(_cfg(cache, tmp_path / "empty", 12), resume=True, progress=False)


def test_cli_train_resume_at_the_end_exits_2_with_one_line(tmp_path, cache, capsys):
    from mapl_swarm.cli import main
    from mapl_swarm.config import config_to_dict

    out = tmp_path / "run"
    cfg = _cfg(cache, out, 3, interval_steps=3)
    train(cfg, progress=False)
    sets = [f"{sec}.{k}={json.dumps(v)}" for sec in ("model", "compression", "optim", "data", "run", "pipeline", "eval", "checkpoint")
            for k, v in config_to_dict(cfg)[sec].items() if v is not None and not isinstance(v, (list, dict))]
    assert main(["train", "--quiet", "--resume", *(a for s in sets for a in ("--set", s))]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["mapl-swarm: error: checkpoint at step 3 >= run.steps 3: nothing to train; raise run.steps"]


def test_train_resume_refuses_swarm_checkpoint(tmp_path, cache):
    out = tmp_path / "swarm"
    cfg = _cfg(cache, out, 12)
    train(_cfg(cache, out, 4, interval_steps=4), progress=False)
    for s in range(2):  # as a swarm peer would have written it
        meta = checkpoint.read_meta(out, 4, s)
        checkpoint.save_stage(out, 4, s, checkpoint.load_stage(out, 4, s), meta={**meta, "driver": "swarm"})
    with pytest.raises(CheckpointError, match="driver swarm vs train"):
        train(cfg, resume=True, progress=False)


def test_stage_0_records_checkpoint_steps_and_whole_ones_only_count_as_having_their_loss(tmp_path, make_config):
    """Stage 0's record of a step waits for the last stage's REPORT; a record written without it
    (the stream closed by a departure), a missing one, or a validation step without its val loss is
    a step whose loss the history lacks (:func:`steps_without_loss`)."""
    from mapl_swarm.pipeline.run_records import StepRecords, metrics_path, steps_without_loss

    cfg = make_config(run={"out_dir": str(tmp_path), "steps": 12}, pipeline={"num_stages": 3},
                      metrics={"log_interval_steps": 5}, checkpoint={"interval_steps": 3}, eval={"interval_steps": 6})
    path = metrics_path(tmp_path, 0)
    records = StepRecords(cfg, 0, MetricsLog(path, resume_from=None), 0)
    for step in range(1, 10):
        records.stage_step(step, {"lr_mult": 1.0})
        if step not in (7, 9):  # the REPORTs of steps 7 and 9 never came
            records.train_loss(step, 5.0 - step / 10, 64)
        if step == 6:
            assert [json.loads(x)["step"] for x in path.read_text().splitlines()] == [3, 5]  # 6 waits for val
            records.val_loss(6, 4.5)
    records.close()  # a departure: the pending records of steps 7 and 9 are written without a loss
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    assert [(r["step"], "loss" in r) for r in lines] == [(3, True), (5, True), (6, True), (7, False), (9, False)]
    assert steps_without_loss(cfg, path, [3, 6, 9]) == {9}
    assert steps_without_loss(cfg, path, [3, 6, 9, 12]) == {9, 12}  # 12: no record at all
    path.write_text(path.read_text().replace('"val_loss": 4.5', '"other": 1') + '{"step": 3, "lo')  # cut short
    assert steps_without_loss(cfg, path, [3, 6]) == {6}  # a validation step without its val loss
    assert steps_without_loss(cfg, tmp_path / "missing.jsonl", [3, 6]) == {3, 6}
