"""A peer's codebook link: rejected slices are counted (never fatal), gaps and reconnects ask for RESYNC."""

import asyncio
from types import SimpleNamespace

import torch

from mapl_swarm.compress.codebook_sync import VQSender, stream_generator
from mapl_swarm.compress.vq import VQSettings
from mapl_swarm.compress.vq_stage import StageVQ
from mapl_swarm.config import CompressionConfig
from mapl_swarm.peer.vq_link import CodebookLink
from mapl_swarm.wire import Message, MessageType, decode, encode

S = VQSettings.from_config(CompressionConfig(codec="mapl_vq", rank=8, vq_codebook_size=16,
                                             vq_slice_fraction=0.25, vq_kmeans_iters=2))


class StubPeer:
    """Stage 1 of 3: receives ``act`` from stage 0 and ``grad`` from stage 2."""

    name, up, down = "stage1", 0, 2

    def __init__(self) -> None:
        vq = StageVQ(S, 1, has_inbound=True, has_outbound=True, seed=0)
        self.rt = SimpleNamespace(vq=vq, apply_slice=vq.apply_slice, take_slices=vq.take_slices)
        self.sent: list[tuple[int, MessageType, dict]] = []
        self.bad: list[str] = []

    async def _send(self, dst, mtype, **kw):
        self.sent.append((dst, mtype, kw))

    def _bad_frame(self, sender, why):
        self.bad.append(why)


def _wire(sl) -> Message:
    return decode(encode(sl.to_message(run_id="r", src=0, dst=1)))


def test_slices_applied_rejections_counted_and_gaps_trigger_resync():
    peer = StubPeer()
    link = CodebookLink(peer)
    upstream = VQSender(S, "act", stream_generator(0, 0, "act"))  # stage 0's act sender
    gen = torch.Generator().manual_seed(0)
    slices = []
    for _ in range(5):
        upstream.encode(torch.randn(1, 32, 8, generator=gen), learn=True)
        slices += upstream.take_slices()

    async def scenario():
        for sl in slices[:2]:
            await link.on_slice(_wire(sl))
        await link.on_slice(_wire(slices[0]))  # replay: stale
        no_meta = _wire(slices[2])
        no_meta.meta = {}
        await link.on_slice(no_meta)  # malformed
        await link.on_slice(_wire(slices[3]))  # slice 2 was lost: future -> RESYNC
        await link.on_slice(_wire(slices[4]))  # awaiting the resync: ignored
        link.on_resync(Message(type=MessageType.RESYNC, run_id="r", src=2, dst=1,
                               meta={"stream": "act", "have": 0}))
        await link.on_handshake(2)
        await link.on_handshake(2)  # stage 2 handshakes again: it reconnected

    asyncio.run(scenario())
    assert link.stats["applied"] == 2 and link.stats["ignored"] == 1
    assert dict(link.stats["rejected"]) == {"stale_slice": 1, "slice_malformed": 1, "future_slice": 1}
    rx = peer.rt.vq.rx["act"]
    assert rx.version == 2 and rx.awaiting_resync
    resyncs = [(dst, kw["meta"]) for dst, t, kw in peer.sent if t == MessageType.RESYNC]
    assert resyncs == [(0, {"stream": "act", "have": 2, "reason": "future_slice"}),
                       (2, {"stream": "grad", "have": 0, "reason": "reconnected"})]
    assert peer.rt.vq.tx["act"].resync_pending and link.stats["reconnects"] == 1
    assert peer.bad == []
