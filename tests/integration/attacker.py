"""Attackers for the live attack tests (``test_attacks.py``): a helper module and a script, not a test.

In the test process:

- :func:`forge` / :func:`repack` build frames of any message and edit a header after encoding
  (descriptors that lie); :func:`lz4_zeros_block` an LZ4
  block that inflates to N zero bytes, built by hand (the issue's 1 MiB -> 255 MiB bomb costs 1 MiB);
- :class:`Intruder`: one DEALER dialing a peer's ROUTER with a chosen routing id, as plain TCP, as a
  CURVE client with a keypair of its own dialing any server key (an outsider, or a member that
  completes CURVE with the peer's key), and a socket monitor telling how its connection ended;
- :class:`TcpRelay`: the network path between two peers, recording the bytes one side sends.

As a script (started by the tests, each a process of its own)::

    python attacker.py peer [--hold-at K] [--insider-at K] -- PEER_ARGS...

``mapl-swarm peer PEER_ARGS`` with two hooks that change nothing until used. ``--hold-at K``:
after K steps stage 0 prints ``HELD K`` and waits for SIGUSR1 (prints ``RELEASED``), so the test
can be sure the swarm is still training while its attacks run. ``--insider-at K``: after K steps
the peer turns into a buggy neighbour (a key holder with the neighbour's real session) and sends,
through that session, well-formed messages that do not fit the run (:class:`Insider`), printing
``FIRED <name>`` for each and ``INSIDER DONE`` when all are out. ::

    python attacker.py dht --initial-peer MADDR --run RUN --stage S --endpoint EP
                           [--peer-key K --cert C]

Joins the run's DHT (with the run key or a member's identity: signing its record; without: an
unsigned one), prints
``READY``, waits for a line on stdin, stores a record for stage S pointing at EP that outlives
the honest ones (TTL 600 s), and prints ``LOOKUP <json>``: the endpoints this node then reads
for stage S, freshest first. It holds the record until stdin closes.
"""

from __future__ import annotations

import json
import socket
import sys
import threading
import time
import zlib
from typing import Any, Callable, Sequence

import msgpack
import numpy as np
import zmq
from zmq.utils.monitor import parse_monitor_message

from mapl_swarm.wire import Message, MessageType, WireTensor, encode, new_nonce
from mapl_swarm.wire.spec import PROTOCOL_VERSION

MT = MessageType
BF16_NAN = 0x7FC0
"""bf16 bit pattern of a quiet NaN."""


# ------------------------------------------------------------------------------------------ frames
def forge(mtype: MessageType, *, run: str, src: int, dst: int, seq: int = 1,
          step: int = 0, micro: int = 0, pver: int = 0, cver: int = 0, epoch: int = 0, meta: dict | None = None,
          tensors: dict[str, Any] | None = None, max_header_bytes: int = 64 * 1024) -> list[bytes]:
    """The frames of one message."""
    msg = Message(type=mtype, run_id=run, src=src, dst=dst, step=step, micro=micro, seq=seq, pver=pver, cver=cver,
                  epoch=epoch, meta=meta or {}, tensors=tensors or {})
    return [bytes(f) for f in encode(msg, max_header_bytes=max_header_bytes)]


def repack(frames: Sequence[bytes], edit: Callable[[dict], None] = lambda h: None,
           tensor_frames: Sequence[bytes] | None = None) -> list[bytes]:
    """``frames`` with the header edited by ``edit(header dict)`` and the tensor frames replaced by
    ``tensor_frames`` when given."""
    header = msgpack.unpackb(frames[0], raw=False)
    edit(header)
    body_frames = list(frames[1:] if tensor_frames is None else tensor_frames)
    return [msgpack.packb(header, use_bin_type=True), *body_frames]


