"""All P stages in one process, joined by in-memory links that count every payload byte.

Payloads are produced by :class:`StageRuntime` already cast to their wire dtypes, so an in-memory
link moves exactly what a network link would (the wire only adds headers). With mapl_vq the
codebook slices a stage queues travel first, in the order a peer sends them (counted as
``codebook`` forward and ``grad_codebook`` backward), and the payload carries its ``cver``. Micro-batches run
forward through every stage then backward; the result equals a 1F1B or GPipe schedule of the same
step because weights only change at the step's flush, and gradients accumulate in micro-batch order.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from mapl_swarm.config import TrainConfig
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

    def __init__(self, cfg: TrainConfig, device: torch.device | str = "cpu") -> None:
        self.cfg = cfg
        self.stages = [StageRuntime(cfg, s, device) for s in range(cfg.pipeline.num_stages)]
        self.links = [LinkCounter() for _ in range(cfg.pipeline.num_stages - 1)]

    def _deliver_slices(self, src: int, dst: int, stream: Stream, count: bool) -> int:
        """Move stage ``src``'s queued ``stream`` slices to stage ``dst``; returns the payload cver."""
        link = self.links[min(src, dst)]
        for sl in self.stages[src].take_slices(stream):
            if count:
                link.add(stream.slice_kind,
                         {WireName.CODES: sl.codes, **({} if sl.index is None else {WireName.INDEX: sl.index})})
            self.stages[dst].apply_slice(sl)
        return self.stages[src].codebook_version(stream)

    def _forward(self, micro: int, ids: torch.Tensor, train: bool, keep_logits: bool = False) -> ForwardResult:
        payload = None
        result = None
        cver = None
        for s, stage in enumerate(self.stages):
            result = stage.forward(micro, ids=ids if s == 0 else None, payload=payload, train=train, cver=cver,
                                   keep_logits=keep_logits)
            payload = result.payload
            if payload is not None:
                cver = self._deliver_slices(s, s + 1, Stream.ACT, train)
            if payload is not None and train:
                act = PayloadKey.CODES if PayloadKey.CODES in payload else PayloadKey.ACT
                self.links[s].add(LinkKind.ACT, payload[act])
                self.links[s].add(LinkKind.IDS, payload[PayloadKey.IDS])
        assert result is not None and result.loss is not None
        return result

    def accumulate(self, micro_batches: list[torch.Tensor]) -> tuple[list[float], int]:
        """Forward+backward every micro-batch (B, T+1); gradients accumulate, nothing steps."""
        losses, tokens = [], 0
        for micro, ids in enumerate(micro_batches):
            result = self._forward(micro, ids, train=True)
            losses.append(result.loss)
            tokens += result.tokens
            grad = None
            cver = None
            for s in range(len(self.stages) - 1, -1, -1):
                grad = self.stages[s].backward(micro, grad, cver=cver)
                if grad is not None:
                    cver = self._deliver_slices(s, s - 1, Stream.GRAD, True)
                    key = PayloadKey.CODES if PayloadKey.CODES in grad else PayloadKey.GRAD
                    self.links[s - 1].add(LinkKind.GRAD, grad[key])
        return loss_values(losses), tokens

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
        return mean_loss([self._forward(-1 - i, ids, train=False).loss for i, ids in enumerate(batches)])

    @torch.no_grad()
    def logits(self, ids: torch.Tensor) -> torch.Tensor:
        """(B, T, V) fp32 logits of a (B, T+1) micro-batch (the last id of a row is only its last
        label), forward only, as :meth:`evaluate` computes them."""
        result = self._forward(-1, ids, train=False, keep_logits=True)
        assert result.logits is not None
        return result.logits

    def state_dicts(self) -> list[dict]:
        return [s.state_dict() for s in self.stages]
