"""An operator's mistakes while replacing a departed stage cost nothing (SPEC "Rejoin").

Stage 1 of a 3-stage swarm runs on its own host (its own run folder) and is killed mid-run. Then:

1. its replacement is started **without** ``--resume``: it stops at once, saying that it must
   resume from the stage's checkpoints (it does not wait for pipeline messages that never come, and
   moves no checkpoint aside); the other stages keep waiting for another (its BYE, or its silence
   past the liveness floor, frees the stage);
2. it is started **with** ``--resume`` on a fresh host (an empty run folder): it stops with one line
   naming the step every stage saved and the files to copy; the other stages say the same in the
   line of their pause and keep waiting for another replacement (issue 45: nobody else exits); no
   stage rolled back to step 0 or deleted a checkpoint;
3. the files are copied and the replacement started again with ``--resume``: the swarm goes on and
   the run finishes with the losses of one uninterrupted in-process run.
"""

from __future__ import annotations

import json
import re
import shutil
import signal

import pytest

from mapl_swarm.config import load_config
from mapl_swarm.pipeline import checkpoint
from mapl_swarm.pipeline.trainer import train

from swarm_helpers import Watched, cli, start_dht, train_losses, wait_steps, write_config

pytestmark = pytest.mark.timeout(420)


def _peer(path, maddr: str, stage: int, out, *extra: str) -> Watched:
    return Watched(cli("peer", "--config", str(path), "--stage", str(stage), "--initial-peer", maddr, "--quiet",
                       "--set", f'run.out_dir="{out}"', *extra))


def test_a_replacement_started_wrongly_is_told_how_and_nothing_is_lost(tmp_path):
    steps = 12
    shared, host1, fresh = tmp_path / "hosts02", tmp_path / "host1", tmp_path / "fresh-host1"
    path = write_config(tmp_path / "faults.toml", stages=3, steps=steps, cache=tmp_path / "cache", out=shared,
                        run_id="faults", timeout=60)
    # a short liveness floor (the default 10 s is the liveness tests' business): the kill is noticed sooner
    path.write_text(path.read_text().replace("[net]\n", "[net]\nrejoin_timeout_s = 120\nhello_retry_s = 2\n"
                                                         "heartbeat_interval_s = 0.5\nliveness_floor_s = 3\n")
                    + "\n[checkpoint]\ninterval_steps = 3\n")
    dht, maddr = start_dht(path)
    survivors = [_peer(path, maddr, 0, shared), _peer(path, maddr, 2, shared)]
    first = _peer(path, maddr, 1, host1)
    later: list[Watched] = []
    try:
        wait_steps(shared, 5, [*survivors, first], 240)
        first.proc.kill()
        first.wait(10)
        for p in survivors:
            p.wait_for(r"stage 1 at tcp://\S+ silent since .*pausing", 60)
        kept = {s: checkpoint.stage_steps(shared, s) for s in (0, 2)} | {1: checkpoint.stage_steps(host1, 1)}
        assert all(kept.values()), kept

        no_resume = _peer(path, maddr, 1, host1)  # the right folder, but no --resume
        later.append(no_resume)
        assert no_resume.wait(60) == 2, no_resume.output[-4000:]
        assert re.search(r"mapl-swarm: error: stage \d belongs to a swarm that re-forms after a departure \(run epoch "
                         r"1\): stage 1 must take the departed peer's place from its checkpoints, so start it again "
                         r"with --resume", no_resume.output), no_resume.output[-4000:]
        assert checkpoint.stage_steps(host1, 1) == kept[1]  # nothing moved aside

        wrong_host = _peer(path, maddr, 1, fresh, "--resume")  # --resume, but no checkpoint folder
        later.append(wrong_host)
        said = (r"stage 1 has no checkpoint of this run, but every stage saved step (\d+): copy "
                r"checkpoints/step_(\d{8})/stage_1\.pt, stage_1\.manifest\.json from the run\.out_dir of the host "
                r"that ran stage 1")
        assert wrong_host.wait(120) == 2, wrong_host.output[-4000:]
        m = re.search(r"mapl-swarm: error: " + said, wrong_host.output)
        assert m and int(m.group(1)) == int(m.group(2)) in kept[1], wrong_host.output[-4000:]
        for p in survivors:  # they pause, saying the same, and wait for another replacement
            m = p.wait_for(r"the replacement of stage\(s\) \[1\] cannot resume: " + said + r".*pausing", 60)
            assert int(m.group(1)) in kept[1]
        assert all(p.proc.poll() is None for p in survivors), [p.output[-3000:] for p in survivors]
        assert {s: checkpoint.stage_steps(shared, s) for s in (0, 2)} == {0: kept[0], 2: kept[2]}
        assert checkpoint.stage_steps(host1, 1) == kept[1]

        shutil.copytree(host1 / "checkpoints", fresh / "checkpoints", dirs_exist_ok=True)
        replacement = _peer(path, maddr, 1, fresh, "--resume")
        later.append(replacement)
        for p in [*survivors, replacement]:
            assert p.wait(240) == 0, p.output[-4000:]
    finally:
        for p in [*survivors, first, *later]:
            p.stop(signal.SIGKILL)
        dht.stop(sig=signal.SIGINT)
    records = [json.loads(line) for line in (shared / "metrics_stage0.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "loss" in r] == list(range(1, steps + 1))
    train(load_config(path, {"run": {"out_dir": str(tmp_path / "ref")}, "checkpoint": {"interval_steps": 0}}),
          progress=False)
    assert [r["loss"] for r in records if "loss" in r] == pytest.approx(train_losses(tmp_path / "ref"), abs=1e-3)
