"""``launch`` / ``lab --revocations FILE`` (issue 46): every local peer gets the authority's list, which
it re-reads when it changes; a file that is no list of this run by this swarm's authority is named
before any peer starts."""

from __future__ import annotations

import pytest

from mapl_swarm.errors import ConfigError
from mapl_swarm.launch import peer_processes, revocation_args
from mapl_swarm.net.identity import issue_local, revoke, write_signed

from conftest import capture_launch

RUN = "revocations-run"


def test_every_local_peer_gets_the_checked_list_and_a_wrong_one_is_named(tmp_path):
    local = issue_local(tmp_path / "ids", run_id=RUN, num_stages=2)
    good = tmp_path / "revoked.list"
    write_signed(good, revoke(local.authority, [3], run_id=RUN))
    args = revocation_args(good, local, RUN)
    assert args == ["--revocations", str(good.resolve())]
    peers = peer_processes(2, ["--config", "c.toml"], maddr="/ip4/127.0.0.1/tcp/1/p2p/x", threads=1, progress=False,
                           gpus=[None, None], environ={}, member_args=[[*local.args(s), *args] for s in range(2)])
    assert all(p.cmd[p.cmd.index("--revocations") + 1] == str(good.resolve()) for p in peers)
    assert revocation_args(None, local, RUN) == []

    other = issue_local(tmp_path / "other", run_id=RUN, num_stages=2)  # another authority's list
    foreign = tmp_path / "foreign.list"
    write_signed(foreign, revoke(other.authority, [1], run_id=RUN))
    with pytest.raises(ConfigError, match=r"--revocations .*foreign.list: not a revocation list of run "
                                          r"'revocations-run' by this swarm's authority"):
        revocation_args(foreign, local, RUN)
    with pytest.raises(ConfigError, match=r"--revocations .*missing.list: no such file"):
        revocation_args(tmp_path / "missing.list", local, RUN)
    other_run = tmp_path / "run2.list"
    write_signed(other_run, revoke(local.authority, [1], run_id="another-run"))
    with pytest.raises(ConfigError, match="not a revocation list of run 'revocations-run'"):
        revocation_args(other_run, local, RUN)


def test_the_launch_option_reaches_launch(monkeypatch):
    from mapl_swarm import cli

    got = capture_launch(monkeypatch, "revocations")
    assert cli.main(["launch", "--revocations", "revoked.list", "--quiet"]) == 2
    assert got == {"revocations": "revoked.list"}
