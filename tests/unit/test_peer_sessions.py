"""Per-check tests of what a peer lets in: one middle peer (stage 1 of 3) fed messages directly
through :meth:`Peer.receive` on an in-memory transport (issue 12, items 2-4)."""

from __future__ import annotations

import asyncio
import threading
from types import SimpleNamespace

import numpy as np
import pytest

import mapl_swarm.peer.admission as admission
from mapl_swarm.peer.admission import Arrival, mailbox_bound
from mapl_swarm.peer.control import Control, PeerRejected
from mapl_swarm.peer.link import stage_of
from mapl_swarm.peer.mailbox import Mailbox
from mapl_swarm.peer.runtime import Peer, PeerState
from mapl_swarm.peer.session import Rejected
from mapl_swarm.pipeline.stage import StageRuntime
from mapl_swarm.wire import Message, MessageType, WireTensor, decode, encode

from peer_fakes import FakeNet, link_neighbours, swarm_config

MT = MessageType
UP, DOWN = "stage0.000000a0", "stage2.000000b0"
HELLO = {"fingerprint": "fp", "num_stages": 3, "capabilities": ["1f1b"], "nonce": b"n" * 16,
         "num_micro_batches": 2, "micro_batch_size": 2, "eval_batches": 1}


def _cfg():
    return swarm_config(pipeline={"num_stages": 3}, run={"run_id": "mem"})


class Middle:
    """Stage 1 of 3 with a fake transport; ``feed(sender, frames)`` runs one message through it."""

    def __init__(self) -> None:
        self.net = FakeNet()
        self.transport = self.net.transport("stage1")
        for s in (0, 2):  # the neighbours' own connections (for answers to this peer's HELLOs)
            self.net.transport(f"stage{s}")
        cfg = _cfg()

        async def resolve(stage, timeout_s):
            return f"mem://stage{stage}"

        async def announce(endpoint):
            return None

        self.peer = Peer(cfg, 1, StageRuntime(cfg, 1), fingerprint="fp", resolve=resolve, announce=announce)
        self.peer.admission.replies_on_link = True
        link_neighbours(self.peer)
        for link in self.peer.links:
            link.connect(self.transport, f"mem://stage{link.stage}", None)

    async def feed(self, sender: str, frames, *, reply_link: str | None = None) -> None:
        """``reply_link``: an answer on this peer's connection to that neighbour (``stage<k>``)."""
        if reply_link is not None:
            reply_link = self.peer.links.route(int(reply_link.removeprefix("stage"))).name
        await self.peer.receive(Arrival(sender, [bytes(f) for f in frames], reply_link=reply_link), self.transport)

    async def handshake(self, up: str = UP, down: str = DOWN) -> None:
        """Both neighbours' HELLOs, then training starts (as after a handshake without a resume)."""
        await self.feed(up, msg(MT.HELLO, src=0, meta=HELLO))
        await self.feed(down, msg(MT.HELLO, src=2, meta=HELLO))
        self.peer.state = PeerState.TRAINING
        await self.peer.ingress.start(self.transport)

    @property
    def rejects(self) -> dict[str, int]:
        return self.peer.result.rejects

    def answers(self, routing_id: str) -> list[tuple[str, int, str | None]]:
        return [(m.type.name, m.seq, m.meta.get("code")) for m in map(decode, self.net.orphan_replies[routing_id])]

    def welcome(self, stage: int, seq: int = 0, **meta) -> list:
        """The neighbour's WELCOME to this peer's pending HELLO."""
        nonce = self.peer.links.route(stage)._hello_nonce
        return msg(MT.WELCOME, src=stage, seq=seq, meta={**HELLO, "nonce": b"w" * 16, "hello_nonce": nonce, **meta})


def msg(mtype, *, src, dst=1, run="mem", **kw) -> list:
    return encode(Message(type=mtype, run_id=run, src=src, dst=dst, **kw))


