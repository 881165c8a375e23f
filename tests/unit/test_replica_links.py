"""A starting replica's handshake with its neighbour stages' replicas (SPEC §9.10 item 1): a DHT
record may outlive its replica's process, so the handshake reads the records again until as many
replicas of each neighbour stage as ``replicas.initial`` welcomed it, and drops the links of those
that did not. Stage 1 of 3 on the in-memory transport; the neighbours that live answer its HELLO
(a fake neighbour: the WELCOME's own checks are the session tests')."""

from __future__ import annotations

import asyncio

import pytest

from mapl_swarm.errors import MaplError
from mapl_swarm.net.emulator import LinkConfig
from mapl_swarm.peer.link import LinkSettings, Links
from mapl_swarm.peer.replica_links import ReplicaLinker
from mapl_swarm.peer.waiting import WaitingLog
from mapl_swarm.wire import MessageType

from peer_fakes import FakeNet, peek

SETTINGS = LinkSettings(run_id="r", stage=1, num_stages=3, fingerprint="f" * 32, capabilities=("1f1b", "replicas"),
                        max_frame_bytes=1 << 20, replicas=True)


class Neighbours:
    """The DHT's records of stages 0 and 2 (``records``, freshest first) and which of their
    replicas live (``live``: they welcome the HELLOs that reach them)."""

    def __init__(self, records: dict[int, list[str]], live: set[str], timeout_s: float = 10.0) -> None:
        self.net = FakeNet()
        self.me = self.net.transport("me")
        self.records, self.live = records, live
        for contacts in records.values():
            for contact in contacts:
                self.net.transport(contact)
        self.hellos: list[str] = []
        self.on_first_hello: dict[str, object] = {}
        """``contact: action()``, run when the first HELLO to ``contact`` goes out."""
        self.links = Links(None, None, up=0, down=2)
        self.linker = ReplicaLinker("stage1", self.links, SETTINGS, resolve=self.resolve,
                                    shaping=LinkConfig(), timeout_s=timeout_s, hello_retry_s=0.2,
                                    waits=WaitingLog("stage1"), on_bad_frame=lambda *a: None,
                                    gone=set, epoch=lambda: 0)
        self.net.tap = self._answer

    async def resolve(self, stage: int, timeout_s: float) -> list[str]:
        return [f"mem://{c}" for c in self.records[stage]]

    def add(self, stage: int, contact: str) -> None:
        """A replica started since announces its record (it lives)."""
        self.net.transport(contact)
        self.records[stage].insert(0, contact)
        self.live.add(contact)

    def _answer(self, src, dst, frames, reply) -> None:
        msg = peek(frames)
        if msg is None or msg.type is not MessageType.HELLO:
            return
        self.hellos.append(dst)
        if dst in self.on_first_hello:
            self.on_first_hello.pop(dst)()
        if dst in self.live:
            link = next(link for link in self.links if link.contact == f"mem://{dst}")
            link.welcomed = True
            self.linker.welcomed()

    async def handshake(self, want) -> None:
        await self.linker.link_all(self.me, "mem://me", want)
        await self.linker.handshake(self.me, want, timeout_s=self.linker.timeout_s)


def test_stale_records_are_dropped_and_a_replica_announced_meanwhile_is_linked():
    """Stage 0's records: a replica's stale one (its process died) and a live replica's; the
    second live replica announces itself while the handshake runs. The handshake ends with the
    two live replicas of stage 0 and the one of stage 2 linked, the stale record's link dropped."""
    n = Neighbours({0: ["stale0", "a0"], 2: ["c2"]}, live={"a0", "c2"})

    n.on_first_hello["stale0"] = lambda: n.add(0, "b0")
    asyncio.run(asyncio.wait_for(n.handshake(lambda stage: 2 if stage == 0 else 1), 20))
    assert sorted(link.contact for link in n.links) == ["mem://a0", "mem://b0", "mem://c2"]
    assert all(link.welcomed for link in n.links)
    assert "stale0" not in n.me.links() and n.hellos.count("stale0") >= 1


def test_too_few_replicas_that_answer_end_the_handshake_naming_the_stage():
    n = Neighbours({0: ["stale0", "a0"], 2: ["c2"]}, live={"a0", "c2"}, timeout_s=1.0)
    with pytest.raises(MaplError, match=r"handshake not completed within 1 s \(net.timeout_s\): 1 of stage 0's 2 "
                                        r"replicas \(replicas.initial\) welcomed this peer"):
        asyncio.run(n.handshake(lambda stage: 2 if stage == 0 else 1))
