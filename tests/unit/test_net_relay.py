"""The relay between two dial-out neighbours (SPEC §9.12), over real sockets on 127.0.0.1: the link
runs end to end through it (CURVE pinned both ways), it serves certified members of its run only,
and it carries bytes it cannot read."""

from __future__ import annotations

import asyncio
import contextlib
from typing import AsyncIterator

import pytest
from zmq.utils import z85

from mapl_swarm.net.discovery import TrustedAuthority
from mapl_swarm.net.errors import NetError
import msgpack

from mapl_swarm.net.identity import create_peer_key, issue_local, load_identity
from mapl_swarm.net import relay as relay_module
from mapl_swarm.net.relay import Relay, RelayClient, read_frame, relay_statement, role_of, seal, write_frame
from mapl_swarm.net.transport import Transport, TransportConfig

from deadlines import until

RUN = "relay-run"


@pytest.fixture(scope="module")
def ids(tmp_path_factory):
    local = issue_local(tmp_path_factory.mktemp("ids"), run_id=RUN, num_stages=3)
    return [load_identity(local.key_file(s), local.cert_file(s), run_id=RUN, stage=s) for s in range(3)]


@pytest.fixture(scope="module")
def stranger(tmp_path_factory):
    """A member of another run."""
    local = issue_local(tmp_path_factory.mktemp("other"), run_id="other-run", num_stages=3)
    return load_identity(local.key_file(1), local.cert_file(1), run_id="other-run", stage=1)


@pytest.fixture(scope="module")
def relay_key(tmp_path_factory):
    return create_peer_key(tmp_path_factory.mktemp("relay") / "relay.key")


def _trust(identity) -> TrustedAuthority:
    return TrustedAuthority(identity.run_id, identity.authority)


def _dialing(identity, relay: Relay, port: int, name: str) -> Transport:
    config = TransportConfig(bind_host="127.0.0.1", curve=identity.curve, send_timeout_s=5, dial_out=True)
    return Transport(name, config, relay=RelayClient("127.0.0.1", port, relay.public, identity))


@contextlib.asynccontextmanager
async def _linked(relay: Relay, one_id, two_id) -> AsyncIterator[tuple[Transport, Transport, int]]:
    """``relay`` started, and stages 1 and 2 (dial-out, of these identities) linked through it:
    (the dialing one, the serving one, the relay's port); everything closed at the end."""
    port = await relay.start("127.0.0.1", 0)
    one, two = _dialing(one_id, relay, port, "stage1"), _dialing(two_id, relay, port, "stage2")
    try:
        one.start()
        two.start()
        one.connect("stage2", two.endpoint)
        two.connect("stage1", one.endpoint)
        dials = role_of(one_id.key.curve_public, two_id.key.curve_public) == "dial"
        yield (one, two, port) if dials else (two, one, port)
    finally:
        await one.aclose()
        await two.aclose()
        await relay.aclose()


@pytest.mark.asyncio
async def test_two_dial_out_neighbours_link_through_the_relay_which_reads_nothing(ids, relay_key):
    relay = Relay(_trust(ids[1]), relay_key)
    async with _linked(relay, ids[1], ids[2]) as (dialer, server, _):
        to_server, to_dialer = server.name, dialer.name
        secret = b"run id " + RUN.encode() + b" and token ids 1 2 3"
        await dialer.send(to_server, [b"HELLO", secret])
        sender, frames = await server.recv(timeout_s=10)
        assert frames == [b"HELLO", secret]
        assert server.peer_key(sender) == z85.decode(dialer.config.curve.public)  # pinned end to end
        server.bind_reverse(to_dialer, sender)
        await server.send(to_dialer, [b"WELCOME and more", secret])
        link, frames = await dialer.recv_reply(timeout_s=10)
        assert (link, frames) == (to_server, [b"WELCOME and more", secret])
        assert relay.stats.paired >= 1 and relay.stats.bytes > 2 * len(secret)
        assert dialer.relay.bytes > 0 and server.relay.bytes > 0


async def _ask(relay: Relay, port: int, request, seal_to: bytes | None = None) -> dict:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        nonce = (await read_frame(reader))["nonce"]
        body = msgpack.packb(request(nonce), use_bin_type=True)
        write_frame(writer, {"sealed": seal(seal_to or relay.public, nonce, body)})
        return await read_frame(reader)
    finally:
        writer.close()