def lz4_zeros_block(n: int) -> bytes:
    """An LZ4 block (no size prefix) inflating to ``n`` >= 16 zero bytes, about n/255 bytes long,
    written by hand: one literal 0, one match at offset 1 of length n - 6, five literal zeros."""
    if n < 16:
        raise ValueError("n must be >= 16")
    ml = n - 6 - 4  # match length beyond LZ4's minimum of 4
    out = bytearray([0x10 | min(ml, 15), 0x00, 0x01, 0x00])  # 1 literal; the literal 0; offset 1
    if ml >= 15:
        out += b"\xff" * ((ml - 15) // 255) + bytes([(ml - 15) % 255])
    out += bytes([0x50]) + bytes(5)  # the block ends with 5 literals
    return bytes(out)


def lying_lz4(frames: Sequence[bytes], name: str, block: bytes) -> list[bytes]:
    """``frames`` with tensor ``name``'s frame replaced by the LZ4 ``block`` under its old
    declaration (``rawbytes`` unchanged, so the block inflates past what it declares)."""
    header = msgpack.unpackb(frames[0], raw=False)
    index = next(i for i, d in enumerate(header["tensors"]) if d["name"] == name)
    tensor_frames = list(frames[1:])
    tensor_frames[index] = block

    def edit(h: dict) -> None:
        d = h["tensors"][index]
        d.update(codec="lz4", nbytes=len(block), crc=zlib.crc32(block))

    return repack(frames, edit, tensor_frames)


def big_header(nbytes: int, *, run: str, src: int, dst: int) -> list[bytes]:
    """One frame: a msgpack header map of about ``nbytes`` bytes (a huge ``meta`` value)."""
    return [msgpack.packb({"v": list(PROTOCOL_VERSION), "type": int(MT.HEARTBEAT), "run": run, "src": src, "dst": dst,
                           "step": 0, "micro": 0, "seq": 1, "pver": 0, "cver": 0,
                           "meta": {"pad": bytes(nbytes)}, "tensors": []}, use_bin_type=True)]


def nan_bf16(shape: tuple[int, ...]) -> WireTensor:
    return WireTensor("bf16", np.full(shape, BF16_NAN, dtype=np.uint16))


# ------------------------------------------------------------------------------------------ sockets
_FAILED = {zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL: "failed", zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL: "failed",
           zmq.EVENT_HANDSHAKE_FAILED_AUTH: "failed"}
_EVENTS = {**_FAILED, zmq.EVENT_HANDSHAKE_SUCCEEDED: "ok", zmq.EVENT_DISCONNECTED: "closed",
           zmq.EVENT_CLOSED: "closed"}


class Intruder:
    """One DEALER to ``endpoint`` with routing id ``routing_id``. ``curve``: None (plain TCP) or
    ``(client public, client secret, server public)`` z85 keys. One connection attempt (no
    reconnect); :meth:`until` waits for how it goes (``ok``, ``failed``, ``closed``)."""

    def __init__(self, ctx: zmq.Context, endpoint: str, routing_id: str,
                 curve: tuple[bytes, bytes, bytes] | None = None) -> None:
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.RECONNECT_IVL, 600_000)
        self.sock.setsockopt(zmq.ROUTING_ID, routing_id.encode())
        if curve is not None:
            public, secret, server = curve
            self.sock.setsockopt(zmq.CURVE_PUBLICKEY, public)
            self.sock.setsockopt(zmq.CURVE_SECRETKEY, secret)
            self.sock.setsockopt(zmq.CURVE_SERVERKEY, server)
        self.monitor = self.sock.get_monitor_socket()
        self.events: list[str] = []
        self.unsent = 0
        self.sock.connect(endpoint)

    def send(self, frames: Sequence[bytes]) -> "Intruder":
        """Queue ``frames`` (never blocks: a connection that already failed its handshake has no
        pipe left, and the message is then counted in ``unsent``)."""
        try:
            self.sock.send_multipart(list(frames), flags=zmq.NOBLOCK, copy=True)
        except zmq.Again:
            self.unsent += 1
        return self

    def until(self, wanted: set[str], timeout_s: float = 20.0) -> str:
        """Wait for the first monitor event among ``wanted``; returns it (AssertionError at the deadline)."""
        deadline = time.monotonic() + timeout_s
        for name in self.events:
            if name in wanted:
                return name
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not self.monitor.poll(int(left * 1000)):
                raise AssertionError(f"none of {sorted(wanted)} within {timeout_s} s (events: {self.events})")
            event = parse_monitor_message(self.monitor.recv_multipart())["event"]
            name = _EVENTS.get(event)
            if name is not None:
                self.events.append(name)
                if name in wanted:
                    return name

    def recv(self, timeout_s: float) -> list[bytes] | None:
        """The next message answered on this connection (a ROUTER reply), or None at the deadline."""
        if self.sock.poll(int(timeout_s * 1000)):
            return self.sock.recv_multipart()
        return None

    def close(self) -> None:
        self.sock.disable_monitor()
        self.monitor.close(linger=0)
        self.sock.close(linger=0)


def free_port(*hosts: str) -> int:
    """A TCP port free on every host of ``hosts`` (checked by binding each)."""
    for _ in range(100):
        with socket.socket() as s:
            s.bind((hosts[0], 0))
            port = s.getsockname()[1]
        try:
            for host in hosts[1:]:
                with socket.socket() as t:
                    t.bind((host, port))
        except OSError:
            continue
        return port
    raise RuntimeError(f"no port free on {hosts}")


