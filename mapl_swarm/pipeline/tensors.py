"""torch <-> wire tensor conversion for stage payloads (explicit dtypes, little-endian).

Stage payloads (see :mod:`mapl_swarm.pipeline.stage`) already hold wire dtypes; here they become
:class:`~mapl_swarm.wire.WireTensor` s and back, bit for bit. bf16 travels as its raw uint16
patterns.

Threads: :func:`to_wire` runs on the event loop (in
:meth:`~mapl_swarm.peer.link.PeerLink.send`) and only wraps memory: it takes host tensors that the
compute thread already brought to the host (:mod:`mapl_swarm.peer.host`) and refuses any other.
:func:`from_wire` copies a received frame once into torch memory (pinned on request) and runs on
the compute thread (:class:`~mapl_swarm.peer.host.HostRuntime`); the replicas that check a
partner's work (:mod:`mapl_swarm.replicas.checker`) digest its inputs through :func:`to_wire` too.
"""

from __future__ import annotations

import numpy as np
import torch

from mapl_swarm.wire import WireTensor

__all__ = ["to_wire", "from_wire", "TORCH_TO_TAG"]

TORCH_TO_TAG = {
    torch.bfloat16: "bf16",
    torch.float16: "fp16",
    torch.float32: "fp32",
    torch.float64: "fp64",
    torch.uint8: "uint8",
    torch.uint16: "uint16",
    torch.uint32: "uint32",
    torch.int32: "int32",
    torch.int64: "int64",
}
_TAG_TO_TORCH = {v: k for k, v in TORCH_TO_TAG.items()}


def to_wire(t: torch.Tensor) -> WireTensor:
    """A WireTensor viewing the memory of ``t``, a contiguous CPU tensor (no copy, no device work).

    Raises ValueError for a tensor on another device or a non-contiguous one: bringing tensors to
    the host is the compute thread's job (:func:`~mapl_swarm.peer.host.to_host`), never the event loop's.

    Ownership until ZeroMQ has sent the bytes (pinned buffers included; nothing here copies):
    the numpy array from ``Tensor.numpy()`` has as ``.base`` a torch Tensor sharing ``t``'s
    storage, so the array keeps the storage alive; :func:`mapl_swarm.wire.encode` makes each raw
    tensor frame a ``memoryview`` of a view of that array (lz4 frames are new ``bytes``); the
    frames list is held by the link's shaper until delivery, then by pyzmq: ``send_multipart(...,
    copy=False)`` wraps each frame of 64 KiB or more in a ``zmq.Frame`` whose buffer object pyzmq
    stores (``zmq.utils.garbage.gc.store``) until libzmq's free callback says the message is gone
    (smaller frames are copied by pyzmq). So frame -> array view -> array -> base tensor ->
    storage, and the storage is freed (a pinned block goes back to torch's host cache) only after
    the send has completed. The tensor must not be written meanwhile: the compute thread hands
    fresh buffers to the wire (see :mod:`mapl_swarm.peer.host`).
    """
    tag = TORCH_TO_TAG.get(t.dtype)
    if tag is None:
        raise TypeError(f"dtype {t.dtype} has no wire tag")
    if t.device.type != "cpu":
        raise ValueError(f"to_wire got a tensor on {t.device}: the compute thread brings tensors to the "
                         f"host (peer.host.to_host) before they reach the event loop")
    if not t.is_contiguous():
        raise ValueError(f"to_wire got a non-contiguous tensor of shape {tuple(t.shape)}: the compute "
                         f"thread makes wire tensors contiguous (peer.host.to_host)")
    t = t.detach()
    if t.dtype == torch.bfloat16:
        arr = t.view(torch.uint16).numpy()  # raw bf16 bit patterns
    else:
        arr = t.numpy()
    return WireTensor(tag, arr)


def from_wire(w: WireTensor, device: torch.device | str = "cpu", *, pin: bool = False) -> torch.Tensor:
    """The tensor a WireTensor carries, with its exact wire dtype, on ``device``: one copy out of
    the (read-only) frame into torch-owned memory, page-locked with ``pin`` (CUDA only) so that a
    later ``.to(cuda, non_blocking=True)`` is asynchronous."""
    arr = w.wire_array()  # C-contiguous little-endian view of the frame
    dtype = _TAG_TO_TORCH[w.dtype]
    t = torch.empty(arr.shape, dtype=dtype, pin_memory=pin)
    dst = t.view(torch.uint16) if dtype == torch.bfloat16 else t
    if arr.size:
        np.copyto(dst.numpy(), arr, casting="no")
    return t.to(device, non_blocking=pin)
