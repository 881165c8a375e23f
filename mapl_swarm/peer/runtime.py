"""One stage peer: transport, handshake, message dispatch, lifecycle and result.

The peer drives the same :class:`~mapl_swarm.pipeline.stage.StageRuntime` as the single-process
pipeline; compute runs on one worker thread so the event loop keeps sending, receiving and
heart-beating while a stage computes (communication overlaps compute). The 1F1B schedule itself
(what a stage does with each ACT, GRAD, PROJ and REPORT) is :class:`~.schedule.PipelineSchedule`.

Bad frames (garbage, truncated, wrong version, wrong run, unknown sender) are counted, logged and
dropped; the peer keeps serving.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import torch
from tqdm import tqdm

from mapl_swarm.config import TrainConfig
from mapl_swarm.errors import MaplError
from mapl_swarm.net.emulator import LinkConfig
from mapl_swarm.net.heartbeat import HeartbeatConfig, attach_heartbeat
from mapl_swarm.net.transport import Transport, TransportConfig
from mapl_swarm.peer.mailbox import Mailbox
from mapl_swarm.peer.schedule import PipelineSchedule
from mapl_swarm.peer.tensors import to_wire
from mapl_swarm.peer.vq_link import CodebookLink
from mapl_swarm.pipeline.inprocess import LinkCounter
from mapl_swarm.pipeline.stage import StageRuntime
from mapl_swarm.wire import Message, MessageType, VersionMismatch, WireError, decode, encode
from mapl_swarm.wire.codebook import INDEXED_SLICES_CAPABILITY, RETRANSMIT_CAPABILITY, VQ_CAPABILITY

if TYPE_CHECKING:
    from mapl_swarm.peer.checkpoints import PeerRunPolicy

log = logging.getLogger(__name__)

__all__ = ["Peer", "PeerResult", "PeerRejected", "stage_name"]

MT = MessageType


class PeerRejected(MaplError):
    """A neighbour refused the handshake (version or config fingerprint mismatch)."""


def stage_name(stage: int) -> str:
    return f"stage{stage}"


@dataclass
class PeerResult:
    """What a peer measured; stage 1 also holds the swarm's losses."""

    stage: int
    train_losses: list[float] = field(default_factory=list)
    report_times_s: list[float] = field(default_factory=list)
    """Seconds since the handshake at which each step's REPORT reached stage 1."""
    val_history: list[tuple[int, float]] = field(default_factory=list)
    tokens: int = 0
    wall_s: float = 0.0
    bad_frames: int = 0
    payload_tx: dict[str, dict[str, int]] = field(default_factory=dict)
    """Payload bytes sent per link and kind (act, ids, grad, proj, proj_grad)."""
    wire_tx: dict[str, dict[str, int]] = field(default_factory=dict)
    """Bytes handed to ZeroMQ per link and message type (headers included)."""
    shaper: dict[str, dict[str, float]] = field(default_factory=dict)
    """Per outbound link: shaped bytes sent and seconds the emulated link spent transmitting."""
    codebooks: dict[str, Any] = field(default_factory=dict)
    """mapl_vq: slices applied/ignored/rejected (by error code), RESYNCs, versions and digests."""


