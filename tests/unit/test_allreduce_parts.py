"""SPEC §9.1 "Replica records": how an all-reduce cuts the averaged tensors into parts and which
member reduces each, written from SPEC's words here and compared with hivemind's own container
(the reference every replica runs) over shapes that put pivots inside parts and between them."""

from __future__ import annotations

import math

import pytest
import torch
from hivemind.averaging.load_balancing import load_balance_peers
from hivemind.averaging.partition import TensorPartContainer
from hivemind.compression import Float16Compression, NoCompression

pytestmark = pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated:DeprecationWarning")


def spec_parts(sizes: list[int], n: int, part_values: int) -> list[list[int]]:
    """Each member's parts (their lengths, in order) by SPEC's rule."""
    total = sum(sizes)
    counts = [total // n + (1 if i < total % n else 0) for i in range(n)]
    pivots = [int(float(sum(counts[:i + 1])) / float(total) * float(total)) for i in range(n)]
    pivots[-1] = total
    out: list[list[int]] = [[] for _ in range(n)]
    start = 0
    for size in sizes:
        for offset in range(0, size, part_values):
            length = min(part_values, size - offset)
            lo, hi = start, start + length
            spans = [(max(0, min(hi, pivots[i]) - max(lo, pivots[i - 1] if i else 0)), -i) for i in range(n)]
            out[-max(spans)[1]].append(length)
            start = hi
    return out


@pytest.mark.parametrize("compression, part_values", [(NoCompression(), 2 ** 19 // 4), (Float16Compression(), 2 ** 18)])
@pytest.mark.parametrize("sizes, n", [([192], 2), ([192], 3), ([300_000, 7, 131_072, 5], 2),
                                      ([1, 2, 3, 400_001], 3), ([131_072 * 3 + 1], 4), ([10, 10, 10], 5)])
def test_parts_and_their_reducers_follow_the_spec(sizes, n, compression, part_values) -> None:
    tensors = [torch.zeros(size) for size in sizes]
    fractions = load_balance_peers(sum(sizes), [None] * n)  # no member declares a bandwidth
    container = TensorPartContainer(tensors, fractions, compression=compression)
    got = [[len(part) for part, _ in container._input_parts_by_peer[i]] for i in range(n)]
    assert got == spec_parts(sizes, n, part_values)
    assert math.fsum(map(sum, got)) == sum(sizes)
