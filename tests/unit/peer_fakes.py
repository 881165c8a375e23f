"""An in-memory network for peers (no sockets): fake transports, a tap on every delivery, attackers.

:class:`FakeNet` holds one :class:`FakeTransport` per peer, with the transport API a peer uses
(``start``, ``connect``, ``send`` on a link, ``recv`` on its ROUTER, ``reply`` on the connection a
message came from, ``recv_reply`` for answers on its own connections, ``flush``, ``counters``,
``shaper``). Every delivery passes :attr:`FakeNet.tap` (``tap(src_routing_id, dst_name, frames,
reply)``), which tests use to record traffic and to inject messages at a precise point, without
sleeping. Replies to a routing id no transport holds (an attacker's) are kept in
:attr:`FakeNet.orphan_replies`. :func:`fake_swarm` builds a real swarm of P stages on it.
"""

from __future__ import annotations

import asyncio
import secrets
from collections import defaultdict
from types import SimpleNamespace
from typing import Any, Callable

import msgpack
import torch

from mapl_swarm.net.counters import TrafficCounters
from mapl_swarm.peer.runtime import Peer
from mapl_swarm.pipeline.stage import StageRuntime
from mapl_swarm.wire import decode

from conftest import micro_config


def peek(frames: list):
    """The message ``frames`` carry, its tag (if any) not checked; None for garbage."""
    try:
        header = msgpack.unpackb(bytes(frames[0]))
        header.pop("auth", None)
        return decode([msgpack.packb(header), *frames[1:]])
    except Exception:  # noqa: BLE001 - garbage
        return None


def on_first(net: "FakeNet", src: str, mtype, action: Callable[[list], None], *, nth: int = 1,
             reply: bool = False) -> None:
    """Call ``action(frames)`` when ``src`` sends its ``nth`` message of ``mtype`` (a ROUTER reply
    with ``reply``), before it is delivered: ``action`` may inject messages or rewrite ``frames``."""
    seen = {"n": 0}

    def tap(sender, dst, frames, is_reply):
        msg = peek(frames)
        if sender.startswith(src + ".") and is_reply == reply and msg is not None and msg.type == mtype:
            seen["n"] += 1
            if seen["n"] == nth:
                action(frames)

    net.tap = tap


class FakeNet:
    def __init__(self) -> None:
        self.transports: dict[str, FakeTransport] = {}
        self.tap: Callable[[str, str, list, bool], None] = lambda src, dst, frames, reply: None
        self.orphan_replies: dict[str, list[list]] = defaultdict(list)
        self.log: list[tuple[str, str, Any, bool]] = []
        """(src routing id, dst name, decoded message or None, is_reply) of every delivery."""
        self.keys: dict[str, bytes] = {}
        """The CURVE key each injected routing id proves (a certified transport's ``peer_key``)."""

    def transport(self, name: str) -> "FakeTransport":
        t = self.transports[name] = FakeTransport(self, name)
        return t

    def by_routing_id(self, routing_id: str) -> "FakeTransport | None":
        return next((t for t in self.transports.values() if t.routing_id == routing_id), None)

    def inject(self, dst: str, routing_id: str, frames: list, *, key: bytes | None = None) -> None:
        """Deliver ``frames`` to ``dst``'s ROUTER as if from a connection with ``routing_id`` (that
        proved the CURVE ``key``)."""
        if key is not None:
            self.keys[routing_id] = key
        self.transports[dst].inbox.put_nowait((routing_id, [bytes(f) for f in frames]))

    def key_of(self, routing_id: str) -> bytes | None:
        t = self.by_routing_id(routing_id)
        return t.curve_key if t is not None else self.keys.get(routing_id)

    def _record(self, src: str, dst: str, frames: list, reply: bool) -> None:
        msg = peek(frames)
        self.log.append((src, dst, msg, reply))
        self.tap(src, dst, frames, reply)

    def messages(self, src_name: str, dst_name: str) -> list:
        """Decoded messages delivered from ``src_name`` to ``dst_name`` (replies included), in order."""
        return [m for s, d, m, _ in self.log if s.split(".")[0] == src_name and d == dst_name and m is not None]


