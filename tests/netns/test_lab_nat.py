"""Hosts behind NAT in the namespace lab, and peers on them serving a stage by dialing out (root,
iproute2 and iptables; skipped elsewhere)."""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from mapl_swarm.config import load_config
from mapl_swarm.lab.netns import NetnsLab, nat_available
from mapl_swarm.pipeline.trainer import train

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "integration"))
from swarm_helpers import Watched, cli, crash, train_losses, wait_steps, write_config  # noqa: E402

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


@pytest.mark.slow  # ~2-3 min: a lab swarm and the in-process reference
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


@pytest.mark.parametrize("scheme", ["fp32", pytest.param("topk", marks=pytest.mark.slow)])  # ~35 s each
def test_a_replica_behind_nat_averages_with_its_partner_and_its_kill_is_survived(tmp_path, scheme):
    """Stage 1 has two replicas, the second behind NAT: its averager runs in hivemind's client mode
    (its partner, which cannot dial it, reduces every part and reaches it on the connections it
    opens: with ``topk`` it asks it for its sparse share there). It averages the first steps with
    its partner; SIGKILLed mid-run, its stage goes on with the other replica, and the run ends with
    every step (``fp32``: at the losses of `mapl-swarm train`)."""
    out = tmp_path / "run"
    path = write_config(tmp_path / "natrep.toml", stages=3, steps=8, cache=tmp_path / "cache", out=out,
                        run_id=f"natreplica-{scheme}", timeout=60)
    path.write_text(path.read_text().replace("[net]\n", "[net]\nheartbeat_interval_s = 0.5\nliveness_floor_s = 5.0\n")
                    + '\n[replicas]\nenabled = true\ninitial = [1, 2, 1]\nmatchmaking_s = 1.0\nrouting = "uniform"\n'
                    + f'averaging = "{scheme}"\n')
    lab = Watched(cli("lab", "--config", str(path), "--rate-mbit", "50", "--subnet", "88", "--nat", "stage1r1"))
    try:
        wait_steps(out, 3, [lab], 400)
        crash(f"peer --config {path} --stage 1 .*replica1", "peer of stage 1's second replica")
        lab.wait_for(r"stage 1 replica 1 \(pid \d+\) exited with status -9 \(SIGKILL\); stage 1 goes on with its 1 "
                     r"other replica", 60)
        assert lab.wait(400) == 0, lab.output[-6000:]
        assert "Traceback" not in lab.output
    finally:
        lab.stop()
    survivor = json.loads((out / "peer_stage1.json").read_text())
    assert survivor["end"] == "finished" and survivor["averaging"]["rounds"] >= 2, survivor["averaging"]
    records = [json.loads(line) for line in (out / "metrics_stage0.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in records if "loss" in r]
    assert len(losses) == 8
    if scheme == "fp32":
        train(load_config(path, {"run": {"out_dir": str(tmp_path / "ref")}}), progress=False)
        assert losses == pytest.approx(train_losses(tmp_path / "ref"), rel=1e-3)


@pytest.mark.slow  # ~1 min
def test_two_dial_out_neighbours_without_a_relay_stop_the_lab_saying_a_relay_is_needed(tmp_path):
    """The first of the two to find the other's record says so and exits, and the lab stops the
    swarm (each naming the other, when both got there first: test_dial_out_swarm.py checks both)."""
    path = write_config(tmp_path / "nat2.toml", stages=3, steps=3, cache=tmp_path / "cache", out=tmp_path / "run",
                        run_id="natlab2", timeout=60)
    proc = subprocess.run(cli("lab", "--config", str(path), "--rate-mbit", "0", "--subnet", "86", "--nat",
                              "stage1,stage2", "--max-restarts", "0"), capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    said = [mine for mine, theirs in ((1, 2), (2, 1)) if re.search(
        rf"stage{mine}: link 'stage{theirs}(@[0-9a-f]{{8}})?': the peer at dialout#[0-9a-f]{{64}} accepts no "
        rf"connection, and neither does this one \(both dial out\): a relay between them is needed", proc.stderr)]
    assert said, proc.stderr[-6000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-6000:]


CAPTURE = r"""
import socket, sys, time
s = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.ntohs(0x0003))  # every frame, both ways
s.settimeout(0.5)
out = open(sys.argv[1], "wb"); print("capturing", flush=True)
end = time.time() + float(sys.argv[2])
while time.time() < end:
    try:
        frame = s.recv(65535)
        out.write(len(frame).to_bytes(4, "big") + frame)
    except socket.timeout:
        pass
    out.flush()
"""


@pytest.mark.slow  # ~3 min: a lab swarm with a relay and a capture, and the in-process reference
def test_two_neighbours_behind_nat_train_through_a_relay_that_sees_only_ciphertext(tmp_path):
    """Stages 1 and 2 both behind NAT: they meet at the relay on the DHT's host, and the 3-stage chain
    trains to `mapl-swarm train`'s losses. Every frame on the relay's host, captured there, holds
    no run id, no token-id sequence of the batches and no header key in clear."""
    from mapl_swarm.lab import swarm as lab_swarm
    from mapl_swarm.lab.netns import NetnsLab as Lab

    path = write_config(tmp_path / "relay.toml", stages=3, steps=3, cache=tmp_path / "cache", out=tmp_path / "run",
                        run_id="natrelay-run-7f3a", timeout=90)
    path.write_text(path.read_text().replace("[net]\n", "[net]\ncompress_ids = false\n"))
    cfg = load_config(path)
    captured = tmp_path / "relay.pcapraw"
    capture: list[subprocess.Popen] = []

    class CapturingLab(Lab):  # the capture starts on the relay's host as soon as the lab is up
        def up(self):
            lab = super().up()
            proc = lab.popen("dht", [sys.executable, "-c", CAPTURE, str(captured), "400"], stdout=subprocess.PIPE,
                             text=True)
            assert proc.stdout.readline().strip() == "capturing"
            capture.append(proc)
            return lab

    lab_swarm.NetnsLab, original = CapturingLab, lab_swarm.NetnsLab
    try:
        summary = lab_swarm.run_lab_swarm(cfg, ["--config", str(path)], rate_mbit=50, subnet=87, timeout_s=500,
                                          nat=["stage1", "stage2"], relay=True)
    finally:
        lab_swarm.NetnsLab = original
        for proc in capture:
            proc.kill()
            proc.wait()
    train(load_config(path, {"run": {"out_dir": str(tmp_path / "ref")}}), progress=False)
    assert summary.train_losses == pytest.approx(train_losses(tmp_path / "ref"), abs=1e-3)
    assert summary.links[1]["forward_payload"] > 0  # stage 1 -> 2, through the relay
    frames = _frames(captured.read_bytes())
    relayed = b"".join(_relay_payload(frame, lab_swarm.RELAY_PORT) for frame in frames)
    assert len(relayed) >= summary.links[1]["forward_payload"]  # the link 1 -> 2 crossed the relay's host
    assert b"\xa5relay\x01\xa5nonce" in relayed  # a control: what the relay says in clear is in the capture
    assert b"natrelay-run-7f3a" not in relayed
    for key in (b"\xa4type", b"\xa3run", b"\xa7tensors", b"fingerprint", b"capabilities", b"\xa4cert"):
        assert key not in relayed, key
    for ids in _token_ids(cfg):
        assert ids not in relayed


def _frames(raw: bytes) -> list[bytes]:
    out, i = [], 0
    while i + 4 <= len(raw):
        n = int.from_bytes(raw[i:i + 4], "big")
        out.append(raw[i + 4:i + 4 + n])
        i += 4 + n
    return out


def _relay_payload(frame: bytes, relay_port: int) -> bytes:
    """The TCP payload of an Ethernet + IPv4 + TCP frame to or from ``relay_port`` (b"" otherwise)."""
    import struct

    if len(frame) < 54 or frame[12:14] != b"\x08\x00" or frame[14] >> 4 != 4 or frame[23] != 6:
        return b""
    ihl = (frame[14] & 0x0F) * 4
    total = struct.unpack(">H", frame[16:18])[0]
    tcp = 14 + ihl
    src, dst = struct.unpack(">HH", frame[tcp:tcp + 4])
    if relay_port not in (src, dst):
        return b""
    return frame[tcp + (frame[tcp + 12] >> 4) * 4:14 + total]


def _token_ids(cfg):
    """The first micro-batch's first 16 token ids, as int32 and int64 bytes (stage 0 sends them raw:
    ``net.compress_ids`` is off in this run)."""
    from mapl_swarm.data import prepare_data
    from mapl_swarm.data.batches import BatchSampler

    data = prepare_data(cfg.data, progress=False)
    row = BatchSampler(data.train, cfg.pipeline.micro_batch_size, cfg.model.context_length,
                       cfg.run.seed).batch_at(0)[0, :16].numpy()
    return [row.astype("<i4").tobytes(), row.astype("<i8").tobytes()]
