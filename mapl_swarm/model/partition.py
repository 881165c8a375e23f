"""Balanced contiguous partition of L decoder layers over P pipeline stages."""

from __future__ import annotations

from mapl_swarm.errors import ConfigError

__all__ = ["partition_layers"]


def partition_layers(num_layers: int, num_stages: int) -> list[range]:
    """Split ``range(num_layers)`` into ``num_stages`` contiguous ranges whose sizes differ by at
    most one; earlier stages take the extra layers (stage 0 also embeds, stage P-1 also runs the head,
    so neither end is systematically lighter)."""
    if num_stages < 1:
        raise ConfigError(f"number of stages must be >= 1, got {num_stages}")
    if num_stages > num_layers:
        raise ConfigError(f"cannot split {num_layers} layers over {num_stages} stages (P > layers)")
    base, extra = divmod(num_layers, num_stages)
    out: list[range] = []
    start = 0
    for s in range(num_stages):
        size = base + (1 if s < extra else 0)
        out.append(range(start, start + size))
        start += size
    return out
