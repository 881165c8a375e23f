"""A peer link's codebook side: rejected slices are counted (never fatal), gaps and reconnects ask for RESYNC."""

import asyncio
import dataclasses
from types import SimpleNamespace

import pytest
import torch

from mapl_swarm.compress.codebook_sync import CodebookSlice, VQSender, stream_generator
from mapl_swarm.compress.vq import decode_codes
from mapl_swarm.compress.vq_stage import StageVQ
from mapl_swarm.config import CompressionConfig, VQConfig
from mapl_swarm.errors import MaplError
from mapl_swarm.peer.link import LinkSettings, PeerLink
from mapl_swarm.peer.vq_link import Retransmitting, codebook_summary
from mapl_swarm.wire import Message, MessageType, decode, encode
from mapl_swarm.wire.codebook import INDEXED_SLICES_CAPABILITY, RETRANSMIT_CAPABILITY, CodebookVersionMismatch

S = CompressionConfig(codec="mapl_vq", rank=8, vq=VQConfig(codebook_size=16, slice_fraction=0.25, kmeans_iters=2)).vq


SETTINGS = LinkSettings(run_id="r", stage=1, num_stages=3, fingerprint="f", capabilities=("1f1b",),
                        max_frame_bytes=1 << 20)


class Compute:
    """The compute thread, run inline."""

    def __init__(self) -> None:
        self.encode_lock = asyncio.Lock()

    async def run(self, fn, *args, **kwargs):
        return fn(*args, **kwargs)


class RecordingLink(PeerLink):
    """A real link of stage 1 whose ``send`` records ``(neighbour, type, kwargs)`` instead of sending."""

    async def send(self, mtype, **kw):
        self.peer.sent.append((self.stage, mtype, kw))


class StubPeer:
    """Stage 1 of 3: receives ``act`` from stage 0 and ``grad`` from stage 2; records what it sends."""

    def __init__(self) -> None:
        vq = StageVQ(S, 1, has_inbound=True, has_outbound=True, seed=0)
        self.rt = SimpleNamespace(vq=vq, apply_slice=vq.apply_slice, slices_for=vq.slices_for,
                                  reencode=vq.reencode,
                                  codebook_version=lambda s: vq.version(s) if s in vq.tx else 0)
        self.sent: list[tuple[int, MessageType, dict]] = []
        self.bad: list[str] = []
        self.tasks: list[asyncio.Task] = []
        self.up, self.down = (RecordingLink(SETTINGS, s, on_bad_frame=lambda _, why: self.bad.append(why))
                              for s in (0, 2))
        compute = Compute()
        for link in (self.up, self.down):
            link.peer = self
            link.use_codebooks(self.rt, compute, spawn=self.spawn)

    def spawn(self, coro):
        self.tasks.append(asyncio.get_running_loop().create_task(coro))

    def stats(self):
        return codebook_summary(self.rt.vq, [self.up.codebooks, self.down.codebooks])


def _wire(sl) -> Message:
    return decode(encode(sl.to_message(run_id="r", src=0, dst=1)))


