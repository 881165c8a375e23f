"""Ways a checkpoint file rots, for the tests of checkpoints that verify (issue 13)."""

from __future__ import annotations

from pathlib import Path

import torch


def _tensors(x):
    if isinstance(x, torch.Tensor):
        yield x
    elif isinstance(x, (dict, list, tuple)):
        for v in (x.values() if isinstance(x, dict) else x):
            yield from _tensors(v)


def flip_tensor_byte(path: Path) -> None:
    """Flip one byte inside the data of the file's largest tensor (tensor bytes are stored verbatim),
    the kind of damage ``torch.load`` does not notice."""
    state = torch.load(path, weights_only=True)
    t = max((t for t in _tensors(state) if t.numel() > 1), key=lambda t: t.numel())
    data = t.contiguous().view(-1).view(torch.uint8).numpy().tobytes()
    raw = bytearray(path.read_bytes())
    at = raw.find(data)
    assert at >= 0 and raw.find(data, at + 1) < 0, "the tensor's bytes are not unique in the file"
    raw[at + len(data) // 2 + 3] ^= 0x40  # an exponent bit of a float32 in the middle
    path.write_bytes(bytes(raw))


def truncate(path: Path) -> None:
    """Cut the file in half (a copy or a write that stopped)."""
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
