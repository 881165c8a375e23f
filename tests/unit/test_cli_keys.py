"""`mapl-swarm keys` and the membership options of `peer` / `dht`: a peer runs without a certificate
only when told to, warning while it runs; a protocol 1.x run key is refused naming what replaces it."""

from __future__ import annotations

import logging
import subprocess
import sys
import threading

import pytest

from mapl_swarm.cli import build_parser, main
from mapl_swarm.peer.main import InsecureWarning


def keys(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mapl_swarm", "keys", *args], capture_output=True, text=True,
                          timeout=120)


def test_keys_without_a_subcommand_names_them_and_a_run_key_is_refused_naming_what_replaces_it(tmp_path, capsys):
    proc = keys("--out", str(tmp_path / "run.key"))  # a run key: no such thing any more
    assert proc.returncode == 2 and not (tmp_path / "run.key").exists()
    assert "choose from 'authority', 'peer', 'local'" in proc.stderr
    assert main(["keys"]) == 2
    err = capsys.readouterr().err
    assert err.count("mapl-swarm: error:") == 1 and "a subcommand (authority, peer, request, issue" in err
    (tmp_path / "run.key").write_text("mapl-run-key v1\n" + "00" * 32 + "\n")
    for command in (["peer", "--stage", "0"], ["dht"]):
        assert main([*command, "--key-file", str(tmp_path / "run.key")]) == 2
        err = capsys.readouterr().err
        assert err.count("mapl-swarm: error:") == 1 and "peers no longer share a run key" in err, err
        assert "--peer-key FILE --cert FILE" in err and "keys local" in err and "Traceback" not in err


@pytest.mark.parametrize("command", [["peer", "--stage", "0"], ["dht"]])
def test_a_certificate_or_insecure_is_required(command, capsys):
    parser = build_parser()
    with pytest.raises(SystemExit):
        parser.parse_args(command)
    assert "one of the arguments --cert --insecure is required" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parser.parse_args([*command, "--cert", "c", "--insecure"])
    assert parser.parse_args([*command, "--cert", "c"]).cert == "c"
    assert parser.parse_args([*command, "--insecure"]).insecure


def test_secret_file_and_key_file_are_not_offered(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["peer", "--stage", "0", "--insecure", "--secret-file", "s"])
    assert "unrecognized arguments: --secret-file" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        build_parser().parse_args(["peer", "--help"])
    assert "--key-file" not in capsys.readouterr().out


def test_insecure_peer_warns_at_once_and_then_periodically():
    seen = threading.Event()
    warnings: list[str] = []

    class Count(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            warnings.append(record.getMessage())
            if len(warnings) >= 3:
                seen.set()

    logger = logging.getLogger("mapl_swarm.peer.main")
    handler = Count(level=logging.WARNING)
    logger.addHandler(handler)
    try:
        with InsecureWarning(stage=2, interval_s=0.01):
            assert seen.wait(10), warnings
        n = len(warnings)
    finally:
        logger.removeHandler(handler)
    assert all(w.startswith("INSECURE: stage 2 runs without a certificate") and "--cert" in w for w in warnings)
    assert len(warnings) == n  # the thread stopped with the block
