"""compose.yaml, compose.gpu.yaml and the Dockerfile, validated statically (the default run has no
Docker engine; tests/docker runs them for real)."""

import shlex
from pathlib import Path

import pytest
import yaml

from mapl_swarm.cli import build_parser, parse_overrides
from mapl_swarm.config import load_config

ROOT = Path(__file__).resolve().parents[2]


ONE_SHOT = ("keys", "prepare")
"""compose.yaml's services that run once before the swarm."""


def _compose(name: str = "compose.yaml") -> dict:
    return yaml.safe_load((ROOT / name).read_text())


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
        if name in ONE_SHOT + ("dht",):
            continue
        args = parser.parse_args(svc["command"])  # every command parses with the real CLI
        assert args.command == "peer"
        assert args.initial_peers_file == maddr_file
        assert (ROOT / args.config).exists()
        cfg = load_config(ROOT / args.config)
        stages[args.stage] = (name, cfg)
        assert svc["build"]["dockerfile"] == "docker/Dockerfile"
        assert svc["depends_on"]["dht"] == {"condition": "service_healthy"}
    num = {cfg.pipeline.num_stages for _, cfg in stages.values()}
    assert len(num) == 1 and sorted(stages) == list(range(num.pop()))
    for stage, (name, cfg) in stages.items():
        assert cfg.net.bind_host == "0.0.0.0" and cfg.net.port > 0
        # each peer advertises its own service name so the others can dial it
        cmd = " ".join(services[name]["command"])
        assert f'net.advertise_host="{name}"' in cmd


def test_compose_gives_each_stage_its_own_identity_read_only():
    """A one-shot `keys` service issues the identities (`keys local`) into a volume, its authority
    key in a volume of its own that no other service mounts; the DHT node and every peer start
    after it completed, mount the identities read-only and read their own by path (never inline)."""
    compose = yaml.safe_load((ROOT / "compose.yaml").read_text())
    services, parser = compose["services"], build_parser()
    keys = parser.parse_args(services["keys"]["command"])
    assert keys.command == "keys" and keys.func.__name__ == "_cmd_keys_local"
    volume, mode = _mounts(services["keys"])[keys.out]
    authority_dir = str(Path(keys.authority).parent)
    authority_volume, _ = _mounts(services["keys"])[authority_dir]
    assert mode == "rw" and volume in compose["volumes"] and authority_volume in compose["volumes"]
    assert services["keys"].get("depends_on") in ({}, [], None)
    assert keys.out not in _mounts(services["prepare"])  # data preparation needs no key
    stages = []
    for name, svc in services.items():
        if name in ONE_SHOT:
            continue
        args = parser.parse_args(svc["command"])
        assert args.cert.startswith(keys.out + "/") and not args.insecure, name
        if args.command == "peer":
            assert args.peer_key == f"{keys.out}/stage{args.stage}.key", name
            assert args.cert == f"{keys.out}/stage{args.stage}.cert", name
            stages.append(args.stage)
        assert _mounts(svc)[keys.out] == (volume, "ro"), name
        assert authority_volume not in {v for v, _ in _mounts(svc).values()}, name
        assert svc["depends_on"]["keys"] == {"condition": "service_completed_successfully"}, name
        assert not any("KEY" in str(k).upper() for k in svc.get("environment", {})), name
    assert sorted(stages) == [0, 1, 2, 3]


def test_keys_local_issues_what_the_compose_peers_load(tmp_path):
    """What the `keys` service writes is what each peer's --peer-key/--cert loads, for its stage only."""
    from mapl_swarm.cli import main
    from mapl_swarm.config import load_config
    from mapl_swarm.errors import ConfigError
    from mapl_swarm.net.identity import load_identity

    cfg = load_config(ROOT / "peers" / "compose.toml")
    assert main(["keys", "local", "--config", str(ROOT / "peers" / "compose.toml"), "--out", str(tmp_path / "keys"),
                 "--authority", str(tmp_path / "authority" / "authority.key")]) == 0
    assert not (tmp_path / "keys" / "authority.key").exists()
    for k in range(cfg.pipeline.num_stages):
        ident = load_identity(tmp_path / "keys" / f"stage{k}.key", tmp_path / "keys" / f"stage{k}.cert",
                              run_id=cfg.run.run_id, stage=k)
        assert ident.body.stages == (k,)
    with pytest.raises(ConfigError, match="stage_not_allowed"):
        load_identity(tmp_path / "keys" / "stage1.key", tmp_path / "keys" / "stage1.cert", run_id=cfg.run.run_id,
                      stage=2)


