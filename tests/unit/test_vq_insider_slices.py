"""A buggy neighbour's codebook slices, through its real session (SPEC §5.1, 1.9): a full slice of
version 10^6 and a slice with a finite absurd value (1e30) are rejected (the first by the codebook
receiver, the second before it: ``value_out_of_range``, SPEC §6.1) and leave the receiver's
codebooks untouched; the far version asks for a RESYNC, which heals like a lost slice and changes
no code (the sender's mirror comes whole at its version, its stream goes on as it would have), so
training equals an unattacked MAPL+VQ run. A spray of far full slices (no honest sender sends one)
cuts the sender off at the eighth, as a departure: the receiver neither hangs nor floods its
neighbour with RESYNCs (one is awaited at a time)."""

from __future__ import annotations

import asyncio

import pytest
import torch

from mapl_swarm.peer.departures import NeighbourLost
from mapl_swarm.wire import MessageType
from mapl_swarm.wire.codebook import resync_meta, slice_parts

from peer_fakes import fake_swarm, run_swarm, swarm_config

MT = MessageType


def _run(attack: bool, spray: int = 0, flood: int = 0):
    async def main():
        cfg = swarm_config(compression={"codec": "mapl_vq"}, run={"steps": 4})
        _, peers, transports = fake_swarm(cfg)
        if flood:  # the receiver of the act stream asks for RESYNCs it does not need, each step
            up = peers[1].links.upstream
            on_slice, flooded = up.codebooks.on_slice, set()

            async def flooding(msg) -> None:
                await on_slice(msg)
                if msg.step not in flooded:
                    flooded.add(msg.step)
                    for _ in range(flood):
                        await up.send(MT.RESYNC, step=msg.step, meta=resync_meta("act", msg.cver, "flood"))

            up.codebooks.on_slice = flooding
        if attack:
            link = peers[0].links.downstream
            send_slices, fired = link.codebooks.send_slices, []

            async def with_bad_slices(step: int, micro: int) -> None:
                await send_slices(step, micro)
                if step == 1 and not fired:  # after the first step's real slice: the receiver is at v >= 1
                    fired.append(step)
                    R, NG, K, G = peers[1].rt.vq.rx["act"].s.layout.shape
                    have = peers[1].rt.vq.rx["act"].version
                    huge = torch.zeros(R, NG, 1, G)
                    huge[0, 0, 0, 0] = 1e30
                    bad = [(10 ** 6 + i, 0, True, torch.zeros(R, NG, K, G)) for i in range(spray)] or \
                        [(10 ** 6, 0, True, torch.zeros(R, NG, K, G)), (have + 1, 0, False, huge)]
                    for version, start, full, codes in bad:
                        p = slice_parts(stream="act", version=version, start=start, full=full, codes=codes)
                        await link.send(MT.CODEBOOK_SLICE, step=step, micro=micro, meta=p.meta, cver=p.cver,
                                        tensors=p.tensors, kinds={n: "codebook" for n in p.tensors})

            link.codebooks.send_slices = with_bad_slices
        return await run_swarm(peers, transports)

    return asyncio.run(main())


def test_a_neighbours_far_version_and_absurd_slices_are_rejected_and_training_is_unchanged():
    clean, attacked = _run(False), _run(True)
    rejected = attacked[1].codebooks["rejected"]
    assert rejected == {"future_slice": 1}, attacked[1].codebooks
    assert attacked[1].rejects.get("value_out_of_range") == 1, attacked[1].rejects
    assert attacked[1].codebooks["resyncs_sent"] > clean[1].codebooks["resyncs_sent"]  # the far version heals
    assert attacked[0].train_losses == clean[0].train_losses
    assert attacked[1].codebooks["digests"]["rx_act"] == attacked[0].codebooks["digests"]["tx_act"]  # in sync


def test_a_spray_of_far_full_slices_cuts_the_sender_off_at_the_eighth():
    with pytest.raises(NeighbourLost, match="8 of its messages failed the content checks .*future_full_slice"):
        _run(True, spray=40)


def test_a_neighbours_resync_flood_changes_no_loss():
    """The receiver of a stream floods its sender with RESYNCs each step (SPEC §5.1): those within
    the step's bound bring the sender's mirror whole, the rest are dropped as ``implausible``, and
    the losses are the clean run's, bit for bit (the flood used to make the sender promote its
    learned codebooks early, which changed every later code)."""
    clean, flooded = _run(False), _run(False, flood=12)
    assert flooded[0].codebooks["resyncs_received"] > 0 and flooded[0].rejects.get("implausible", 0) > 0
    assert flooded[0].train_losses == clean[0].train_losses
