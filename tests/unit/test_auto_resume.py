"""``peer --auto-resume``: resume when this stage's folder holds a checkpoint, fresh otherwise, and
nothing to do once the run is over (what a restart policy needs)."""

from __future__ import annotations

import logging

from mapl_swarm.cli import _auto_resume, main
from mapl_swarm.config import config_from_dict
from mapl_swarm.pipeline import checkpoint


def _cfg(out, steps=20):
    return config_from_dict({"run": {"steps": steps, "out_dir": str(out)}, "pipeline": {"num_stages": 2}}, "test")


def _checkpoint(out, step: int, stage: int) -> None:
    d = out / checkpoint.CHECKPOINTS / f"step_{step:08d}"  # as checkpoint.save_stage names it
    d.mkdir(parents=True, exist_ok=True)
    (d / f"stage_{stage}.pt").write_bytes(b"state")


def test_fresh_without_a_checkpoint_of_this_stage(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="mapl_swarm")
    _checkpoint(tmp_path, 10, stage=0)  # another stage's files do not count
    assert _auto_resume(_cfg(tmp_path), 1) is False
    assert f"stage 1: starting fresh (no checkpoint of this stage under {tmp_path})" in caplog.text


def test_resume_with_a_checkpoint_of_this_stage(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="mapl_swarm")
    _checkpoint(tmp_path, 5, stage=1)
    _checkpoint(tmp_path, 10, stage=1)
    assert _auto_resume(_cfg(tmp_path), 1) is True
    assert "stage 1: resuming (checkpoint steps [5, 10]" in caplog.text


def test_a_finished_run_exits_0_at_once(tmp_path, capsys):
    _checkpoint(tmp_path, 20, stage=1)
    config = tmp_path / "run.toml"
    config.write_text(f'[run]\nsteps = 20\nout_dir = "{tmp_path}"\n[pipeline]\nnum_stages = 2\n')
    assert main(["peer", "--config", str(config), "--stage", "1", "--insecure", "--auto-resume"]) == 0
    assert capsys.readouterr().out == ("mapl-swarm: stage 1: the run is over (checkpoint of step 20, run.steps 20); "
                                       "nothing to do\n")


def test_auto_resume_and_resume_exclude_each_other(tmp_path, capsys):
    try:
        main(["peer", "--stage", "0", "--insecure", "--auto-resume", "--resume"])
    except SystemExit as exc:
        assert exc.code == 2
    assert "not allowed with argument" in capsys.readouterr().err
