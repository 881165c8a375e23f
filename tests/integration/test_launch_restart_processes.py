"""launch --max-restarts with real processes: the launcher's Supervisor runs stand-in peers, built by
the same ``peer_processes`` (only the interpreter is a small script), so nothing depends on the peers'
own rejoin. A stage that dies is started again with ``--resume`` while the others keep running; once
its restarts are spent the swarm stops with exit status 2 naming the stage; a forwarded signal reaches
a restarted peer and nothing restarts while the swarm drains."""

from __future__ import annotations

import json
import logging
import os
import select
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from mapl_swarm.errors import MaplError
from mapl_swarm.launch import PeerProcess, RestartPolicy, Supervisor, _Forwarded, peer_processes

from deadlines import wait_until

pytestmark = pytest.mark.timeout(120)

# Stands in for the interpreter in ``[python, "-m", "mapl_swarm", "peer", *config_args, "--stage", S, ...]``;
# config_args are LOG FIFO MODES (one mode per stage). Every start appends a JSON line to LOG.
FAKE_PEER = r'''#!{python}
import json, os, signal, subprocess, sys

log, fifo, modes = sys.argv[4:7]
stage = int(sys.argv[sys.argv.index("--stage") + 1])
mode, _, arg = modes.split(",")[stage].partition(":")


def record(**what):
    with open(log, "a") as f:
        f.write(json.dumps({{"stage": stage, "pid": os.getpid(), **what}}) + "\n")


with open(log) as f:  # this stage's earlier starts
    start = sum(1 for r in map(json.loads, f) if r["stage"] == stage and r["event"] == "start")
record(event="start", start=start, pgid=os.getpgid(0), argv=sys.argv[4:], gpu=os.environ.get("CUDA_VISIBLE_DEVICES"))


def serve():
    """Announce this pid on FIFO, wait for SIGTERM (the launcher's forwarded one), exit with ARG."""
    signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGTERM])
    with open(fifo, "w") as f:
        f.write(f"{{stage}} {{os.getpid()}}\n")
    signal.sigwait([signal.SIGTERM])
    record(event="SIGTERM")
    sys.exit(int(arg))


if mode == "wait":  # the neighbour left alone: until the restarted stage writes to FIFO
    with open(fifo) as f:
        f.read()
    sys.exit(0)
if mode == "die-twice":
    if start == 0:  # a helper in its process group (as its DHT node would be), then SIGKILL
        helper = subprocess.Popen([sys.executable, "-c", "import signal; signal.pause()"])
        record(event="helper", helper=helper.pid)
        os.kill(os.getpid(), signal.SIGKILL)
    if start == 1:
        sys.exit(3)  # NonFiniteError's status
    with open(fifo, "w") as f:
        f.write("resumed\n")
    sys.exit(0)
if mode == "die":  # once every stage has started (else the swarm could stop one before its start record)
    import time
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        with open(log) as f:
            if len({{r["stage"] for r in map(json.loads, f) if r["event"] == "start"}}) == len(modes.split(",")):
                break
        time.sleep(0.01)  # polls the other processes' records: they have no event to wait on
    sys.exit(1)
if mode == "serve":
    serve()
if mode == "die-then-serve":
    if start == 0:
        sys.exit(1)
    serve()
sys.exit(f"unknown mode {{mode}}")
'''


def _peers(tmp_path: Path, modes: list[str], gpus: list[str | None]):
    fake = tmp_path / "fake-python"
    fake.write_text(FAKE_PEER.format(python=sys.executable))
    fake.chmod(0o755)
    log, fifo = tmp_path / "starts.jsonl", tmp_path / "fifo"
    log.touch()
    os.mkfifo(fifo)
    peers = peer_processes(len(modes), [str(log), str(fifo), ",".join(modes)], maddr="/ip4/127.0.0.1/tcp/1/p2p/Q",
                           threads=1, progress=False, gpus=gpus, environ=dict(os.environ),
                           member_args=[["--peer-key", "k", "--cert", "c"]] * len(modes),
                           python=str(fake))
    return peers, log, fifo


def _records(log: Path) -> list[dict]:
    return [json.loads(line) for line in log.read_text().splitlines()]


