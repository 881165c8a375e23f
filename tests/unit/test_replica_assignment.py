"""Stage-0 replicas split each step's global micro-batches disjointly, and read each by its index."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mapl_swarm.data.batches import BatchSampler
from mapl_swarm.step.assignment import replica_rank, replica_share


@pytest.mark.parametrize("replicas", [1, 2, 3, 5, 8])
def test_shares_cover_each_steps_micro_batches_once(replicas):
    for step in (0, 1, 17):
        shares = [list(replica_share(step, 6, r, replicas)) for r in range(replicas)]
        flat = [g for share in shares for g in share]
        assert flat == list(range(step * 6, step * 6 + 6))  # disjoint, contiguous, in rank order
        assert max(map(len, shares)) - min(map(len, shares)) <= 1


def test_rank_is_the_place_in_sorted_peer_ids():
    ids = [b"\x03", b"\x01", b"\x02"]
    assert [replica_rank(i, ids) for i in ids] == [2, 0, 1]
    with pytest.raises(ValueError):
        replica_rank(b"\x09", ids)


def test_a_micro_batch_read_by_index_is_the_one_the_stream_gives_there():
    tokens = np.arange(1000, dtype=np.int32)
    stream = BatchSampler(tokens, micro_batch_size=3, seq_len=7, seed=5)
    reader = BatchSampler(tokens, micro_batch_size=3, seq_len=7, seed=5)
    reader.next_batch()
    position = reader.state_dict()
    for g in range(130):  # three epochs of 142 windows: some batches straddle two
        assert torch.equal(stream.next_batch(), reader.batch_at(g))
    assert reader.state_dict() == position  # reading by index leaves the stream where it was
