"""Members-only links, transport side: CURVE with each peer's own keypair and dials pinned to the
server's key, routing ids that cannot be taken over, replies on the HELLO's own connection,
ZeroMQ's maximum message size. Real sockets on 127.0.0.1 (port 0); "nothing delivered" is a recv
deadline expiring while the member keeps serving its members."""

from __future__ import annotations

import asyncio
import os
import re
from dataclasses import replace
from typing import AsyncIterator

import pytest
import pytest_asyncio
import zmq
import zmq.asyncio
from zmq.utils import z85
from zmq.utils.monitor import parse_monitor_message

from mapl_swarm.net.errors import NetError, NetTimeoutError
from mapl_swarm.net.identity import CurveKeys
from mapl_swarm.net.transport import Transport, TransportConfig, contact, split_contact

KEY = CurveKeys(*zmq.curve_keypair())
OTHER_KEY = CurveKeys(*zmq.curve_keypair())
SECURE = TransportConfig(bind_host="127.0.0.1", curve=KEY, send_timeout_s=5)
SILENCE_S = 0.5
"""Deadline of "nothing is delivered" (a member-to-member message arrives in milliseconds)."""
ROUTING_ID = re.compile(r"(?P<name>.+)\.[0-9a-f]{8}")


@pytest_asyncio.fixture
async def members() -> AsyncIterator[tuple[Transport, Transport]]:
    a, b = Transport("a", SECURE), Transport("b", SECURE)
    a.start()
    b.start()
    try:
        yield a, b
    finally:
        await a.aclose()
        await b.aclose()


@pytest_asyncio.fixture
async def ctx() -> AsyncIterator[zmq.asyncio.Context]:
    """A context for raw attacker sockets (closed with linger 0)."""
    context = zmq.asyncio.Context()
    try:
        yield context
    finally:
        context.destroy(linger=0)


async def recv_payload(t: Transport, payload: bytes, timeout_s: float = 5.0) -> str:
    """Receive until ``payload`` arrives (ignoring anything else); its sender's routing id."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while True:
        sender, frames = await t.recv(timeout_s=max(0.01, deadline - loop.time()))
        if [bytes(f) for f in frames] == [payload]:
            return sender


async def nothing_delivered(t: Transport, timeout_s: float = SILENCE_S) -> None:
    with pytest.raises(NetTimeoutError):
        sender, frames = await t.recv(timeout_s=timeout_s)
        pytest.fail(f"delivered from {sender!r}: {[bytes(f)[:40] for f in frames]}")


async def until_delivered(tx: Transport, link: str, rx: Transport, timeout_s: float = 5.0) -> str:
    """Send ``b"again"`` on ``link`` every 0.2 s until ``rx`` receives one (messages written into a
    connection that is being dropped are lost); the routing id it came from."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while loop.time() < deadline:
        await tx.send(link, [b"again"])
        try:
            return await recv_payload(rx, b"again", timeout_s=0.2)
        except NetTimeoutError:
            continue
    pytest.fail(f"{tx.name} never got through to {rx.name} again")


async def try_send(s: zmq.asyncio.Socket, frames: list[bytes]) -> None:
    """An attacker's send: queued if the socket takes it within 0.2 s (a DEALER whose handshakes
    fail may have no connection to queue on), else given up."""
    try:
        await asyncio.wait_for(s.send_multipart(frames), 0.2)
    except asyncio.TimeoutError:
        pass


def raw_dealer(ctx: zmq.asyncio.Context, endpoint: str, routing_id: bytes | None = None, *,
               client: CurveKeys | None = None, server_public: bytes | None = None) -> zmq.asyncio.Socket:
    """An attacker's DEALER: plain TCP, or a CURVE client with ``client``'s keypair dialling
    ``server_public`` (z85; default: its own key)."""
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    if routing_id is not None:
        s.setsockopt(zmq.ROUTING_ID, routing_id)
    if client is not None:
        s.setsockopt(zmq.CURVE_SERVERKEY, server_public or client.public)
        s.setsockopt(zmq.CURVE_PUBLICKEY, client.public)
        s.setsockopt(zmq.CURVE_SECRETKEY, client.secret)
    s.connect(split_contact(endpoint)[0])
    return s


@pytest.mark.asyncio
async def test_members_exchange_over_curve_with_routing_ids(members) -> None:
    a, b = members
    assert ROUTING_ID.fullmatch(a.routing_id)["name"] == "a" and a.routing_id != Transport("a").routing_id
    a.connect("b", b.endpoint)
    b.connect("a", a.endpoint)
    big = os.urandom(200_000)
    await a.send("b", [b"ACT", big], kind="ACT")
    sender, frames = await b.recv(timeout_s=5)
    assert sender == a.routing_id and Transport.name_of(sender) == "a"
    assert [bytes(f) for f in frames] == [b"ACT", big]
    await b.send("a", [b"GRAD"], kind="GRAD")
    assert await a.recv(timeout_s=5) == (b.routing_id, [b"GRAD"])
    assert b.counters.get("a", "rx", "rx").messages == 1  # counted under the name, not the routing id


