"""Kernel-shaped links in network namespaces (root + iproute2; skipped elsewhere)."""

import json
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from mapl_swarm.config import load_config
from mapl_swarm.lab.netns import NetnsLab, netns_available
from mapl_swarm.pipeline import checkpoint
from mapl_swarm.pipeline.trainer import train

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "integration"))
from swarm_helpers import Watched, cli, crash, ctrl_c_after, train_losses, wait_steps, write_config  # noqa: E402
from test_swarm_liveness import BAD_OUTPUT  # noqa: E402

ok, why = netns_available()
pytestmark = [pytest.mark.netns, pytest.mark.skipif(not ok, reason=f"network namespaces unavailable: {why}"),
              pytest.mark.timeout(600)]

RECEIVER = r"""
import sys, time, zmq
ctx = zmq.Context(); s = ctx.socket(zmq.PULL); s.setsockopt(zmq.LINGER, 0)
s.bind(sys.argv[1]); print("ready", flush=True)
n = int(sys.argv[2]); got = 0; first = last = None
for i in range(n):
    m = s.recv()
    now = time.perf_counter(); first = first or now; last = now; got += len(m) if i else 0
print(f"{got} {last - first}", flush=True)
"""
SENDER = r"""
import sys, zmq
ctx = zmq.Context(); s = ctx.socket(zmq.PUSH); s.setsockopt(zmq.LINGER, -1)
s.connect(sys.argv[1])
for _ in range(int(sys.argv[2])): s.send(b"x" * 65536)
s.close(); ctx.term()
"""


BRIDGE_NF = Path("/proc/sys/net/bridge/bridge-nf-call-iptables")


def _iptables(*args: str) -> str:
    return subprocess.run(["iptables", "-w", "5", *args], capture_output=True, text=True, check=True,
                          timeout=30).stdout


def _rules(listing: str) -> list[str]:
    return [line for line in listing.splitlines() if not line.startswith("-P ")]


@pytest.fixture(params=["open", "docker"])
def firewall(request):
    """``docker``: the kernel state a Docker engine leaves (running or stopped): iptables FORWARD policy
    DROP and bridge-nf-call-iptables on; restored after the test. Yields the FORWARD rules before."""
    if request.param == "open":
        yield None
        return
    if subprocess.run(["which", "iptables"], capture_output=True).returncode != 0:
        pytest.skip("iptables not installed: no FORWARD chain to drop the lab's traffic")
    before = _iptables("-S", "FORWARD")
    policy = next(l.split()[2] for l in before.splitlines() if l.startswith("-P FORWARD "))
    nf = BRIDGE_NF.read_text().strip() if BRIDGE_NF.exists() else None
    _iptables("-P", "FORWARD", "DROP")
    if nf is not None:
        BRIDGE_NF.write_text("1")
    try:
        yield before
    finally:
        _iptables("-P", "FORWARD", policy)
        if nf is not None:
            BRIDGE_NF.write_text(nf)


def test_tbf_link_shapes_throughput_to_its_rate(firewall):
    """Also beside Docker's firewall (FORWARD DROP): the lab accepts its own bridge's traffic by one rule,
    which is gone again after the lab is down."""
    with NetnsLab(["a", "b"], rate_mbit=20, subnet=78) as lab:
        endpoint = f"tcp://{lab.address('a')}:5599"
        recv = lab.popen("a", [sys.executable, "-c", RECEIVER, endpoint, "80"], stdout=subprocess.PIPE, text=True)
        assert recv.stdout.readline().strip() == "ready"
        send = lab.popen("b", [sys.executable, "-c", SENDER, endpoint, "80"])
        out, _ = recv.communicate(timeout=120)
        send.wait(60)
        nbytes, seconds = out.split()
        mbit = int(nbytes) * 8 / float(seconds) / 1e6
        # payload rate: TCP/IP headers take ~4 % of 20 Mbit/s, slow start and a busy machine's Python
        # sender a few more; above the rate only if tbf does not shape
        assert 17.0 <= mbit <= 21.0, mbit
    if firewall is not None:
        assert _rules(_iptables("-S", "FORWARD")) == _rules(firewall)