def _starts(log: Path, stage: int) -> list[dict]:
    return [r for r in _records(log) if r["stage"] == stage and r["event"] == "start"]


def _wait_gone(pid: int, timeout_s: float) -> bool:
    """Whether process ``pid`` (not our child) has exited within ``timeout_s``."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return True
    try:
        return bool(select.select([fd], [], [], timeout_s)[0])
    finally:
        os.close(fd)


def test_a_dead_stage_restarts_with_resume_and_the_others_are_left_alone(tmp_path, caplog):
    caplog.set_level(logging.WARNING, logger="mapl_swarm.launch")
    peers, log, _ = _peers(tmp_path, ["wait", "die-twice"], gpus=[None, "7"])
    swarm = Supervisor(RestartPolicy(3))
    try:
        swarm.start(peers)
        first = [p.pid for p in swarm.procs]
        swarm.run(_Forwarded(), 60, drain_timeout_s=10)
    finally:
        swarm.stop()
    assert [p.returncode for p in swarm.procs] == [0, 0]
    assert swarm.procs[0].pid == first[0] and len(_starts(log, 0)) == 1  # stage 0 never restarted
    starts = _starts(log, 1)
    assert [s["start"] for s in starts] == [0, 1, 2]
    assert starts[0]["pid"] == first[1]
    base = peers[1].cmd[4:]
    assert starts[0]["argv"] == base and starts[1]["argv"] == starts[2]["argv"] == base + ["--resume"]
    for s in starts:  # the same PeerProcess: its key file, GPU, process group of its own
        assert s["gpu"] == "7" and s["pgid"] == s["pid"] and "--peer-key" in s["argv"]
    assert swarm.policy.counts() == {"1": 2}
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == [
        f"stage 1 (pid {starts[0]['pid']}) died (SIGKILL); restarting it with --resume (restart 1 of 3)",
        f"stage 1 (pid {starts[1]['pid']}) died (status 3); restarting it with --resume (restart 2 of 3)",
    ]
    helper = next(r["helper"] for r in _records(log) if r["event"] == "helper")
    gone = _wait_gone(helper, 10)
    if not gone:
        os.kill(helper, signal.SIGKILL)
    assert gone, "the dead peer's process group outlived it"


def _stopped(swarm: Supervisor, peers) -> pytest.ExceptionInfo[MaplError]:
    """Run ``peers`` under ``swarm``, which must stop with a MaplError; every peer is stopped after."""
    try:
        swarm.start(peers)
        with pytest.raises(MaplError) as err:
            swarm.run(_Forwarded(), 60, drain_timeout_s=10)
    finally:
        swarm.stop()
    return err


def test_a_companion_that_exits_stops_the_swarm_naming_it(tmp_path):
    """The lab's DHT node is a companion: its exit stops every peer, with one line naming it."""
    peers, _, _ = _peers(tmp_path, ["wait", "wait"], gpus=[None] * 2)
    dht = subprocess.Popen([sys.executable, "-c", "import sys; sys.exit(4)"])
    swarm = Supervisor(RestartPolicy(3), {"the lab's DHT node": dht})
    err = _stopped(swarm, peers)
    assert str(err.value) == "the lab's DHT node exited with status 4; stopped the swarm"
    assert all(p.returncode is not None for p in swarm.procs)  # every peer stopped and reaped
    assert swarm.policy.counts() == {}  # nothing restarted


@pytest.mark.parametrize("max_restarts", [0, 2])
def test_a_stage_out_of_restarts_stops_the_swarm_naming_it(tmp_path, max_restarts):
    peers, log, _ = _peers(tmp_path, ["wait", "die", "wait"], gpus=[None] * 3)
    swarm = Supervisor(RestartPolicy(max_restarts))
    err = _stopped(swarm, peers)
    spent = "no restarts allowed" if max_restarts == 0 else "restarted 2 times already"
    assert str(err.value) == (f"stage 1 peer exited with status 1; {spent} (--max-restarts {max_restarts}); "
                              f"stopped the swarm")
    assert err.value.exit_code == 2
    assert len(_starts(log, 1)) == max_restarts + 1
    assert len(_starts(log, 0)) == len(_starts(log, 2)) == 1
    assert all(p.returncode is not None for p in swarm.procs)  # every peer stopped and reaped


