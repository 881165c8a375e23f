"""Device <-> host for everything that crosses the wire, done on the compute thread (DESIGN §6).

The event loop only encodes bytes and moves frames. Every stage call whose result travels or
whose input came off the wire goes through :class:`HostRuntime`, whose methods run on the compute
thread (``await compute.run(host.forward, ...)``), so by the time ``compute.run`` returns:

- what goes out (ACT/GRAD payloads, the projector and its gradient, codebook slices, re-encoded
  codes) is in host memory, contiguous (:func:`to_host`): CUDA tensors are copied into fresh
  pinned buffers with ``non_blocking=True`` and one CUDA event per device, recorded after the
  copies and synchronised here, in the worker, says they have landed. The loop never waits for
  the device; :func:`~.tensors.to_wire` only wraps host memory (and refuses anything else).
  CPU tensors pass unchanged when contiguous (no copy), else as a contiguous copy.
- what came in (the wire tensors of ACT, GRAD, PROJ, PROJ_GRAD, CODEBOOK_SLICE) has been copied out
  of its frame into torch memory (:func:`~.tensors.from_wire`), pinned when the stage runs on
  CUDA so the stage's ``.to(device, non_blocking=True)`` copies are asynchronous.

What goes out is checked for NaN/Inf here, on the host copy (no device sync):
:func:`~mapl_swarm.pipeline.stage.check_finite` raises
:class:`~mapl_swarm.errors.NonFiniteError` before a non-finite ACT, GRAD, PROJ or PROJ_GRAD reaches
the event loop, so it is never sent.

Buffers handed to the wire are always fresh (a copy on CUDA; on the CPU the runtime's results are
new tensors: payloads are cast, projectors cloned) and nothing writes them afterwards; how they
stay alive until ZeroMQ has sent them: :func:`~.tensors.to_wire`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable, Mapping
from typing import TYPE_CHECKING, Any, TypeVar

import torch

from mapl_swarm.compress.codebook_sync import CodebookSlice
from mapl_swarm.pipeline.tensors import from_wire
from mapl_swarm.pipeline.stage import check_finite

if TYPE_CHECKING:
    from mapl_swarm.pipeline.stage import ForwardResult, StageRuntime
    from mapl_swarm.wire import Message, WireTensor

__all__ = ["HostRuntime", "to_host", "tensors_to_host", "slices_to_host"]

K = TypeVar("K", bound=Hashable)


def _start_copy(t: torch.Tensor) -> tuple[torch.Tensor, torch.device | None]:
    """``t``'s host copy (being made) and the CUDA device to wait for (None: nothing to wait for)."""
    t = t.detach()
    if t.device.type == "cpu":
        return t.contiguous(), None  # no copy when already contiguous
    if t.device.type == "cuda":
        buf = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)  # page-locked: the DMA target
        buf.copy_(t, non_blocking=True)  # queued on the device's current stream, after the compute
        return buf, t.device
    return t.to("cpu").contiguous(), None  # another accelerator: a blocking copy, still in the worker


def _wait(devices: set[torch.device]) -> None:
    """Block the compute thread (never the loop) until the copies queued on ``devices`` are done."""
    for device in devices:
        done = torch.cuda.Event()
        done.record(torch.cuda.current_stream(device))
        done.synchronize()


def tensors_to_host(tensors: Mapping[K, torch.Tensor]) -> dict[K, torch.Tensor]:
    """Every tensor of ``tensors`` in host memory, contiguous, with one wait per device."""
    out: dict[K, torch.Tensor] = {}
    devices: set[torch.device] = set()
    for key, t in tensors.items():
        out[key], device = _start_copy(t)
        if device is not None:
            devices.add(device)
    _wait(devices)
    return out


def to_host(t: torch.Tensor) -> torch.Tensor:
    """One tensor in host memory, contiguous (see :func:`tensors_to_host`)."""
    return tensors_to_host({0: t})[0]


def slices_to_host(slices: list[CodebookSlice]) -> list[CodebookSlice]:
    """Codebook slices with their ``codes`` and ``index`` in host memory (one wait for all)."""
    tensors: dict[tuple[int, str], torch.Tensor] = {}
    for i, sl in enumerate(slices):
        tensors[(i, "codes")] = sl.codes
        if sl.index is not None:
            tensors[(i, "index")] = sl.index
    host = tensors_to_host(tensors)
    return [dataclasses.replace(sl, codes=host[(i, "codes")], index=host.get((i, "index")))
            for i, sl in enumerate(slices)]


