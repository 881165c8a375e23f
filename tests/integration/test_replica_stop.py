"""Stopping a swarm with replicas on purpose (SPEC §9.10 item 14), as real processes.

- **Ctrl-C** to a launched swarm with two replicas of each of three stages: every replica says
  ``leave`` in its stage's next round, no stage would keep a replica, so the swarm drains: every
  replica stops after the same step, saves it (whatever the checkpoint interval) and exits 0; the
  launcher says so in one line, and ``launch --resume`` goes on from that step to the losses of
  one uninterrupted in-process run.
- **SIGTERM to one replica** (slow): it leaves at a step boundary and exits 0 saying so; its stage
  goes on with its partner, nothing is repaired or redone, and the run ends at ``train``'s losses.
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys

import pytest

from mapl_swarm.config import load_config
from mapl_swarm.launch import replica_out_dir
from mapl_swarm.pipeline import checkpoint
from mapl_swarm.pipeline.trainer import train

from swarm_helpers import ReplicaSwarm, cli, ctrl_c_after, train_losses, wait_steps, write_config

pytestmark = pytest.mark.timeout(300)

REPLICAS = '\n[replicas]\nenabled = true\ninitial = [2, 2, 2]\nmatchmaking_s = 1.0\nrouting = "uniform"\n'


def test_ctrl_c_drains_every_replica_at_one_step_and_the_resumed_run_matches_train(tmp_path):
    out = tmp_path / "swarm"
    steps = 16
    path = write_config(tmp_path / "drain.toml", stages=3, steps=steps, cache=tmp_path / "cache", out=out,
                        run_id="replica-drain", timeout=60)
    path.write_text(path.read_text() + "\n[checkpoint]\ninterval_steps = 1000\n" + REPLICAS)
    status, stdout, stderr, took = ctrl_c_after(cli("launch", "--config", str(path), "--quiet"), out, 3, timeout_s=60)
    assert status == 0, stderr[-6000:]
    lines = stdout.splitlines()
    assert len(lines) == 1, stdout
    m = re.fullmatch(r"mapl-swarm: swarm drained at step (\d+) \(SIGINT\): checkpoint of step \1 saved by every "
                     r"replica; continue with `mapl-swarm launch --resume`", lines[0])
    assert m, lines[0]
    step = int(m.group(1))
    assert 3 <= step < steps, stdout
    for s in range(3):  # every replica saved the drain step, not a checkpoint interval's
        for r in range(2):
            assert checkpoint.stage_steps(replica_out_dir(out, r), s) == [step], (s, r)
    try:
        resumed = subprocess.run([sys.executable, "-m", "mapl_swarm", "launch", "--config", str(path), "--resume"],
                                 capture_output=True, text=True, timeout=240)
    except subprocess.TimeoutExpired as hung:  # the peers' own logs (not --quiet) say where it stood
        pytest.fail(f"the resumed swarm did not end in 240 s:\n{(hung.stderr or b'').decode(errors='replace')[-20000:]}")
    assert resumed.returncode == 0, resumed.stderr[-6000:]
    records = [json.loads(line) for line in (out / "metrics_stage0.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in records if "loss" in r]
    ref = tmp_path / "ref"
    train(load_config(path, {"run": {"out_dir": str(ref)}, "checkpoint": {"interval_steps": 0},
                             "replicas": {"enabled": False, "initial": [1, 1, 1]}}), progress=False)
    assert losses == pytest.approx(train_losses(ref), rel=1e-3)


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("scheme", ["powersgd", "topk/updates"])
def test_a_drained_compressed_swarm_resumes_with_its_error_feedback_and_factors(tmp_path, scheme):
    """``replicas.averaging = "powersgd"`` and ``"topk"`` with ``averaged = "updates"`` (SPEC §9.10
    item 16): every replica saves its error feedback and warm-start factors (and, with updates, its
    own optimizer state of the compressed matrices) with its checkpoint, so a swarm drained by
    Ctrl-C and resumed trains to the losses of the same swarm run without a stop, as close as two such runs come:
    the feedback of a replica routed no micro-batch in a step waits for its next one, so two runs
    differ where routing did, before the drain too (measured: within 0.04%, 0.5% and 0.4% of the
    whole run's losses in three runs). That a checkpoint's feedback and factors are what is loaded:
    tests/unit/test_checkpoint_agreement.py and tests/integration/test_replica_schemes.py."""
    steps = 10
    name, _, carried = scheme.partition("/")
    settings = (f'\naveraging = "{name}"\naveraging_rank = 2\ntopk_fraction = 0.05\n'
                f'averaged = "{carried or "gradients"}"\n')
    whole_out, out = tmp_path / "whole", tmp_path / "swarm"
    whole = write_config(tmp_path / "whole.toml", stages=3, steps=steps, cache=tmp_path / "cache", out=whole_out,
                         run_id=f"replica-{name}-whole", timeout=60)
    path = write_config(tmp_path / "drain.toml", stages=3, steps=steps, cache=tmp_path / "cache", out=out,
                        run_id=f"replica-{name}-drain", timeout=60)
    for p in (whole, path):
        p.write_text(p.read_text() + "\n[checkpoint]\ninterval_steps = 1000\n" + REPLICAS + settings)
    done = subprocess.run([sys.executable, "-m", "mapl_swarm", "launch", "--config", str(whole), "--quiet"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-6000:]
    status, stdout, stderr, _ = ctrl_c_after(cli("launch", "--config", str(path), "--quiet"), out, 3, timeout_s=60)
    assert status == 0, stderr[-6000:]
    step = int(re.search(r"drained at step (\d+)", stdout).group(1))
    state = checkpoint.load_stage(replica_out_dir(out, 1), step, 1)
    assert state["averaging"]["scheme"] == name and state["averaging"]["errors"]
    assert bool(state["averaging"]["factors"]) == (name == "powersgd")
    assert state["averaging"]["averaged"] == (carried or "gradients")
    resumed = subprocess.run([sys.executable, "-m", "mapl_swarm", "launch", "--config", str(path), "--resume"],
                             capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-6000:]

    def losses(folder):
        return [r["loss"] for r in map(json.loads, (folder / "metrics_stage0.jsonl").read_text().splitlines())
                if "loss" in r]
    assert len(losses(out)) == len(losses(whole_out)) == steps
    assert losses(out) == pytest.approx(losses(whole_out), rel=1e-2)


@pytest.mark.slow
def test_a_signalled_replica_leaves_at_a_step_boundary_and_the_run_goes_on(tmp_path):
    steps = 12
    with ReplicaSwarm(tmp_path, "replica-leave", steps=steps, identities=[2, 2, 2]) as swarm:
        for s in range(3):
            for r in range(2):
                swarm.start(s, r)
        wait_steps(swarm.out, 3, list(swarm.procs.values()), 180)
        swarm.procs[1, 1].proc.send_signal(signal.SIGTERM)
        codes = {key: p.wait(240) for key, p in swarm.procs.items()}
    assert all(code == 0 for code in codes.values()), {k: (c, swarm.procs[k].output[-3000:])
                                                       for k, c in codes.items() if c}
    leaver = swarm.result(1, 1)
    assert leaver["end"] == "stopped" and "replica left after" in leaver["end_note"], leaver
    for key in [(0, 0), (0, 1), (1, 0), (2, 0), (2, 1)]:
        res = swarm.result(*key)
        assert res["end"] == "finished", (key, res["end_note"])
        assert "is redone" not in swarm.procs[key].output and "sent again" not in swarm.procs[key].output
    results0 = swarm.result(0, 0)
    assert results0["tokens"] == steps * swarm.cfg.tokens_per_step
    ref = tmp_path / "ref"
    train(load_config(swarm.path, {"run": {"out_dir": str(ref)}}), progress=False)
    assert results0["train_losses"] == pytest.approx(train_losses(ref), rel=5e-3)
