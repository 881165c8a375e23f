"""Dial-out peers, transport side: a peer that accepts no connection advertises ``dialout#<key>``, and
both directions of its link travel on the one connection it dials. Real CURVE sockets on 127.0.0.1
(port 0); the dial-out side binds too, but nobody dials it (its contact names no address)."""

from __future__ import annotations

import asyncio
import re
from dataclasses import replace
from typing import AsyncIterator

import pytest
import pytest_asyncio
import zmq

from mapl_swarm.errors import ConfigError
from mapl_swarm.net.errors import NetError, NetTimeoutError
from mapl_swarm.net.identity import CurveKeys
from mapl_swarm.net.transport import DIAL_OUT, Transport, TransportConfig, is_dial_out, split_contact

REACHABLE = TransportConfig(bind_host="127.0.0.1", curve=CurveKeys(*zmq.curve_keypair()), send_timeout_s=5)
DIALING = TransportConfig(bind_host="127.0.0.1", curve=CurveKeys(*zmq.curve_keypair()), send_timeout_s=5,
                          dial_out=True)
SILENCE_S = 0.5


@pytest_asyncio.fixture
async def pair() -> AsyncIterator[tuple[Transport, Transport]]:
    """``stage1`` reachable, ``stage2`` dial-out, each linked to the other."""
    a, d = Transport("stage1", REACHABLE), Transport("stage2", DIALING)
    a.start()
    d.start()
    a.connect("stage2", d.endpoint)
    d.connect("stage1", a.endpoint)
    try:
        yield a, d
    finally:
        await a.aclose()
        await d.aclose()


def test_a_dial_out_peer_advertises_its_key_and_no_address() -> None:
    async def main() -> None:
        async with Transport("stage2", DIALING) as d:
            address, key = split_contact(d.endpoint)
            assert address == DIAL_OUT and is_dial_out(d.endpoint)
            assert key == zmq.utils.z85.decode(DIALING.curve.public)
    asyncio.run(main())


def test_dial_out_needs_curve_keys() -> None:
    with pytest.raises(ConfigError, match="net.reachable"):
        TransportConfig(dial_out=True)


@pytest.mark.asyncio
async def test_both_directions_travel_on_the_dial_out_peers_connection(pair) -> None:
    a, d = pair
    assert a.is_reverse("stage2") and not d.is_reverse("stage1")
    await d.send("stage1", [b"HELLO from 2"])
    sender, frames = await a.recv(timeout_s=5)
    assert frames == [b"HELLO from 2"] and Transport.name_of(sender) == "stage2"
    assert a.peer_key(sender) == a.server_key("stage2")  # the connection proved the contact's key
    a.bind_reverse("stage2", sender)
    assert a.reverse_link(sender) == "stage2"

    await a.send("stage2", [b"HELLO from 1"])  # out on the ROUTER, in on the dial-out peer's DEALER
    link, frames = await d.recv_reply(timeout_s=5)
    assert (link, frames) == ("stage1", [b"HELLO from 1"])
    request = d.request_sender("stage1")
    assert request is not None and Transport.name_of(request) == "stage1"
    assert d.peer_key(request) == d.server_key("stage1")

    await d.reply(request, [b"WELCOME from 2"])  # answered on the same connection
    sender2, frames = await a.recv(timeout_s=5)
    assert (sender2, frames) == (sender, [b"WELCOME from 2"])
    big = bytes(range(256)) * 4096  # 1 MiB, zero-copy on both ends
    await a.send("stage2", [b"ACT", big])
    _, frames = await d.recv_reply(timeout_s=5)
    assert bytes(frames[1]) == big
    assert a.counters.total(link="stage2", direction="tx").payload_bytes > len(big)
    assert d.counters.total(link="stage1", direction="rx").payload_bytes > len(big)


@pytest.mark.asyncio
async def test_a_reverse_link_sends_nothing_before_it_is_bound_then_everything_in_order(pair) -> None:
    a, d = pair
    await a.send("stage2", [b"one"])
    await a.send("stage2", [b"two"])
    with pytest.raises(NetTimeoutError):
        await d.recv_reply(timeout_s=SILENCE_S)
    await d.send("stage1", [b"HELLO"])
    sender, _ = await a.recv(timeout_s=5)
    a.bind_reverse("stage2", sender)
    assert [(await d.recv_reply(timeout_s=5))[1] for _ in range(2)] == [[b"one"], [b"two"]]


