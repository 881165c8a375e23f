"""All P stages in one process, joined by in-memory links that count every payload byte.

Payloads are produced by :class:`StageRuntime` already cast to their wire dtypes, so an in-memory
link moves exactly what a network link would (the wire only adds headers). With mapl_vq the
codebook slices a stage queues travel first, in the order a peer sends them (counted as
``codebook`` forward and ``grad_codebook`` backward), and the payload carries its ``cver``. A step
runs every stage's list of actions (:mod:`~mapl_swarm.step.actions`, 1F1B by default), the
lists the peers of a swarm run, interleaved as their messages allow; weights only change at the
step's flush and gradients accumulate in micro-batch order, so every order gives the same step.
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass

import torch

from mapl_swarm.config import TrainConfig
from mapl_swarm.step.actions import Op, stage_actions
from mapl_swarm.pipeline.payload import LinkCounter, LinkKind, PayloadKey, Stream, WireName
from mapl_swarm.pipeline.stage import ForwardResult, StageRuntime, loss_values, mean_loss

log = logging.getLogger(__name__)

__all__ = ["InProcessPipeline", "LinkCounter", "StepResult"]  # LinkCounter: re-exported from .payload


@dataclass
class StepResult:
    """One optimizer step of the whole pipeline."""

    loss: float
    """Mean training loss over the step's micro-batches."""
    tokens: int
    """Tokens processed."""
    metrics: dict[str, float]
    """Per-stage optimizer metrics, keys prefixed with the stage."""


