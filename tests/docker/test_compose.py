"""compose.yaml for real: the image built from a local base, the 4-stage swarm trained in containers.

Marked ``docker`` (not in the default run: CI has no Docker engine) and skipped where no engine
answers. Run with ``python -m pytest -m docker tests/docker``. Each test runs its own compose project
(``-p``) from compose.yaml plus an override that only shortens the run (the commands are compose.yaml's
own, with ``--set`` items appended), and takes it down with its volumes at the end.

The reference numbers come from ``mapl-swarm train`` in the same image: the corpus is the image's
Python standard library, which differs from this machine's.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from deadlines import wait_until  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
STAGES = [f"stage{k}" for k in range(4)]
STEPS = 12
SHORT = ["--set", f"run.steps={STEPS}", "--set", "checkpoint.interval_steps=4", "--set", "eval.interval_steps=4"]
"""What the tests change in compose.yaml's run: 12 steps, a checkpoint and a validation every 4."""


def _compose_command() -> list[str] | None:
    for cmd in (["docker", "compose"], ["docker-compose"]):
        if shutil.which(cmd[0]) and subprocess.run([*cmd, "version"], capture_output=True).returncode == 0:
            return cmd
    return None


def _engine() -> tuple[bool, str]:
    if shutil.which("docker") is None:
        return False, "no docker client"
    if subprocess.run(["docker", "info"], capture_output=True, timeout=30).returncode != 0:
        return False, "no Docker engine answers (`docker info` failed)"
    if _compose_command() is None:
        return False, "neither `docker compose` nor `docker-compose` is installed"
    return True, ""


ok, why = _engine()
pytestmark = [pytest.mark.docker, pytest.mark.skipif(not ok, reason=why), pytest.mark.timeout(1800)]