class TcpRelay:
    """The network path: accepts TCP on ``listen`` and forwards each connection to ``target``,
    recording (up to ``limit`` bytes) what the first connection's client sends."""

    def __init__(self, listen: tuple[str, int], target: tuple[str, int], limit: int = 4 << 20) -> None:
        self.target, self.limit = target, limit
        self.captured = bytearray()
        self.connections = 0
        self._server = socket.create_server(listen)
        self._socks: list[socket.socket] = [self._server]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._server.accept()
            except OSError:
                return
            try:
                upstream = socket.create_connection(self.target)
            except OSError:
                client.close()  # the target is not up (yet): the client reconnects
                continue
            self._socks += [client, upstream]
            first = self.connections == 0
            self.connections += 1
            threading.Thread(target=self._pump, args=(client, upstream, first), daemon=True).start()
            threading.Thread(target=self._pump, args=(upstream, client, False), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, record: bool) -> None:
        try:
            while data := src.recv(65536):
                if record and len(self.captured) < self.limit:
                    self.captured += data[: self.limit - len(self.captured)]
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self) -> None:
        for s in self._socks:
            try:
                s.close()
            except OSError:
                pass


class Listener:
    """A TCP port that only counts who connects (where a forged DHT record points)."""

    def __init__(self, host: str = "127.0.0.1") -> None:
        self._server = socket.create_server((host, 0))
        self.endpoint = f"tcp://{host}:{self._server.getsockname()[1]}"
        self.connections = 0
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._server.accept()
            except OSError:
                return
            self.connections += 1
            conn.close()

    def close(self) -> None:
        self._server.close()