def act(seq: int, micro: int = 0, step: int = 0) -> list:
    cfg = _cfg()
    B, T, r = cfg.pipeline.micro_batch_size, cfg.model.context_length, cfg.compression.rank
    return msg(MT.ACT, src=0, seq=seq, step=step, micro=micro, meta={"mode": "train"},
               tensors={"z": WireTensor("bf16", np.zeros((B, T, r), np.uint16)),
                        "ids": np.zeros((B, T + 1), np.uint16)})


def run(coro_fn):
    async def main():
        m = Middle()
        await coro_fn(m)
        m.peer.decoder.close()
        return m
    return asyncio.run(main())


# ---------------------------------------------------------------------- the handshake
@pytest.mark.parametrize("case, code", [
    (dict(run="other"), "run_mismatch"),
    (dict(dst=2), "stage_mismatch"),
    (dict(src=2), "stage_mismatch"),  # a stage-0 connection claiming stage 2
    (dict(meta={**HELLO, "num_stages": 4}), "stage_mismatch"),
    (dict(meta={**HELLO, "fingerprint": "other"}), "fingerprint_mismatch"),
    (dict(meta={**HELLO, "num_micro_batches": 3}), "fingerprint_mismatch"),
    (dict(meta={**HELLO, "micro_batch_size": 1}), "fingerprint_mismatch"),
    (dict(meta={**HELLO, "eval_batches": 4}), "fingerprint_mismatch"),
])
def test_a_refused_hello_gets_reject_with_the_spec_code_on_its_own_connection(case, code):
    async def scenario(m):
        await m.feed(UP, msg(MT.HELLO, **{"src": 0, "meta": HELLO, **case}))
    m = run(scenario)
    assert m.answers(UP) == [("REJECT", 0, code)]
    assert decode(m.net.orphan_replies[UP][0]).meta["hello_nonce"] == HELLO["nonce"]
    assert m.rejects == {code: 1} and m.peer.links.upstream.rx is None


def test_other_major_version_gets_one_reject_per_connection():
    async def scenario(m):
        frames = msg(MT.HELLO, src=0, meta=HELLO)
        import msgpack
        header = msgpack.unpackb(bytes(frames[0]))
        header["v"] = [1, 9]  # a 1.x peer
        for _ in range(3):
            await m.feed(UP, [msgpack.packb(header)])
    m = run(scenario)
    assert [a[::2] for a in m.answers(UP)] == [("REJECT", "version_mismatch")]
    assert m.rejects == {"version_mismatch": 3}


def test_welcome_binds_the_session_and_a_second_connection_for_the_stage_is_refused():
    async def scenario(m):
        await m.handshake()
        await m.feed(UP, msg(MT.HEARTBEAT, src=0, seq=1))
        await m.feed("stage0.0badc0de", msg(MT.HELLO, src=0, meta=HELLO))  # stage 0 is alive: taken
        await m.feed(UP, msg(MT.HELLO, src=0, meta=HELLO))  # the bound connection again: it reconnects
        await m.feed(UP, msg(MT.HEARTBEAT, src=0, seq=1))  # the new session's seq starts again
    m = run(scenario)
    assert m.peer.links.upstream.rx.routing_id == UP and m.peer.links.downstream.rx.routing_id == DOWN
    assert m.answers(UP) == [("WELCOME", 0, None)] * 2 and m.answers(DOWN) == [("WELCOME", 0, None)]
    welcome = decode(m.net.orphan_replies[DOWN][0]).meta
    assert welcome["hello_nonce"] == HELLO["nonce"] and len(welcome["nonce"]) == 16
    assert welcome["num_micro_batches"] == 2 and welcome["micro_batch_size"] == 2 and welcome["eval_batches"] == 1
    assert m.answers("stage0.0badc0de") == [("REJECT", 0, "stage_taken")]
    assert m.rejects == {"stage_taken": 1} and m.peer.links.upstream.rx.last_seq == 1


