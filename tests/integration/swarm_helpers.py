"""Helpers for multi-process swarm tests: watched subprocesses, a DHT bootstrap, small configs."""

from __future__ import annotations

import asyncio
import functools
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path

from deadlines import wait_until

CONFIG = """
preset = "tiny"
[model]
vocab_size = 512
hidden_size = 64
num_layers = 4
num_heads = 4
ffn_hidden_size = 128
context_length = 32
[compression]
codec = "{codec}"
rank = {rank}
anchor_rank = 16
[optim]
warmup_steps = 2
[data]
vocab_size = 512
max_corpus_bytes = 400000
val_fraction = 0.2
cache_dir = "{cache}"
[run]
steps = {steps}
out_dir = "{out}"
run_id = "{run_id}"
[pipeline]
num_stages = {stages}
micro_batch_size = 2
num_micro_batches = 3
[eval]
interval_steps = {steps}
batches = 2
[net]
timeout_s = {timeout}
"""


def train_losses(out_dir: Path) -> list[float]:
    """Per-step train losses an in-process run wrote to ``out_dir/metrics.jsonl``."""
    records = [json.loads(line) for line in (Path(out_dir) / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in records if "loss" in r]


def write_config(path: Path, *, codec="mapl", rank=16, stages=4, steps=5, cache: Path, out: Path,
                 run_id="test", timeout=60) -> Path:
    path.write_text(CONFIG.format(codec=codec, rank=rank, stages=stages, steps=steps, cache=cache, out=out,
                                  run_id=run_id, timeout=timeout))
    return path


class Watched:
    """A subprocess whose stdout/stderr lines are collected by threads; wait for patterns."""

    def __init__(self, cmd: list[str], **popen) -> None:
        """``popen``: more ``subprocess.Popen`` arguments (stdin, preexec_fn...)."""
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **popen)
        self.lines: list[str] = []
        self._cond = threading.Condition()
        self._threads = [threading.Thread(target=self._pump, args=(s,), daemon=True)
                         for s in (self.proc.stdout, self.proc.stderr)]
        for t in self._threads:
            t.start()

    def _pump(self, stream) -> None:
        for line in stream:
            with self._cond:
                self.lines.append(line.rstrip("\n"))
                self._cond.notify_all()

    def wait_for(self, pattern: str, timeout: float) -> re.Match:
        rx = re.compile(pattern)
        with self._cond:
            self._cond.wait_for(lambda: any(rx.search(l) for l in self.lines) or self.proc.poll() is not None,
                                timeout)
            for l in self.lines:
                m = rx.search(l)
                if m:
                    return m
        raise AssertionError(f"{pattern!r} not seen within {timeout} s (exited={self.proc.poll()}):\n"
                             + "\n".join(self.lines[-30:]))

    def wait(self, timeout: float) -> int:
        """The exit status; a process still running after ``timeout`` is stopped (SIGINT, then
        SIGKILL) and the failure shows its output."""
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.stop(signal.SIGINT, timeout=30)
            raise AssertionError(f"{self.proc.args[:4]}... still running after {timeout} s; its output:\n"
                                 + "\n".join(self.lines[-60:])) from None
        for t in self._threads:
            t.join(5)
        return code

    @property
    def output(self) -> str:
        return "\n".join(self.lines)

    def stop(self, sig=signal.SIGTERM, timeout: float = 20) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@functools.cache
def _identities_root() -> Path:
    """The folder of the identities the swarm tests issue (one per test process)."""
    return Path(tempfile.mkdtemp(prefix="mapl-test-ids-"))


def identity_args(run_id: str, num_stages: int, stage: int) -> list[str]:
    """``--peer-key``/``--cert`` of stage ``stage`` of run ``run_id``: issued once per test process
    by one authority per run (``issue_local``, as ``launch`` does: each stage its own key and a
    certificate for it alone, with the drain role)."""
    from mapl_swarm.net.identity import issue_local

    return issue_local(_identities_root() / f"{run_id}-{num_stages}", run_id=run_id, num_stages=num_stages).args(stage)


def _run_of(args: tuple[str, ...]) -> tuple[str, int, int]:
    """(run id, stages, stage) of a ``peer`` command line, read with the CLI's own config loading."""
    from mapl_swarm.cli import _load, build_parser

    ns = build_parser().parse_args([*args, "--insecure"])
    cfg = _load(ns)
    return cfg.run.run_id, cfg.pipeline.num_stages, ns.stage


