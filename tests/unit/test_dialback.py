"""Dial-back (SPEC §9.11) over real pinned ZeroMQ transports: a live peer's service dials a member's
own contact and echoes its nonce; it refuses a stranger, another member's contact, a request
without a certificate of the run and a second request too soon. ``mapl-swarm doctor``'s client
hears the dial when its contact is reachable and says FAIL when it is not."""

from __future__ import annotations

import asyncio
import secrets

import pytest

from mapl_swarm.config import config_from_dict
from mapl_swarm.doctor import Check
from mapl_swarm.net.identity import issue_local, load_identity
from mapl_swarm.net.transport import Transport, TransportConfig
from mapl_swarm.peer.dialback import DialBacks, PER_MEMBER_S, Refused, ask_dial_back
from mapl_swarm.wire import Message, MessageType, decode, encode

RUN = "dialback-run"


@pytest.fixture(scope="module")
def ids(tmp_path_factory):
    local = issue_local(tmp_path_factory.mktemp("ids"), run_id=RUN, num_stages=3)
    return [load_identity(local.key_file(s), local.cert_file(s), run_id=RUN, stage=s) for s in range(3)]


def pinned(identity, host: str = "127.0.0.1", advertise: str | None = None) -> TransportConfig:
    return TransportConfig(bind_host=host, advertise_host=advertise, curve=identity.curve, send_timeout_s=5)


def request(identity, contact: str, src: int = 2, nonce: bytes | None = None) -> Message:
    return Message(type=MessageType.DIALBACK, run_id=RUN, src=src, dst=1,
                   meta={"nonce": nonce or secrets.token_bytes(16), "cert": identity.encoded_cert, "contact": contact})


async def serve(live: Transport, dialbacks: DialBacks, count: int) -> list[str]:
    """The live peer's side: ``count`` requests taken, each answered as its ingress would."""
    outcomes = []
    for _ in range(count):
        sender, frames = await live.recv(timeout_s=10)
        try:
            dial = dialbacks.request(decode(frames), sender, live.peer_key(sender), live)
        except Refused as exc:
            outcomes.append(exc.code)
            continue
        await dial()
        outcomes.append("dialed")
    return outcomes


@pytest.mark.asyncio
async def test_a_member_is_dialed_back_at_its_own_contact_and_refusals_are_named(ids, tmp_path):
    clock = [100.0]
    dialbacks = DialBacks("stage1", 1, RUN, ids[1], clock=lambda: clock[0])
    async with Transport("stage1", pinned(ids[1])) as live, Transport("dialback", pinned(ids[2])) as member:
        member.connect("ask", live.endpoint)
        nonce = secrets.token_bytes(16)
        await member.send("ask", encode(request(ids[2], member.endpoint, nonce=nonce)))
        assert await serve(live, dialbacks, 1) == ["dialed"]
        _, frames = await member.recv(timeout_s=10)  # on its ROUTER: the live peer dialed it
        got = decode(frames)
        assert (got.type, got.meta["nonce"], got.src) == (MessageType.DIALBACK, nonce, 1)
        link, frames = await member.recv_reply(timeout_s=10)  # and first, on the request's connection: heard
        assert link == "ask" and decode(frames).meta["nonce"] == nonce
        # too soon for the same certificate; another member's contact; a certificate of another stage
        other = Transport("other", pinned(ids[0]))
        other.start()
        try:
            for msg in (request(ids[2], member.endpoint), request(ids[2], other.endpoint),
                        request(ids[2], member.endpoint, src=0)):
                await member.send("ask", encode(msg))
            assert await serve(live, dialbacks, 3) == ["queue_full", "not_allowed", "not_certified"]
            clock[0] += PER_MEMBER_S
            await member.send("ask", encode(request(ids[2], member.endpoint)))
            assert await serve(live, dialbacks, 1) == ["dialed"]
        finally:
            await other.aclose()
    stranger = issue_local(tmp_path / "stranger", run_id=RUN, num_stages=3)
    theirs = load_identity(stranger.key_file(2), stranger.cert_file(2), run_id=RUN, stage=2)
    async with Transport("stage1", pinned(ids[1])) as live, Transport("dialback", pinned(theirs)) as outsider:
        outsider.connect("ask", live.endpoint)
        await outsider.send("ask", encode(request(theirs, outsider.endpoint)))
        assert await serve(live, dialbacks, 1) == ["not_certified"]
    with pytest.raises(Refused, match="insecure"):
        DialBacks("stage1", 1, RUN, None).request(request(ids[2], "tcp://h:1"), "dialback.0", None, None)


@pytest.mark.asyncio
async def test_doctor_hears_the_dial_when_reachable_and_fails_when_not(ids):
    dialbacks = DialBacks("stage1", 1, RUN, ids[1])
    reachable = config_from_dict({"run": {"run_id": RUN}, "pipeline": {"num_stages": 3}}, "test")
    # bound on 127.0.0.1 but advertising 127.0.0.2, where nothing listens: what a NAT does to a dialer
    hidden = config_from_dict({"run": {"run_id": RUN}, "pipeline": {"num_stages": 3},
                               "net": {"advertise_host": "127.0.0.2"}}, "test")
    async with Transport("stage1", pinned(ids[1])) as live:
        server = asyncio.ensure_future(serve(live, dialbacks, 1))
        check = await _ask(reachable, ids[2], 2, [(1, live.endpoint)], wait_s=10)
        assert await server == ["dialed"]
        assert check.ok is True
        assert check.line().startswith("ok   reachable: a live peer of stage 1 dialed tcp://127.0.0.1:")
        dialbacks = DialBacks("stage1", 1, RUN, ids[1])
        server = asyncio.ensure_future(serve(live, dialbacks, 1))
        check = await _ask(hidden, ids[2], 2, [(1, live.endpoint)], wait_s=1.5)
        assert await server == ["dialed"]  # the live peer tried: its dial never arrived
        assert check.ok is False and "no live peer could dial tcp://127.0.0.2:" in check.line()
        assert "forward/open TCP port" in check.line()
    # a live peer this host cannot connect to was not asked: not a verdict on this host
    gone = "tcp://127.0.0.1:1#" + ids[1].key.curve_public.hex()
    check = await _ask(reachable, ids[2], 2, [(1, gone)], wait_s=5, connect_s=0.5)
    assert check.ok is None and "no live peer acknowledged a dial-back request" in check.line()



async def _ask(*args, **kwargs) -> Check:
    """:func:`ask_dial_back` as ``doctor`` shows it."""
    found = await ask_dial_back(*args, **kwargs)
    return Check("reachable", found.ok, found.detail, found.fix)
