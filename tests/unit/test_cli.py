"""User mistakes give one-line errors, no traceback; config loading is strict."""

import subprocess
import sys

import pytest

from mapl_swarm.cli import parse_overrides
from mapl_swarm.config import load_config
from mapl_swarm.errors import ConfigError


def _run(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "mapl_swarm", *args], capture_output=True, text=True,
                          timeout=120, cwd=cwd)


def _assert_one_line_error(proc, *needles):
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    lines = [l for l in proc.stderr.splitlines() if l.startswith("mapl-swarm: error:")]
    assert len(lines) == 1, proc.stderr
    for n in needles:
        assert n in lines[0]


def test_unknown_config_key_names_key_and_file(tmp_path):
    cfg = tmp_path / "bad.toml"
    cfg.write_text('[pipeline]\nnum_stages = 2\nbogus_key = 3\n')
    _assert_one_line_error(_run("train", "--config", str(cfg)), "bogus_key", str(cfg))


def test_missing_corpus_path(tmp_path):
    missing = tmp_path / "nope"
    proc = _run("train", "--set", f'data.source="{missing}"', "--set", "run.steps=1",
                "--set", f'data.cache_dir="{tmp_path}/cache"')
    _assert_one_line_error(proc, str(missing))


def test_impossible_partition():
    proc = _run("train", "--set", "pipeline.num_stages=9")
    _assert_one_line_error(proc, "cannot split 8 layers over 9 stages")


def test_missing_config_file(tmp_path):
    _assert_one_line_error(_run("train", "--config", str(tmp_path / "x.toml")), "not found")


def test_overrides_parse_toml_values():
    assert parse_overrides(["run.steps=3", "compression.codec=none", 'data.source="a b"']) == {
        "run": {"steps": 3}, "compression": {"codec": "none"}, "data": {"source": "a b"}}
    with pytest.raises(ConfigError):
        parse_overrides(["nokey"])


def test_config_file_and_preset(tmp_path):
    p = tmp_path / "c.toml"
    p.write_text('preset = "150M"\n[model]\nnum_layers = 4\n[pipeline]\nnum_stages = 4\n')
    cfg = load_config(p)
    assert cfg.model.hidden_size == 1024 and cfg.model.num_layers == 4
    with pytest.raises(ConfigError, match="must be int"):
        p.write_text('[run]\nsteps = "ten"\n')
        load_config(p)
    with pytest.raises(ConfigError, match="unknown preset"):
        p.write_text('preset = "7B"\n')
        load_config(p)


def test_shipped_configs_load():
    from pathlib import Path
    root = Path(__file__).resolve().parents[2] / "peers"
    files = sorted(root.glob("*.toml"))
    assert files
    for f in files:
        load_config(f)


_NO_TORCH = r"""
import sys
from mapl_swarm.cli import main
args = sys.argv[1:]
rc = main(args)
assert "torch" not in sys.modules, args
sys.exit(rc)
"""


@pytest.mark.parametrize("args", [
    ["train", "--set", "model.bogus=1"],
    ["prepare", "--set", "model.bogus=1"],
    ["launch", "--set", "model.bogus=1", "--log-level", "WARNING"],
    ["peer", "--stage", "0", "--insecure", "--set", "model.bogus=1"],
    ["peer", "--stage", "0", "--peer-key", "missing.key", "--cert", "missing.cert"],  # read before torch too
    ["peer", "--stage", "0", "--key-file", "run.key"],  # a 1.x run key: refused with what to use
    ["dht", "--cert", "missing.cert"],
    ["lab", "--set", "model.bogus=1"],
    ["train", "--set", "compression.codec=mpal"],
    ["sweep", "--grid", "no_such_grid.toml"],
    ["peer", "--stage", "0", "--insecure", "--initial-peer", "/ip4/1.2.3/tcp/5/p2p/QmX"],  # a mistyped address
    ["peer", "--stage", "0", "--insecure", "--initial-peer", "10.0.0.1:31337"],
    ["peer", "--stage", "0", "--insecure", "--initial-peer", "/ip4/10.0.0.1/tcp/31337"],  # no peer id
    ["peer", "--insecure"],  # no stage, and not joining (which picks one)
    ["peer", "--insecure", "--join"],  # joining needs a run with replicas
    ["peer", "--stage", "1", "--insecure", "--set", 'net.reachable="no"'],  # dial-out needs CURVE keys
    ["peer", "--stage", "1", "--insecure", "--set", 'net.reachable="maybe"'],
    ["peer", "--stage", "1", "--insecure", "--set", 'net.relay="host:7400"'],  # no relay key
    ["relay", "--relay-key", "relay.key", "--insecure"],  # a relay serves certified members only
])
def test_config_errors_answer_before_torch_is_imported(args, tmp_path):
    proc = subprocess.run([sys.executable, "-c", _NO_TORCH, *args], capture_output=True, text=True, timeout=120,
                          cwd=tmp_path)
    _assert_one_line_error(proc)


def test_a_relay_announced_in_the_dht_needs_an_address_and_the_key_of_its_certificate(tmp_path):
    from mapl_swarm.net.identity import issue_local

    key, cert = issue_local(tmp_path / "ids", run_id="relayrun", num_stages=2).args(0)[1::2]
    announce = ["relay", "--cert", cert, "--initial-peer", "/ip4/127.0.0.1/tcp/9/p2p/QmPeer"]
    for args, needle in (([*announce, "--relay-key", key], "--announce-host"),
                         ([*announce, "--relay-key", str(tmp_path / "own.key"), "--announce-host", "10.0.0.1"],
                          "the peer key --cert was issued to")):
        proc = subprocess.run([sys.executable, "-c", _NO_TORCH, *args], capture_output=True, text=True, timeout=120,
                              cwd=tmp_path)
        _assert_one_line_error(proc, needle)


def test_log_level_after_the_subcommand_reaches_the_children():
    from mapl_swarm.cli import _config_args, build_parser

    parser = build_parser()
    args = parser.parse_args(["launch", "--config", "f.toml", "--log-level", "warning", "--quiet"])
    assert args.log_level == "WARNING" and args.quiet
    assert _config_args(args)[-2:] == ["--log-level", "WARNING"]
    assert parser.parse_args(["--log-level", "ERROR", "train"]).log_level == "ERROR"
    assert parser.parse_args(["train"]).log_level == "INFO"
    with pytest.raises(SystemExit):
        parser.parse_args(["train", "--log-level", "LOUD"])


def test_launched_peers_log_shared_facts_at_debug():
    import logging

    from mapl_swarm.cli import _SharedFactsAtDebug

    def record(name, level=logging.INFO):
        return logging.LogRecord(name, level, __file__, 1, "corpus ...", None, None)

    at_info = _SharedFactsAtDebug(logging.INFO)
    assert not at_info.filter(record("mapl_swarm.data.corpus"))
    assert not at_info.filter(record("mapl_swarm.net.discovery"))
    assert at_info.filter(record("mapl_swarm.peer.runtime"))
    assert at_info.filter(record("mapl_swarm.data.corpus", logging.WARNING))
    r = record("mapl_swarm.data.shards")
    assert _SharedFactsAtDebug(logging.DEBUG).filter(r) and r.levelname == "DEBUG"


def test_a_stage_outside_the_pipeline_is_named_before_the_certificate_is_read(tmp_path):
    """Not the certificate's "allows stage(s) [0], not 5": the range the run has."""
    proc = _run("peer", "--stage", "5", "--peer-key", "missing.key", "--cert", "missing.cert", cwd=tmp_path)
    _assert_one_line_error(proc, "--stage 5 is outside 0..3 (pipeline.num_stages)")
