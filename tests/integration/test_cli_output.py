"""What `mapl-swarm launch` prints for people: --log-level after the subcommand reaches every peer."""

import subprocess

import pytest

from swarm_helpers import cli, write_config

pytestmark = pytest.mark.timeout(300)


def test_launch_quiet_warning_prints_no_info_lines(tmp_path):
    path = write_config(tmp_path / "c.toml", stages=2, steps=2, cache=tmp_path / "cache", out=tmp_path / "run",
                        run_id="quiet")
    proc = subprocess.run(cli("launch", "--config", str(path), "--log-level", "WARNING", "--quiet"),
                          capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout + proc.stderr
    assert " INFO " not in out and "LinkConfig(" not in out, out
    assert "payload" in proc.stdout and "on the wire" in proc.stdout