class InProcessPipeline:
    """P :class:`StageRuntime` objects driven in one process."""

    def __init__(self, cfg: TrainConfig, device: torch.device | str = "cpu", *, order: str = "1f1b") -> None:
        self.cfg = cfg
        self.order = order
        """The schedule's order (:data:`~mapl_swarm.step.actions.ORDERS`); the step is the same in both."""
        self.in_flight = cfg.net.max_in_flight or cfg.pipeline.num_stages
        """Micro-batches stage 0 keeps in flight (1F1B), as a swarm's."""
        self.stages = [StageRuntime(cfg, s, device) for s in range(cfg.pipeline.num_stages)]
        self.links = [LinkCounter() for _ in range(cfg.pipeline.num_stages - 1)]
        self._queued: dict[tuple[int, Stream], int] = {}
        """(receiving stage, stream) -> version of the last codebook slice queued for it."""

    def _forward(self, micro: int, ids: torch.Tensor, keep_logits: bool = False) -> ForwardResult:
        """Forward only (validation, logits) through every stage: payloads and slices go straight to
        the next stage, uncounted."""
        payload = result = cver = None
        for s, stage in enumerate(self.stages):
            result = stage.forward(micro, ids=ids if s == 0 else None, payload=payload, train=False, cver=cver,
                                   keep_logits=keep_logits)
            payload = result.payload
            if payload is not None:
                for sl in stage.slices_for(Stream.ACT, self._have(s + 1, Stream.ACT)):
                    self.stages[s + 1].apply_slice(sl)
                cver = stage.codebook_version(Stream.ACT)
        assert result is not None and result.loss is not None
        return result

    def accumulate(self, micro_batches: list[torch.Tensor]) -> tuple[list[float], int]:
        """Forward+backward every micro-batch (B, T+1) in the schedule's order
        (:func:`~mapl_swarm.step.actions.stage_actions`, the peers'); gradients accumulate,
        nothing steps. Each link is a FIFO per direction, as a peer's: codebook slices, then the
        payload with the codebook version it was encoded at."""
        P, M = len(self.stages), len(micro_batches)
        lists = [stage_actions(s, P, M, order=self.order, in_flight=self.in_flight) for s in range(P)]
        fifo: dict[tuple[int, int], deque] = {(s, d): deque() for s in range(P) for d in (s - 1, s + 1) if 0 <= d < P}
        done = [0] * P
        losses: list[torch.Tensor] = []
        tokens = 0
        while any(done[s] < len(lists[s]) for s in range(P)):
            ran = False
            for s, stage in enumerate(self.stages):
                while done[s] < len(lists[s]):
                    action = lists[s][done[s]]
                    src = s - 1 if action.op is Op.FORWARD else s + 1
                    if 0 <= src < P and not fifo[(src, s)]:
                        break  # its input is not there yet
                    payload, cver = self._receive(fifo, src, s) if 0 <= src < P else (None, None)
                    if action.op is Op.FORWARD:
                        result = stage.forward(action.micro, ids=micro_batches[action.micro] if s == 0 else None,
                                               payload=payload, train=True, cver=cver)
                        if result.payload is None:
                            losses.append(result.loss)
                            tokens += result.tokens
                        else:
                            self._send(fifo, s, s + 1, Stream.ACT, result.payload)
                    else:
                        grad = stage.backward(action.micro, payload, cver=cver)
                        if grad is not None:
                            self._send(fifo, s, s - 1, Stream.GRAD, grad)
                    done[s] += 1
                    ran = True
            assert ran, f"pipeline schedule deadlocked at {done}"
        return loss_values(losses), tokens

    def _send(self, fifo: dict[tuple[int, int], deque], src: int, dst: int, stream: Stream,
              payload: dict[str, torch.Tensor]) -> None:
        """Stage ``src``'s queued ``stream`` slices, then ``payload`` at their codebook version,
        onto the link to ``dst``, each counted."""
        link = self.links[min(src, dst)]
        for sl in self.stages[src].slices_for(stream, self._have(dst, stream)):
            link.add(stream.slice_kind,
                     {WireName.CODES: sl.codes, **({} if sl.index is None else {WireName.INDEX: sl.index})})
            fifo[(src, dst)].append(sl)
            self._queued[(dst, stream)] = sl.version
        if stream is Stream.ACT:
            act = PayloadKey.CODES if PayloadKey.CODES in payload else PayloadKey.ACT
            link.add(LinkKind.ACT, payload[act])
            link.add(LinkKind.IDS, payload[PayloadKey.IDS])
        else:
            link.add(LinkKind.GRAD, payload[PayloadKey.CODES if PayloadKey.CODES in payload else PayloadKey.GRAD])
        fifo[(src, dst)].append((payload, self.stages[src].codebook_version(stream)))

    def _have(self, dst: int, stream: Stream) -> int:
        """The codebook version stage ``dst`` holds of ``stream`` once the slices queued for it
        are applied (what a full slice of ``update = step`` is due against; -1 without VQ)."""
        vq = self.stages[dst].vq
        return -1 if vq is None else max(vq.rx[stream].version, self._queued.get((dst, stream), -1))

    def _receive(self, fifo: dict[tuple[int, int], deque], src: int, dst: int) -> tuple[dict, int | None]:
        """Stage ``dst`` takes the next payload from ``src``, applying the slices queued before it."""
        queue = fifo[(src, dst)]
        while True:
            item = queue.popleft()
            if isinstance(item, tuple):
                return item
            self.stages[dst].apply_slice(item)

    def finish_step(self) -> dict[str, float]:
        """The step's flush: projector gradients upstream, every stage steps, projectors downstream."""
        for b, link in enumerate(self.links):
            g = self.stages[b + 1].take_inbound_projector_grad()
            if g is not None:
                link.add(LinkKind.PROJ_GRAD, g)
                self.stages[b].add_outbound_projector_grad(g)
        codecs = [stage.codec for stage in self.stages]
        codecs[0].before_pipeline_step(codecs, self.stages[0].step_count)  # e.g. SSN's refresh of U
        metrics: dict[str, float] = {}
        for stage in self.stages:
            for k, v in stage.step().items():
                metrics[f"stage{stage.stage}/{k}"] = v
        self.sync_projectors(count=True)
        return metrics

    def sync_projectors(self, *, count: bool = False) -> None:
        """Every receiver installs its sender's current projector, as a swarm's PROJ does before the
        receiver's next decode. Stage states saved by separate peers can hold a receiver copy one
        version behind (saved before that PROJ arrived): call this after loading them."""
        for b, link in enumerate(self.links):
            proj = self.stages[b].outbound_projector()
            if proj is not None:
                if count:
                    link.add(LinkKind.PROJ, proj[0])
                self.stages[b + 1].load_inbound_projector(*proj)

    def train_step(self, micro_batches: list[torch.Tensor]) -> StepResult:
        """One optimizer step over ``micro_batches``."""
        losses, tokens = self.accumulate(micro_batches)
        metrics = self.finish_step()
        return StepResult(sum(losses) / len(losses), tokens, metrics)

    @torch.no_grad()
    def evaluate(self, batches: list[torch.Tensor]) -> float:
        """Mean loss over held-out micro-batches, forward only."""
        return mean_loss([self._forward(-1 - i, ids).loss for i, ids in enumerate(batches)])

    @torch.no_grad()
    def logits(self, ids: torch.Tensor) -> torch.Tensor:
        """(B, T, V) fp32 logits of a (B, T+1) micro-batch (the last id of a row is only its last
        label), forward only, as :meth:`evaluate` computes them."""
        result = self._forward(-1, ids, keep_logits=True)
        assert result.logits is not None
        return result.logits

    def state_dicts(self) -> list[dict]:
        return [s.state_dict() for s in self.stages]