def test_slices_applied_rejections_counted_and_gaps_trigger_resync():
    peer = StubPeer()
    up, down = peer.up, peer.down
    upstream = VQSender(S, "act", stream_generator(0, 0, "act"))  # stage 0's act sender
    gen = torch.Generator().manual_seed(0)
    slices = []
    for _ in range(5):
        upstream.encode(torch.randn(1, 32, 8, generator=gen), learn=True)
        slices += upstream.take_slices()

    async def scenario():
        for sl in slices[:2]:
            await up.on_codebook_slice(_wire(sl))
        await up.on_codebook_slice(_wire(slices[0]))  # replay: stale
        no_meta = _wire(slices[2])
        no_meta.meta = {}
        await up.on_codebook_slice(no_meta)  # malformed
        await up.on_codebook_slice(_wire(slices[3]))  # slice 2 was lost: future -> RESYNC
        await up.on_codebook_slice(_wire(slices[4]))  # awaiting the resync: ignored
        down.codebooks.on_resync(Message(type=MessageType.RESYNC, run_id="r", src=2, dst=1,
                               meta={"stream": "act", "have": 0}))
        hello = Message(type=MessageType.HELLO, run_id="r", src=2, dst=1,
                        meta={**SETTINGS.hello_meta(), "nonce": bytes(16)})
        async def reply(frames, kind):  # WELCOME goes back on the HELLO's own connection
            peer.sent.append((2, decode(frames).type, {}))

        await down.on_hello(hello, "stage2.0000000a", reply, now=0.0)
        await down.on_hello(hello, "stage2.0000000b", reply, now=1.0)  # stage 2 handshakes again: it reconnected
        await asyncio.gather(*peer.tasks)

    asyncio.run(scenario())
    stats = peer.stats()
    assert stats["applied"] == 2 and stats["ignored"] == 1
    assert dict(stats["rejected"]) == {"stale_slice": 1, "slice_malformed": 1, "future_slice": 1}
    rx = peer.rt.vq.rx["act"]
    assert rx.version == 2 and rx.awaiting_resync
    resyncs = [(dst, kw["meta"]) for dst, t, kw in peer.sent if t == MessageType.RESYNC]
    assert resyncs == [(0, {"stream": "act", "have": 2, "reason": "future_slice"}),
                       (2, {"stream": "grad", "have": 0, "reason": "reconnected"})]
    assert peer.rt.vq.tx["act"].resync_pending and stats["reconnects"] == 1
    assert peer.bad == []
    assert [t for _, t, _ in peer.sent].count(MessageType.WELCOME) == 2
    assert down.rx.routing_id == "stage2.0000000b"  # the new connection is the bound session


def _codes_from(src: int, cver: int) -> Message:
    return Message(type=MessageType.ACT, run_id="r", src=src, dst=1, step=4, micro=2, cver=cver,
                   meta={"mode": "eval"})


def test_undecodable_codes_ask_for_a_retransmission_only_from_peers_that_offer_it():
    peer = StubPeer()
    link = peer.up.codebooks

    async def undecodable():
        raise CodebookVersionMismatch("codes encoded with codebook version 9, the receiver holds version 0")

    async def scenario():
        with pytest.raises(CodebookVersionMismatch):  # stage 0 did not advertise vq_retransmit
            await link.guard(undecodable(), (4, 2, "eval"))
        peer.up.capabilities = frozenset({"vq_stream", RETRANSMIT_CAPABILITY})
        with pytest.raises(Retransmitting):
            await link.guard(undecodable(), (4, 2, "eval"))

    asyncio.run(scenario())
    resyncs = [(dst, kw["step"], kw["micro"], kw["meta"]) for dst, t, kw in peer.sent if t == MessageType.RESYNC]
    reason = "codebook_version_mismatch"
    assert resyncs == [(0, 0, 0, {"stream": "act", "have": 0, "reason": reason}),
                       (0, 4, 2, {"stream": "act", "have": 0, "reason": reason, "retransmit": True, "mode": "eval"})]
    assert link.stats["retransmits_requested"] == 1
    # the RESYNC meta is valid on the wire (1.2 optional fields typed)
    msg = decode(encode(Message(type=MessageType.RESYNC, run_id="r", src=1, dst=0, step=4, micro=2,
                                meta=resyncs[1][3])))
    assert msg.meta == resyncs[1][3] and (msg.step, msg.micro) == (4, 2)


