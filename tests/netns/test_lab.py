"""Kernel-shaped links in network namespaces (root + iproute2; skipped elsewhere)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from mapl_swarm.config import load_config
from mapl_swarm.lab.netns import NetnsLab, netns_available

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "integration"))
from swarm_helpers import write_config  # noqa: E402

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


def test_tbf_link_shapes_throughput_within_10_percent():
    with NetnsLab(["a", "b"], rate_mbit=20, subnet=78) as lab:
        endpoint = f"tcp://{lab.address('a')}:5599"
        recv = lab.popen("a", [sys.executable, "-c", RECEIVER, endpoint, "80"], stdout=subprocess.PIPE, text=True)
        assert recv.stdout.readline().strip() == "ready"
        send = lab.popen("b", [sys.executable, "-c", SENDER, endpoint, "80"])
        out, _ = recv.communicate(timeout=120)
        send.wait(60)
        nbytes, seconds = out.split()
        mbit = int(nbytes) * 8 / float(seconds) / 1e6
        assert 18.0 <= mbit <= 21.0, mbit  # payload rate; TCP/IP headers take a few percent


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
