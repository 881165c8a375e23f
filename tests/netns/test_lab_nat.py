"""Hosts behind NAT in the namespace lab, and peers on them serving a stage by dialing out (root,
iproute2 and iptables; skipped elsewhere)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from mapl_swarm.config import load_config
from mapl_swarm.lab.netns import NetnsLab, nat_available
from mapl_swarm.pipeline.trainer import train

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "integration"))
from swarm_helpers import train_losses, write_config  # noqa: E402

ok, why = nat_available()
pytestmark = [pytest.mark.netns, pytest.mark.skipif(not ok, reason=f"NAT lab unavailable: {why}"),
              pytest.mark.timeout(600)]

LISTEN = r"""
import socket, sys
s = socket.socket(); s.bind((sys.argv[1], 5601)); s.listen(); print("ready", flush=True)
c, peer = s.accept(); print(peer[0], flush=True)
"""
DIAL = r"""
import socket, sys
s = socket.socket(); s.settimeout(3)
try:
    s.connect((sys.argv[1], 5601)); print("connected")
except OSError as exc:
    print(f"failed: {exc}")
"""


def _dial(lab: NetnsLab, host: str, address: str) -> str:
    return subprocess.run(lab.command(host, [sys.executable, "-c", DIAL, address]), capture_output=True, text=True,
                          timeout=30).stdout.strip()


def test_a_host_behind_nat_dials_out_and_nobody_dials_in():
    with NetnsLab(["open", "home"], subnet=84, nat=["home"]) as lab:
        assert lab.address("open") == lab.public_address("open")
        assert lab.address("home") != lab.public_address("home")
        # in: neither its private address (no route) nor its router's public one (nothing forwarded) answers
        listener = lab.popen("home", [sys.executable, "-c", LISTEN, "0.0.0.0"], stdout=subprocess.PIPE, text=True)
        try:
            assert listener.stdout.readline().strip() == "ready"
            assert _dial(lab, "open", lab.public_address("home")).startswith("failed")
            assert _dial(lab, "open", lab.address("home")).startswith("failed")
        finally:
            listener.kill()
            listener.wait()
        # out: the connection opens, and the other side sees it come from the router's public address
        listener = lab.popen("open", [sys.executable, "-c", LISTEN, lab.address("open")], stdout=subprocess.PIPE,
                             text=True)
        try:
            assert listener.stdout.readline().strip() == "ready"
            assert _dial(lab, "home", lab.address("open")) == "connected"
            assert listener.stdout.readline().strip() == lab.public_address("home")
        finally:
            listener.kill()
            listener.wait()


def test_a_chain_whose_middle_stage_is_behind_nat_trains_to_the_in_process_losses(tmp_path):
    """Stage 1 accepts no connection: it announces a dial-out contact, its DHT node runs in client
    mode, and stages 0 and 2 send to it on the connections it opens. The losses are those of
    `mapl-swarm train`."""
    from mapl_swarm.lab.swarm import run_lab_swarm

    path = write_config(tmp_path / "nat.toml", stages=3, steps=3, cache=tmp_path / "cache", out=tmp_path / "run",
                        run_id="natlab", timeout=90)
    cfg = load_config(path)
    summary = run_lab_swarm(cfg, ["--config", str(path)], rate_mbit=50, subnet=85, timeout_s=500, nat=["stage1"])
    train(load_config(path, {"run": {"out_dir": str(tmp_path / "ref")}}), progress=False)
    assert summary.train_losses == pytest.approx(train_losses(tmp_path / "ref"), abs=1e-3)
    middle = json.loads((tmp_path / "run" / "peer_stage1.json").read_text())
    assert middle["bad_frames"] == 0
    assert summary.links[0]["forward_payload"] > 0 and summary.links[1]["forward_payload"] > 0
