"""compose.yaml and the Dockerfile cannot run here (no Docker engine): validate them statically."""

import shlex
from pathlib import Path

import yaml

from mapl_swarm.cli import build_parser
from mapl_swarm.config import load_config

ROOT = Path(__file__).resolve().parents[2]


def test_compose_runs_dht_and_one_peer_per_stage():
    compose = yaml.safe_load((ROOT / "compose.yaml").read_text())
    services = compose["services"]
    assert "dht" in services
    dht_cmd = services["dht"]["command"]
    assert dht_cmd[0] == "dht" and "--maddr-file" in dht_cmd
    maddr_file = dht_cmd[dht_cmd.index("--maddr-file") + 1]
    stages = {}
    parser = build_parser()
    for name, svc in services.items():
        if name == "dht":
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
