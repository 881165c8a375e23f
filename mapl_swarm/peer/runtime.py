"""One stage peer: handshake, 1F1B micro-batch schedule, projector exchange, reports, checkpoints.

The peer drives the same :class:`~mapl_swarm.pipeline.stage.StageRuntime` as the single-process
pipeline; compute runs on one worker thread so the event loop keeps sending, receiving and
heart-beating while a stage computes (communication overlaps compute).

Stage 1 (index 0) reads the data and keeps up to ``net.max_in_flight`` micro-batches in flight:
after the warm-up forwards it sends one new forward per returned gradient (1F1B). Later stages
react: ACT -> forward (the last stage also runs the backward at once), GRAD -> backward. After a
step's M backwards every stage flushes: receiver sends PROJ_GRAD upstream, sender adds it, steps,
and sends the new PROJ (with its version) downstream before the next step's first ACT. The last
stage reports each step's loss upstream (REPORT, relayed stage by stage) so stage 1 shows one
progress bar for the whole swarm. Validation: stage 1 sends eval ACTs; the last stage reports the
mean loss. The end: stage 1 sends BYE down the pipeline once the last report arrived.

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
from typing import Any, Callable

import torch
from tqdm import tqdm

from mapl_swarm.config import TrainConfig
from mapl_swarm.errors import MaplError
from mapl_swarm.net.emulator import LinkConfig
from mapl_swarm.net.heartbeat import HeartbeatConfig, attach_heartbeat
from mapl_swarm.net.transport import Transport, TransportConfig
from mapl_swarm.peer.mailbox import Mailbox
from mapl_swarm.peer.vq_link import (
    CodebookLink,
    Retransmitting,
    act_payload,
    act_tensors,
    grad_payload,
    grad_tensors,
)
from mapl_swarm.peer.tensors import from_wire, to_wire
from mapl_swarm.pipeline import checkpoint
from mapl_swarm.pipeline.inprocess import LinkCounter
from mapl_swarm.pipeline.probe import append_health
from mapl_swarm.pipeline.stage import StageRuntime
from mapl_swarm.wire import Message, MessageType, VersionMismatch, WireError, decode, encode
from mapl_swarm.wire.codebook import RETRANSMIT_CAPABILITY, VQ_CAPABILITY

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


class Peer:
    """Stage ``stage`` of ``cfg``; ``resolve(stage) -> endpoint`` finds neighbours (the DHT)."""

    def __init__(self, cfg: TrainConfig, stage: int, runtime: StageRuntime, *, fingerprint: str,
                 resolve: Callable[[int, float], Any], announce: Callable[[str], Any],
                 sampler=None, val_batches: list[torch.Tensor] | None = None, progress: bool = False,
                 start_step: int = 0, secret: bytes | None = None) -> None:
        self.cfg, self.stage, self.rt = cfg, stage, runtime
        self.P = cfg.run.num_stages
        self.M = cfg.run.num_micro_batches
        self.name = stage_name(stage)
        self.fingerprint = fingerprint
        self.resolve, self.announce = resolve, announce
        self.sampler, self.val_batches = sampler, val_batches or []
        self.progress, self.start_step = progress, start_step
        self.secret = secret
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
        caps = ["1f1b"] + ([VQ_CAPABILITY, RETRANSMIT_CAPABILITY] if self.vq_link is not None else [])
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
            if self._bar is not None:
                elapsed = max(time.perf_counter() - self._t0, 1e-9)
                self._bar.set_postfix(loss=f"{msg.meta['loss']:.3f}", tok_s=f"{self.result.tokens / elapsed:.0f}")
                self._bar.update(1)

    async def _wait_report(self, mode: str, count: int, timeout_s: float) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while sum(1 for r in self._reports if r.meta.get("mode") == mode) < count:
            if self.mailbox.error is not None:
                raise self.mailbox.error
            self._report_event.clear()
            remaining = deadline - loop.time()
            if remaining <= 0:
                raise MaplError(f"{self.name}: no {mode} REPORT from the last stage within {timeout_s:g} s")
            try:
                await asyncio.wait_for(self._report_event.wait(), min(remaining, 1.0))
            except asyncio.TimeoutError:
                pass

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
        log.info("%s: handshake done with stages %s", self.name, self.neighbours)

    # ------------------------------------------------------------------ stage 1
    async def _drive(self) -> None:
        run = self.cfg.run
        in_flight = self.cfg.net.max_in_flight or self.P
        if self.progress:
            self._bar = tqdm(total=run.steps, initial=self.start_step, unit="step", dynamic_ncols=True,
                             desc=f"swarm {self.cfg.compression.codec} P={self.P}")
        timeout = self.cfg.net.timeout_s
        for step in range(self.start_step, run.steps):
            batches = [next(self.sampler) for _ in range(self.M)]
            sent = done = 0
            while done < self.M:
                while sent < self.M and sent - done < in_flight:
                    await self._forward_and_send(step, sent, ids=batches[sent])
                    sent += 1
                msg = await self._next([MT.GRAD], timeout, "(gradient) ")
                try:
                    await self._decode(self._compute(self.rt.backward, msg.micro, grad_payload(msg),
                                                     cver=msg.cver), msg)
                except Retransmitting:
                    continue
                done += 1
            await self._flush(step)
            done_steps = step + 1
            if run.val_interval_steps and (done_steps % run.val_interval_steps == 0 or done_steps == run.steps):
                await self._validate(done_steps)
        await self._wait_report("train", run.steps - self.start_step, timeout)
        if self.down is not None:
            await self._send(self.down, MT.BYE, meta={"reason": "training finished"})

    async def _validate(self, step: int) -> None:
        if self.P == 1:
            return
        before = sum(1 for r in self._reports if r.meta.get("mode") == "eval")
        for i, ids in enumerate(self.val_batches):
            async with self.encode_lock:
                res = await self._compute(self.rt.forward, -1 - i, ids=ids, train=False)
                await self._send_act(step, i, res.payload, eval_mode=True)
        await self._wait_report("eval", before + 1, self.cfg.net.timeout_s)
        report = [r for r in self._reports if r.meta.get("mode") == "eval"][-1]
        self.result.val_history.append((step, float(report.meta["loss"])))
        log.info("step %d: val loss %.4f", step, report.meta["loss"])

    # ------------------------------------------------------------------ every stage
    async def _forward_and_send(self, step: int, micro: int, *, ids=None, msg: Message | None = None) -> None:
        """Forward of a micro-batch (stage 1: ``ids``; later: the ACT ``msg``) and its ACT."""
        async with self.encode_lock:
            work = self._compute(self.rt.forward, micro, ids=ids, payload=None if msg is None else act_payload(msg),
                                 train=True, cver=None if msg is None else msg.cver)
            res = await (work if msg is None else self._decode(work, msg))
            await self._send_act(step, micro, res.payload, eval_mode=False)

    async def _send_act(self, step: int, micro: int, payload: dict, *, eval_mode: bool) -> None:
        """ACT downstream, after the codebook slices it needs (mapl_vq)."""
        if self.vq_link is not None:
            await self.vq_link.send_slices(self.down, "act", step, micro)
            self.vq_link.remember("act", "eval" if eval_mode else "train", step, micro, payload)
        pver = self.rt.outbound.version if self.rt.outbound is not None else 0
        tensors, kinds = act_tensors(payload, eval_mode=eval_mode)
        await self._send(self.down, MT.ACT, step=step, micro=micro, pver=pver,
                         meta={"mode": "eval" if eval_mode else "train"}, tensors=tensors,
                         payload_kinds=kinds, cver=self.rt.codebook_version("act"))

    async def _send_grad(self, step: int, micro: int, payload: dict) -> None:
        """GRAD upstream, after the codebook slices it needs (mapl_vq)."""
        if self.vq_link is not None:
            await self.vq_link.send_slices(self.up, "grad", step, micro)
            self.vq_link.remember("grad", "train", step, micro, payload)
        tensors, kinds = grad_tensors(payload)
        await self._send(self.up, MT.GRAD, step=step, micro=micro, tensors=tensors, payload_kinds=kinds,
                         cver=self.rt.codebook_version("grad"))

    async def _send_projector(self, step: int) -> None:
        proj = self.rt.outbound_projector()
        if proj is not None:
            await self._send(self.down, MT.PROJ, step=step, pver=proj[1], tensors={"proj": proj[0]},
                             payload_kinds={"proj": "proj"})

    async def _flush(self, step: int) -> None:
        """End of step: projector gradient up, optimizer step, projector down, checkpoint."""
        timeout = self.cfg.net.timeout_s
        if self.up is not None:
            g = self.rt.take_inbound_projector_grad()
            if g is not None:
                await self._send(self.up, MT.PROJ_GRAD, step=step, meta={"micro_batches": self.M},
                                 tensors={"grad": g}, payload_kinds={"grad": "proj_grad"})
        proj_before = self.rt.outbound_projector()
        if proj_before is not None:
            msg = await self.mailbox.get([MT.PROJ_GRAD], timeout, "(projector gradient) ")
            if msg.step != step:
                raise MaplError(f"{self.name}: PROJ_GRAD for step {msg.step} while finishing step {step}")
            self.rt.add_outbound_projector_grad(from_wire(msg.tensors["grad"]))
        step_metrics = await self._compute(self.rt.step)
        append_health(self.cfg.run.out_dir, self.stage, step + 1, step_metrics)  # run.health_interval_steps
        await self._send_projector(step + 1)
        every = self.cfg.run.checkpoint_interval_steps
        done = step + 1
        if every and (done % every == 0 or done == self.cfg.run.steps):
            state = self.rt.state_dict()
            if self.sampler is not None:
                state["data"] = self.sampler.state_dict()
            await self._compute(checkpoint.save_stage, self.cfg.run.out_dir, done, self.stage, state)

    async def _serve(self) -> None:
        """Stages 2..P: react to ACT / GRAD / PROJ until BYE."""
        timeout = self.cfg.net.timeout_s
        while True:
            msg = await self._next([MT.ACT, MT.GRAD, MT.PROJ, MT.BYE], timeout, "(pipeline) ")
            if msg.type == MT.BYE:
                if self.down is not None:
                    await self._send(self.down, MT.BYE, meta=dict(msg.meta))
                return
            try:
                if msg.type == MT.PROJ:
                    await self._compute(self.rt.load_inbound_projector, from_wire(msg.tensors["proj"]), msg.pver)
                elif msg.type == MT.GRAD:
                    await self._on_grad(msg)
                elif msg.meta.get("mode") == "eval":
                    await self._eval_forward(msg)
                else:
                    await self._on_act(msg)
            except Retransmitting:
                continue  # undecodable VQ codes: dropped, their retransmission follows

    async def _on_grad(self, msg: Message) -> None:
        """Middle stage: backward, GRAD upstream; the step's last one flushes."""
        async with self.encode_lock:
            grad = await self._decode(self._compute(self.rt.backward, msg.micro, grad_payload(msg), cver=msg.cver),
                                      msg)
            await self._send_grad(msg.step, msg.micro, grad)
        self._backwards += 1
        if self._backwards == self.M:
            self._backwards = 0
            await self._flush(msg.step)

    async def _on_act(self, msg: Message) -> None:
        """Train ACT: forward and ACT downstream; the last stage also runs the backward at once
        (1F1B's tail), and after the step's last one flushes and reports the loss."""
        inbound = self.rt.inbound
        if inbound is not None and inbound.trainable and msg.pver != inbound.version:
            raise MaplError(f"{self.name}: ACT made with projector v{msg.pver}, this stage holds "
                            f"v{inbound.version}")
        if self.down is not None:
            await self._forward_and_send(msg.step, msg.micro, msg=msg)
            return
        async with self.encode_lock:
            res = await self._decode(self._compute(self.rt.forward, msg.micro, payload=act_payload(msg), train=True,
                                                   cver=msg.cver), msg)
            grad = await self._compute(self.rt.backward, msg.micro, None)
            await self._send_grad(msg.step, msg.micro, grad)
        self._last_train_loss.append(res.loss)
        if len(self._last_train_loss) == self.M:
            losses, self._last_train_loss = self._last_train_loss, []
            await self._flush(msg.step)
            await self._send(self.up, MT.REPORT, step=msg.step + 1,
                             meta={"mode": "train", "loss": sum(losses) / len(losses),
                                   "tokens": res.tokens * len(losses)})

    async def _eval_forward(self, msg: Message) -> None:
        async with self.encode_lock:
            res = await self._decode(self._compute(self.rt.forward, -1 - msg.micro, payload=act_payload(msg),
                                                   train=False, cver=msg.cver), msg)
            if self.down is not None:
                await self._send_act(msg.step, msg.micro, res.payload, eval_mode=True)
                return
        self._eval_losses.append(res.loss)
        if len(self._eval_losses) == self.cfg.run.val_batches:
            losses, self._eval_losses = self._eval_losses, []
            await self._send(self.up, MT.REPORT, step=msg.step,
                             meta={"mode": "eval", "loss": sum(losses) / len(losses), "tokens": 0})


def write_result(result: PeerResult, out_dir: str | Path) -> Path:
    path = Path(out_dir) / f"peer_stage{result.stage}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result.__dict__, indent=2))
    return path
