"""ROUTER replies reach the dialer on its own DEALER (``Transport.recv_reply``, SPEC §1.2)."""

import asyncio

import pytest

from mapl_swarm.net.errors import NetTimeoutError
from mapl_swarm.net.transport import Transport, TransportConfig

pytestmark = pytest.mark.timeout(60)


def test_a_reply_comes_back_on_the_dialers_own_connection():
    async def scenario():
        cfg = TransportConfig(bind_host="127.0.0.1", zmq_heartbeat_s=0)
        async with Transport("stage0", cfg) as a, Transport("stage1", cfg) as b:
            a.connect("stage1", b.start())
            await a.send("stage1", [b"HELLO"], kind="HELLO")
            sender, frames = await b.recv(timeout_s=10)
            assert sender == a.routing_id and frames == [b"HELLO"]
            await b.reply(sender, [b"WELCOME", b"x"], kind="WELCOME")
            assert await a.recv_reply(timeout_s=10) == ("stage1", [b"WELCOME", b"x"])
            with pytest.raises(NetTimeoutError):  # nothing on the ROUTER of the dialer
                await a.recv(timeout_s=0.2)
            assert a.counters.rows()  # replies are counted under the link
            await a.disconnect("stage1")  # stops the link's reader
            with pytest.raises(NetTimeoutError):
                await a.recv_reply(timeout_s=0.1)

    asyncio.run(scenario())
