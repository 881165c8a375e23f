"""A certified swarm of real peer processes (SPEC §7.2): a member cannot serve another stage, a
revoked peer is cut off within seconds while the swarm trains, and a stage's key is rotated
without stopping the others.

Two stages started by hand as an operator would (``dht --cert``, ``peer --peer-key --cert
--revocations``), each with its own identity from one authority; stage 1's host does not hold the
revocation list (as a compromised host would ignore it). Once training runs, the
operator revokes stage 1's certificate and replaces the list file: stage 0 cuts stage 1 off (a
departure) within 10 s of the write, and its DHT node reads stage 1's record as withdrawn, so the
re-forming stage 0 waits for another stage 1 peer. The operator rotates stage 1's key: a new key,
a certificate for it, and ``peer --resume`` with them. The swarm re-forms around it (run epoch 1)
and trains on, stage 0 never restarted; the revoked peer's HELLO is refused (``not_certified``),
which stops it.
"""

from __future__ import annotations

import signal
import time

import pytest

from mapl_swarm.net.identity import (CertificateBody, create_peer_key, issue, issue_local, make_request, read_signed,
                                     revoke, write_signed)

from swarm_helpers import Watched, cli, wait_steps, write_config

RUN = "certified-swarm"


@pytest.mark.timeout(400)
def test_a_member_serves_only_its_stage_a_revoked_one_is_cut_off_and_a_key_rotates_while_training(tmp_path):
    local = issue_local(tmp_path / "ids", run_id=RUN, num_stages=2)
    lists = tmp_path / "revoked.list"
    write_signed(lists, revoke(local.authority, [], run_id=RUN, now=1000))
    config = write_config(tmp_path / "c.toml", stages=2, steps=400, cache=tmp_path / "cache", out=tmp_path / "out",
                          run_id=RUN, timeout=120)
    config.write_text(config.read_text().replace("[net]\n", "[net]\nheartbeat_interval_s = 0.5\nliveness_floor_s = 3\n")
                      + "[runtime]\nthreads = 1\n[checkpoint]\ninterval_steps = 2\n")  # a short liveness floor: the
    # revoked peer, cut off without a word, notices sooner that it lost stage 0

    # a member certified for stage 1 only, trying to serve stage 0: refused before any work
    member = create_peer_key(tmp_path / "member.key")
    write_signed(tmp_path / "member.cert", issue(local.authority, make_request(member, "member", [1]), run_id=RUN))
    wrong = Watched(cli("peer", "--config", str(config), "--stage", "0", "--peer-key", str(tmp_path / "member.key"),
                        "--cert", str(tmp_path / "member.cert"), "--quiet"))
    assert wrong.wait(60) == 2 and "allows stage(s) [1], not 0 (stage_not_allowed)" in wrong.output

    dht = Watched(cli("dht", "--host", "127.0.0.1", "--cert", str(local.cert_file(0))))
    procs = [dht]
    try:
        maddr = dht.wait_for(r"--initial-peer (\S+)", 60).group(1)
        def peer(stage: int, *member: str, resume: bool = False, listed: bool = True) -> Watched:
            p = Watched(cli("peer", "--config", str(config), "--stage", str(stage), "--initial-peer", maddr, "--quiet",
                            *member, *(["--revocations", str(lists)] if listed else []),
                            *(["--resume"] if resume else [])))
            procs.append(p)
            return p

        # stage 1's host ignores the list (as a compromised one would): the others must cut it off
        peers = [peer(0, *local.args(0)), peer(1, *local.args(1), listed=False)]
        wait_steps(tmp_path / "out", 1, peers, 300)
        serial = CertificateBody.decode(read_signed(local.cert_file(1), "certificate").body).serial
        written = time.monotonic()
        write_signed(lists, revoke(local.authority, [serial], run_id=RUN, now=2000), force=True)
        peers[0].wait_for(rf"stage 1 at \S+ left before the end: its certificate \(serial {serial}\) is revoked", 10)
        assert time.monotonic() - written < 10
        peers[0].wait_for(r"waiting for stage 1 in the DHT", 60)  # the revoked one's record reads as withdrawn

        # the operator rotates stage 1's key: the swarm re-forms around the new identity
        rotated = create_peer_key(tmp_path / "stage1-new.key")
        write_signed(tmp_path / "stage1-new.cert",
                     issue(local.authority, make_request(rotated, "stage1-new", [1]), run_id=RUN))
        replacement = peer(1, "--peer-key", str(tmp_path / "stage1-new.key"), "--cert",
                           str(tmp_path / "stage1-new.cert"), resume=True)
        start = int(peers[0].wait_for(r"agreeing -> training: from step (\d+) \(run epoch 1\)", 120).group(1))
        wait_steps(tmp_path / "out", start + 2, [peers[0], replacement], 120)
        assert peers[0].proc.poll() is None  # never restarted
        assert peers[1].wait(120) == 2
        assert f"stage 0 refused stage 1: HELLO of stage 1 refused: certificate of 'stage1' (serial {serial}) is " \
               f"revoked (revoked)" in peers[1].output
        assert "configuration" not in peers[1].output.rsplit("refused stage 1", 1)[1].split("\n")[0]
    finally:
        for p in reversed(procs):
            p.stop(signal.SIGINT if p is dht else signal.SIGTERM)
