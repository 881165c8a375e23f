"""In a live swarm every tensor-touching call of a stage runtime runs on the peer's compute thread
(issue 10): the event loop only reads versions and flags, encodes bytes and moves frames.

Three MAPL+VQ peers (projector exchange, codebook slices both ways, a checkpoint, validation) run
in one event loop over real ZeroMQ sockets with an in-memory directory. Every public method of
each :class:`StageRuntime` and of its :class:`StageVQ` and codebook senders/receivers is wrapped to
record the thread it runs on; only the loop-safe accessors named below may run on the loop.
"""

import asyncio
import functools
import threading
from collections import defaultdict

import pytest

from mapl_swarm.config import load_config
from mapl_swarm.peer.main import build_peer

from swarm_helpers import Directory, write_config

pytestmark = pytest.mark.timeout(300)

LOOP_SAFE = {"codebook_version", "version", "request_resync"}
"""Methods that read or set plain Python state (versions, the awaiting-resync flag): allowed on the loop."""


def record_threads(obj, name: str, calls: dict) -> None:
    """Wrap every public method of ``obj`` to note (name.method) -> the threads it ran on."""
    for attr in dir(type(obj)):
        if attr.startswith("_") or attr in LOOP_SAFE or isinstance(getattr(type(obj), attr), property):
            continue
        method = getattr(obj, attr)
        if not callable(method):
            continue

        @functools.wraps(method)
        def wrapped(*args, _method=method, _key=f"{name}.{attr}", **kwargs):
            calls[_key].add(threading.current_thread().name)
            return _method(*args, **kwargs)

        setattr(obj, attr, wrapped)


def test_stage_tensor_work_runs_on_the_compute_thread(tmp_path):
    path = write_config(tmp_path / "vq.toml", codec="mapl_vq", stages=3, steps=2, cache=tmp_path / "cache",
                        out=tmp_path / "swarm", run_id="threads", timeout=60)
    cfg = load_config(path, {"runtime": {"threads": 1}, "checkpoint": {"interval_steps": 2}})
    directory = Directory()
    peers = [build_peer(cfg, s, resolve=directory.resolve, announce=directory.announcer(s), progress=False)
             for s in range(3)]
    calls: dict[str, set[str]] = defaultdict(set)
    for s, peer in enumerate(peers):
        record_threads(peer.rt, f"stage{s}.runtime", calls)
        record_threads(peer.rt.vq, f"stage{s}.vq", calls)
        for stream, end in [*peer.rt.vq.tx.items(), *peer.rt.vq.rx.items()]:
            record_threads(end, f"stage{s}.vq.{stream}.{type(end).__name__}", calls)

    async def swarm():
        return await asyncio.wait_for(asyncio.gather(*(p.run() for p in peers)), 240)

    results = asyncio.run(swarm())
    assert len(results[0].train_losses) == 2 and results[0].val_history
    for key in ("stage0.runtime.forward", "stage1.runtime.backward", "stage2.runtime.forward",
                "stage1.runtime.slices_for", "stage1.runtime.apply_slice", "stage0.runtime.outbound_projector",
                "stage1.runtime.take_inbound_projector_grad", "stage0.runtime.add_outbound_projector_grad",
                "stage1.runtime.load_inbound_projector", "stage2.runtime.state_dict", "stage1.runtime.step"):
        assert key in calls, f"{key} never ran: the test no longer covers it"
    off_worker = {key: threads for key, threads in calls.items()
                  if any(not t.startswith(f"{key.split('.')[0]}-compute") for t in threads)}
    assert off_worker == {}, f"tensor work outside the compute thread: {off_worker}"
