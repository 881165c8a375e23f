"""The 1F1B pipeline schedule of a stage peer (the :class:`~.runtime.Peer` mixes it in).

Stage 1 (index 0) reads the data and keeps up to ``net.max_in_flight`` micro-batches in flight:
after the warm-up forwards it sends one new forward per returned gradient (1F1B). Later stages
react: ACT -> forward (the last stage also runs the backward at once), GRAD -> backward. After a
step's M backwards every stage flushes: receiver sends PROJ_GRAD upstream, sender adds it, steps,
and sends the new PROJ (with its version) downstream before the next step's first ACT. The last
stage reports each step's loss upstream (REPORT, relayed stage by stage) so stage 1 shows one
progress bar for the whole swarm. Validation: stage 1 sends eval ACTs; the last stage reports the
mean loss. The end: stage 1 sends BYE down the pipeline once the last report arrived.

MAPL+VQ: a compute that encodes and the send of its payload happen under ``encode_lock`` (a
retransmission takes it too); a received message whose codes cannot be decoded raises
:class:`~.vq_link.Retransmitting` and is dropped, its copy follows.
"""

from __future__ import annotations

import asyncio
import logging

from tqdm import tqdm

from mapl_swarm.errors import MaplError
from mapl_swarm.peer.tensors import from_wire
from mapl_swarm.peer.vq_link import Retransmitting, act_payload, act_tensors, grad_payload, grad_tensors
from mapl_swarm.pipeline.run_policy import validation_due
from mapl_swarm.wire import Message, MessageType

log = logging.getLogger(__name__)

__all__ = ["PipelineSchedule"]

MT = MessageType


class PipelineSchedule:
    """Stage 1's driver, every stage's serving loop, the step flush and the payload sends; uses the
    peer's plumbing (``rt``, ``mailbox``, ``_send``, ``_next``, ``_compute``, ``_decode``)."""

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
            if validation_due(self.cfg, done_steps):
                await self._validate(done_steps)
        await self._wait_report("train", run.steps - self.start_step, timeout)
        if self.run_policy is not None:  # every stage hears the final checkpoint is complete before BYE
            await self.run_policy.finish(lambda: self.mailbox.error)
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
        if self.run_policy is not None:
            self.run_policy.val_loss(step, float(report.meta["loss"]))
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
        await self._send_projector(step + 1)
        done = step + 1
        if self.run_policy is not None:  # metrics record; checkpoint, then its agreement (SPEC §5.2)
            self.run_policy.step_done(done, step_metrics)
            if self.run_policy.checkpoint_due(done):
                state = self.rt.state_dict()
                if self.sampler is not None:
                    state["data"] = self.sampler.state_dict()
                await self._compute(self.run_policy.save, done, state)
                await self.run_policy.saved(done)

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
