"""compose.yaml and the Dockerfile cannot run here (no Docker engine): validate them statically."""

import shlex
from pathlib import Path

import yaml

from mapl_swarm.cli import build_parser
from mapl_swarm.config import load_config

ROOT = Path(__file__).resolve().parents[2]


def _mounts(svc: dict) -> dict[str, tuple[str, str]]:
    """Volume mounts of a service: container path -> (volume, mode)."""
    out = {}
    for spec in svc.get("volumes", []):
        volume, path, *mode = spec.split(":")
        out[path] = (volume, mode[0] if mode else "rw")
    return out


def test_compose_runs_dht_and_one_peer_per_stage():
    compose = yaml.safe_load((ROOT / "compose.yaml").read_text())
    services = compose["services"]
    assert "dht" in services
    parser = build_parser()
    dht = parser.parse_args(services["dht"]["command"])
    assert dht.command == "dht" and dht.maddr_file
    maddr_file = dht.maddr_file
    stages = {}
    for name, svc in services.items():
        if name in ("dht", "keys"):
            continue
        args = parser.parse_args(svc["command"])  # every command parses with the real CLI
        assert args.command == "peer"
        assert args.initial_peers_file == maddr_file
        assert (ROOT / args.config).exists()
        cfg = load_config(ROOT / args.config)
        stages[args.stage] = (name, cfg)
        assert svc["build"]["dockerfile"] == "docker/Dockerfile"
        assert "dht" in svc.get("depends_on", [])
    num = {cfg.pipeline.num_stages for _, cfg in stages.values()}
    assert len(num) == 1 and sorted(stages) == list(range(num.pop()))
    for stage, (name, cfg) in stages.items():
        assert cfg.net.bind_host == "0.0.0.0" and cfg.net.port > 0
        # each peer advertises its own service name so the others can dial it
        cmd = " ".join(services[name]["command"])
        assert f'net.advertise_host="{name}"' in cmd


def test_compose_shares_one_run_key_read_only():
    """A one-shot `keys` service writes the run key to a volume; the DHT node and every peer start
    after it completed, mount that volume read-only and read the key by path (never inline)."""
    compose = yaml.safe_load((ROOT / "compose.yaml").read_text())
    services, parser = compose["services"], build_parser()
    keys = parser.parse_args(services["keys"]["command"])
    assert keys.command == "keys" and keys.if_missing and not keys.force
    key_dir = str(Path(keys.out).parent)
    volume, mode = _mounts(services["keys"])[key_dir]
    assert mode == "rw" and volume in compose["volumes"]
    assert services["keys"].get("depends_on") in ({}, [], None)
    for name, svc in services.items():
        if name == "keys":
            continue
        args = parser.parse_args(svc["command"])
        assert args.key_file == keys.out and not args.insecure, name
        assert _mounts(svc)[key_dir] == (volume, "ro"), name
        assert svc["depends_on"]["keys"] == {"condition": "service_completed_successfully"}, name
        assert not any("KEY" in str(k).upper() for k in svc.get("environment", {})), name


def test_dockerfile_installs_pinned_torch_then_package():
    text = (ROOT / "docker" / "Dockerfile").read_text()
    lines = [l for l in text.splitlines() if l and not l.startswith("#")]
    assert lines[0].startswith("FROM python:3.11")
    assert 'ARG TORCH_SPEC="torch==2.13.0"' in text
    torch_at = next(i for i, l in enumerate(lines) if "${TORCH_SPEC}" in l)
    pkg_at = next(i for i, l in enumerate(lines) if l.strip() == "RUN pip install .")
    assert torch_at < pkg_at
    for line in lines:
        if line.startswith("COPY"):
            src = shlex.split(line)[1:-1]
            for s in src:
                assert (ROOT / s).exists(), s
    entry = (ROOT / "docker" / "entrypoint.sh").read_text()
    assert 'exec mapl-swarm "$@"' in entry
