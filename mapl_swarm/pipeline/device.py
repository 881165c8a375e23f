"""The device a run computes on: ``runtime.device`` resolved, and bound in each thread that computes."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from mapl_swarm.errors import ConfigError

if TYPE_CHECKING:
    import torch

__all__ = ["resolve_device", "bind_device"]


def resolve_device(name: str) -> "torch.device":
    """The torch device of ``runtime.device``: ``auto`` is CUDA when present (else the CPU), ``cuda``
    the first visible CUDA device, ``cuda:N`` visible device N. Asking for CUDA without one, or for
    an N beyond the visible count (``CUDA_VISIBLE_DEVICES`` narrows it: ``launch`` gives each peer
    one GPU), is a ConfigError that says so. The result is what :func:`bind_device` makes current in
    each thread that computes."""
    import torch

    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ConfigError(f"runtime.device is {name} but no CUDA device is available"
                          + _visible_note())
    device = torch.device(name)
    if device.type != "cuda":
        raise ConfigError(f"runtime.device must be auto, cpu, cuda or cuda:N, got {name!r}")
    count = torch.cuda.device_count()
    if device.index is not None and device.index >= count:
        raise ConfigError(f"runtime.device is cuda:{device.index} but only {count} CUDA device"
                          f"{'s are' if count != 1 else ' is'} visible (cuda:0..cuda:{count - 1})"
                          + _visible_note())
    return device


def _visible_note() -> str:
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    return "" if visible is None else f"; CUDA_VISIBLE_DEVICES={visible!r}"


def bind_device(device: "torch.device | str") -> None:
    """Make ``device`` the calling thread's current CUDA device (nothing for the CPU).

    The current CUDA device is per thread: ``torch.cuda.set_device`` in the main thread does not
    reach a worker thread, where kernels, streams, events, ``mem_get_info`` and compiled kernels
    without an explicit device would land on device 0. So every thread that does device work calls
    this first: the peer's main thread and its compute thread (an executor initializer, see
    :func:`mapl_swarm.peer.main.build_peer`), and the in-process trainer. ``cuda`` without an index
    binds device 0, the first visible one."""
    import torch

    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.set_device(0 if device.index is None else device.index)