def test_a_hello_binds_to_the_link_of_the_contact_it_names_and_another_contact_of_a_chain_stage_is_taken():
    """HELLO ``contact`` (SPEC §9.2): the neighbour's HELLO naming its record's contact binds the
    link to that contact; in a chain another peer of the stage, at another contact, is refused
    ``stage_taken`` while the first is in session, even before that one's session binds."""
    async def scenario(m):
        link = m.peer.links.upstream
        await m.feed(UP, msg(MT.HELLO, src=0, meta={**HELLO, "contact": "mem://stage0"}))
        assert link.rx.routing_id == UP
        await m.feed("stage0.0badc0de", msg(MT.HELLO, src=0, meta={**HELLO, "contact": "mem://other0"}))
        await m.peer.links.downstream.send_hello()
        await m.feed("stage2", m.welcome(2), reply_link="stage2")  # welcomed by stage 2, not yet bound
        await m.feed("stage2.0badc0de", msg(MT.HELLO, src=2, meta={**HELLO, "contact": "mem://other2"}))
    m = run(scenario)
    assert m.answers(UP) == [("WELCOME", 0, None)]
    assert m.answers("stage0.0badc0de") == m.answers("stage2.0badc0de") == [("REJECT", 0, "stage_taken")]
    reject = decode(m.net.orphan_replies["stage0.0badc0de"][0]).meta["reason"]
    assert reject == "stage 0 is taken: this peer is in session with its peer at mem://stage0"
    assert m.peer.links.downstream.rx is None and m.rejects == {"stage_taken": 2}


def test_a_2_0_peers_hello_without_contact_binds_to_the_record_that_welcomed_this_peer():
    """A 2.0 chain peer names no contact: while this peer's HELLOs to two records of its stage (one
    stale) are unanswered, its HELLO is dropped (binding it would be a guess); once one welcomed
    this peer, its HELLO binds to that link."""
    async def scenario(m):
        stale = m.peer.linker.new_link(0, "mem://stale0")
        stale.connect(m.transport, "mem://stale0", None)
        live = m.peer.links.by_contact(0, "mem://stage0")
        await m.feed(UP, msg(MT.HELLO, src=0, meta=HELLO))
        assert live.rx is None and stale.rx is None
        await live.send_hello()
        await m.feed("stage0", m.welcome(0), reply_link="stage0")
        await m.feed(UP, msg(MT.HELLO, src=0, meta=HELLO))
        assert live.rx.routing_id == UP and stale.rx is None
    m = run(scenario)
    assert m.answers(UP) == [("WELCOME", 0, None)] and m.rejects == {}


def test_a_hello_from_an_unknown_contact_of_a_free_stage_reads_the_records_and_is_dropped():
    """Before any peer of stage 0 is in session with this one, a HELLO naming a contact this peer
    has no link to (a peer announced after this one read the records) is dropped, not refused,
    and makes the linker read the records at once (the sender says HELLO again)."""
    async def scenario(m):
        read = []
        m.peer.admission.unknown_replica = read.append
        await m.feed("stage0.0000000c", msg(MT.HELLO, src=0, meta={**HELLO, "contact": "mem://new0"}))
        assert read == [0]
    m = run(scenario)
    assert "stage0.0000000c" not in m.net.orphan_replies and m.peer.links.upstream.rx is None
    assert m.rejects == {}


def test_a_bye_during_the_handshake_frees_the_stage_for_another_peer():
    """A neighbour that stops before training (a refused handshake, a replacement that must
    resume) says BYE: the handshaking peer ends both sessions with it, does not depart or stop,
    and welcomes the next peer of that stage at once instead of refusing it as ``stage_taken``."""
    async def scenario(m):
        m.peer.state = PeerState.HANDSHAKING
        link = m.peer.links.upstream
        await link.send_hello()
        await m.feed(UP, msg(MT.HELLO, src=0, meta=HELLO))
        await m.feed("stage0", m.welcome(0), reply_link="stage0")
        assert link.rx.routing_id == UP and link.welcomed
        await m.feed(UP, msg(MT.BYE, src=0, seq=1, meta={"reason": "stopped before training: must resume"}))
        assert link.rx is None and not link.welcomed
        await m.feed("stage0.0badc0de", msg(MT.HELLO, src=0, meta=HELLO))
    m = run(scenario)
    assert m.answers("stage0.0badc0de") == [("WELCOME", 0, None)]
    assert m.peer.links.upstream.rx.routing_id == "stage0.0badc0de"
    assert m.peer.stop_reason is None and m.rejects == {} and not m.peer.departures.gone(0)


