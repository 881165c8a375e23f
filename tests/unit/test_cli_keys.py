"""`mapl-swarm keys` and the key options of `peer` / `dht` (issue 12 item 1): keys come from files,
are never printed, and a peer runs without one only when told to, warning while it runs."""

from __future__ import annotations

import logging
import stat
import subprocess
import sys
import threading

import pytest

from mapl_swarm.cli import build_parser, main
from mapl_swarm.net.runkey import load_run_key
from mapl_swarm.peer.main import InsecureWarning


def keys(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mapl_swarm", "keys", *args], capture_output=True, text=True,
                          timeout=120)


def test_keys_writes_a_0600_file_and_never_prints_the_key(tmp_path):
    path = tmp_path / "run.key"
    proc = keys("--out", str(path))
    assert proc.returncode == 0, proc.stderr
    key = load_run_key(path)
    out = proc.stdout + proc.stderr
    assert str(path) in proc.stdout and key.key_id in proc.stdout
    for secret in (key.secret.hex(), key.curve_secret.decode(), key.auth_key.hex(), key.dht_key.hex()):
        assert secret not in out and secret[:16] not in out
    assert stat.S_IMODE(path.stat().st_mode) == 0o600

    again = keys("--out", str(path))  # refuses to overwrite: a one-line error
    assert again.returncode == 2 and again.stderr.count("mapl-swarm: error:") == 1
    assert "already exists (--force replaces it" in again.stderr
    assert load_run_key(path).secret == key.secret

    kept = keys("--out", str(path), "--if-missing")
    assert kept.returncode == 0 and key.key_id in kept.stdout and load_run_key(path).secret == key.secret

    rotated = keys("--out", str(path), "--force")
    new = load_run_key(path)
    assert rotated.returncode == 0 and new.key_id in rotated.stdout and new.secret != key.secret
    assert new.secret.hex() not in rotated.stdout + rotated.stderr


def test_keys_if_missing_still_checks_the_existing_file(tmp_path, capsys):
    path = tmp_path / "run.key"
    path.write_text("not a key\n")
    path.chmod(0o644)
    assert main(["keys", "--out", str(path), "--if-missing"]) == 2
    assert "chmod 600" in capsys.readouterr().err


@pytest.mark.parametrize("command", [["peer", "--stage", "0"], ["dht"]])
def test_a_certificate_a_key_file_or_insecure_is_required(command, capsys):
    parser = build_parser()
    with pytest.raises(SystemExit):
        parser.parse_args(command)
    assert "one of the arguments --cert --key-file --insecure is required" in capsys.readouterr().err
    for two in (["--key-file", "k", "--insecure"], ["--cert", "c", "--key-file", "k"]):
        with pytest.raises(SystemExit):
            parser.parse_args([*command, *two])
    assert parser.parse_args([*command, "--cert", "c"]).cert == "c"
    assert parser.parse_args([*command, "--insecure"]).insecure
    assert parser.parse_args([*command, "--key-file", "k"]).key_file == "k"


def test_secret_file_is_gone(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["peer", "--stage", "0", "--key-file", "k", "--secret-file", "s"])
    assert "unrecognized arguments: --secret-file" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        build_parser().parse_args(["peer", "--help"])
    assert "no separate secret" in " ".join(capsys.readouterr().out.split())


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
    assert all(w.startswith("INSECURE: stage 2 runs without a run key") and "--key-file" in w for w in warnings)
    assert len(warnings) == n  # the thread stopped with the block