# ------------------------------------------------------------------------------------------ insider
class Insider:
    """A buggy neighbour: this peer, holding the run key and its real session to the neighbour,
    sends well-formed messages that do not fit the run, each at the point of the protocol where it
    is most plausible (next to the real message it imitates), through that session (next ``seq``,
    the session's key). Every one must be dropped by the neighbour with its SPEC §6.1 code.

    Stage 0 (to stage 1): a NaN PROJ before the next PROJ; before the next train ACT an LZ4 bomb
    declaring 8 MiB of ids in 32 KiB (``size_mismatch``), one declaring the run's ids size but
    inflating to 512 KiB (``decompression_failed``) and a 70 KB header (``frame_too_large``); after
    it, the same ACT again (``replay``); at once a HELLO with a bogus fingerprint on its own
    connection (``fingerprint_mismatch``; the REJECT that comes back is ``not_allowed`` here) and
    an ERROR (informational). Stage P-1 (to stage P-2): a NaN GRAD before the next GRAD, that GRAD
    again after it (``replay``), three copies of its next train REPORT with loss 0.123 after it
    (``out_of_window``), one with loss 1e308 before it (``implausible``), an ERROR, and an ERROR
    ``retransmit_unavailable`` nothing asked for (``implausible``). Both: the implausible re-forms
    of :meth:`_implausible_reforms`."""

    def __init__(self, peer: Any, cfg: Any, say: Callable[[str], None]) -> None:
        self.peer, self.cfg, self.say = peer, cfg, say
        self.pending: set[str] = set()
        self.transport: Any = None
        self.raw_send: Any = None
        self.last: dict[str, list[bytes]] = {}

    def attach(self, transport: Any) -> None:
        """Spy on what the transport sends (the frames a replay resends)."""
        self.transport, self.raw_send = transport, transport.send

        async def send(link: str, frames: Sequence[Any], *, kind: str = "control", timeout_s: float | None = None):
            if kind in ("ACT", "GRAD"):
                self.last[kind] = [bytes(f) for f in frames]
            await self.raw_send(link, frames, kind=kind, timeout_s=timeout_s)

        transport.send = send

    async def _session_send(self, link: Any, make: Callable[[int], list[bytes]], kind: str) -> None:
        seq = link._seq
        link._seq += 1
        await self.raw_send(link.name, make(seq), kind=kind)

    def _fired(self, name: str) -> None:
        self.pending.discard(name)
        self.say(f"FIRED {name}")
        if not self.pending:
            self.say("INSIDER DONE")

    async def arm(self) -> None:
        links, stage, P = self.peer.links, self.peer.stage, self.cfg.pipeline.num_stages
        if stage == 0:
            await self._arm_upstream_sender(links.downstream)
        elif stage == P - 1:
            await self._arm_downstream_sender(links.upstream)

    def _shapes(self) -> tuple[int, int, int, int]:
        c = self.cfg
        return c.pipeline.micro_batch_size, c.model.context_length, c.compression.rank, c.model.hidden_size

    async def _arm_upstream_sender(self, link: Any) -> None:
        B, T, r, d = self._shapes()
        s = link.settings
        run, src, dst = s.run_id, s.stage, link.stage
        self.pending |= {"nan_proj", "bomb_declared", "bomb_lying", "big_header", "replay_act", "bogus_hello",
                         "error"}
        send_projector, send_act = link.send_projector, link.send_act

        async def projector(step: int, projector: Any, pver: int) -> None:
            if "nan_proj" in self.pending:
                await self._session_send(link, lambda seq: forge(
                    MT.PROJ, run=run, src=src, dst=dst, seq=seq, step=step, pver=pver,
                    tensors={"proj": np.full((d, r), np.nan, dtype=np.float32)}), "PROJ")
                self._fired("nan_proj")
            await send_projector(step, projector, pver)

        async def act(step: int, micro: int, payload: Any, *, eval_mode: bool, pver: int) -> None:
            bombing = not eval_mode and "bomb_declared" in self.pending
            if bombing:
                z = WireTensor("bf16", np.zeros((B, T, r), dtype=np.uint16))
                fields = dict(run=run, src=src, dst=dst, step=step, micro=micro, pver=pver, meta={"mode": "train"})
                await self._session_send(link, lambda seq: forge(   # 8 MiB of ids in ~32 KiB
                    MT.ACT, seq=seq, tensors={"z": z, "ids": np.zeros((1, 4 << 20), np.uint16)},
                    **fields), "ACT")
                self._fired("bomb_declared")
                await self._session_send(link, lambda seq: lying_lz4(forge(
                    MT.ACT, seq=seq, tensors={"z": z, "ids": np.zeros((B, T + 1), np.uint16)},
                    **fields), "ids", lz4_zeros_block(512 << 10)), "ACT")
                self._fired("bomb_lying")
                await self._session_send(link, lambda seq: forge(
                    MT.ERROR, run=run, src=src, dst=dst, seq=seq, max_header_bytes=1 << 20,
                    meta={"code": "internal", "message": "x" * 70_000}), "ERROR")
                self._fired("big_header")
            await send_act(step, micro, payload, eval_mode=eval_mode, pver=pver)
            if bombing:
                await self.raw_send(link.name, self.last["ACT"], kind="ACT")  # the same frames again
                self._fired("replay_act")

        link.send_projector, link.send_act = projector, act
        await self.raw_send(link.name, forge(
            MT.HELLO, run=run, src=src, dst=dst, seq=0,
            meta={**s.hello_meta(), "fingerprint": "0" * 32, "nonce": new_nonce()}), kind="HELLO")
        self._fired("bogus_hello")
        await link.send(MT.ERROR, meta={"code": "internal", "message": f"stage {src} (an insider) says stop"})
        self._fired("error")
        await self._implausible_reforms(link)

    async def _implausible_reforms(self, link: Any) -> None:
        """Through the session, words that the swarm re-forms that cannot be true (SPEC §7.2 item
        9): BYE ``"rejoin"`` naming no departed stage (in a 2-stage swarm the neighbour has no other
        neighbour to have lost) and, from stage 0, a HELLO of run epoch 5 (the swarm's next is 1)."""
        s = link.settings
        self.pending |= {"bye_rejoin"}
        if s.stage == 0:
            self.pending |= {"hello_epoch_escalation"}
            await self.raw_send(link.name, forge(
                MT.HELLO, run=s.run_id, src=s.stage, dst=link.stage, seq=0, epoch=5,
                meta={**s.hello_meta(), "nonce": new_nonce()}), kind="HELLO")
            self._fired("hello_epoch_escalation")
        await link.send(MT.BYE, meta={"reason": "rejoin"})
        self._fired("bye_rejoin")

    async def _arm_downstream_sender(self, link: Any) -> None:
        B, T, r, d = self._shapes()
        s = link.settings
        run, src, dst = s.run_id, s.stage, link.stage
        self.pending |= {"nan_grad", "replay_grad", "dup_reports", "absurd_report", "error", "retransmit_unavailable"}
        send_grad, send_report = link.send_grad, link.send_report

        async def grad(step: int, micro: int, payload: Any, *, pver: int) -> None:
            armed = "nan_grad" in self.pending
            if armed:
                await self._session_send(link, lambda seq: forge(
                    MT.GRAD, run=run, src=src, dst=dst, seq=seq, step=step, micro=micro, pver=pver,
                    tensors={"dz": nan_bf16((B, T, r))}), "GRAD")
                self._fired("nan_grad")
            await send_grad(step, micro, payload, pver=pver)
            if armed:
                await self.raw_send(link.name, self.last["GRAD"], kind="GRAD")
                self._fired("replay_grad")

        async def report(step: int, meta: dict) -> None:
            if meta.get("mode", "train") == "train" and "absurd_report" in self.pending:
                await send_report(step, {**meta, "loss": 1e308})  # finite, far above 10 ln V
                self._fired("absurd_report")
            await send_report(step, meta)
            if meta.get("mode", "train") == "train" and "dup_reports" in self.pending:
                for _ in range(3):
                    await send_report(step, {**meta, "loss": 0.123})
                self._fired("dup_reports")

        link.send_grad, link.send_report = grad, report
        await link.send(MT.ERROR, meta={"code": "internal", "message": f"stage {src} (an insider) says stop"})
        self._fired("error")
        await link.send(MT.ERROR, meta={"code": "retransmit_unavailable", "message": "nothing was asked for"})
        self._fired("retransmit_unavailable")
        await self._implausible_reforms(link)