def steps_done(out: Path) -> int:
    """Train losses stage 0 has recorded in its metrics stream so far (a rollback truncates it)."""
    path = out / "metrics_stage0.jsonl"
    if not path.exists():
        return 0
    return sum(1 for line in path.read_text().splitlines() if '"loss"' in line)


def kill_first_logged(procs: dict, keys: Sequence, pattern: re.Pattern, what: str, sig: int = signal.SIGKILL):
    """``sig`` (SIGKILL) to the first of ``procs[key]`` (:class:`Watched`, for ``key`` in ``keys``) to
    log a line ``pattern`` finds, as soon as it did (``what`` names the line if none comes within 120
    s); its key."""
    found: list = []
    wait_until(lambda: found.extend(k for k in keys if any(pattern.search(line) for line in procs[k].lines)) or found,
               120, what)
    procs[found[0]].proc.send_signal(sig)
    return found[0]


def kill_when_logged(procs: dict, keys: Sequence, pattern: re.Pattern, what: str) -> dict:
    """:func:`kill_first_logged`, then wait for the others to end, each with status 0 (else fail
    with their output), and return them."""
    killed = kill_first_logged(procs, keys, pattern, what)
    survivors = {key: p for key, p in procs.items() if key != killed}
    codes = {key: p.wait(240) for key, p in survivors.items()}
    assert all(code == 0 for code in codes.values()), {k: (c, survivors[k].output[-3000:]) for k, c in codes.items()
                                                       if c}
    return survivors


def wait_steps(out: Path, n: int, procs: list, timeout_s: float) -> int:
    """Until stage 0 recorded ``n`` steps; fails, with the output of a :class:`Watched` one, if one
    of ``procs`` (Popen or Watched) exits, or when time runs out."""
    def reached() -> bool:
        for p in procs:
            proc = getattr(p, "proc", p)
            assert proc.poll() is None, (f"a process exited early ({proc.poll()})"
                                         + (f":\n{p.output[-6000:]}" if isinstance(p, Watched) else ""))
        return steps_done(out) >= n

    wait_until(reached, timeout_s, lambda: f"{n} steps recorded (only {steps_done(out)})")
    return steps_done(out)


