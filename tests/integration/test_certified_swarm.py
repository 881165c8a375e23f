"""A certified swarm of real peer processes (SPEC §7.5): a member cannot serve another stage, and
a revoked peer is cut off within seconds while the swarm trains.

Two stages started by hand as an operator would (``dht --cert``, ``peer --peer-key --cert``), each
with its own identity from one authority; stage 0 also watches the authority's revocation list.
Once training runs, the operator revokes stage 1's certificate and replaces the file: stage 0 cuts
stage 1 off (a departure) within 10 s of the write, and stage 1's HELLO to the re-forming swarm is
refused (``not_certified``), which stops it.
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
def test_a_member_serves_only_its_stage_and_a_revoked_one_is_cut_off_within_seconds(tmp_path):
    local = issue_local(tmp_path / "ids", run_id=RUN, num_stages=2)
    lists = tmp_path / "revoked.list"
    write_signed(lists, revoke(local.authority, [], run_id=RUN, now=1000))
    config = write_config(tmp_path / "c.toml", stages=2, steps=400, cache=tmp_path / "cache", out=tmp_path / "out",
                          run_id=RUN, timeout=120)
    config.write_text(config.read_text() + "[runtime]\nthreads = 1\n")

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
        peers = []
        for stage in (0, 1):
            extra = ["--revocations", str(lists)] if stage == 0 else []
            peers.append(Watched(cli("peer", "--config", str(config), "--stage", str(stage), "--initial-peer", maddr,
                                     "--quiet", *local.args(stage), *extra)))
        procs += peers
        wait_steps(tmp_path / "out", 1, peers, 300)
        serial = CertificateBody.decode(read_signed(local.cert_file(1), "certificate").body).serial
        written = time.monotonic()
        write_signed(lists, revoke(local.authority, [serial], run_id=RUN, now=2000), force=True)
        peers[0].wait_for(rf"stage 1 at \S+ left before the end: its certificate \(serial {serial}\) is revoked", 10)
        assert time.monotonic() - written < 10
        assert peers[1].wait(120) == 2
        assert f"stage 0 refused stage 1: HELLO of stage 1 refused: certificate of 'stage1' (serial {serial}) is " \
               f"revoked (revoked)" in peers[1].output
        assert "configuration" not in peers[1].output.rsplit("refused stage 1", 1)[1].split("\n")[0]
    finally:
        for p in reversed(procs):
            p.stop(signal.SIGINT if p is dht else signal.SIGTERM)