def test_dockerfile_takes_its_base_and_torch_as_arguments_then_installs_the_package():
    text = (ROOT / "docker" / "Dockerfile").read_text()
    lines = [l for l in text.splitlines() if l and not l.startswith("#")]
    assert lines[0] == "ARG BASE=python:3.11-slim"  # users with a registry; docker/build-base.sh here
    assert [l for l in lines if l.startswith("FROM")] == ["FROM ${BASE} AS venv", "FROM ${BASE}"]
    assert 'ARG TORCH_SPEC="torch==2.13.0"' in text and 'ARG TORCH_INDEX=' in text
    torch_at = next(i for i, l in enumerate(lines) if "${TORCH_SPEC}" in l)
    assert "--find-links /wheels" in lines[torch_at]  # local wheels (docker/wheels) before any index
    assert "${TORCH_INDEX:+" in lines[torch_at]  # an empty TORCH_INDEX asks PyPI only
    pkg_at = next(i for i, l in enumerate(lines) if "pip install --no-deps --force-reinstall ." in l)
    assert torch_at < pkg_at
    for line in lines:
        if line.startswith("COPY") and "--from=" not in line:
            src = shlex.split(line)[1:-1]
            for s in src:
                assert (ROOT / s).exists(), s
    entry = (ROOT / "docker" / "entrypoint.sh").read_text()
    assert 'exec mapl-swarm "$@"' in entry


def test_dockerignore_keeps_the_venv_runs_caches_and_git_out():
    ignored = {l.strip() for l in (ROOT / ".dockerignore").read_text().splitlines() if l and not l.startswith("#")}
    assert {".git", ".venv", "runs", ".mapl_cache", "**/__pycache__"} <= ignored
    gitignore = (ROOT / ".gitignore").read_text().splitlines()
    assert "docker/wheels/*" in gitignore and (ROOT / "docker" / "wheels" / "README.md").exists()


def test_compose_survives_restarts():
    """The DHT node keeps its peer id (an identity file on a volume) and announces its service name,
    so the address it writes can never go stale; its healthcheck gates the peers; one-shot services
    prepare keys and data; peers restart on failure and resume when their folder has a checkpoint."""
    compose, parser = _compose(), build_parser()
    services = compose["services"]
    dht_svc = services["dht"]
    dht = parser.parse_args(dht_svc["command"])
    assert dht.announce_host == "dht" and dht.port > 0
    identity_dir = str(Path(dht.identity).parent)
    assert _mounts(dht_svc)[identity_dir][1] == "rw" and _mounts(dht_svc)[identity_dir][0] in compose["volumes"]
    maddr_dir = str(Path(dht.maddr_file).parent)
    assert dht.maddr_file in " ".join(dht_svc["healthcheck"]["test"])
    assert dht_svc["restart"].startswith("on-failure")
    prepare = parser.parse_args(services["prepare"]["command"])
    assert prepare.command == "prepare" and services["prepare"]["restart"] == "no"
    prepared = load_config(ROOT / prepare.config).data
    for name, svc in services.items():
        if name in ONE_SHOT + ("dht",):
            continue
        args = parser.parse_args(svc["command"])
        assert args.auto_resume and not args.resume, name
        assert svc["restart"].startswith("on-failure"), name
        assert svc["depends_on"]["prepare"] == {"condition": "service_completed_successfully"}, name
        cfg = load_config(ROOT / args.config)
        assert cfg.data == prepared, name  # the shards the prepare service built
        assert _mounts(svc)[maddr_dir] == _mounts(dht_svc)[maddr_dir], name
        assert cfg.data.cache_dir.startswith(maddr_dir + "/") and cfg.run.out_dir.startswith(maddr_dir + "/")
        assert f"'127.0.0.1', {cfg.net.port}" in " ".join(svc["healthcheck"]["test"]), name


def _merged(base: dict, override: dict) -> dict:
    """Compose's merge of an override file: mappings merge key by key, everything else is replaced."""
    out = dict(base)
    for key, value in override.items():
        out[key] = _merged(base[key], value) if isinstance(value, dict) and isinstance(base.get(key), dict) else value
    return out