def test_before_training_a_dead_session_may_be_replaced_by_a_new_connection():
    """Before training a bound session unheard for the liveness floor frees its stage; while
    training it stays bound until this peer finds the neighbour lost (which re-forms the swarm)."""
    async def scenario(m):
        await m.handshake()
        assert m.peer.cfg.net.liveness_floor + 1 < m.peer.cfg.net.timeout_s
        m.peer.links.upstream.rx.heard_at -= m.peer.cfg.net.liveness_floor + 1  # past the floor, not the timeout
        await m.feed("stage0.0000000b", msg(MT.HELLO, src=0, meta=HELLO))  # training: still taken
        m.peer.state = PeerState.HANDSHAKING
        m.peer.ingress.started = False
        await m.feed("stage0.0000000c", msg(MT.HELLO, src=0, meta=HELLO))
        await m.feed(UP, msg(MT.HEARTBEAT, src=0, seq=1))  # the old connection is no longer the session
    m = run(scenario)
    assert m.answers("stage0.0000000b") == [("REJECT", 0, "stage_taken")]
    assert m.peer.links.upstream.rx.routing_id == "stage0.0000000c"
    assert m.answers("stage0.0000000c") == [("WELCOME", 0, None)]
    assert m.rejects == {"stage_taken": 1, "wrong_session": 1}


def test_welcome_and_reject_count_only_as_the_answer_to_this_peers_hello():
    async def scenario(m):
        reject = msg(MT.REJECT, src=0, meta={"code": "fingerprint_mismatch", "reason": "forged"})
        await m.feed("stage0", msg(MT.WELCOME, src=0, meta={**HELLO, "hello_nonce": b"x" * 16}),
                     reply_link="stage0")  # no HELLO sent yet
        await m.peer.links.upstream.send_hello()
        welcome = m.welcome(0)
        await m.feed(UP, reject)  # on the neighbour's connection, not this peer's own one
        await m.feed("stage0.0badc0de", welcome)
        await m.feed("stage0", msg(MT.REJECT, src=0, meta={"code": "x", "reason": "for another HELLO",
                                                         "hello_nonce": b"x" * 16}), reply_link="stage0")
        await m.feed("stage0", m.welcome(0, seq=3), reply_link="stage0")  # the handshake's seq is 0
        assert m.peer.stop_reason is None and not m.peer.links.upstream.welcomed
        await m.feed("stage0", welcome, reply_link="stage0")  # the answer, on this peer's connection
        await m.feed("stage0", reject, reply_link="stage0")  # a second answer
    m = run(scenario)
    assert m.peer.links.upstream.welcomed and m.peer.stop_reason is None
    assert m.rejects == {"not_allowed": 6}


def test_the_answer_to_an_earlier_hello_is_not_a_bad_message():
    """HELLO is resent until answered; a WELCOME to an earlier one (a newer HELLO replaced it) is
    not used and not counted, the WELCOME to the newest one completes the handshake."""
    async def scenario(m):
        await m.peer.links.upstream.send_hello()
        earlier = m.welcome(0)
        for _ in range(60):  # a neighbour stalled for a rejoin wait answers every HELLO it missed
            await m.peer.links.upstream.send_hello()
        await m.feed("stage0", earlier, reply_link="stage0")
        assert not m.peer.links.upstream.welcomed
        await m.feed("stage0", m.welcome(0), reply_link="stage0")
    m = run(scenario)
    assert m.peer.links.upstream.welcomed and m.rejects == {}