@pytest.mark.parametrize("status_on_sigterm", [0, 1])
def test_a_forwarded_signal_reaches_a_restarted_peer_and_nothing_restarts_while_draining(tmp_path,
                                                                                         status_on_sigterm):
    peers, log, fifo = _peers(tmp_path, ["serve:0", f"die-then-serve:{status_on_sigterm}"], gpus=[None] * 2)
    ready: list[str] = []

    def signal_when_both_serve() -> None:  # like Ctrl-C, once stage 0 and the restarted stage 1 wait for it
        with open(fifo) as f:
            while len(ready) < 2:
                line = f.readline()
                if not line or line == "stop\n":
                    return
                ready.append(line)
        os.kill(os.getpid(), signal.SIGTERM)

    fd = os.open(fifo, os.O_RDWR)  # keeps the FIFO open: the reader never sees EOF between writers
    reader = threading.Thread(target=signal_when_both_serve, daemon=True)
    reader.start()
    swarm = Supervisor(RestartPolicy(3))
    try:
        with _Forwarded() as signals:
            swarm.start(peers)
            if status_on_sigterm == 0:
                swarm.run(signals, 60, drain_timeout_s=30)
            else:
                with pytest.raises(MaplError, match=r"^stage 1 peer exited with status 1; stopped the swarm$"):
                    swarm.run(signals, 60, drain_timeout_s=30)
    finally:
        swarm.stop()
        os.write(fd, b"stop\n")
        reader.join(10)
        os.close(fd)
    assert signals.received == ["SIGTERM"]
    starts = _starts(log, 1)
    assert len(starts) == 2 and starts[1]["argv"][-1] == "--resume"  # not restarted after the signal
    got = {(r["stage"], r["pid"]) for r in _records(log) if r["event"] == "SIGTERM"}
    assert got == {(0, swarm.procs[0].pid), (1, starts[1]["pid"])}
    assert swarm.policy.counts() == {"1": 1}


def test_a_replica_that_dies_leaves_its_stage_to_the_others(tmp_path, caplog):
    """With replicas (SPEC §9.10) a peer whose stage keeps a running replica is not restarted and
    does not stop the swarm: the others go on (the peers' schedule drops it); the run ends when they do."""
    caplog.set_level(logging.WARNING, logger="mapl_swarm.launch")
    fifos = [tmp_path / "fifo0", tmp_path / "fifo1"]
    for f in fifos:
        os.mkfifo(f)
    env = dict(os.environ)
    peers = [PeerProcess(0, [sys.executable, "-c", f"open({str(fifos[0])!r}).read()"], env, None),
             PeerProcess(1, [sys.executable, "-c", f"open({str(fifos[1])!r}).read()"], env, None, 0),
             PeerProcess(1, [sys.executable, "-c", "raise SystemExit(3)"], env, None, 1)]
    swarm = Supervisor(RestartPolicy(3))  # restarts allowed: still none for a replica with a partner
    errors: list[BaseException] = []
    supervising = _supervise(swarm, peers, errors)
    _end_when(lambda: swarm.left == {2}, "the dead replica's exit handled", swarm, supervising, fifos, errors)
    assert [p.returncode for p in swarm.procs] == [0, 0, 3]
    assert "stage 1 replica 1" in caplog.text and "stage 1 goes on with its 1 other replica(s)" in caplog.text
    assert caplog.text.count("goes on with") == 1  # handled once, not at every poll
    assert swarm.policy.counts() == {}


