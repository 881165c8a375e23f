"""``net.reachable = "auto"``: a peer decides by a dial-back whether it serves as a dial-out peer;
dial-out contacts are never asked to dial back (nobody can reach them)."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import pytest

from mapl_swarm.config import config_from_dict
from mapl_swarm.net.identity import issue_local, load_identity
from mapl_swarm.peer.dialback import Reachability, reachability
from mapl_swarm.peer.main import decide_reachable

RUN = "decide-run"


def _cfg(**sections):
    return config_from_dict({"run": {"run_id": RUN}, "pipeline": {"num_stages": 3},
                             "net": {"reachable": "auto"}, **sections}, "test")


@pytest.mark.parametrize("ok, decided", [(True, "yes"), (False, "no"), (None, "yes")])
def test_auto_takes_the_dial_backs_verdict(ok, decided, caplog):
    check = Reachability(ok, "what the dial-back found")
    with caplog.at_level(logging.INFO, logger="mapl_swarm.peer.main"):
        cfg = decide_reachable(_cfg(), check, 1)
    assert cfg.net.reachable == decided
    assert "what the dial-back found" in caplog.text
    if ok is None:  # nobody could be asked: said, with what to set on a NATed host
        assert 'set net.reachable = "no"' in caplog.text


def test_auto_in_a_run_with_replicas_dials_out_too():
    cfg = decide_reachable(_cfg(replicas={"enabled": True}), Reachability(False, "no live peer could dial"), 1)
    assert cfg.net.reachable == "no"


@dataclass
class _Record:
    contact: str

    def silent(self, status_s: float) -> bool:
        return False


def test_a_dial_out_peer_is_never_asked_to_dial_back(tmp_path):
    local = issue_local(tmp_path, run_id=RUN, num_stages=3)
    me = load_identity(local.key_file(2), local.cert_file(2), run_id=RUN, stage=2)
    staged = [(1, _Record("dialout#" + "ab" * 32))]
    check = reachability(_cfg(), me, 2, staged, status_s=5.0)
    assert check.ok is None and "no live peer to dial back" in check.detail