def _say(line: str) -> None:
    print(line, flush=True)


def hooked_peer(argv: list[str]) -> int:
    """``attacker.py peer``: see the module docstring."""
    import argparse
    import asyncio
    import signal

    ap = argparse.ArgumentParser(prog="attacker.py peer")
    ap.add_argument("--hold-at", type=int, default=0)
    ap.add_argument("--insider-at", type=int, default=0)
    ap.add_argument("peer_args", nargs=argparse.REMAINDER)
    args = ap.parse_args(argv)
    peer_args = args.peer_args[1:] if args.peer_args[:1] == ["--"] else args.peer_args

    import mapl_swarm.peer.main as peer_main  # no torch yet: the DHT forks first, as in `mapl-swarm peer`

    build = peer_main.build_peer

    def build_hooked(cfg, stage, **kwargs):
        peer = build(cfg, stage, **kwargs)
        insider = Insider(peer, cfg, _say)
        policy, serve = peer.run_policy, peer.serve
        step_end = policy.step_end
        release: list[asyncio.Event] = []

        async def serve_hooked(transport):
            insider.attach(transport)
            release.append(asyncio.Event())
            asyncio.get_running_loop().add_signal_handler(signal.SIGUSR1, release[0].set)
            return await serve(transport)

        async def step_end_hooked(step: int, metrics: dict) -> None:
            await step_end(step, metrics)
            if step == args.insider_at:
                await insider.arm()
            if step == args.hold_at and stage == 0:
                _say(f"HELD {step}")
                await release[0].wait()
                _say("RELEASED")

        peer.serve, policy.step_end = serve_hooked, step_end_hooked
        return peer

    peer_main.build_peer = build_hooked
    from mapl_swarm.cli import main

    return main(["peer", *peer_args])


def dht_poison(argv: list[str]) -> int:
    """``attacker.py dht``: see the module docstring."""
    import argparse

    ap = argparse.ArgumentParser(prog="attacker.py dht")
    ap.add_argument("--initial-peer", required=True)
    ap.add_argument("--run", required=True)
    ap.add_argument("--stage", type=int, required=True)
    ap.add_argument("--endpoint", required=True)
    ap.add_argument("--peer-key")
    ap.add_argument("--cert")
    args = ap.parse_args(argv)
    from mapl_swarm.net.discovery import Discovery, DiscoveryConfig
    from mapl_swarm.net.identity import load_identity

    # a certified member (for whichever stages its certificate allows), or an insecure node
    key = load_identity(args.peer_key, args.cert, run_id=args.run) if args.cert else None
    config = DiscoveryConfig(initial_peers=(args.initial_peer,), host="127.0.0.1", ttl_s=600.0, refresh_s=300.0,
                             poll_s=0.1)
    with Discovery(args.run, config, membership=key) as node:
        _say("READY")
        sys.stdin.readline()
        node.announce(args.stage, args.endpoint, subkey=f"stage{args.stage}.0badc0de")
        try:
            _say("LOOKUP " + json.dumps(node.lookup_all(args.stage, timeout_s=10)))
        except Exception as exc:  # noqa: BLE001 - e.g. an insecure node reading certified records
            _say("LOOKUP " + json.dumps([f"error: {exc!r}"]))
        sys.stdin.read()  # hold the record until the test is done
    return 0


if __name__ == "__main__":
    commands = {"peer": hooked_peer, "dht": dht_poison}
    sys.exit(commands[sys.argv[1]](sys.argv[2:]))