def test_a_fresh_peer_welcomed_by_a_re_forming_swarm_stops_saying_it_must_resume():
    async def scenario(m):
        await m.peer.links.upstream.send_hello()
        frames = encode(Message(type=MT.WELCOME, run_id="mem", src=0, dst=1, epoch=2, meta={
            **HELLO, "nonce": b"w" * 16, "hello_nonce": m.peer.links.upstream._hello_nonce}))
        await m.feed("stage0", frames, reply_link="stage0")
    m = run(scenario)
    assert "belongs to a swarm that re-forms after a departure (run epoch 2): stage 1 must take the departed " \
           "peer's place from its checkpoints, so start it again with --resume" in str(m.peer.stop_reason)
    assert m.peer.links.upstream.welcomed  # the neighbour's session of this peer, ended by the BYE on stopping


def test_a_peer_that_stops_before_training_says_bye_to_the_neighbour_that_welcomed_it():
    """The WELCOME of a re-forming swarm stops a fresh peer; on stopping it ends the session that
    neighbour opened for it (BYE with its reason), so the stage is free for the right peer at once."""
    async def scenario(m):
        await m.peer.links.upstream.send_hello()
        await m.feed("stage0", msg(MT.WELCOME, src=0, epoch=1, meta={
            **HELLO, "nonce": b"w" * 16, "hello_nonce": m.peer.links.upstream._hello_nonce}), reply_link="stage0")
        with pytest.raises(PeerRejected, match="start it again with --resume"):
            await m.peer._stopped(m.transport)
    m = run(scenario)
    sent = m.net.messages("stage1", "stage0")
    assert [x.type for x in sent] == [MT.HELLO, MT.BYE]
    assert sent[1].meta["reason"].startswith("stopped before training: stage 0 belongs to a swarm that re-forms")
    assert m.net.messages("stage1", "stage2") == []  # stage 2 never welcomed it: nothing to end


def test_a_welcome_of_another_configuration_stops_the_peer():
    async def scenario(m):
        await m.peer.links.upstream.send_hello()
        await m.feed("stage0", m.welcome(0, num_micro_batches=4), reply_link="stage0")
    m = run(scenario)
    assert "num_micro_batches mismatch: stage 0 has 4, stage 1 2" in str(m.peer.stop_reason)


def test_hello_seq_0_then_every_message_takes_the_next_seq_and_heartbeats_wait_for_welcome():
    async def scenario(m):
        link = m.peer.links.downstream
        await link.send_heartbeat()  # not welcomed: nothing goes out
        await link.send_hello()
        await m.feed("stage2", m.welcome(2), reply_link="stage2")
        await link.send_heartbeat()
        await link.send_heartbeat()
    m = run(scenario)
    sent = m.net.messages("stage1", "stage2")
    assert [(x.type, x.seq) for x in sent] == [(MT.HELLO, 0), (MT.HEARTBEAT, 1), (MT.HEARTBEAT, 2)]


# ---------------------------------------------------------------------- sessions and who may say what
def test_after_the_handshake_only_the_bound_connection_in_sequence_and_direction_gets_in():
    async def scenario(m):
        await m.feed(UP, msg(MT.HEARTBEAT, src=0, seq=1))  # before any handshake
        await m.handshake()
        await m.feed(UP, msg(MT.HEARTBEAT, src=0, seq=1))
        await m.feed(UP, msg(MT.HEARTBEAT, src=0, seq=1))  # duplicate
        await m.feed(UP, msg(MT.HEARTBEAT, src=0, seq=4))  # a gap: 2 and 3 lost, accepted
        await m.feed(UP, msg(MT.HEARTBEAT, src=0, seq=3))  # older
        await m.feed("stage0.0badc0de", msg(MT.BYE, src=0, seq=9))  # another connection of stage 0
        await m.feed(UP, msg(MT.BYE, src=2, seq=10))  # stage 0's connection claiming stage 2
        await m.feed(DOWN, msg(MT.ERROR, src=2, seq=1, meta={"code": "internal", "message": "x"}))
        await m.feed(DOWN, msg(MT.BYE, src=2, seq=2, meta={"reason": "going"}))
        await m.feed(UP, msg(MT.ERROR, src=0, seq=11, run="other", meta={"code": "internal", "message": "x"}))
        await m.feed("intruder", msg(MT.BYE, src=0, seq=12))
    m = run(scenario)
    assert m.rejects == {"not_allowed": 3, "replay": 2, "wrong_session": 2}
    assert m.peer.links.upstream.rx.lost == 2 and m.peer.links.upstream.rx.last_seq == 4  # refused: not consumed
    assert m.peer.result.errors == {"internal": 1}  # ERROR is informational
    assert "stage 2 at mem://stage2 left before the end: going" in str(m.peer.stop_reason)  # BYE from downstream: it left


