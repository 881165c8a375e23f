"""torch <-> wire tensor conversion for stage payloads (explicit dtypes, little-endian).

Stage payloads (see :mod:`mapl_swarm.pipeline.stage`) already hold wire dtypes; here they become
:class:`~mapl_swarm.wire.WireTensor` s and back, bit for bit. bf16 travels as its raw uint16
patterns. Received arrays are copied once into torch-owned memory (frames are read-only views).
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
    """A CPU, contiguous view of ``t`` as a WireTensor (no copy for CPU contiguous tensors)."""
    tag = TORCH_TO_TAG.get(t.dtype)
    if tag is None:
        raise TypeError(f"dtype {t.dtype} has no wire tag")
    t = t.detach().to("cpu").contiguous()
    if t.dtype == torch.bfloat16:
        arr = t.view(torch.uint16).numpy()  # raw bf16 bit patterns
    else:
        arr = t.numpy()
    return WireTensor(tag, arr)


def from_wire(w: WireTensor, device: torch.device | str = "cpu") -> torch.Tensor:
    """The tensor a WireTensor carries, with its exact wire dtype, on ``device``."""
    arr = np.ascontiguousarray(w.wire_array()).copy()  # own writable memory
    t = torch.from_numpy(arr)
    if w.dtype == "bf16":
        t = t.view(torch.bfloat16)
    expected = _TAG_TO_TORCH[w.dtype]
    assert t.dtype == expected, (t.dtype, expected)
    return t.to(device)