def test_a_replica_the_swarm_took_for_gone_joins_again_on_a_new_port_at_most_the_restarts(tmp_path, caplog):
    """A replica that exits with status 4 (the swarm took it for gone, SPEC §9.10 item 10) while its
    stage keeps a running one is started again with ``--join``, without ``--resume`` and without its
    fixed port (its old contact is gone at every member), at most ``--max-restarts`` times per stage;
    then it is left as any replica that exits."""
    caplog.set_level(logging.WARNING, logger="mapl_swarm.launch")
    fifos, count = [tmp_path / "fifo0", tmp_path / "fifo1"], tmp_path / "starts"
    for f in fifos:
        os.mkfifo(f)
    env = dict(os.environ)
    taken = (f"import pathlib; c = pathlib.Path({str(count)!r}); "
             f"c.write_text(c.read_text() + ' '.join(__import__('sys').argv[1:]) + chr(10) if c.exists() else "
             f"' '.join(__import__('sys').argv[1:]) + chr(10)); raise SystemExit(4)")
    peers = [PeerProcess(0, [sys.executable, "-c", f"open({str(fifos[0])!r}).read()"], env, None),
             PeerProcess(1, [sys.executable, "-c", f"open({str(fifos[1])!r}).read()"], env, None, 0),
             PeerProcess(1, [sys.executable, "-c", taken, "--set", "net.port=5601", "--resume"], env, None, 1)]
    swarm = Supervisor(RestartPolicy(0), rejoins=2)  # no restarts (no re-form), two rejoins
    errors: list[BaseException] = []
    supervising = _supervise(swarm, peers, errors)
    _end_when(lambda: swarm.left == {2}, "the replica left after its rejoins", swarm, supervising, fifos, errors)
    starts = count.read_text().splitlines()
    assert starts == ["--set net.port=5601 --resume", "--join", "--join"]
    assert caplog.text.count("starting it again with --join") == 2
    assert "stage 1 goes on with its 1 other replica(s)" in caplog.text
    assert swarm.policy.counts() == {}


def test_a_stages_last_replica_that_dies_is_restarted_with_resume(tmp_path):
    """The last running replica of a stage dies (its partner left before): the swarm re-forms and
    waits for it (SPEC §9.10 item 10), so it is started again with ``--resume``, as a chain's peer."""
    fifos, marker = [tmp_path / "fifo0", tmp_path / "fifo1"], tmp_path / "started"
    for f in fifos:
        os.mkfifo(f)
    env = dict(os.environ)
    once = (f"import pathlib, sys; m = pathlib.Path({str(marker)!r}); "
            f"sys.exit(3) if not m.exists() and not m.touch() else open({str(fifos[1])!r}).read()")
    peers = [PeerProcess(0, [sys.executable, "-c", f"open({str(fifos[0])!r}).read()"], env, None),
             PeerProcess(1, [sys.executable, "-c", "raise SystemExit(3)"], env, None, 1),
             PeerProcess(1, [sys.executable, "-c", once], env, None, 0)]
    swarm = Supervisor(RestartPolicy(3))
    errors: list[BaseException] = []
    swarm.start(peers[:2])
    wait_until(lambda: swarm.procs[1].poll() is not None, 30, "the first replica's exit")
    swarm.start(peers[2:])
    supervising = _supervise(swarm, [], errors)
    _end_when(lambda: swarm.policy.counts() == {"1": 1}, "the last replica restarted", swarm, supervising, fifos, errors)
    assert swarm.left == {1} and swarm.peers[2].cmd[-1] == "--resume"
    assert [p.returncode for p in swarm.procs] == [0, 3, 0]


def _supervise(swarm: Supervisor, peers: list[PeerProcess], errors: list[BaseException]) -> threading.Thread:
    """Start ``peers`` and :meth:`Supervisor.run` in a thread (what it raises goes to ``errors``)."""
    def run() -> None:
        try:
            swarm.run(_Forwarded(), 60, drain_timeout_s=10)
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            errors.append(exc)

    swarm.start(peers)
    supervising = threading.Thread(target=run)
    supervising.start()
    return supervising


def _end_when(ready, what: str, swarm: Supervisor, supervising: threading.Thread, fifos: list[Path],
              errors: list[BaseException]) -> None:
    """Once ``ready()`` (``what``), the peers waiting on ``fifos`` end their run; the supervisor
    returns without an error (every peer stopped either way)."""
    try:
        wait_until(lambda: ready() or errors, 30, what)
        for f in fifos:
            with open(f, "w"):
                pass
        supervising.join(30)
    finally:
        swarm.stop()
    assert not errors and not supervising.is_alive()