@pytest.mark.parametrize("mtype, meta, sender, allowed", [
    (MT.ACT, {"mode": "train"}, UP, True),
    (MT.ACT, {"mode": "train"}, DOWN, False),
    (MT.PROJ, {}, UP, True),
    (MT.PROJ, {}, DOWN, False),
    (MT.GRAD, {}, DOWN, True),
    (MT.GRAD, {}, UP, False),
    (MT.PROJ_GRAD, {}, UP, False),
    (MT.REPORT, {"loss": 1.0, "tokens": 1}, UP, False),
    (MT.ROUTE, {"phase": "reopen", "gone": ["mem://stage2"]}, UP, False),  # a chain: ROUTE is implied, never sent
    (MT.ROUTE, {"phase": "ready"}, DOWN, False),
    (MT.CHECKPOINT, {"phase": "saved", "step": 1}, UP, False),
    (MT.CHECKPOINT, {"phase": "complete", "step": 1}, DOWN, False),
    (MT.CODEBOOK_SLICE, {"stream": "act"}, UP, False),  # this run has no codebooks
    (MT.RESYNC, {"stream": "act"}, DOWN, False),
    (MT.HEARTBEAT, {}, UP, True),
    (MT.HEARTBEAT, {}, DOWN, True),
])
def test_who_may_say_what(mtype, meta, sender, allowed):
    async def scenario(m):
        await m.handshake()
        await m.feed(sender, msg(mtype, src=stage_of(sender), seq=1, meta=meta))
    m = run(scenario)
    assert ("not_allowed" not in m.rejects) is allowed, m.rejects


# ---------------------------------------------------------------------- bounded resources
def test_tensors_are_decoded_off_the_loop_and_never_for_a_stranger(monkeypatch):
    decoded: list[str] = []
    real = admission.decode_tensors

    def spy(header, frames, limits):
        if header.tensors:
            decoded.append(threading.current_thread().name)
        return real(header, frames, limits)

    monkeypatch.setattr(admission, "decode_tensors", spy)

    async def scenario(m):
        await m.feed("intruder", act(seq=1))
        await m.feed(UP, act(seq=1))  # before the handshake
        await m.handshake()
        await m.feed("stage0.0badc0de", act(seq=1))
        await m.feed(UP, act(seq=1, step=0))
    m = run(scenario)
    assert decoded == ["stage1-decode_0"] and m.peer.mailbox.queued(0) == 1
    assert m.rejects == {"not_allowed": 1, "wrong_session": 2}


def test_each_neighbour_may_queue_a_bounded_number_of_messages():
    bound = mailbox_bound(_cfg())
    assert bound == 2 * max(_cfg().pipeline.num_micro_batches, _cfg().eval.batches) + 8

    async def scenario(m):
        await m.handshake()
        for seq in range(1, bound + 3):
            await m.feed(UP, msg(MT.PROJ, src=0, seq=seq,
                                 tensors={"proj": np.eye(64, 16, dtype=np.float32)}))
        await m.feed(DOWN, msg(MT.PROJ_GRAD, src=2, seq=1, tensors={"grad": np.eye(64, 16, dtype=np.float32)}))
    m = run(scenario)
    assert m.peer.mailbox.queued(0) == bound and m.peer.mailbox.queued(2) == 1
    assert m.rejects == {"queue_full": 2}