class Peer(PipelineSchedule):
    """Stage ``stage`` of ``cfg``; ``resolve(stage) -> endpoint`` finds neighbours (the DHT)."""

    def __init__(self, cfg: TrainConfig, stage: int, runtime: StageRuntime, *, fingerprint: str,
                 resolve: Callable[[int, float], Any], announce: Callable[[str], Any],
                 sampler=None, val_batches: list[torch.Tensor] | None = None, progress: bool = False,
                 start_step: int = 0, secret: bytes | None = None, run_policy: "PeerRunPolicy | None" = None) -> None:
        self.cfg, self.stage, self.rt = cfg, stage, runtime
        self.P = cfg.run.num_stages
        self.M = cfg.run.num_micro_batches
        self.name = stage_name(stage)
        self.fingerprint = fingerprint
        self.resolve, self.announce = resolve, announce
        self.sampler, self.val_batches = sampler, val_batches or []
        self.progress, self.start_step = progress, start_step
        self.secret = secret
        self.run_policy = run_policy
        """Checkpoints (agreed across the swarm, SPEC §5.2), metrics stream and manifest of this stage."""
        self.up = stage - 1 if stage > 0 else None
        self.down = stage + 1 if stage < self.P - 1 else None
        self.neighbours = [s for s in (self.up, self.down) if s is not None]
        self.mailbox = Mailbox(self.name)
        self.welcomed: set[int] = set()
        self.neighbour_caps: dict[int, set[str]] = {}
        """Capabilities each neighbour advertised in its HELLO/WELCOME."""
        self._welcome_event = asyncio.Event()
        self._seq: dict[int, int] = {}
        self.links = {s: LinkCounter() for s in self.neighbours}
        self.result = PeerResult(stage)
        self._reports: list[Message] = []
        self._report_event = asyncio.Event()
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"{self.name}-compute")
        self._bar: tqdm | None = None
        self._t0 = 0.0
        self._last_train_loss: list[float] = []  # last stage: losses of the current step
        self._backwards = 0  # middle stages: backwards done in the current step
        self._eval_losses: list[float] = []
        self.transport: Transport | None = None
        self.vq_link = CodebookLink(self) if runtime.vq is not None else None
        """mapl_vq: codebook slices and RESYNC on this peer's links (:mod:`.vq_link`)."""
        self.encode_lock = asyncio.Lock()
        """Held from a compute that encodes until its payload is sent (a retransmission takes it too)."""
        self._tasks: set[asyncio.Task] = set()

    # ------------------------------------------------------------------ plumbing
    async def _compute(self, fn, *args, **kwargs):
        return await asyncio.get_running_loop().run_in_executor(self._pool, lambda: fn(*args, **kwargs))

    def spawn(self, coro) -> None:
        """Run ``coro`` beside the serving loop; its failure fails the peer."""
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)

        def done(t: asyncio.Task) -> None:
            self._tasks.discard(t)
            if not t.cancelled() and t.exception() is not None:
                self.mailbox.fail(t.exception())

        task.add_done_callback(done)

    async def _send(self, dst: int, mtype: MessageType, *, step: int = 0, micro: int = 0,
                    meta: dict | None = None, tensors: dict[str, torch.Tensor] | None = None,
                    pver: int = 0, payload_kinds: dict[str, str] | None = None, cver: int = 0) -> None:
        seq = self._seq.get(dst, 0)
        self._seq[dst] = seq + 1
        wire_tensors = {k: to_wire(v) for k, v in (tensors or {}).items()}
        msg = Message(type=mtype, run_id=self.cfg.run.run_id, src=self.stage, dst=dst, step=step,
                      micro=micro, seq=seq, pver=pver, cver=cver, meta=meta or {}, tensors=wire_tensors)
        compress = None if self.cfg.net.compress_ids else "raw"
        frames = encode(msg, secret=self.secret, compress=compress,
                        max_frame_bytes=self.cfg.net.max_frame_bytes)
        for name, t in (tensors or {}).items():
            self.links[dst].add((payload_kinds or {}).get(name, name), t)
        await self.transport.send(stage_name(dst), frames, kind=mtype.name)

    def _bad_frame(self, sender: str, why: str) -> None:
        self.result.bad_frames += 1
        log.warning("%s: dropped a message from %r: %s (%d dropped so far)", self.name, sender, why,
                    self.result.bad_frames)

    async def _receive_loop(self) -> None:
        net = self.cfg.net
        while True:
            sender, frames = await self.transport.recv(timeout_s=3600.0)
            try:
                msg = decode(frames, secret=self.secret, max_frame_bytes=net.max_frame_bytes)
            except VersionMismatch as exc:
                self._bad_frame(sender, str(exc))
                await self._reject_unknown(sender, "version_mismatch", str(exc))
                continue
            except WireError as exc:
                self._bad_frame(sender, f"{type(exc).__name__}: {exc}")
                continue
            if msg.run_id != self.cfg.run.run_id or msg.dst != self.stage or msg.src not in self.neighbours:
                self._bad_frame(sender, f"run {msg.run_id!r} src {msg.src} dst {msg.dst} is not for "
                                        f"{self.cfg.run.run_id!r} stage {self.stage}")
                continue
            await self._dispatch(msg)

    async def _reject_unknown(self, sender: str, code: str, reason: str) -> None:
        for s in self.neighbours:
            if stage_name(s) == sender:
                await self._send(s, MT.REJECT, meta={"code": code, "reason": reason})

    async def _dispatch(self, msg: Message) -> None:
        t = msg.type
        if t == MT.HELLO:
            await self._on_hello(msg)
        elif t == MT.WELCOME:
            self.welcomed.add(msg.src)
            self.neighbour_caps[msg.src] = set(msg.meta.get("capabilities", []))
            if set(self.neighbours) <= self.welcomed:
                self._welcome_event.set()
        elif t == MT.REJECT:
            self.mailbox.fail(PeerRejected(f"stage {msg.src} refused stage {self.stage}: {msg.meta.get('reason')}"))
            self._welcome_event.set()
        elif t == MT.ERROR:
            self.mailbox.fail(MaplError(f"stage {msg.src} failed: {msg.meta.get('message')}"))
        elif t == MT.HEARTBEAT:
            pass
        elif t == MT.CHECKPOINT and self.run_policy is not None:
            await self.run_policy.on_message(msg)
        elif t == MT.RESYNC and self.vq_link is not None:
            self.vq_link.on_resync(msg)
        elif t == MT.REPORT:
            if self.stage == 0:
                self._on_report(msg)
            else:
                await self._send(self.up, MT.REPORT, step=msg.step, meta=dict(msg.meta))
        else:
            self.mailbox.put(msg)

    async def _on_hello(self, msg: Message) -> None:
        meta = msg.meta
        if meta.get("fingerprint") != self.fingerprint:
            reason = (f"config fingerprint mismatch: peer stage {msg.src} has {meta.get('fingerprint')}, "
                      f"stage {self.stage} has {self.fingerprint}")
            self._bad_frame(stage_name(msg.src), reason)
            await self._send(msg.src, MT.REJECT, meta={"code": "fingerprint_mismatch", "reason": reason})
            return
        if meta.get("num_stages") != self.P:
            reason = f"num_stages mismatch: peer has {meta.get('num_stages')}, this peer has {self.P}"
            await self._send(msg.src, MT.REJECT, meta={"code": "fingerprint_mismatch", "reason": reason})
            return
        self.neighbour_caps[msg.src] = set(meta.get("capabilities", []))
        await self._send(msg.src, MT.WELCOME, meta=self._hello_meta())
        if self.vq_link is not None:
            await self.vq_link.on_handshake(msg.src)

    def _hello_meta(self) -> dict:
        vq_caps = [VQ_CAPABILITY, RETRANSMIT_CAPABILITY, INDEXED_SLICES_CAPABILITY]
        caps = ["1f1b"] + (vq_caps if self.vq_link is not None else [])
        caps += self.run_policy.capabilities if self.run_policy is not None else []
        return {"fingerprint": self.fingerprint, "num_stages": self.P, "capabilities": caps,
                "peer": self.name}

    async def _next(self, types: list[MessageType], timeout: float, what: str) -> Message:
        """The next message of ``types``, applying the codebook slices that arrive before it."""
        while True:
            msg = await self.mailbox.get([*types, MT.CODEBOOK_SLICE], timeout, what)
            if msg.type != MT.CODEBOOK_SLICE:
                return msg
            if self.vq_link is None:
                self._bad_frame(stage_name(msg.src), "CODEBOOK_SLICE but the codec has no codebooks")
            else:
                await self.vq_link.on_slice(msg)

    async def _decode(self, work, msg: Message):
        """Await ``work`` (a compute that decodes ``msg``); VQ version errors ask for a RESYNC and a
        retransmission (raising :class:`Retransmitting`: drop ``msg``, its copy follows)."""
        if self.vq_link is None:
            return await work
        return await self.vq_link.guard(work, msg.src, (msg.step, msg.micro, msg.meta.get("mode", "train")))

    def _on_report(self, msg: Message) -> None:
        self._reports.append(msg)
        self._report_event.set()
        if msg.meta.get("mode") == "train":
            self.result.train_losses.append(float(msg.meta["loss"]))
            self.result.report_times_s.append(time.perf_counter() - self._t0)
            self.result.tokens += int(msg.meta["tokens"])
            if self.run_policy is not None:
                self.run_policy.train_loss(msg.step, float(msg.meta["loss"]), int(msg.meta["tokens"]))
            if self._bar is not None:
                elapsed = max(time.perf_counter() - self._t0, 1e-9)
                self._bar.set_postfix(loss=f"{msg.meta['loss']:.3f}", tok_s=f"{self.result.tokens / elapsed:.0f}")
                self._bar.update(1)

    # ------------------------------------------------------------------ lifecycle
    async def run(self) -> PeerResult:
        net = self.cfg.net
        tcfg = TransportConfig(bind_host=net.bind_host, bind_port=net.port,
                               advertise_host=net.advertise_host or None, send_timeout_s=net.timeout_s)
        link = LinkConfig(bandwidth_mbps=net.bandwidth_mbps, latency_ms=net.latency_ms)
        async with Transport(self.name, tcfg) as transport:
            self.transport = transport
            endpoint = transport.start()
            await self.announce(endpoint)
            for s in self.neighbours:
                ep = await self.resolve(s, net.timeout_s)
                transport.connect(stage_name(s), ep, link)
                log.info("%s: link to stage %d at %s", self.name, s, ep)
            receiver = asyncio.create_task(self._receive_loop())
            hb = attach_heartbeat(
                transport, HeartbeatConfig(interval_s=net.heartbeat_interval_s, timeout_s=net.timeout_s),
                lambda peer: encode(Message(type=MT.HEARTBEAT, run_id=self.cfg.run.run_id, src=self.stage,
                                            dst=int(peer.removeprefix("stage"))),
                                    secret=self.secret),
                on_silent=lambda peer, s: self.mailbox.fail(MaplError(f"{self.name}: {peer} silent for {s:.0f} s")))
            try:
                await self._handshake()
                if self.run_policy is not None:  # the start step (agreed by every stage on resume), loaded
                    try:
                        self.start_step = await self.run_policy.begin(
                            lambda dst, meta: self._send(dst, MT.CHECKPOINT, step=meta.get("step") or 0, meta=meta),
                            self.neighbour_caps, lambda: self.mailbox.error)
                    except MaplError:
                        await transport.flush(net.timeout_s)  # a refusal reaches the other stages first
                        raise
                    if self.start_step:
                        state = await self._compute(self.run_policy.load, self.start_step)
                        await self._compute(self.rt.load_state_dict, state)
                        if self.sampler is not None:
                            self.sampler.load_state_dict(state["data"])
                # a resumed receiver's checkpoint may hold the projector of before the sender's
                # last step: the sender's copy is authoritative, so send it before any ACT
                await self._send_projector(self.start_step)
                self._t0 = time.perf_counter()
                if self.stage == 0:
                    await self._drive()
                else:
                    await self._serve()
                self.result.wall_s = time.perf_counter() - self._t0
                await transport.flush(net.timeout_s)
            finally:
                for task in list(self._tasks):
                    task.cancel()
                await asyncio.gather(*self._tasks, return_exceptions=True)
                await hb.aclose()
                receiver.cancel()
                await asyncio.gather(receiver, return_exceptions=True)
                self._pool.shutdown(wait=True)
                if self.run_policy is not None:
                    self.run_policy.close()
                if self._bar is not None:
                    self._bar.close()
            self.result.payload_tx = {stage_name(s): dict(c.bytes) for s, c in self.links.items()}
            self.result.wire_tx = {
                stage_name(s): {r["kind"]: r["wire_bytes"] for r in transport.counters.rows()
                                if r["link"] == stage_name(s) and r["direction"] == "tx"}
                for s in self.neighbours}
            for s in self.neighbours:
                st = transport.shaper(stage_name(s)).stats()
                self.result.shaper[stage_name(s)] = {"bytes_sent": st.bytes_sent, "busy_s": st.busy_s,
                                                     "messages": st.messages_sent}
            if self.vq_link is not None:
                self.result.codebooks = self.vq_link.summary()
        return self.result

    async def _handshake(self) -> None:
        for s in self.neighbours:
            await self._send(s, MT.HELLO, meta=self._hello_meta())
        try:
            await asyncio.wait_for(self._welcome_event.wait(), self.cfg.net.timeout_s)
        except asyncio.TimeoutError:
            raise MaplError(f"{self.name}: handshake with stages {self.neighbours} not completed within "
                            f"{self.cfg.net.timeout_s:g} s") from None
        if self.mailbox.error is not None:
            raise self.mailbox.error
        if self.vq_link is not None:
            for s in self.neighbours:
                self.vq_link.check_neighbour(s)
        log.info("%s: handshake done with stages %s", self.name, self.neighbours)

def write_result(result: PeerResult, out_dir: str | Path) -> Path:
    path = Path(out_dir) / f"peer_stage{result.stage}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result.__dict__, indent=2))
    return path
