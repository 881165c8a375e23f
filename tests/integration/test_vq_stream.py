"""MAPL+VQ codebook streaming between two processes over ZeroMQ with the real wire encoding.

A sender process (vq_stream_sender.py) learns codebooks on a fixed distribution and streams
CODEBOOK_SLICE + ACT messages; this process is the receiver. After every applied slice the
receiver's codebooks must equal the sender's mirror bit for bit, and every ACT must decode to what
the sender decoded. Then the receiver "crashes" (transport closed, codebook state dropped),
reconnects on a new port, asks for a RESYNC and must end bit-identical again.
"""

import asyncio
import hashlib
import sys
from pathlib import Path

import pytest

from mapl_swarm.compress.codebook_sync import CodebookSlice, VQReceiver
from mapl_swarm.net.transport import Transport, TransportConfig
from mapl_swarm.pipeline.tensors import from_wire
from mapl_swarm.wire import Message, MessageType, decode, encode
from mapl_swarm.wire.codebook import CodebookVersionMismatch, resync_message
from mapl_swarm.wire.session import new_nonce

from swarm_helpers import Watched

sys.path.insert(0, str(Path(__file__).parent))
from vq_stream_sender import HANDSHAKE_META, RUN, SETTINGS  # noqa: E402

pytestmark = pytest.mark.timeout(300)
PHASE1, PRE, PHASE2 = 250, 6, 150
TIMEOUT_S = 60.0


class Receiver:
    def __init__(self) -> None:
        self.rx = VQReceiver(SETTINGS, "act")
        self.verified_slices = self.verified_acts = self.undecodable = 0
        self.seq = 0

    def on_slice(self, msg: Message) -> str:
        outcome = self.rx.apply(CodebookSlice.from_message(msg))
        if outcome == "apply" and "sha" in msg.meta:
            assert self.rx.digest() == msg.meta["sha"], f"codebooks differ after slice v{msg.cver}"
            self.verified_slices += 1
        return outcome

    def on_act(self, msg: Message) -> None:
        codes = from_wire(msg.tensors["codes"])
        try:
            z = self.rx.decode(codes, msg.cver)
        except CodebookVersionMismatch:
            self.undecodable += 1
            return
        assert hashlib.sha256(z.numpy().tobytes()).hexdigest() == msg.meta["decoded_sha"]
        self.verified_acts += 1


async def _connect(sender_ep: str) -> Transport:
    t = Transport("rx", TransportConfig(bind_host="127.0.0.1"))
    ep = t.start()
    t.connect("tx", sender_ep)
    hello = Message(type=MessageType.HELLO, run_id=RUN, src=1, dst=0,
                    meta={**HANDSHAKE_META, "nonce": new_nonce(), "endpoint": ep})
    await t.send("tx", encode(hello))
    return t


async def _recv(t: Transport) -> Message:
    _, frames = await t.recv(TIMEOUT_S)
    return decode(frames)


async def _receive(sender_ep: str) -> dict:
    r = Receiver()
    t = await _connect(sender_ep)
    assert (await _recv(t)).type == MessageType.WELCOME
    acts = 0
    while acts < PHASE1:
        msg = await _recv(t)
        if msg.type == MessageType.CODEBOOK_SLICE:
            r.on_slice(msg)
        else:
            r.on_act(msg)
            acts += 1
    phase1 = (r.verified_slices, r.verified_acts, r.rx.version)

    await t.aclose()  # forced reconnect: the receiver loses its transport and its codebooks
    r = Receiver()
    t = await _connect(sender_ep)
    try:
        assert (await _recv(t)).type == MessageType.WELCOME
        have = r.rx.request_resync()
        await t.send("tx", encode(resync_message(run_id=RUN, src=1, dst=0, stream="act", have=have,
                                                 reason="reconnected")))
        outcomes = []
        while True:
            msg = await _recv(t)
            if msg.type == MessageType.CODEBOOK_SLICE:
                outcomes.append(r.on_slice(msg))
            elif msg.type == MessageType.ACT:
                r.on_act(msg)
            else:
                assert msg.type == MessageType.BYE
                final = msg.meta
                break
        await t.send("tx", encode(Message(type=MessageType.BYE, run_id=RUN, src=1, dst=0)))
        await t.flush(TIMEOUT_S)
    finally:
        await t.aclose()
    return {"phase1": phase1, "receiver": r, "outcomes": outcomes, "final": final}


def test_codebooks_stay_bit_identical_over_zmq_and_after_reconnect_resync():
    script = Path(__file__).parent / "vq_stream_sender.py"
    proc = Watched([sys.executable, str(script), str(PHASE1), str(PRE), str(PHASE2)])
    try:
        sender_ep = proc.wait_for(r"ENDPOINT (\S+)", 120).group(1)
        res = asyncio.run(asyncio.wait_for(_receive(sender_ep), 240))
        assert proc.wait(60) == 0, proc.output
    finally:
        proc.stop()
    slices1, acts1, version1 = res["phase1"]
    assert acts1 == PHASE1 and slices1 == PHASE1 and version1 == PHASE1  # one slice per micro-batch
    r = res["receiver"]
    # the fresh receiver ignored the partial slices sent before the RESYNC, then took the mirror
    # whole (at the sender's version, SPEC §5.1) and every slice after it
    assert res["outcomes"][:PRE] == ["ignore"] * PRE and res["outcomes"][PRE:] == ["apply"] * (PHASE2 + 1)
    assert r.undecodable == PRE and r.verified_acts == PHASE2 and r.verified_slices == PHASE2
    assert r.rx.digest() == res["final"]["sha"] and r.rx.version == res["final"]["version"]
    assert r.rx.version == PHASE1 + PRE + PHASE2 and sum(r.rx.rejected.values()) == PRE