def test_a_flood_of_upstream_byes_is_dropped_as_queue_full_and_the_peer_serves_on():
    bound = mailbox_bound(_cfg())

    async def scenario(m):
        await m.handshake()
        for seq in range(1, bound + 3):  # BYE from upstream goes to the schedule's mailbox, bounded like the rest
            await m.feed(UP, msg(MT.BYE, src=0, seq=seq, step=_cfg().run.steps, meta={"reason": "training finished"}))
    m = run(scenario)
    assert m.peer.mailbox.queued(0) == bound and m.rejects == {"queue_full": 2} and m.peer.stop_reason is None


def test_before_training_pipeline_messages_are_held_in_the_ingress_within_its_bound_then_taken_in_order():
    """A neighbour that had the resume decision first sends ACTs before this peer's training
    started: they are held (their ``seq`` accepted), beyond the ingress's bound dropped as
    ``queue_full``, and taken in arrival order, before anything later, once training starts."""
    async def scenario(m):
        m.peer.ingress.held_bound = 2
        await m.feed(UP, msg(MT.HELLO, src=0, meta=HELLO))
        for seq in (1, 2, 3):
            await m.feed(UP, act(seq=seq, micro=seq - 1))
        assert [a.held for a in m.peer.ingress.held] == [False, False] and m.peer.mailbox.queued(0) == 0
        m.peer.state = PeerState.TRAINING
        await m.peer.ingress.start(m.transport)
        await m.feed(UP, act(seq=4, micro=1))  # a later one after the held ones
    m = run(scenario)
    assert m.rejects == {"queue_full": 1}  # the third held one
    assert m.peer.ingress.held == [] and m.peer.mailbox.queued(0) == 3
    assert [(x.seq, x.micro) for x in (m.peer.mailbox.take(lambda x: True) for _ in range(3))] == \
        [(1, 0), (2, 1), (4, 1)]


def test_mailbox_frees_room_as_messages_are_taken():
    async def scenario():
        box = Mailbox("x", max_per_sender=2)
        for micro in range(2):
            box.put(Message(type=MT.ACT, run_id="r", src=0, dst=1, micro=micro, meta={"mode": "train"}))
        with pytest.raises(Rejected, match="queue_full"):
            box.put(Message(type=MT.ACT, run_id="r", src=0, dst=1, micro=2, meta={"mode": "train"}))
        box.put(Message(type=MT.GRAD, run_id="r", src=2, dst=1))  # another neighbour has its own room
        assert (await box.get(lambda m: m.type is MT.ACT, 1.0, "an ACT")).micro == 0
        box.put(Message(type=MT.ACT, run_id="r", src=0, dst=1, micro=2, meta={"mode": "train"}))
    asyncio.run(scenario())


@pytest.mark.parametrize("joining", [True, False])
def test_with_replicas_a_later_run_epoch_is_a_redo_a_joining_replica_takes_with_its_state(joining):
    """With replicas the run epoch grows with each step's redo (SPEC §9.10 item 6), so the WELCOME
    a joining replica gets from a swarm that redid a step carries epoch > 0: it goes on (its
    download brings the epoch). A fresh starting replica in that swarm stops saying how to start."""
    stopped: list[BaseException] = []
    peer = SimpleNamespace(started=False, resuming=False, joining=joining, stage=1, stop=stopped.append)
    control = Control(peer, SimpleNamespace(replicas=SimpleNamespace(enabled=True)), links=None, linker=None,
                      monitor=None, schedule=SimpleNamespace(on_control=None), agreement=None, ingress=None,
                      rejects=None, result=None, clock=None, replica_resume=lambda: None, credits=None, step=None)
    must = control._must_resume(Message(type=MT.WELCOME, run_id="mem", src=0, dst=1, epoch=3))
    assert must is not joining
    if joining:
        assert stopped == []
    else:
        assert len(stopped) == 1 and isinstance(stopped[0], PeerRejected)
        assert "(run epoch 3): start this replica of stage 1 with --join" in str(stopped[0])
