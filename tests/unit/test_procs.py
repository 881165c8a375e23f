"""mapl_swarm.procs on real processes: a child dies with its SIGKILLed parent (issue 13, item 5).

Each case starts a small Python "parent" that starts a child and prints the child's pid, then
SIGKILLs the parent and waits, with a deadline, for the child to be gone.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from mapl_swarm.procs import parent_death_signal_supported

from deadlines import wait_until

ROOT = Path(__file__).resolve().parents[2]
ENV = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))

pytestmark = pytest.mark.skipif(not (parent_death_signal_supported() and Path("/proc/self/stat").exists()),
                                reason="needs Linux: prctl(PR_SET_PDEATHSIG) and /proc")

PREEXEC_PARENT = """
import subprocess, sys
from mapl_swarm.procs import die_with_parent
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], preexec_fn=die_with_parent())
print(child.pid, flush=True)
sys.stdin.read()
"""

WATCHED_CHILD = """
import os, sys, threading
from mapl_swarm.procs import watch_parent
assert watch_parent(int(sys.argv[1]), lambda: os._exit(0)) is not None
print("watching", flush=True)
threading.Event().wait()
"""
WATCH_PARENT = f"""
import os, subprocess, sys
child = subprocess.Popen([sys.executable, "-c", {WATCHED_CHILD!r}, str(os.getpid())], stdout=subprocess.PIPE)
assert child.stdout.readline() == b"watching\\n"
print(child.pid, flush=True)
sys.stdin.read()
"""


def alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat[stat.rindex(")") + 2] not in "ZX"


def kill_parent_and_check_child(parent_code: str) -> None:
    parent = subprocess.Popen([sys.executable, "-c", parent_code], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              env=ENV, text=True)
    child = 0
    try:
        assert parent.stdout is not None
        child = int(parent.stdout.readline())
        assert alive(child)
        parent.kill()
        parent.wait(timeout=10)
        wait_until(lambda: not alive(child), 5.0, "the child's death after its parent was SIGKILLed")
    finally:
        parent.kill()
        if child and alive(child):  # first: it holds the parent's stdout open
            os.kill(child, signal.SIGKILL)
        parent.communicate(timeout=10)


@pytest.mark.timeout(60)
def test_die_with_parent_preexec_kills_the_child_with_its_parent() -> None:
    kill_parent_and_check_child(PREEXEC_PARENT)


@pytest.mark.timeout(60)
def test_watch_parent_calls_back_when_the_parent_dies() -> None:
    if not hasattr(os, "pidfd_open"):
        pytest.skip("os.pidfd_open unavailable")
    kill_parent_and_check_child(WATCH_PARENT)


@pytest.mark.timeout(60)
def test_a_parent_already_gone_sends_the_signal_at_once() -> None:
    code = ("import signal; from mapl_swarm.procs import set_parent_death_signal\n"
            "set_parent_death_signal(signal.SIGTERM, parent_pid=-1)\nprint('survived')")
    done = subprocess.run([sys.executable, "-c", code], env=ENV, capture_output=True, text=True, timeout=30)
    assert (done.returncode, done.stdout) == (-signal.SIGTERM, "")


SIGNAL_ON_A_HELPER_THREAD = """
import signal, sys, threading
from mapl_swarm.procs import wait_for_signal

signal.signal(signal.SIGINT, signal.default_int_handler)  # also when started with SIGINT ignored

def poke():  # the kernel may hand a signal sent to the process to any thread: here a helper's
    signal.pthread_kill(threading.get_ident(), signal.SIGINT)

threading.Timer(0.2, poke).start()
try:
    wait_for_signal() if sys.argv[1] == "wait_for_signal" else threading.Event().wait()
except KeyboardInterrupt:
    print("KeyboardInterrupt")
"""


@pytest.mark.parametrize("wait, ends", [("wait_for_signal", True), ("untimed", False)])
def test_a_signal_taken_by_a_helper_thread_still_interrupts_wait_for_signal(wait: str, ends: bool) -> None:
    """Ctrl-C handled on one of hivemind's threads: ``wait_for_signal`` raises KeyboardInterrupt on
    the main thread within its slice, where an untimed wait (the DHT bootstrap node's before) never
    returns."""
    proc = subprocess.Popen([sys.executable, "-c", SIGNAL_ON_A_HELPER_THREAD, wait], env=ENV, stdout=subprocess.PIPE,
                            text=True)
    try:
        out, _ = proc.communicate(timeout=10 if ends else 3)
        assert ends and out.split() == ["KeyboardInterrupt"], out
    except subprocess.TimeoutExpired:
        assert not ends, f"{wait}: no KeyboardInterrupt within 10 s"
    finally:
        proc.kill()
        proc.wait()


def test_a_peer_raises_its_open_file_limit_to_the_hard_limit():
    """A held connection costs a descriptor until its handshake times out: peers take all they may."""
    code = ("import resource; from mapl_swarm.procs import raise_open_file_limit; "
            "soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE); "
            "resource.setrlimit(resource.RLIMIT_NOFILE, (min(256, hard), hard)); "
            "got = raise_open_file_limit(); "
            "print(got == resource.getrlimit(resource.RLIMIT_NOFILE)[0], "
            "got == hard or hard == resource.RLIM_INFINITY)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.split() == ["True", "True"], out.stderr