def test_name_of() -> None:
    assert Transport.name_of("stage1.0a1b2c3d") == "stage1"
    assert Transport.name_of("my.peer.0a1b2c3d") == "my.peer"
    assert Transport.name_of("stage1") == "stage1"


@pytest.mark.asyncio
@pytest.mark.parametrize("stranger", ["another server key", "plain dealer"])
async def test_stranger_gets_nothing_delivered(members, ctx, stranger) -> None:
    """A client that does not dial the peer's own key (a relay's, a guess) completes no CURVE
    handshake, nor does a plain one; one that dials it is attributed its key (test_net_certified)."""
    a, b = members
    if stranger == "another server key":  # its own client keypair, dialling its own key as the server's
        s = raw_dealer(ctx, b.endpoint, b"a.00000000", client=OTHER_KEY)
    else:  # a plain (NULL mechanism) DEALER against a CURVE ROUTER
        s = raw_dealer(ctx, b.endpoint, b"a.00000000")
    for i in range(3):
        await try_send(s, [b"HELLO", b"%d" % i])
    await nothing_delivered(b)
    a.connect("b", b.endpoint)  # the member still serves members
    await a.send("b", [b"member"])
    assert await recv_payload(b, b"member") == a.routing_id


@pytest.mark.asyncio
async def test_curve_client_cannot_reach_plain_router(ctx) -> None:
    """A member does not leak to an insecure listener either: its CURVE DEALER never delivers to a
    NULL-mechanism ROUTER (nothing of the member's traffic is sent in the clear)."""
    async with Transport("open", TransportConfig(bind_host="127.0.0.1")) as plain, \
            Transport("member", SECURE) as member:
        member.connect("open", contact(plain.endpoint, z85.decode(OTHER_KEY.public)))
        await member.send("open", [b"secret payload"])
        await nothing_delivered(plain)


@pytest.mark.asyncio
async def test_second_connection_cannot_take_over_a_routing_id(members, ctx) -> None:
    a, b = members
    a.connect("b", b.endpoint)
    await a.send("b", [b"first"])
    assert await recv_payload(b, b"first") == a.routing_id
    # an insider (it holds a's key) dials again presenting a's routing id
    thief = raw_dealer(ctx, b.endpoint, a.routing_id.encode(), client=KEY)
    for _ in range(3):
        await try_send(thief, [b"stolen"])
    await a.send("b", [b"second"])
    assert await recv_payload(b, b"second") == a.routing_id  # the first connection keeps working
    # nothing of the thief's arrives under a's routing id, and replies to it reach a, not the thief
    with pytest.raises(NetTimeoutError):
        while True:
            sender, frames = await b.recv(timeout_s=SILENCE_S)
            assert sender != a.routing_id, f"taken over: {frames}"
    await b.reply(a.routing_id, [b"to a"])
    with pytest.raises(asyncio.TimeoutError):
        await asyncio.wait_for(thief.recv_multipart(), SILENCE_S)


@pytest.mark.asyncio
async def test_reply_reaches_the_hellos_own_connection(members) -> None:
    a, b = members
    a.connect("b", b.endpoint)
    b.connect("a", a.endpoint)  # b's own link to a: a reply must not travel on it
    await a.send("b", [b"HELLO"])
    sender, _ = await b.recv(timeout_s=5)
    await b.reply(sender, [b"WELCOME"], kind="WELCOME")
    assert b.counters.get("a", "tx", "WELCOME").messages == 1
    # the reply arrives on a's DEALER (the HELLO's connection), not on a's ROUTER
    assert await a.recv_reply(timeout_s=5) == ("b", [b"WELCOME"])
    await nothing_delivered(a, 0.2)
    with pytest.raises(NetError, match="no such connection"):
        await b.reply("a.ffffffff", [b"REJECT"], kind="REJECT")


@pytest.mark.asyncio
async def test_max_message_size_drops_the_oversized_message_and_keeps_serving() -> None:
    cfg = TransportConfig(bind_host="127.0.0.1", curve=KEY, max_message_bytes=100_000)
    fast = replace(SECURE, zmq_heartbeat_s=0.1)  # the dropped DEALER reconnects after 0.5 s
    async with Transport("rx", cfg) as rx, Transport("big", fast) as big, Transport("small", fast) as small:
        big.connect("rx", rx.endpoint)
        small.connect("rx", rx.endpoint)
        await big.send("rx", [b"hdr", bytes(100_001)])  # one frame over the limit
        await nothing_delivered(rx)
        await small.send("rx", [b"ok", bytes(100_000)])  # at the limit: delivered
        sender, frames = await rx.recv(timeout_s=5)
        assert sender == small.routing_id and len(frames[1]) == 100_000
        # the dropped sender's DEALER reconnects; its later messages get through
        assert await until_delivered(big, "rx", rx) == big.routing_id