class FakeTransport:
    def __init__(self, net: FakeNet, name: str) -> None:
        self.net = net
        self.name = name
        self.routing_id = f"{name}.{secrets.token_hex(4)}"
        self.inbox: asyncio.Queue = asyncio.Queue()
        self.replies: asyncio.Queue = asyncio.Queue()
        self.counters = TrafficCounters()
        self.curve_key: bytes | None = None
        """The CURVE key this transport's connections prove (a certified peer's)."""
        self._links: dict[str, str] = {}

    def start(self) -> str:
        return f"mem://{self.name}"

    def new_routing_id(self) -> str:
        self.routing_id = f"{self.name}.{secrets.token_hex(4)}"
        return self.routing_id

    def connect(self, link: str, endpoint: str, config: Any = None) -> None:
        self._links[link] = endpoint.removeprefix("mem://")

    def endpoint_of(self, link: str) -> str | None:
        return f"mem://{self._links[link]}" if link in self._links else None

    async def disconnect(self, link: str, *, linger_s: float = 0.0) -> None:
        self._links.pop(link, None)

    def links(self) -> list[str]:
        return list(self._links)

    def add_connection_listener(self, listener) -> Any:
        """In memory no connection ends by itself: a test calls the listeners (``connection_listeners``)."""
        self.connection_listeners = [*getattr(self, "connection_listeners", []), listener]
        return lambda: self.connection_listeners.remove(listener)

    async def send(self, link: str, frames: list, *, kind: str = "control", timeout_s: float | None = None) -> None:
        frames = [bytes(f) for f in frames]
        dst = self._links[link]
        self.counters.add(link, "tx", kind, frames)
        self.net._record(self.routing_id, dst, frames, False)
        self.net.transports[dst].inbox.put_nowait((self.routing_id, frames))

    async def reply(self, routing_id: str, frames: list, *, kind: str = "control",
                    timeout_s: float | None = None) -> None:
        frames = [bytes(f) for f in frames]
        target = self.net.by_routing_id(routing_id)
        if target is None:  # an attacker's connection (or a gone one)
            self.net.orphan_replies[routing_id].append(frames)
            return
        self.counters.add(routing_id.split(".")[0], "tx", kind, frames)
        self.net._record(self.routing_id, target.name, frames, True)
        link = next((name for name, dst in target._links.items() if dst == self.name), self.name)
        target.replies.put_nowait((link, frames))  # on the receiver's connection to this transport

    async def recv(self, timeout_s: float) -> tuple[str, list]:
        return await self.inbox.get()

    async def recv_reply(self, timeout_s: float) -> tuple[str, list]:
        return await self.replies.get()

    def is_reverse(self, link: str) -> bool:  # every fake link is dialed: no dial-out peers here
        return False

    def reverse_link(self, routing_id: str) -> str | None:
        return None

    def request_sender(self, link: str) -> str | None:
        return None

    def peer_key(self, routing_id: str) -> bytes | None:
        return self.net.key_of(routing_id)

    def server_key(self, link: str) -> bytes | None:
        dst = self.net.transports.get(self._links.get(link, ""))
        return None if dst is None else dst.curve_key

    async def flush(self, timeout_s: float) -> None:
        return None

    def shaper(self, link: str) -> Any:
        return SimpleNamespace(stats=lambda: SimpleNamespace(bytes_sent=0, busy_s=0.0, messages_sent=0))


def swarm_config(**sections):
    base = {"pipeline": {"num_stages": 2, "micro_batch_size": 2, "num_micro_batches": 2},
            "run": {"steps": 3, "run_id": "mem"}, "eval": {"interval_steps": 0, "batches": 1},
            "net": {"timeout_s": 30.0, "heartbeat_interval_s": 0.02, "liveness_floor_s": 2.0, "hello_retry_s": 1.0}}
    for name, values in sections.items():
        base.setdefault(name, {}).update(values)
    return micro_config(**base)


