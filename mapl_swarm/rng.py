"""Deterministic random streams derived from (run seed, component name, index...).

Every random initialisation in mapl_swarm draws from a generator seeded by the run seed and the
name of what it initialises (``("layer", 3)``, ``("projector", 1)``...), so a stage builds exactly
the same tensors whether it runs in one process with all other stages or alone on its own host.
"""

from __future__ import annotations

import hashlib

import torch

__all__ = ["derive_seed", "generator"]


def derive_seed(seed: int, *keys: object) -> int:
    """A 63-bit seed from the run seed and a tuple of keys (stable across processes and hosts)."""
    blob = repr((int(seed),) + tuple(keys)).encode()
    return int.from_bytes(hashlib.sha256(blob).digest()[:8], "little") & ((1 << 63) - 1)


def generator(seed: int, *keys: object) -> torch.Generator:
    """A CPU torch.Generator seeded by :func:`derive_seed`; draw on CPU then move to the device."""
    gen = torch.Generator(device="cpu")
    gen.manual_seed(derive_seed(seed, *keys))
    return gen
