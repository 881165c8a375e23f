"""Nothing of a peer's DHT outlives the peer, and closing it is quiet (issue 13, items 4 and 5).

A peer-like process (dht_peer_process.py) starts DHT nodes the way a peer does. Its process
tree is read from /proc: the DHT node processes (forked), their p2pd daemons and the
torch_shm_manager that hivemind's shared-memory futures start. Then:

* SIGKILL of the peer (one node started on the main thread, one on a thread that has ended):
  every one of them is gone within 5 s, and so are p2pd's unix sockets and the peer's /dev/shm
  segments;
* SIGINT to the peer's process group (Ctrl-C in a terminal): the peer closes its nodes, exits 0,
  stderr has no traceback, go-libp2p error or hard-kill warning, and nothing is left behind.
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import NamedTuple

import pytest

from mapl_swarm.procs import parent_death_signal_supported

from deadlines import wait_until

SCRIPT = Path(__file__).with_name("dht_peer_process.py")
ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.skipif(not (parent_death_signal_supported() and Path("/proc/self/stat").exists()),
                                reason="needs Linux: prctl(PR_SET_PDEATHSIG) and /proc")


class Proc(NamedTuple):
    pid: int
    start: int  # clock ticks after boot: tells a process from a later one with the same pid
    name: str


def read_proc(pid: int) -> tuple[int, str, int, str] | None:
    """(ppid, state, start time, comm) of ``pid``; None when it does not exist."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    comm, rest = raw[raw.index("(") + 1: raw.rindex(")")], raw[raw.rindex(")") + 2:].split()
    return int(rest[1]), rest[0], int(rest[19]), comm


def descendants(root: int) -> list[Proc]:
    """Every live process below ``root``."""
    children: dict[int, list[tuple[int, int, str]]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and (info := read_proc(int(entry.name))) is not None:
            children.setdefault(info[0], []).append((int(entry.name), info[2], info[3]))
    found, todo = [], [root]
    while todo:
        for pid, start, name in children.get(todo.pop(), []):
            found.append(Proc(pid, start, name))
            todo.append(pid)
    return found


def gone(proc: Proc) -> bool:
    info = read_proc(proc.pid)
    return info is None or info[1] in "ZX" or info[2] != proc.start


def start_peer(mode: str) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    return subprocess.Popen([sys.executable, str(SCRIPT), mode], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env=env, text=True, start_new_session=True)


def wait_ready(peer: subprocess.Popen, timeout_s: float = 60.0) -> dict:
    deadline = time.monotonic() + timeout_s
    assert peer.stdout is not None
    while time.monotonic() < deadline:
        if select.select([peer.stdout], [], [], max(0.0, deadline - time.monotonic()))[0]:
            line = peer.stdout.readline()
            if line.startswith("READY "):
                return json.loads(line.removeprefix("READY "))
            if not line:
                break
    peer.kill()
    _, err = peer.communicate(timeout=10)
    raise AssertionError(f"peer process not ready within {timeout_s:g} s; stderr:\n{err[-4000:]}")


def p2pd_sockets(proc: Proc) -> list[Path]:
    """The unix sockets of a p2pd process (its control socket and its client's)."""
    args = Path(f"/proc/{proc.pid}/cmdline").read_bytes().decode().split("\0")
    path = next(a.removeprefix("-listen=/unix") for a in args if a.startswith("-listen=/unix/"))
    return [Path(path), Path(path.replace("-p2pd-", "-p2pclient-"))]


def reap(peer: subprocess.Popen, tree: list[Proc]) -> None:
    """Whatever the test's outcome: no process of the peer's tree stays."""
    if peer.poll() is None:
        peer.kill()
    for proc in tree:  # first: they may hold the peer's output pipes open
        if not gone(proc):
            os.kill(proc.pid, signal.SIGKILL)
    peer.communicate(timeout=30)


@pytest.mark.timeout(120)
def test_sigkill_of_the_peer_leaves_no_process_socket_or_shm_segment() -> None:
    peer = start_peer("hold")
    tree: list[Proc] = []
    try:
        info = wait_ready(peer)
        tree = descendants(peer.pid)
        assert {p.pid for p in tree} >= set(info["dht_pids"]), tree
        sockets = [s for p in tree if p.name == "p2pd" for s in p2pd_sockets(p)]
        assert len(sockets) == 4, f"not one p2pd per DHT node below the peer: {tree}"
        assert sockets[0].exists() and sockets[2].exists()
        shm = sorted(Path("/dev/shm").glob(f"torch_{peer.pid}_*"))  # hivemind's MPFuture state bytes

        peer.kill()
        peer.wait(timeout=10)
        t0 = time.monotonic()
        wait_until(lambda: all(gone(p) for p in tree), 5.0,
                   lambda: f"the peer's tree gone after its SIGKILL (alive: {[p for p in tree if not gone(p)]})")
        wait_until(lambda: not any(p.exists() for p in [*sockets, *shm]), 5.0 - (time.monotonic() - t0),
                   lambda: f"nothing left behind (left: {[str(p) for p in [*sockets, *shm] if p.exists()]})")
    finally:
        reap(peer, tree)


def communicate_or_dump(peer: subprocess.Popen, timeout_s: float) -> tuple[str, str]:
    """``peer.communicate``; when it times out, the failure shows every thread's stack (SIGUSR1:
    the child's faulthandler) and the output so far."""
    try:
        return peer.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.kill(peer.pid, signal.SIGUSR1)
        try:
            out, err = peer.communicate(timeout=5)
        except subprocess.TimeoutExpired:
            peer.kill()
            out, err = peer.communicate()
        raise AssertionError(f"the peer did not exit within {timeout_s:g} s; stdout {out!r}; stderr with its "
                             f"threads' stacks:\n{err[-12000:]}") from None


@pytest.mark.timeout(120)
def test_sigint_to_the_process_group_closes_the_dht_quietly() -> None:
    peer = start_peer("sigint")
    tree: list[Proc] = []
    try:
        wait_ready(peer)
        tree = descendants(peer.pid)
        sockets = [s for p in tree if p.name == "p2pd" for s in p2pd_sockets(p)]
        assert len(sockets) == 4, tree  # two nodes, two sockets each
        shm = sorted(Path("/dev/shm").glob(f"torch_{peer.pid}_*"))

        os.killpg(peer.pid, signal.SIGINT)  # Ctrl-C: the whole foreground process group
        out, err = communicate_or_dump(peer, 75)  # a loaded machine: closing two DHT nodes can take tens of s
        assert (peer.returncode, out.split()[-1:]) == (0, ["CLOSED"]), err[-4000:]
        for bad in ("Traceback", "ERROR", "grace period", "hard way", "did not stop", "terminate called"):
            assert bad not in err, f"{bad!r} in the peer's stderr:\n{err[-4000:]}"
        wait_until(lambda: all(gone(p) for p in tree), 5.0,
                   lambda: f"the peer's tree gone (alive: {[p for p in tree if not gone(p)]})")
        wait_until(lambda: not any(p.exists() for p in [*sockets, *shm]), 5.0,
                   lambda: f"nothing left behind (left: {[str(p) for p in [*sockets, *shm] if p.exists()]})")
    finally:
        reap(peer, tree)