def _run(cmd: list[str], timeout: float = 600, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"`{' '.join(cmd)}` exited {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return proc


@pytest.fixture(scope="module")
def image():
    """``make docker-image``: the local Debian base (built when missing; needs root and debootstrap),
    the local torch wheel in docker/wheels, the image. Prints the build time, context and image size."""
    base_there = _run(["docker", "image", "inspect", "mapl-swarm-base:bookworm"], check=False).returncode == 0
    if not base_there and (os.geteuid() != 0 or shutil.which("debootstrap") is None):
        pytest.skip("no local base image and no way to build one (needs root and debootstrap)")
    t0 = time.monotonic()
    built = _run(["make", "docker-image"], timeout=1800)
    took = time.monotonic() - t0
    context = re.search(r"Sending build context to Docker daemon\s+(\S+)", built.stdout + built.stderr)
    size = _run(["docker", "image", "inspect", "-f", "{{.Size}}", "mapl-swarm:latest"]).stdout.strip()
    print(f"\nimage mapl-swarm:latest built in {took:.0f} s, build context {context.group(1) if context else '?'}, "
          f"image {int(size) / 1e9:.2f} GB")
    if context:  # .dockerignore keeps .venv, runs/, caches and .git out: the wheel is most of it
        number, unit = re.fullmatch(r"([\d.]+)([kMG]?B)", context.group(1)).groups()
        assert float(number) * {"B": 1e-6, "kB": 1e-3, "MB": 1, "GB": 1e3}[unit] < 400, context.group(1)
    return "mapl-swarm:latest"


class Project:
    """One compose project: compose.yaml + an override appending ``SHORT`` to every stage's command."""

    def __init__(self, name: str, tmp: Path) -> None:
        self.name = name
        spec = yaml.safe_load((ROOT / "compose.yaml").read_text())
        override = {"services": {s: {"command": spec["services"][s]["command"] + SHORT} for s in STAGES}}
        self.override = tmp / "short.yaml"
        self.override.write_text(yaml.safe_dump(override))
        self.cmd = [*_compose_command(), "-p", name, "-f", str(ROOT / "compose.yaml"), "-f", str(self.override)]

    def __call__(self, *args: str, timeout: float = 600, check: bool = True) -> subprocess.CompletedProcess:
        return _run([*self.cmd, *args], timeout=timeout, check=check)

    def container(self, service: str) -> str:
        return self("ps", "-q", service).stdout.strip()

    def state(self, service: str) -> dict:
        return json.loads(_run(["docker", "inspect", "-f", "{{json .State}}", self.container(service)]).stdout)

    def restarts(self, service: str) -> int:
        return int(_run(["docker", "inspect", "-f", "{{.RestartCount}}", self.container(service)]).stdout)

    def volume(self, name: str) -> Path:
        """The host folder of volume ``name`` (the tests run as root, as the engine's files need)."""
        return Path(_run(["docker", "volume", "inspect", "-f", "{{.Mountpoint}}", f"{self.name}_{name}"]).stdout.strip())

    def losses(self) -> list[float]:
        """Stage 0's per-step train losses so far (a line still being written is left out)."""
        path = self.volume("shared") / "run" / "metrics_stage0.jsonl"
        text = path.read_text() if path.exists() else ""
        records = [json.loads(line) for line in text[:text.rfind("\n") + 1].splitlines()]
        return [r["loss"] for r in records if "loss" in r]

    def wait_stages_exited(self, timeout_s: float) -> None:
        def done() -> bool:
            states = [self.state(s) for s in STAGES]
            return all(st["Status"] == "exited" for st in states)
        wait_until(done, timeout_s, lambda: f"stages still running:\n{self('logs', '--tail', '30').stdout[-6000:]}")

    def logs(self, service: str) -> str:
        return self("logs", "--no-color", service).stdout

    def down(self) -> None:
        self("down", "-v", "--remove-orphans", "-t", "20", check=False)
        left = _run(["docker", "ps", "-a", "-q", "--filter", f"label=com.docker.compose.project={self.name}"]).stdout
        assert left.strip() == "", f"containers left after down: {left}"


@pytest.fixture
def project(image, tmp_path, request):
    p = Project(f"mapltest{os.getpid()}{request.node.name[-6:].lower().strip('_')}", tmp_path)
    p.down()  # nothing of an earlier, interrupted test run
    yield p
    p.down()


@pytest.fixture(scope="module")
def reference(image, tmp_path_factory) -> list[float]:
    """``mapl-swarm train`` of the same config in the same image: the losses the swarm must match."""
    p = Project(f"mapltest{os.getpid()}ref", tmp_path_factory.mktemp("ref"))
    p.down()
    try:
        p("run", "--rm", "prepare", "train", "--config", "peers/compose.toml", *SHORT,
          "--set", 'run.out_dir="/shared/ref"', "--quiet", timeout=900)
        records = [json.loads(line) for line in
                   (p.volume("shared") / "ref" / "metrics.jsonl").read_text().splitlines()]
        return [r["loss"] for r in records if "loss" in r]
    finally:
        p.down()


def test_compose_trains_to_the_end_and_a_second_up_resumes(project, reference):
    """``up``; ``stop`` mid-run drains every stage to one saved step; ``up`` again continues from it
    (every peer logs that it resumes) and the run ends with exit 0 and the losses of ``train``."""
    t0 = time.monotonic()
    project("up", "-d")
    wait_until(lambda: len(project.losses()) >= 5, 600, lambda: project("logs", "--tail", "30").stdout[-6000:])
    project("stop", "-t", "60")  # SIGTERM to every container: the swarm drains
    for s in STAGES:
        assert project.state(s)["ExitCode"] == 0, project.logs(s)[-4000:]
    stopped_at = len(project.losses())
    assert stopped_at < STEPS
    project("up", "-d")
    project.wait_stages_exited(600)
    took = time.monotonic() - t0
    for s in STAGES:
        assert project.state(s)["ExitCode"] == 0, project.logs(s)[-4000:]
        assert re.search(rf"stage {s[-1]}: resuming \(checkpoint steps \[.*\]", project.logs(s)), s
    assert "Traceback" not in project("logs", "--no-color").stdout
    assert project.losses() == pytest.approx(reference, abs=1e-3)
    print(f"\ncompose up + stop at step {stopped_at} + up to step {STEPS}: {took:.0f} s")


def test_a_crashed_stage_restarts_and_a_killed_one_is_started_again(project, reference):
    """Stage 1's process is SIGKILLed from the host (a crash: the restart policy brings it back); later
    ``docker kill stage2`` (a manual stop, which Docker never restarts) and ``compose start stage2``.
    Both rejoin and the run ends with the losses of ``train``; ``down`` leaves no container."""
    t0 = time.monotonic()
    project("up", "-d")
    wait_until(lambda: len(project.losses()) >= 5, 600, lambda: project("logs", "--tail", "30").stdout[-6000:])
    os.kill(project.state("stage1")["Pid"], 9)
    wait_until(lambda: project.restarts("stage1") >= 1, 60, "stage 1 restarted by its restart policy")
    wait_until(lambda: len(project.losses()) >= 9, 600, lambda: project("logs", "--tail", "40").stdout[-6000:])
    _run(["docker", "kill", project.container("stage2")])
    assert project.state("stage2")["Status"] == "exited" and project.restarts("stage2") == 0
    project("start", "stage2")
    project.wait_stages_exited(900)
    took = time.monotonic() - t0
    for s in STAGES:
        assert project.state(s)["ExitCode"] == 0, project.logs(s)[-4000:]
    assert "resuming (checkpoint steps" in project.logs("stage1")
    assert "resuming (checkpoint steps" in project.logs("stage2")
    assert project.losses() == pytest.approx(reference, abs=1e-3)
    print(f"\ncompose up + crash of stage 1 + docker kill/start of stage 2 to step {STEPS}: {took:.0f} s")


def test_the_monitoring_override_scrapes_every_stage(image, tmp_path):
    """compose.monitoring.yaml: its Prometheus (built on the same local base) scrapes every stage's
    endpoint while the swarm trains: each stage's ``mapl_step`` series is up, and stage 0's train
    loss is the one its JSONL holds at that step."""
    _run(["docker", "build", "-f", "docker/prometheus.Dockerfile", "--build-arg", "BASE=mapl-swarm-base:bookworm",
          "-t", "mapl-swarm-prometheus:latest", "."], timeout=1800)
    p = Project(f"mapltest{os.getpid()}mon", tmp_path)
    p.cmd[p.cmd.index(str(p.override)):p.cmd.index(str(p.override))] = [str(ROOT / "compose.monitoring.yaml"), "-f"]
    p.down()
    try:
        p("up", "-d", "--no-build")

        def query(q: str) -> list[dict]:
            with urllib.request.urlopen(f"http://127.0.0.1:9090/api/v1/query?query={urllib.parse.quote(q)}",
                                        timeout=5) as resp:
                return json.loads(resp.read())["data"]["result"]

        def scraped() -> bool:
            try:
                steps = {r["metric"]["stage"]: float(r["value"][1]) for r in query("mapl_step")}
            except OSError:
                return False
            return sorted(steps) == ["0", "1", "2", "3"] and min(steps.values()) >= 2

        wait_until(scraped, 600, lambda: p("logs", "--tail", "30").stdout[-6000:])
        # one query: both series of the same scrape
        got = {r["metric"]["__name__"]: float(r["value"][1])
               for r in query('{__name__=~"mapl_step|mapl_train_loss",stage="0"}')}
        text = (p.volume("shared") / "run" / "metrics_stage0.jsonl").read_text()
        records = {r["step"]: r for r in map(json.loads, text.splitlines())}
        assert got["mapl_train_loss"] == pytest.approx(records[int(got["mapl_step"])]["loss"], rel=1e-9)
    finally:
        p.down()