@pytest.mark.asyncio
async def test_a_reverse_link_binds_only_a_connection_of_its_peers_key(pair) -> None:
    a, d = pair
    async with Transport("stage2", REACHABLE) as impostor:  # another key, same stage name
        impostor.connect("stage1", a.endpoint)
        await impostor.send("stage1", [b"HELLO"])
        sender, _ = await a.recv(timeout_s=5)
        with pytest.raises(NetError, match="has not proved the key"):
            a.bind_reverse("stage2", sender)
        assert a.reverse_link(sender) is None
    with pytest.raises(NetError, match="not a reverse link"):
        a.bind_reverse("nowhere", sender)


@pytest.mark.asyncio
async def test_two_dial_out_peers_cannot_link_and_say_a_relay_is_needed() -> None:
    async with Transport("stage1", replace(DIALING, curve=CurveKeys(*zmq.curve_keypair()))) as one, \
            Transport("stage2", DIALING) as two:
        with pytest.raises(NetError, match="relay"):
            one.connect("stage2", two.endpoint)


@pytest.mark.asyncio
async def test_an_insecure_peer_cannot_link_to_a_dial_out_contact(pair) -> None:
    _, d = pair
    async with Transport("stage1", TransportConfig(bind_host="127.0.0.1")) as plain:
        with pytest.raises(NetError, match="certified"):
            plain.connect("stage2", d.endpoint)


@pytest.mark.asyncio
async def test_a_reverse_link_waits_for_its_peer_to_connect_again(pair) -> None:
    """The dial-out peer's connection ends (its process stopped) and a connection under the same
    routing id comes back: what was sent in between waits for it rather than being refused."""
    a, d = pair
    events = a._router.get_monitor_socket(zmq.EVENT_DISCONNECTED)
    try:
        await d.send("stage1", [b"HELLO"])
        sender, _ = await a.recv(timeout_s=5)
        a.bind_reverse("stage2", sender)
        endpoint = d.endpoint_of("stage1")
        await d.aclose()
        await asyncio.wait_for(events.recv_multipart(), 10)  # the ROUTER dropped the connection
    finally:
        a._router.disable_monitor()
        events.close(linger=0)
    await a.send("stage2", [b"while away"])
    async with Transport("stage2", DIALING) as again:
        again.routing_id = sender  # the same connection name, as a DEALER that reconnects keeps it
        again.connect("stage1", endpoint)
        link, frames = await again.recv_reply(timeout_s=5)
        assert (link, frames) == ("stage1", [b"while away"])


@pytest.mark.asyncio
async def test_a_gone_dial_out_peer_holds_up_no_flush_and_its_messages_are_dropped_after_the_send_timeout(
        caplog) -> None:
    """Its neighbour took it for gone and the run ends: a flush of every link returns at once (what
    waits for the connection is held, as a DEALER's queue holds it), and once the connection has
    been gone for ``send_timeout_s`` the held messages are dropped, said once."""
    a, d = Transport("stage1", replace(REACHABLE, send_timeout_s=1.0)), Transport("stage2", DIALING)
    a.start()
    d.start()
    try:
        a.connect("stage2", d.endpoint)
        d.connect("stage1", a.endpoint)
        await d.send("stage1", [b"HELLO"])
        sender, _ = await a.recv(timeout_s=5)
        a.bind_reverse("stage2", sender)
        await d.aclose()  # gone, with no connection to come back
        for i in range(3):
            await a.send("stage2", [b"late %d" % i])
        await asyncio.wait_for(a.flush(timeout_s=5), 2.0)
        await asyncio.wait_for(a._reverse["stage2"].task, 10)  # it ends when it drops what it held
        assert re.search(r"dropped [1-3] message\(s\) on link 'stage2'", caplog.text), caplog.text
    finally:
        await a.aclose()
        await d.aclose()