def test_gpu_override_reserves_one_gpu_per_stage_and_builds_cuda_torch():
    compose = _merged(_compose(), _compose("compose.gpu.yaml"))
    parser, gpus = build_parser(), []
    for name, svc in compose["services"].items():
        assert svc["image"] == "mapl-swarm:cuda", name
        assert "cu" in svc["build"]["args"]["TORCH_INDEX"] and svc["build"]["args"]["TORCH_SPEC"].startswith("torch")
        if name in ONE_SHOT + ("dht",):
            continue
        args = parser.parse_args(svc["command"])
        overrides = parse_overrides(args.set)
        cfg = load_config(ROOT / args.config, overrides)
        assert cfg.runtime.device == "cuda" and cfg.model.hidden_size == 1024, name  # the 150M recipe
        assert args.auto_resume, name
        assert (args.peer_key, args.cert) == (f"/keys/stage{args.stage}.key", f"/keys/stage{args.stage}.cert"), name
        (device,) = svc["deploy"]["resources"]["reservations"]["devices"]
        assert device["capabilities"] == ["gpu"] and device["driver"] == "nvidia"
        gpus += device["device_ids"]
    assert sorted(gpus) == ["0", "1", "2", "3"]
    prepare = parser.parse_args(compose["services"]["prepare"]["command"])
    assert load_config(ROOT / prepare.config, parse_overrides(prepare.set)).data == cfg.data
    keys = parser.parse_args(compose["services"]["keys"]["command"])  # identities for the run the peers train
    assert keys.func.__name__ == "_cmd_keys_local" and load_config(ROOT / keys.config).run.run_id == cfg.run.run_id


def test_the_replicas_override_runs_two_replicas_of_every_stage_each_with_its_own_identity_and_folder(tmp_path):
    """compose.replicas.yaml (over compose.yaml): stage<k>r1 extends stage<k>; every peer runs the
    replicas config, its own key and certificate (what `keys local` issues for that config), its own
    advertised name, and replica 1 its own run folder."""
    base, over = _compose()["services"], _compose("compose.replicas.yaml")["services"]
    parser = build_parser()
    keys = parser.parse_args(over["keys"]["command"])
    cfg = load_config(ROOT / keys.config)
    assert cfg.replicas.enabled and list(cfg.replicas.initial) == [2] * cfg.pipeline.num_stages
    assert parser.parse_args(over["prepare"]["command"]).config == keys.config
    peers = {}
    for name, svc in over.items():
        if name in ONE_SHOT:
            continue
        if name not in base:  # a replica: the stage's service of compose.yaml, its own command
            assert svc["extends"] == {"file": "compose.yaml", "service": name.removesuffix("r1")}
        args = parser.parse_args(svc["command"])
        assert args.command == "peer" and args.config == keys.config and not args.auto_resume
        assert svc["restart"] == "no"
        sets = parse_overrides(args.set or [])
        assert sets["net"]["advertise_host"] == name
        assert (args.peer_key, args.cert) == (f"/keys/{name}.key", f"/keys/{name}.cert")
        assert sets.get("run", {}).get("out_dir") == ("/shared/run/replica1" if name.endswith("r1") else None)
        peers[name] = args.stage
    assert sorted(peers.values()) == sorted([k for k in range(4) for _ in range(2)])
    # `keys local` with that config issues exactly those files
    from mapl_swarm.cli import main

    assert main(["keys", "local", "--config", str(ROOT / keys.config), "--out", str(tmp_path)]) == 0
    assert {p.name for p in tmp_path.glob("stage*.key")} == {f"{name}.key" for name in peers}


def test_monitoring_override_scrapes_every_stage_peer_on_its_metrics_port():
    """compose.monitoring.yaml: a Prometheus built like the peer image, on the swarm's network and
    a non-internal one for its UI port, scraping each stage service at the metrics port its
    config serves on (bound to every interface of its container)."""
    base, monitoring = _compose(), _compose("compose.monitoring.yaml")
    compose = _merged(base, monitoring)
    prom = compose["services"]["prometheus"]
    assert prom["build"]["dockerfile"] == "docker/prometheus.Dockerfile"
    assert (ROOT / "docker/prometheus.Dockerfile").read_text().count("ARG BASE=") == 1
    assert set(prom["networks"]) == {"default", "monitoring"} and "internal" not in compose["networks"]["monitoring"]
    assert prom["ports"] == ["127.0.0.1:9090:9090"]
    parser, targets = build_parser(), []
    for name, svc in base["services"].items():
        if name in ONE_SHOT + ("dht",):
            continue
        args = parser.parse_args(svc["command"])
        cfg = load_config(ROOT / args.config, parse_overrides(args.set))
        assert cfg.metrics.prometheus_host == "0.0.0.0" and cfg.metrics.prometheus_port
        targets.append(f"{name}:{cfg.metrics.prometheus_port}")
    (job,) = yaml.safe_load((ROOT / "docker/prometheus.yml").read_text())["scrape_configs"]
    (static,) = job["static_configs"]
    assert sorted(static["targets"]) == sorted(targets)
    assert set(prom["depends_on"]) == {t.split(":")[0] for t in targets}
    gpu = _merged(base, _compose("compose.gpu.yaml"))  # the GPU override's peers serve the same port
    for name in prom["depends_on"]:
        args = parser.parse_args(gpu["services"][name]["command"])
        assert load_config(ROOT / args.config, parse_overrides(args.set)).metrics.prometheus_port == 9400
