"""Child processes that die with their parent, even when the parent is killed with SIGKILL.

A killed peer must not leave its helpers (the DHT node process, the p2pd daemon, peers started
by ``launch``) running. Nothing in a SIGKILLed process runs, so the kernel has to tell its
children: Linux's ``prctl(PR_SET_PDEATHSIG, sig)`` makes it send ``sig`` to a process when the
*thread* that created it exits. That binds the child to the parent process only when the fork
happened on a thread that lives as long as the process (the main thread); for a child forked
on another thread, :func:`watch_parent` waits on a pidfd of the parent instead.

- :func:`die_with_parent` — a ``preexec_fn`` for ``subprocess`` / ``asyncio`` subprocesses
  (``Popen(cmd, preexec_fn=die_with_parent())``), from the main thread.
- :func:`set_parent_death_signal` — the same, called in a forked child itself.
- :func:`watch_parent` — a daemon thread calling back when a given process has exited.
- :func:`wait_for_signal` — the main thread of a process that only waits for its end (a DHT
  bootstrap node) blocks so that signal handlers still run on it.

Where prctl is missing (not Linux) these return False / None and do nothing: the caller keeps
its previous behaviour. Standard library only.
"""

from __future__ import annotations

import ctypes
import functools
import os
import select
import signal
import sys
import threading
from typing import Any, Callable

__all__ = ["parent_death_signal_supported", "set_parent_death_signal", "die_with_parent", "watch_parent",
           "wait_for_signal"]

_PR_SET_PDEATHSIG = 1

SIGNAL_SLICE_S = 0.5
"""How late, at most, :func:`wait_for_signal` lets a signal's handler run."""


@functools.cache
def _prctl() -> Any:
    """libc's ``prctl`` (None off Linux). Resolved once, before any fork that uses it."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
    prctl.restype = ctypes.c_int
    return prctl


def parent_death_signal_supported() -> bool:
    """Whether this platform has ``PR_SET_PDEATHSIG`` (Linux)."""
    return _prctl() is not None


def set_parent_death_signal(sig: int, *, parent_pid: int | None = None) -> bool:
    """In a child: have the kernel send ``sig`` to this process when the thread that forked it
    exits. With ``parent_pid`` (the expected parent), a parent that died before this call is
    noticed too: ``sig`` is then sent at once. Returns False where unsupported."""
    prctl = _prctl()
    if prctl is None or prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
        return False
    if parent_pid is not None and os.getppid() != parent_pid:
        os.kill(os.getpid(), sig)
    return True


def die_with_parent(sig: int = signal.SIGKILL) -> Callable[[], None]:
    """A ``preexec_fn`` that makes the spawned program receive ``sig`` when the spawning thread
    exits — spawn from the main thread to tie it to this process. Safe in the forked child:
    it makes one libc call (resolved here, before the fork) and reads the parent pid."""
    parent, prctl = os.getpid(), _prctl()

    def preexec() -> None:
        if prctl is not None:
            prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
            if os.getppid() != parent:  # the parent died between fork and prctl
                os.kill(os.getpid(), sig)

    return preexec


def watch_parent(parent_pid: int, on_death: Callable[[], None]) -> threading.Thread | None:
    """Call ``on_death()`` (on a daemon thread, or at once when it is already gone) once process
    ``parent_pid`` — this process's parent — has exited. Returns the thread, or None when the
    parent is already gone or pidfds are unsupported (Linux >= 5.3)."""
    try:
        fd = os.pidfd_open(parent_pid)
    except ProcessLookupError:
        on_death()
        return None
    except (AttributeError, OSError):
        return None
    if os.getppid() != parent_pid:  # died (and its pid was reused) before pidfd_open
        os.close(fd)
        on_death()
        return None

    def wait() -> None:
        select.select([fd], [], [])  # a pidfd turns readable when its process exits
        on_death()

    thread = threading.Thread(target=wait, name="mapl-parent-watch", daemon=True)
    thread.start()
    return thread


def wait_for_signal(event: threading.Event | None = None) -> None:
    """Block the main thread until ``event`` is set (None: never), or until a signal handler raises
    (Ctrl-C's KeyboardInterrupt, a SIGTERM handler's exception), which propagates.

    An untimed wait is not enough: the kernel may deliver a signal sent to the process to any
    thread that does not block it (hivemind and torch start several), and Python then runs the
    handler on the main thread only when that thread next runs bytecode, which a thread blocked
    in an untimed lock wait or ``signal.pause()`` never does. Waiting in slices of
    :data:`SIGNAL_SLICE_S` bounds how late the handler runs."""
    event = event or threading.Event()
    while not event.wait(SIGNAL_SLICE_S):
        pass


def raise_open_file_limit() -> int:
    """Raise this process's soft limit on open files to its hard limit and return it: every TCP
    connection to a serving peer costs a descriptor until its handshake fails or completes, so the
    common default of 1024 lets a stranger's held connections starve a peer of descriptors (its
    checkpoint files included)."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (OSError, ValueError):
            pass  # keep the soft limit (a container may forbid raising it)
    return soft
