"""Where a peer's work runs: one compute thread (with the encode lock) and background tasks.

Received tensors are decoded and inflated on another :class:`WorkerThread` (the peer's decode
thread, :mod:`.admission`), so neither a long compute delays decoding nor a large message the loop.

Compute stays synchronous and off the event loop: :class:`ComputeThread` runs the stage's
forward/backward/step on one worker thread, so the loop keeps sending, receiving and
heart-beating meanwhile; what a compute hands to the wire comes back in host memory, device
copies included (:class:`~.host.HostRuntime`), so the loop never waits for a device. Its
``encode_lock`` is held from a compute that encodes a payload until that payload is sent (a VQ
retransmission takes it too), so nothing encodes in between.
:class:`BackgroundTasks` runs coroutines beside the serving loop (e.g. answering a RESYNC); a
failure is handed to ``on_error`` (the peer fails its mailbox, which stops the schedule).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Coroutine
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

__all__ = ["WorkerThread", "ComputeThread", "BackgroundTasks"]

T = TypeVar("T")


class WorkerThread:
    """One worker thread that runs calls in order, awaited from the event loop."""

    def __init__(self, name: str, *, initializer: Callable[[], None] | None = None) -> None:
        """``initializer`` runs once on the worker thread before its first call."""
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name, initializer=initializer)

    async def run(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """``fn(*args, **kwargs)`` on the worker thread."""
        return await asyncio.get_running_loop().run_in_executor(self._pool, lambda: fn(*args, **kwargs))

    def close(self) -> None:
        """Wait for the running call, then stop the thread."""
        self._pool.shutdown(wait=True)


class ComputeThread(WorkerThread):
    """One worker thread for a stage's compute, and the lock that orders encodes and sends."""

    def __init__(self, name: str, *, initializer: Callable[[], None] | None = None) -> None:
        """``initializer`` runs once on the worker thread before its first compute: per-thread
        state such as the current CUDA device (``torch.cuda.set_device`` in another thread does
        not reach this one), given by whoever builds the peer."""
        super().__init__(f"{name}-compute", initializer=initializer)
        self.encode_lock = asyncio.Lock()
        """Held from a compute that encodes until its payload is sent (a retransmission takes it too)."""
        self.busy_s = 0.0
        """Seconds this thread spent computing so far (:meth:`run`; not :meth:`wait`): what a
        replica's capacity is measured by (:mod:`~.status`)."""

    async def run(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """``fn(*args, **kwargs)`` on the compute thread, its time counted in :attr:`busy_s`."""
        def timed() -> T:
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.busy_s += time.perf_counter() - t0
        return await super().run(timed)

    async def wait(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """``fn(*args, **kwargs)`` on the compute thread that mostly waits (an averaging round, a
        state download): not counted as compute."""
        return await super().run(fn, *args, **kwargs)


class BackgroundTasks:
    """Coroutines run beside the serving loop; the first failure goes to ``on_error``."""

    def __init__(self, on_error: Callable[[BaseException], None]) -> None:
        self._on_error = on_error
        self._tasks: set[asyncio.Task] = set()

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> None:
        """Run ``coro`` beside the serving loop; its failure fails the peer."""
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)

        def done(t: asyncio.Task) -> None:
            self._tasks.discard(t)
            if not t.cancelled() and t.exception() is not None:
                self._on_error(t.exception())

        task.add_done_callback(done)

    async def aclose(self) -> None:
        """Cancel what still runs and wait for it."""
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