def ctrl_c_after(cmd: list[str], out: Path, steps: int, *, timeout_s: float = 10,
                 cleanup: int = signal.SIGKILL) -> tuple[int, str, str, float]:
    """Start ``cmd`` (a swarm writing its metrics to ``out``) in a session of its own; after stage 0
    recorded ``steps`` steps, SIGINT to its process group (a terminal's Ctrl-C). Its (status,
    stdout, stderr, seconds from the SIGINT to its exit); one still running ``timeout_s`` after it
    gets ``cleanup`` (SIGKILL: to its whole group) and fails the test."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        wait_steps(out, steps, [proc], 300)
        interrupted = time.monotonic()
        os.killpg(proc.pid, signal.SIGINT)
        stdout, stderr = proc.communicate(timeout=timeout_s)
        return proc.returncode, stdout, stderr, time.monotonic() - interrupted
    finally:
        if proc.poll() is None:
            if cleanup == signal.SIGKILL:
                os.killpg(proc.pid, signal.SIGKILL)
            else:
                proc.send_signal(cleanup)
            proc.communicate(timeout=60)


def pids(*pgrep_args: str) -> list[int]:
    """The pids ``pgrep`` finds with these arguments (e.g. ``"-f", pattern``)."""
    return [int(p) for p in subprocess.run(["pgrep", *pgrep_args], capture_output=True, text=True).stdout.split()]


def crash(pattern: str, what: str) -> None:
    """SIGKILL every process whose command line ``pattern`` finds (a peer and its forked DHT child:
    a host crash); fails naming ``what`` when there is none."""
    killed = pids("-f", pattern)
    assert killed, f"no {what} found"
    for pid in killed:
        os.kill(pid, signal.SIGKILL)


def cli(*args: str) -> list[str]:
    """``mapl-swarm ARGS``; a ``peer`` gets its stage's identity (:func:`identity_args`, for the run
    and stage its options name) unless ARGS choose (``--cert`` or ``--insecure``)."""
    if args and args[0] == "peer" and not {"--cert", "--insecure"} & set(args):
        args = (*args, *identity_args(*_run_of(args)))
    return [sys.executable, "-m", "mapl_swarm", *args]


def dht_cli(config: Path, *args: str, run_id: str | None = None) -> list[str]:
    """``mapl-swarm dht`` for the run of ``config`` (or ``run_id``, with that config's stages): it
    trusts that run's authority (``--cert`` of its stage 0, as :func:`identity_args` issues it)."""
    config_run, stages, _ = _run_of(("peer", "--config", str(config), "--stage", "0"))
    return cli("dht", *args, "--cert", identity_args(run_id or config_run, stages, 0)[-1])


def start_dht(config: Path | None, *args: str, run_id: str | None = None) -> tuple[Watched, str]:
    """A DHT bootstrap node on 127.0.0.1 for the run of ``config`` (or ``run_id``; config None:
    with ``--insecure``; ``args``: more options) and its multiaddr."""
    cmd = cli("dht", "--host", "127.0.0.1", "--insecure", *args) if config is None else \
        dht_cli(config, "--host", "127.0.0.1", *args, run_id=run_id)
    dht = Watched(cmd)
    maddr = dht.wait_for(r"--initial-peer (\S+)", 60).group(1)
    return dht, maddr


class Directory:
    """Endpoints by stage, in memory (what the DHT does between hosts)."""

    def __init__(self) -> None:
        self.endpoints: dict[int, str] = {}
        self.changed = asyncio.Event()

    def announcer(self, stage: int):
        async def announce(endpoint: str) -> None:
            self.endpoints[stage] = endpoint
            self.changed.set()
        return announce

    async def resolve(self, stage: int, timeout_s: float) -> str:
        async def wait() -> str:
            while stage not in self.endpoints:
                self.changed.clear()
                await self.changed.wait()
            return self.endpoints[stage]
        return await asyncio.wait_for(wait(), timeout_s)


class ReplicaSwarm:
    """A 3-stage ``mapl`` run (or ``codec``; ``mapl_vq`` learns per step) with replicas (SPEC §9.10) as real processes: its config under
    ``tmp_path`` (6 micro-batches a step, uniform routing, 1 s matchmaking), a certified identity
    per replica (``identities[s]`` replicas of stage s), a DHT bootstrap, and :meth:`start` for
    each ``peer``; ``initial``: the replicas each stage starts with (``replicas.initial``). A
    context manager: leaving it stops every process and the DHT."""

    def __init__(self, tmp_path: Path, run_id: str, *, steps: int, identities: list[int], codec: str = "mapl",
                 initial: tuple[int, int, int] = (2, 2, 2)) -> None:
        from mapl_swarm.config import load_config
        from mapl_swarm.net.identity import issue_local

        self.out = tmp_path / "swarm"
        self.path = write_config(tmp_path / f"{run_id}.toml", codec=codec, stages=3, steps=steps,
                                 cache=tmp_path / "cache", out=self.out, run_id=run_id)
        vq = '\n[compression.vq]\nupdate = "step"\ncodebook_size = 16\n' if codec == "mapl_vq" else ""
        self.path.write_text(self.path.read_text().replace("num_micro_batches = 3", "num_micro_batches = 6") + vq
                             + f'\n[replicas]\nenabled = true\ninitial = {list(initial)}\nmatchmaking_s = 1.0\n'
                               'routing = "uniform"\n')
        self.cfg = load_config(self.path)
        self.local = issue_local(_identities_root() / f"{run_id}-3", run_id=run_id, num_stages=3, replicas=identities)
        self.procs: dict[tuple[int, int], Watched] = {}
        self.dht, self.maddr = start_dht(self.path)

    def start(self, stage: int, r: int, *more: str, pick: bool = False, env: dict[str, str] | None = None) -> Watched:
        """Replica ``r`` of ``stage`` (``pick``: started without ``--stage``; ``env``: its environment),
        in its own run folder."""
        from mapl_swarm.launch import replica_out_dir

        args = ["peer", "--config", str(self.path), *([] if pick else ["--stage", str(stage)]), "--initial-peer",
                self.maddr, *self.local.args(stage, r), *more]
        if r:
            args += ["--set", f"run.out_dir={json.dumps(str(replica_out_dir(self.out, r)))}"]
        self.procs[stage, r] = Watched(cli(*args), **({"env": env} if env is not None else {}))
        return self.procs[stage, r]

    def result(self, stage: int, r: int) -> dict:
        from mapl_swarm.launch import replica_out_dir

        return json.loads((replica_out_dir(self.out, r) / f"peer_stage{stage}.json").read_text())

    def __enter__(self) -> "ReplicaSwarm":
        return self

    def __exit__(self, *exc) -> None:
        for (s, r), p in self.procs.items():
            p.stop()
            (self.out.parent / f"peer-{s}-{r}.log").write_text(p.output)  # for a failure's reader
        self.dht.stop()
