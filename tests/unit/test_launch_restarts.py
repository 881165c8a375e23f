"""launch --max-restarts: the restart decision (pure), the --resume command, the CLI flag."""

from __future__ import annotations

import signal

import pytest

from mapl_swarm.errors import ConfigError
from mapl_swarm.launch import PeerProcess, RestartPolicy, exit_text, resumed

from conftest import capture_launch


def test_each_stage_gets_its_own_restarts_then_stops_the_swarm():
    policy = RestartPolicy(2)
    assert [policy.decide(1, 1, stopping=False) for _ in range(3)] == ["restart", "restart", "stop"]
    assert policy.decide(1, 1, stopping=False) == "stop"  # spent for good
    assert policy.decide(0, -signal.SIGKILL, stopping=False) == "restart"  # stage 0 still has its own
    assert policy.counts() == {"0": 1, "1": 2}
    assert policy.used(1) == 2 and policy.used(2) == 0


def test_zero_restarts_stops_on_the_first_death():
    policy = RestartPolicy(0)
    assert policy.decide(0, 2, stopping=False) == "stop"
    assert policy.decide(1, -signal.SIGKILL, stopping=False) == "stop"
    assert policy.counts() == {}


def test_status_zero_is_the_end_of_a_run_not_a_restart():
    policy = RestartPolicy(1)
    assert policy.decide(0, 0, stopping=False) == "done"
    assert policy.decide(0, 0, stopping=True) == "done"  # drained: done too
    assert policy.counts() == {}


@pytest.mark.parametrize("status", [1, 2, 3, 130, -signal.SIGKILL, -signal.SIGSEGV, -signal.SIGTERM])
def test_any_death_is_restarted_nan_and_signals_included(status):
    policy = RestartPolicy(3)
    assert policy.decide(2, status, stopping=False) == "restart"
    assert policy.counts() == {"2": 1}


@pytest.mark.parametrize("status", [1, 3, 130, -signal.SIGKILL, -signal.SIGINT])
def test_nothing_restarts_while_the_swarm_drains_or_stops(status):
    policy = RestartPolicy(3)
    assert policy.decide(1, status, stopping=True) == "stop"
    assert policy.counts() == {}  # not counted: the stage keeps its restarts


def test_negative_max_restarts_is_a_config_error():
    with pytest.raises(ConfigError, match="--max-restarts -1"):
        RestartPolicy(-1)


def test_exit_text_names_the_signal_or_the_status():
    assert exit_text(-signal.SIGKILL) == "SIGKILL"
    assert exit_text(-signal.SIGTERM) == "SIGTERM"
    assert exit_text(3) == "status 3"
    assert exit_text(-200) == "signal 200"


def test_a_restarted_peer_is_the_same_peer_with_resume_once():
    peer = PeerProcess(1, ["py", "-m", "mapl_swarm", "peer", "--stage", "1", "--peer-key", "k", "--cert", "c", "--quiet"],
                       {"CUDA_VISIBLE_DEVICES": "3", "PATH": "/bin"}, "3")
    again = resumed(peer)
    assert again.cmd == peer.cmd + ["--resume"]
    assert (again.stage, again.env, again.gpu) == (peer.stage, peer.env, peer.gpu)
    assert resumed(again) == again  # never twice
    assert peer.cmd[-1] == "--quiet"  # the original is left as it was


def test_cli_flag_is_per_stage_defaults_to_3_and_reaches_launch(monkeypatch):
    from mapl_swarm import cli

    parser = cli.build_parser()
    assert parser.parse_args(["launch"]).max_restarts == 3
    assert parser.parse_args(["launch", "--max-restarts", "0"]).max_restarts == 0
    launch_parser = parser._subparsers._group_actions[0].choices["launch"]
    assert "per stage" in launch_parser.format_help()

    # what launch() does first: its restart policy
    got = capture_launch(monkeypatch, "max_restarts", first=lambda kw: RestartPolicy(kw["max_restarts"]))
    assert cli.main(["launch", "--max-restarts", "5", "--quiet"]) == 2
    assert got == {"max_restarts": 5}
    assert cli.main(["launch", "--max-restarts", "-1", "--quiet"]) == 2
    assert got == {"max_restarts": -1}
