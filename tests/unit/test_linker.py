"""A starting peer's handshake with its neighbour stages' peers (SPEC §9.2, §9.10 item 1), one
linker for chains and replicas: a DHT record may outlive its peer's process, so the handshake
HELLOs every record and reads them again until as many peers of each neighbour stage as start the
run welcomed it (a chain: one; replicas: ``replicas.initial``), and drops the links of those that
did not; a chain keeps one link per stage; a swarm with replicas that re-forms after a stage lost
its last replica starts with the replicas live at the pause instead (SPEC §9.10 item 10: each says
how many in its WELCOME). Stage 1 of 3 on the in-memory transport; the neighbours that live answer
its HELLO (a fake neighbour: the WELCOME's own checks are the session tests')."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from mapl_swarm.errors import MaplError
from mapl_swarm.net.emulator import LinkConfig
from mapl_swarm.peer.link import LinkSettings, Links
from mapl_swarm.peer.link import PeerLink
from mapl_swarm.peer.linker import Linker, Reform, starting_replicas
from mapl_swarm.peer.waiting import WaitingLog
from mapl_swarm.wire import MessageType

from peer_fakes import FakeNet, peek

SETTINGS = LinkSettings(run_id="r", stage=1, num_stages=3, fingerprint="f" * 32, capabilities=("1f1b", "replicas"),
                        max_frame_bytes=1 << 20, replicas=True)
CHAIN = dataclasses.replace(SETTINGS, capabilities=("1f1b",), replicas=False)


class Neighbours:
    """The DHT's records of stages 0 and 2 (``records``, freshest first) and which of their
    replicas live (``live``: they welcome the HELLOs that reach them)."""

    def __init__(self, records: dict[int, list[str]], live: set[str], timeout_s: float = 10.0,
                 reform: dict[str, tuple[int, int | None]] | None = None, chain: bool = False) -> None:
        self.net = FakeNet()
        self.me = self.net.transport("me")
        self.records, self.live = records, live
        for contacts in records.values():
            for contact in contacts:
                self.net.transport(contact)
        self.reform = reform or {}
        """``contact: (stage_replicas, lost)`` its WELCOME says (a replica of a re-forming swarm)."""
        self.hellos: list[str] = []
        self.sent: list[tuple[str, list, bool]] = []
        self.on_first_hello: dict[str, object] = {}
        """``contact: action()``, run when the first HELLO to ``contact`` goes out."""
        self.links = Links(0, 2)
        self.linker = Linker("stage1", self.links, CHAIN if chain else SETTINGS, resolve=self.resolve,
                             shaping=LinkConfig(), timeout_s=timeout_s, hello_retry_s=0.2,
                             waits=WaitingLog("stage1"), on_bad_frame=lambda *a: None,
                             gone=set, epoch=lambda: 0, one_per_stage=chain)
        self.net.tap = self._answer

    async def resolve(self, stage: int, timeout_s: float) -> list[str]:
        return [f"mem://{c}" for c in self.records[stage]]

    def add(self, stage: int, contact: str) -> None:
        """A replica started since announces its record (it lives)."""
        self.net.transport(contact)
        self.records[stage].insert(0, contact)
        self.live.add(contact)

    def _answer(self, src, dst, frames, reply) -> None:
        self.sent.append((dst, frames, reply))
        msg = peek(frames)
        if msg is None or msg.type is not MessageType.HELLO:
            return
        self.hellos.append(dst)
        if dst in self.on_first_hello:
            self.on_first_hello.pop(dst)()
        if dst in self.live:
            link = next(link for link in self.links if link.contact == f"mem://{dst}")
            link.welcomed = True
            link.reform_replicas, link.reform_lost = self.reform.get(dst, (None, None))
            self.linker.welcomed()

    async def handshake(self, want) -> None:
        await self.linker.link_all(self.me, "mem://me")
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
                                        r"replicas \(replicas.initial, or those a re-formed swarm keeps\) welcomed"):
        asyncio.run(n.handshake(lambda stage: 2 if stage == 0 else 1))


def test_a_chain_hellos_every_record_and_keeps_the_one_peer_that_welcomes_it():
    """A chain's stage 0 has a stale record (its peer died) beside the live one, stage 2 a planted
    record that never answers: both are HELLOed at once (no record waits for another's retry),
    the live peers' links stay, one per stage, and their HELLO names this peer's contact."""
    n = Neighbours({0: ["stale0", "a0"], 2: ["planted2", "c2"]}, live={"a0", "c2"}, chain=True)
    asyncio.run(asyncio.wait_for(n.handshake(lambda stage: 1), 20))
    assert sorted(link.contact for link in n.links) == ["mem://a0", "mem://c2"]
    assert {"stale0", "planted2"} <= set(n.hellos) and sorted(n.me.links()) == sorted(link.name for link in n.links)
    hello = next(peek(frames) for dst, frames, _ in n.sent if dst == "a0")
    assert hello.meta["contact"] == "mem://me" and "replicas" not in hello.meta["capabilities"]


def test_a_chain_keeps_one_link_when_two_peers_of_a_stage_welcome_it():
    """Two peers started for stage 0 by mistake both welcome this peer: a chain keeps one (the
    first that welcomed; the admission refuses the other's HELLO ``stage_taken``, see
    ``test_peer_sessions``); replicas keep both."""
    n = Neighbours({0: ["a0", "b0"], 2: ["c2"]}, live={"a0", "b0", "c2"}, chain=True)
    asyncio.run(asyncio.wait_for(n.handshake(lambda stage: 1), 20))
    assert len(n.links.of_stage(0)) == 1 and len(n.me.links()) == 2
    n = Neighbours({0: ["a0", "b0"], 2: ["c2"]}, live={"a0", "b0", "c2"})
    asyncio.run(asyncio.wait_for(n.handshake(lambda stage: 1), 20))
    assert sorted(link.contact for link in n.links.of_stage(0)) == ["mem://a0", "mem://b0"]


def test_a_chain_whose_neighbour_never_answers_names_the_stage():
    n = Neighbours({0: ["stale0"], 2: ["c2"]}, live={"c2"}, timeout_s=1.0, chain=True)
    with pytest.raises(MaplError, match=r"handshake not completed within 1 s \(net.timeout_s\): no peer of stage 0 "
                                        r"welcomed this peer$"):
        asyncio.run(n.handshake(lambda stage: 1))


def _want(n: Neighbours, reform: Reform | None = None):
    return lambda stage: starting_replicas(stage, own_stage=1, initial=2, reform=reform, links=n.links)


def test_a_re_forming_swarm_waits_for_the_replicas_its_welcomes_name_not_replicas_initial():
    """Stage 0 started with two replicas, one died earlier (its record is stale); the survivor's
    WELCOME says its stage re-forms with 1. Stage 2 lost its last replica: its replacement comes
    with no count (one, as this peer's pause names the stage lost). The handshake ends with both
    links, not waiting for replicas.initial's two of stage 0."""
    n = Neighbours({0: ["dead0", "a0"], 2: ["new2"]}, live={"a0", "new2"}, timeout_s=5.0, reform={"a0": (1, 2)})
    asyncio.run(asyncio.wait_for(n.handshake(_want(n, Reform(replicas=2, lost=2))), 20))
    assert sorted(link.contact for link in n.links) == ["mem://a0", "mem://new2"]


def _welcomed(stage: int, said: tuple[int | None, int | None]) -> PeerLink:
    link = PeerLink(SETTINGS, stage, on_bad_frame=lambda *a: None, contact=f"mem://{stage}-{said}")
    link.welcomed = True
    link.reform_replicas, link.reform_lost = said
    return link


@pytest.mark.parametrize("links, reform, expected", [
    # no re-form: replicas.initial for every stage
    ([], None, {0: 2, 1: 2, 2: 2}),
    # a survivor: its own stage as its pause counted, the lost stage one, a neighbour as it says
    ([(0, (3, 2))], Reform(replicas=1, lost=2), {0: 3, 1: 1, 2: 1}),
    # two replicas of a stage that counted differently (one saw a partner leave later): the most
    ([(0, (1, 2)), (0, (2, 2))], Reform(replicas=1, lost=2), {0: 2}),
    # a replacement of the lost stage (no plan of its own): one, itself, as its neighbours' WELCOMEs say
    ([(0, (2, 1)), (2, (1, 1))], None, {0: 2, 1: 1, 2: 1}),
    # told by a neighbour's HELLO (lost not known here): the neighbours as they say
    ([(0, (1, None))], Reform(replicas=2, lost=None), {0: 1, 1: 2, 2: 2}),
])
def test_starting_replicas(links, reform, expected):
    got = Links(0, 2)
    for stage, said in links:
        got.add(_welcomed(stage, said))
    for stage, n in expected.items():
        assert starting_replicas(stage, own_stage=1, initial=2, reform=reform, links=got) == n, stage


def test_a_re_forming_session_waits_for_a_record_as_long_as_the_rejoin_wait_and_names_it():
    """A re-forming session waits for the departed stage's new record up to ``net.rejoin_timeout_s``
    (its log said so), not ``net.timeout_s``, and names that setting when none comes."""
    asked: list[float] = []

    async def no_record(stage: int, timeout_s: float) -> list[str]:
        asked.append(timeout_s)
        raise MaplError(f"no peer of stage {stage} in the DHT within {timeout_s:g} s")

    n = Neighbours({0: [], 2: []}, live=set(), timeout_s=10.0, chain=True)
    n.linker.resolve = no_record
    with pytest.raises(MaplError, match=r"within 300 s \(net.rejoin_timeout_s: no replacement came\)"):
        asyncio.run(n.linker.link_all(n.me, "mem://me", fresh=True, timeout_s=300.0,
                                      why="net.rejoin_timeout_s: no replacement came"))
    assert asked == [300.0]


def test_a_joiner_that_finds_no_swarm_is_told_so_not_to_join():
    """A ``--join`` after the run ended finds no neighbour's record: its error says no swarm of the
    run runs, not to start with ``--join``."""
    async def no_record(stage: int, timeout_s: float) -> list[str]:
        raise MaplError(f"no peer of stage {stage} in the DHT within {timeout_s:g} s")

    n = Neighbours({0: [], 2: []}, live=set(), timeout_s=1.0)
    n.linker.resolve = no_record
    with pytest.raises(MaplError, match=r"no swarm of run 'r' runs to join \(it ended, or has not started") as got:
        asyncio.run(n.linker.link_all(n.me, "mem://me", joining=True))
    assert "--join" not in str(got.value)


def test_a_replica_short_of_its_neighbour_stages_replicas_says_how_to_go_on_without_one():
    """Issue 45: a resume started without one replica of a stage (its host gone) names what to do."""
    n = Neighbours({0: ["a0", "dead0"], 2: ["c2"]}, live={"a0", "c2"}, timeout_s=1.0)
    with pytest.raises(MaplError, match=r"1 of stage 0's 2 replicas \(replicas.initial, or those a re-formed swarm "
                                        r"keeps\) welcomed this peer: start the missing ones; a replica whose host is "
                                        r"gone for good is not waited for once replicas.initial of stage 0 is lowered "
                                        r"on every host \(add a host later with --join\)"):
        asyncio.run(n.handshake(lambda stage: 2 if stage == 0 else 1))
