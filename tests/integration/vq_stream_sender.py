"""Codebook-stream sender process for tests/integration/test_vq_stream.py (not a test module).

    python vq_stream_sender.py PHASE1 PRE PHASE2

Binds a transport on port 0 and prints ``ENDPOINT tcp://...``. Answers every HELLO with WELCOME,
(re)connecting its link to the endpoint in the HELLO's meta. Phase 1: PHASE1 micro-batches (each
its CODEBOOK_SLICE then an ACT with VQ codes), then waits. On the second HELLO (the receiver
reconnected with fresh state) it streams PRE micro-batches without reading its inbox, then reads
the receiver's RESYNC and streams PHASE2 more, then a BYE carrying its mirror digest and version.
Each encode's own slice carries ``meta.sha`` (the mirror digest after it) and every ACT ``meta.decoded_sha``
(SHA-256 of what the codes decode to with the mirror), so the receiver can check both.
"""

from __future__ import annotations

import asyncio
import hashlib
import sys

import numpy as np
import torch

from mapl_swarm.compress.codebook_sync import VQSender, stream_generator
from mapl_swarm.compress.vq import decode_codes
from mapl_swarm.config import CompressionConfig, VQConfig
from mapl_swarm.net.transport import Transport, TransportConfig, run
from mapl_swarm.wire import Message, MessageType, WireTensor, decode, encode
from mapl_swarm.wire.session import new_nonce

RUN = "vq-stream-test"
HANDSHAKE_META = {"fingerprint": "f", "num_stages": 2, "num_micro_batches": 1, "micro_batch_size": 1,
                  "eval_batches": 1, "capabilities": ["vq_stream"]}
"""HELLO/WELCOME meta of this two-party test (the nonces are added per message, SPEC §9.2)."""
SETTINGS = CompressionConfig(codec="mapl_vq", rank=16,
                             vq=VQConfig(codebook_size=64, slice_fraction=0.125, kmeans_iters=3)).vq
TIMEOUT_S = 60.0


def batch(gen: torch.Generator, centers: torch.Tensor) -> torch.Tensor:
    """(2, 32, 16) samples of a fixed Gaussian mixture."""
    pick = torch.randint(0, centers.shape[0], (64,), generator=gen)
    return (centers[pick] + 0.3 * torch.randn(64, 16, generator=gen)).reshape(2, 32, 16)


class Sender:
    def __init__(self, transport: Transport) -> None:
        self.t = transport
        self.tx = VQSender(SETTINGS, "act", stream_generator(0, 0, "act"))
        self.gen = torch.Generator().manual_seed(7)
        self.centers = 2 * torch.randn(12, 16, generator=self.gen)
        self.seq = 0
        self.micro = 0

    async def send(self, msg: Message) -> None:
        msg.seq = self.seq
        self.seq += 1
        await self.t.send("rx", encode(msg), kind=msg.type.name)

    async def micro_batch(self) -> None:
        codes = self.tx.encode(batch(self.gen, self.centers), learn=True)
        slices = self.tx.take_slices()
        for n, sl in enumerate(slices, 1):
            msg = sl.to_message(run_id=RUN, src=0, dst=1, micro=self.micro)
            if n == len(slices):  # the encode's own slice (a RESYNC's whole mirror comes before it)
                msg.meta["sha"] = self.tx.digest()
            await self.send(msg)
        decoded = decode_codes(codes, self.tx.mirror).numpy().tobytes()
        await self.send(Message(type=MessageType.ACT, run_id=RUN, src=0, dst=1, micro=self.micro,
                                cver=self.tx.version,
                                meta={"mode": "train", "decoded_sha": hashlib.sha256(decoded).hexdigest()},
                                tensors={"codes": WireTensor("uint8", codes.numpy())}))
        self.micro += 1

    async def control(self) -> Message:
        _, frames = await self.t.recv(TIMEOUT_S)
        msg = decode(frames)
        if msg.type == MessageType.HELLO:
            if "rx" in self.t.links():
                await self.t.disconnect("rx")
            self.t.connect("rx", msg.meta["endpoint"])
            self.seq = 0
            await self.send(Message(type=MessageType.WELCOME, run_id=RUN, src=0, dst=1,
                                    meta={**HANDSHAKE_META, "nonce": new_nonce(), "hello_nonce": msg.meta["nonce"]}))
        elif msg.type == MessageType.RESYNC:
            self.tx.request_resync()
        return msg


async def main(phase1: int, pre: int, phase2: int) -> None:
    async with Transport("tx", TransportConfig(bind_host="127.0.0.1")) as t:
        print("ENDPOINT", t.start(), flush=True)
        s = Sender(t)
        assert (await s.control()).type == MessageType.HELLO
        for _ in range(phase1):
            await s.micro_batch()
        assert (await s.control()).type == MessageType.HELLO  # the receiver reconnected
        for _ in range(pre):  # still streaming partial slices the fresh receiver cannot use
            await s.micro_batch()
        assert (await s.control()).type == MessageType.RESYNC
        for _ in range(phase2):
            await s.micro_batch()
        await s.send(Message(type=MessageType.BYE, run_id=RUN, src=0, dst=1,
                             meta={"reason": "done", "sha": s.tx.digest(), "version": s.tx.version}))
        await t.flush(TIMEOUT_S)
        await asyncio.wait_for(s.control(), TIMEOUT_S)  # the receiver's BYE: everything arrived


if __name__ == "__main__":
    torch.set_num_threads(1)
    np.seterr(all="raise")
    run(main(*(int(a) for a in sys.argv[1:4])))