def sampler(cfg, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    B, T = cfg.pipeline.micro_batch_size, cfg.model.context_length
    while True:
        yield torch.randint(0, cfg.model.vocab_size, (B, T + 1), generator=gen)


def link_neighbours(peer: Peer) -> None:
    """``peer``'s links to its neighbours' records on a :class:`FakeNet` (``mem://stage<k>``) made
    now, as its start would make them, so that a test may reach them before the peer serves."""
    for stage in peer.links.stages_expected:
        peer.linker.new_link(stage, f"mem://stage{stage}")


def fake_swarm(cfg=None, *, fingerprint: str = "fp", net: FakeNet | None = None,
               identities: list | None = None, linked: bool = True) -> tuple[FakeNet, list[Peer], list[FakeTransport]]:
    """Stages 0 .. P-1 of ``cfg`` (default :func:`swarm_config`, 2 stages) on a :class:`FakeNet`,
    insecure or with each stage's certified identity (``identities[s]``, a ``PeerIdentity``), their
    links made (:func:`link_neighbours`) unless not ``linked``; run them with :func:`run_swarm`.
    Call inside a running event loop."""
    cfg = cfg or swarm_config()
    net = net or FakeNet()
    P = cfg.pipeline.num_stages
    transports = [net.transport(f"stage{s}") for s in range(P)]
    for s, t in enumerate(transports):
        t.curve_key = identities[s].key.curve_public if identities else None

    async def resolve(stage: int, timeout_s: float) -> str:
        return f"mem://stage{stage}"

    async def announce(endpoint: str) -> None:
        return None

    val = [next(sampler(cfg, 99)) for _ in range(cfg.eval.batches)] if cfg.eval.interval_steps else []
    peers = [Peer(cfg, s, StageRuntime(cfg, s), fingerprint=fingerprint, resolve=resolve, announce=announce,
                  sampler=sampler(cfg) if s == 0 else None, val_batches=val if s == 0 else None,
                  membership=identities[s] if identities else None)
             for s in range(P)]
    for peer in peers if linked else ():
        link_neighbours(peer)
    return net, peers, transports


async def run_swarm(peers: list[Peer], transports: list[FakeTransport], timeout_s: float = 120.0) -> list:
    return await asyncio.wait_for(asyncio.gather(*(p.serve(t) for p, t in zip(peers, transports))), timeout_s)


def policy_swarm(cfg, *, resume: bool = False) -> tuple[FakeNet, list[Peer], list[FakeTransport]]:
    """Stages 0 .. P-1 of ``cfg`` on a :class:`FakeNet`, each with a real run policy
    (:class:`~mapl_swarm.peer.checkpoints.PeerRunPolicy`: checkpoints and metrics in ``run.out_dir``,
    the resume agreement when ``resume``); serve them with :func:`serve_all`. Call inside a running
    event loop."""
    from mapl_swarm.peer.checkpoints import PeerRunPolicy
    from mapl_swarm.peer.compute import ComputeThread

    net = FakeNet()
    transports = [net.transport(f"stage{s}") for s in range(cfg.pipeline.num_stages)]
    data = SimpleNamespace(meta={}, tokenizer=SimpleNamespace(file_hash="h"))

    async def resolve(stage: int, timeout_s: float) -> str:
        return f"mem://stage{stage}"

    async def announce(endpoint: str) -> None:
        return None

    peers = []
    for s in range(cfg.pipeline.num_stages):
        rt, compute = StageRuntime(cfg, s), ComputeThread(f"stage{s}")
        policy = PeerRunPolicy(cfg, s, data, "f" * 32, resume=resume, runtime=rt, compute=compute)
        peers.append(Peer(cfg, s, rt, fingerprint="f" * 32, resolve=resolve, announce=announce,
                          sampler=sampler(cfg) if s == 0 else None, compute=compute, run_policy=policy))
        link_neighbours(peers[-1])
    return net, peers, transports


async def serve_all(peers: list[Peer], transports: list[FakeTransport], timeout_s: float = 120.0) -> list:
    """Every peer's result, or what it raised; the run policies closed at the end."""
    try:
        return await asyncio.wait_for(asyncio.gather(*(p.serve(t) for p, t in zip(peers, transports)),
                                                     return_exceptions=True), timeout_s)
    finally:
        for p in peers:
            if p.run_policy is not None:
                p.run_policy.close()