def test_heartbeat_options() -> None:
    assert TransportConfig(zmq_heartbeat_s=0).heartbeat_options() == TransportConfig(zmq_heartbeat_s=0).dealer_options() == {}
    hb = {zmq.HEARTBEAT_IVL: 2500, zmq.HEARTBEAT_TIMEOUT: 7500, zmq.HEARTBEAT_TTL: 7500}
    assert TransportConfig(zmq_heartbeat_s=2.5).heartbeat_options() == hb
    assert TransportConfig(zmq_heartbeat_s=2.5).dealer_options() == {**hb, zmq.RECONNECT_IVL: 12500}


class FreezableProxy:
    """A TCP forwarder on 127.0.0.1: ``freeze()`` makes every connection open so far a dead one
    (bytes are no longer forwarded, sockets stay open: a host that vanished without a FIN);
    connections made later are forwarded normally."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.frozen_generation = -1
        self.generation = 0
        self.tasks: list[asyncio.Task] = []
        self.writers: list[asyncio.StreamWriter] = []
        self.client_writers: list[asyncio.StreamWriter] = []
        self.server: asyncio.base_events.Server | None = None

    async def start(self) -> str:
        self.server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        return f"tcp://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    def freeze(self, *, reset_clients: bool = False) -> None:
        """Make the connections open so far dead; with ``reset_clients`` their client side is also
        closed (the DEALER sees it at once) while the server side stays open and silent."""
        self.frozen_generation = self.generation
        self.generation += 1
        if reset_clients:
            for writer in self.client_writers:
                writer.close()

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target_port)
        self.writers += [writer, up_writer]
        self.client_writers.append(writer)
        generation = self.generation
        for src, dst in ((reader, up_writer), (up_reader, writer)):
            self.tasks.append(asyncio.create_task(self._pump(src, dst, generation)))

    async def _pump(self, src: asyncio.StreamReader, dst: asyncio.StreamWriter, generation: int) -> None:
        try:
            while data := await src.read(65536):
                if generation <= self.frozen_generation:
                    await asyncio.Event().wait()  # dead: hold the socket open, forward nothing, forever
                dst.write(data)
                await dst.drain()
        except ConnectionError:
            pass

    async def aclose(self) -> None:
        for t in self.tasks:
            t.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        for w in self.writers:
            w.close()
        if self.server is not None:
            self.server.close()


async def wait_event(monitor: zmq.asyncio.Socket, event: int, timeout_s: float) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while True:
        msg = await asyncio.wait_for(monitor.recv_multipart(), max(0.01, deadline - loop.time()))
        if parse_monitor_message(msg)["event"] == event:
            return


@pytest.mark.asyncio
async def test_zmq_heartbeat_drops_a_dead_connection_and_frees_its_routing_id() -> None:
    """A connection whose other end vanished (no FIN, nothing answers) is dropped after the
    heartbeat timeout (3 x 0.1 s), freeing the routing id: the sender's reconnection gets it."""
    cfg = TransportConfig(bind_host="127.0.0.1", curve=KEY, zmq_heartbeat_s=0.1)
    async with Transport("rx", cfg) as rx, Transport("a", cfg) as a:
        proxy = FreezableProxy(rx.port)
        monitor = rx._router.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        try:
            a.connect("rx", contact(await proxy.start(), z85.decode(KEY.public)))
            await a.send("rx", [b"one"])
            assert await recv_payload(rx, b"one") == a.routing_id
            proxy.freeze()
            t0 = asyncio.get_running_loop().time()
            await wait_event(monitor, zmq.EVENT_DISCONNECTED, 5)
            assert asyncio.get_running_loop().time() - t0 < 2.0
            # a's DEALER notices too and reconnects (new connections are forwarded) with its routing id
            assert await until_delivered(a, "rx", rx) == a.routing_id
        finally:
            rx._router.disable_monitor()
            monitor.close(linger=0)
            await proxy.aclose()


@pytest.mark.asyncio
async def test_reconnection_waits_until_the_router_dropped_the_half_dead_connection() -> None:
    """The DEALER's side of a connection dies at once (reset) while the ROUTER's side stays open and
    silent. Without handover the ROUTER would never serve a reconnection arriving while it still
    holds the old connection; the DEALER waits (5x the heartbeat) until the ROUTER dropped it."""
    cfg = TransportConfig(bind_host="127.0.0.1", curve=KEY, zmq_heartbeat_s=0.1)
    assert cfg.dealer_options()[zmq.RECONNECT_IVL] == 500
    async with Transport("rx", cfg) as rx, Transport("a", cfg) as a:
        proxy = FreezableProxy(rx.port)
        try:
            a.connect("rx", contact(await proxy.start(), z85.decode(KEY.public)))
            await a.send("rx", [b"one"])
            assert await recv_payload(rx, b"one") == a.routing_id
            proxy.freeze(reset_clients=True)
            assert await until_delivered(a, "rx", rx) == a.routing_id
        finally:
            await proxy.aclose()