def test_sigint_drains_the_lab_swarm_to_one_checkpointed_step(tmp_path):
    """Ctrl-C in a terminal: SIGINT to the lab's process group. The lab forwards it to each peer (each
    in a process group of its own, in its namespace); every stage saves the same step, the DHT node
    stops quietly, and the lab exits 0 within 10 s, its last line naming `lab --resume`."""
    out = tmp_path / "run"
    path = write_config(tmp_path / "lab.toml", stages=3, steps=100_000, cache=tmp_path / "cache", out=out,
                        run_id="labint", timeout=60)
    path.write_text(path.read_text() + "\n[checkpoint]\ninterval_steps = 5\n")
    status, stdout, stderr, took = ctrl_c_after(  # a SIGTERM stops the lab at once and takes its namespaces down
        cli("lab", "--config", str(path), "--rate-mbit", "0", "--subnet", "83"), out, 3, cleanup=signal.SIGTERM)
    assert status == 0 and took < 10.0, stderr[-6000:]
    assert not any(bad in stderr for bad in BAD_OUTPUT + ("stopped by",)), stderr[-6000:]
    assert "DHT bootstrap node stopped (SIGTERM)" in stderr
    m = re.fullmatch(r"mapl-swarm: swarm drained at step (\d+) \(SIGINT\): checkpoint of step \1 saved by every "
                     r"stage; continue with `mapl-swarm lab --resume`", stdout.splitlines()[-1])
    assert m, stdout
    assert [checkpoint.stage_steps(out, s)[-1] for s in range(3)] == [int(m.group(1))] * 3


def test_lab_swarm_trains_over_kernel_shaped_links(tmp_path):
    from mapl_swarm.lab.swarm import run_lab_swarm

    path = write_config(tmp_path / "lab.toml", stages=2, steps=3, cache=tmp_path / "cache", out=tmp_path / "run",
                        run_id="lab")
    cfg = load_config(path)
    summary = run_lab_swarm(cfg, ["--config", str(path)], rate_mbit=50, subnet=79, timeout_s=500)
    assert len(summary.train_losses) == 3
    assert all(l > 0 for l in summary.train_losses)
    res = json.loads((tmp_path / "run" / "peer_stage1.json").read_text())
    assert res["bad_frames"] == 0
    assert summary.links[0]["forward_payload"] > 0


@pytest.mark.slow  # ~1 min; the restart logic itself is in the default run (test_launch_restart_processes.py)
def test_lab_restarts_a_killed_peer_in_its_namespace_and_the_losses_are_unchanged(tmp_path):
    """`lab` supervises its peers as `launch` does: SIGKILL of stage 1's peer (and its DHT child) mid-run;
    it is started again with --resume in its namespace, and the run ends with exit 0 and the losses of
    one uninterrupted in-process run."""
    out = tmp_path / "run"
    path = write_config(tmp_path / "lab.toml", stages=3, steps=12, cache=tmp_path / "cache", out=out, run_id="labre",
                        timeout=60)
    path.write_text(path.read_text().replace("[net]\n", "[net]\nrejoin_timeout_s = 120\nhello_retry_s = 2\n")
                    + "\n[checkpoint]\ninterval_steps = 3\n")
    lab = Watched(cli("lab", "--config", str(path), "--rate-mbit", "0", "--subnet", "81"))
    try:
        wait_steps(out, 5, [lab], 300)
        crash(f"peer --config {path} --stage 1 ", "stage 1 peer")
        lab.wait_for(r"stage 1 \(pid \d+\) died \(SIGKILL\); restarting it with --resume \(restart 1 of 3\)", 30)
        assert lab.wait(300) == 0, lab.output[-6000:]
        assert "restarted peers: stage 1 x1" in lab.output and "Traceback" not in lab.output
    finally:
        lab.stop()  # SIGTERM: the lab drains and takes its namespaces down
    records = [json.loads(line) for line in (out / "metrics_stage0.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in records if "loss" in r]
    train(load_config(path, {"run": {"out_dir": str(tmp_path / "ref")}, "checkpoint": {"interval_steps": 0}}),
          progress=False)
    assert losses == pytest.approx(train_losses(tmp_path / "ref"), abs=1e-3)