def test_retransmission_sends_a_full_slice_then_the_same_values_reencoded():
    peer = StubPeer()
    link = peer.down
    vq = peer.rt.vq
    gen = torch.Generator().manual_seed(1)
    z = torch.randn(2, 16, 8, generator=gen)
    receiver = StageVQ(S, 2, has_inbound=True, has_outbound=False, seed=0)  # stage 2's act receiver
    ids = torch.zeros(2, 17, dtype=torch.int64)

    async def scenario():
        for micro in range(3):  # train micro-batches 0..2 of step 4, then eval micro-batch 0 (key -1)
            codes = vq.encode("act", z + micro, learn=True, key=micro)
            await link.send_act(4, micro, {"codes": codes, "ids": ids}, eval_mode=False, pver=0)
        await link.send_act(4, 0, {"codes": vq.encode("act", z * 2, learn=False, key=-1), "ids": ids},
                            eval_mode=True, pver=0)
        for _, t, kw in peer.sent:  # the receiver got every slice but the last train one (lost)
            if t == MessageType.CODEBOOK_SLICE and kw["cver"] != 3:
                receiver.apply_slice(_wire_slice(kw))
        peer.sent.clear()
        learned = vq.tx["act"].learner.state_dict()
        for micro, mode, step in ((2, "train", 4), (0, "eval", 4), (1, "train", 3)):
            link.codebooks.on_resync(Message(type=MessageType.RESYNC, run_id="r", src=2, dst=1, step=step, micro=micro,
                                   meta={"stream": "act", "have": 2, "retransmit": True, "mode": mode}))
            await asyncio.gather(*peer.tasks)
        return learned

    learned = asyncio.run(scenario())
    kinds = [(t, kw.get("step"), kw.get("micro"), kw["meta"].get("full"), kw["meta"].get("mode"))
             for _, t, kw in peer.sent]
    assert kinds == [(MessageType.CODEBOOK_SLICE, 4, 2, True, None), (MessageType.ACT, 4, 2, None, "train"),
                     (MessageType.CODEBOOK_SLICE, 4, 0, True, None), (MessageType.ACT, 4, 0, None, "eval"),
                     (MessageType.ERROR, None, None, None, None)]  # step 3 micro 1 is gone: ERROR
    assert peer.sent[-1][2]["meta"]["code"] == "retransmit_unavailable"
    assert link.codebooks.stats["retransmitted"] == 2
    for (_, _, sl), (_, _, act), values in ((peer.sent[0], peer.sent[1], z + 2), (peer.sent[2], peer.sent[3], z * 2)):
        receiver.apply_slice(_wire_slice(sl))  # full slice: applied whatever the receiver's version
        decoded = receiver.decode("act", act["tensors"]["codes"], act["cver"])
        expected = vq.tx["act"].mirror
        assert act["cver"] == sl["cver"] == receiver.rx["act"].version
        assert torch.equal(decoded, decode_codes(act["tensors"]["codes"], expected))  # bit-identical
        assert act["tensors"]["ids"] is ids
        assert float((decoded - values).pow(2).mean()) < float(values.pow(2).mean())
    # re-encoding never trains the sender's codebooks
    after = vq.tx["act"].learner.state_dict()
    assert all(torch.equal(learned[k], after[k]) for k in ("live", "share", "sums"))


def _wire_slice(kw: dict):
    """The CodebookSlice a recorded CODEBOOK_SLICE send carries, through the real wire encoding."""
    msg = Message(type=MessageType.CODEBOOK_SLICE, run_id="r", src=1, dst=2, cver=kw["cver"], meta=kw["meta"],
                  tensors={"codes": kw["tensors"]["codes"].numpy()})
    return CodebookSlice.from_message(decode(encode(msg)))


def test_priority_slices_need_a_receiver_that_accepts_indexed_slices():
    peer = StubPeer()
    link = peer.down.codebooks

    def stage(order: str) -> StageVQ:
        return StageVQ(dataclasses.replace(S, slice_order=order), 1, has_inbound=True, has_outbound=True, seed=0)

    peer.rt.vq = stage("round_robin")
    link.check_capabilities()  # contiguous slices: any vq_stream receiver
    peer.rt.vq = stage("priority")
    with pytest.raises(MaplError, match="vq_indexed_slices"):
        link.check_capabilities()
    peer.down.capabilities = frozenset({"vq_stream", INDEXED_SLICES_CAPABILITY})
    link.check_capabilities()