class HostRuntime:
    """A :class:`~mapl_swarm.pipeline.stage.StageRuntime`'s calls as a peer makes them: wire tensors
    in, host tensors out. **Every method runs on the compute thread** (``compute.run(host.X, ...)``);
    the event loop passes it the wire tensors of received messages and sends what it returns.

    ``runtime`` is a StageRuntime or anything with the methods used (tests pass a stub); received
    tensors are pinned when its ``device`` is a CUDA device."""

    def __init__(self, runtime: StageRuntime | Any) -> None:
        self.rt = runtime
        device = getattr(runtime, "device", None)
        self.pin = device is not None and torch.device(device).type == "cuda" and torch.cuda.is_available()
        """Copy received tensors into pinned memory (the stage runs on CUDA)."""

    def _check(self, tensors: Mapping[str, torch.Tensor], what: str) -> None:
        check_finite(tensors, stage=getattr(self.rt, "stage", -1), step=getattr(self.rt, "step_count", 0), what=what)

    def received(self, wire: Mapping[K, WireTensor]) -> dict[K, torch.Tensor]:
        """Wire tensors as torch tensors in host memory (pinned on CUDA stages)."""
        return {key: from_wire(w, pin=self.pin) for key, w in wire.items()}

    # ------------------------------------------------------------------ payloads
    def forward(self, micro: int, *, ids: torch.Tensor | None = None,
                wire: Mapping[str, WireTensor] | None = None, train: bool = True,
                cver: int | None = None, proof: Mapping[str, bytes] | None = None) -> ForwardResult:
        """:meth:`StageRuntime.forward` of stage 0's ``ids`` or of a received ACT payload (``wire``,
        by payload key; ``proof``: its sender's, kept with it); the ACT payload it returns is in host
        memory (the loss stays on the device)."""
        payload = None if wire is None else self.received(wire)
        res = self.rt.forward(micro, ids=ids, payload=payload, train=train, cver=cver,
                              **({"proof": proof} if proof is not None else {}))
        if res.payload is None:
            return res
        payload = tensors_to_host(res.payload)
        self._check(payload, f"the ACT of micro-batch {micro}" if micro >= 0 else f"the eval ACT of batch {-1 - micro}")
        return dataclasses.replace(res, payload=payload)

    def backward(self, micro: int, wire: Mapping[str, WireTensor] | None = None,
                 cver: int | None = None, origin: str | None = None,
                 proof: Mapping[str, bytes] | None = None) -> dict[str, torch.Tensor] | None:
        """:meth:`StageRuntime.backward` of a received GRAD payload (``wire``; None on the last stage;
        ``proof``: its sender's); the GRAD payload it returns is in host memory. ``origin``: the
        upstream replica of its ACT."""
        grad = self.rt.backward(micro, None if wire is None else self.received(wire), cver=cver,
                                **({"origin": origin} if origin is not None else {}),
                                **({"proof": proof} if proof is not None else {}))
        if grad is None:
            return None
        grad = tensors_to_host(grad)
        self._check(grad, f"the GRAD of micro-batch {micro}")
        return grad

    # ------------------------------------------------------------------ projector exchange
    def outbound_projector(self) -> tuple[torch.Tensor, int] | None:
        """The projector to send downstream (host, fp32) and its version; None if this stage owns none."""
        proj = self.rt.outbound_projector()
        if proj is None:
            return None
        value = to_host(proj[0])
        self._check({"proj": value}, "the PROJ")
        return value, proj[1]

    def take_inbound_projector_grad(self, origin: str | None = None) -> torch.Tensor | None:
        """The step's partial projector gradient to send upstream (host, fp32), or None; ``origin``:
        of the micro-batches of that upstream replica only."""
        g = self.rt.take_inbound_projector_grad(**({"origin": origin} if origin is not None else {}))
        if g is None:
            return None
        g = to_host(g)
        self._check({"grad": g}, "the PROJ_GRAD")
        return g

    def add_outbound_projector_grad(self, wire: WireTensor, *, sign: float = 1.0) -> None:
        """Add the receiver's PROJ_GRAD tensor (times ``sign``: -1 takes back one added before) to
        the outbound projector's gradient."""
        grad = from_wire(wire, pin=self.pin)
        self.rt.add_outbound_projector_grad(grad if sign == 1.0 else grad * sign)

    def load_inbound_projector(self, wire: WireTensor, version: int) -> None:
        """Load the PROJ tensor the sender stage sent (at ``version``)."""
        self.rt.load_inbound_projector(from_wire(wire, pin=self.pin), version)

    # ------------------------------------------------------------------ codebook streams (mapl_vq)
    def slices_for(self, stream: str, have: int) -> list[CodebookSlice]:
        """The slices due before the next ``stream`` payload to a receiver at version ``have``
        (:meth:`StageRuntime.slices_for`), in host memory."""
        return slices_to_host(self.rt.slices_for(stream, have))

    def reencode(self, stream: str, micro: int) -> torch.Tensor | None:
        """:meth:`StageRuntime.reencode`'s codes in host memory (None when they are gone)."""
        codes = self.rt.reencode(stream, micro)
        return None if codes is None else to_host(codes)

    def apply_slice(self, msg: Message) -> str:
        """Read a received CODEBOOK_SLICE and apply it (raises its CodebookError when rejected)."""
        return self.rt.apply_slice(CodebookSlice.from_message(msg))