@pytest.mark.asyncio
async def test_the_relay_refuses_outsiders_other_runs_and_forged_requests(ids, stranger, relay_key, tmp_path):
    relay = Relay(_trust(ids[1]), relay_key)
    port = await relay.start("127.0.0.1", 0)
    me, peer = ids[1], ids[2].key.curve_public
    role = role_of(me.key.curve_public, peer)

    def signed(identity, *, run=RUN, role=role, sign_role=None, nonce_for=None):
        def build(nonce: bytes) -> dict:
            statement = relay_statement(identity.run_id, nonce_for or nonce, sign_role or role, peer)
            return {"run": run, "cert": identity.encoded_cert, "role": role, "peer": peer,
                    "sig": identity.key.sign(statement)}
        return build

    try:
        other_relay = create_peer_key(tmp_path / "other.key").curve_public
        answers = {
            "outsider": await _ask(relay, port, lambda nonce: {"run": RUN, "role": role, "peer": peer,
                                                                "sig": b"x" * 64}),
            "other run": await _ask(relay, port, signed(stranger, run=RUN)),
            "wrong run": await _ask(relay, port, signed(me, run="other-run")),
            "replayed": await _ask(relay, port, signed(me, nonce_for=b"\0" * 16)),
            "wrong role": await _ask(relay, port, signed(me, role="serve" if role == "dial" else "dial")),
            "sealed to another relay": await _ask(relay, port, signed(me), seal_to=other_relay),
            "itself as peer": await _ask(relay, port, lambda nonce: {
                "run": RUN, "cert": me.encoded_cert, "role": "serve", "peer": me.key.curve_public,
                "sig": me.key.sign(relay_statement(RUN, nonce, "serve", me.key.curve_public))}),
        }
        # a stranger learns nothing from the code, not even whether it guessed the run
        assert {k: (a["ok"], a["code"]) for k, a in answers.items()} == {
            "outsider": (False, "not_certified"), "other run": (False, "not_certified"),
            "wrong run": (False, "not_certified"), "replayed": (False, "not_certified"),
            "wrong role": (False, "not_allowed"), "sealed to another relay": (False, "malformed"),
            "itself as peer": (False, "not_allowed")}
        assert all(set(a) == {"ok", "code"} for a in answers.values())  # nothing of the run in the answer
        assert relay.stats.paired == 0 and relay.stats.bytes == 0
        with pytest.raises(NetError, match="refused this peer"):
            await RelayClient("127.0.0.1", port, relay.public, stranger).open(role, peer)
    finally:
        await relay.aclose()


@pytest.mark.asyncio
async def test_without_a_relay_two_dial_out_peers_say_one_is_needed(ids):
    config = TransportConfig(bind_host="127.0.0.1", curve=ids[1].curve, send_timeout_s=5, dial_out=True)
    async with Transport("stage1", config) as one:
        with pytest.raises(NetError, match="a relay between them is needed"):
            one.connect("stage2", "dialout#" + ids[2].key.curve_public.hex())


@pytest.mark.asyncio
async def test_the_relay_reads_the_revocation_list_refuses_the_revoked_and_cuts_their_pairs(relay_key, tmp_path):
    from mapl_swarm.net.identity import revoke, write_signed

    local = issue_local(tmp_path / "ids", run_id=RUN, num_stages=3)
    ids = {s: load_identity(local.key_file(s), local.cert_file(s), run_id=RUN, stage=s) for s in (1, 2)}
    listed = tmp_path / "revocations"
    relay = Relay(_trust(ids[1]), relay_key, revocations=listed)  # no list yet: nobody revoked
    async with _linked(relay, ids[1], ids[2]) as (dialer, server, port):
        await dialer.send(server.name, [b"HELLO"])
        await server.recv(timeout_s=10)  # paired and carried
        assert relay.stats.paired == 1 and len(relay._pairs) == 1
        write_signed(listed, revoke(local.authority, [ids[2].body.serial], run_id=RUN))
        relay.enforce_revocations()
        await until(lambda: not relay._pairs, 10, "the revoked member's pair cut")
        with pytest.raises(NetError, match="refused this peer"):  # and it is refused from now on
            await RelayClient("127.0.0.1", port, relay.public, ids[2]).open(
                role_of(ids[2].key.curve_public, ids[1].key.curve_public), ids[1].key.curve_public)
        assert relay.stats.refused["not_certified"] >= 1


@pytest.mark.asyncio
async def test_idle_connections_of_one_address_are_bounded_and_refusals_are_logged_sparingly(
        ids, relay_key, monkeypatch, caplog) -> None:
    """A stranger's idle connections beyond the bound are closed at once (no nonce); the
    members' spliced link goes on; a flood of bad requests logs one line per code."""
    monkeypatch.setattr(relay_module, "MAX_UNREAD_PER_ADDRESS", 3)
    relay = Relay(_trust(ids[1]), relay_key)
    async with _linked(relay, ids[1], ids[2]) as (dialer, server, port):
        await dialer.send(server.name, [b"HELLO"])
        assert (await server.recv(timeout_s=10))[1] == [b"HELLO"]
        idle = [await asyncio.open_connection("127.0.0.1", port) for _ in range(3)]
        for reader, _ in idle:
            assert "nonce" in await read_frame(reader)  # each waits for its request
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        assert await reader.read() == b""  # the fourth: closed, nothing said
        writer.close()
        for _, w in idle:
            w.close()
        await until(lambda: not relay._unread, 10, "the relay read the idle connections' ends")
        for _ in range(5):
            await _ask(relay, port, lambda nonce: {"run": "guess", "role": "dial", "peer": b"x" * 32, "sig": b""})
        assert relay.stats.refused["busy"] >= 1 and relay.stats.refused["not_certified"] == 5
        assert caplog.text.count("(not_certified;") == 1
        await dialer.send(server.name, [b"still there"])
        assert (await server.recv(timeout_s=10))[1] == [b"still there"]
