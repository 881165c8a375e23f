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
from collections import defaultdict
from dataclasses import dataclass

import torch

from mapl_swarm.compress import ssn
from mapl_swarm.config import TrainConfig
from mapl_swarm.pipeline.stage import StageRuntime

log = logging.getLogger(__name__)

__all__ = ["InProcessPipeline", "LinkCounter", "StepResult"]


class LinkCounter:
    """Payload bytes per message kind crossing one boundary."""

    def __init__(self) -> None:
        self.bytes: dict[str, int] = defaultdict(int)
        self.messages: dict[str, int] = defaultdict(int)

    def add(self, kind: str, tensors: dict[str, torch.Tensor] | torch.Tensor) -> None:
        items = tensors.values() if isinstance(tensors, dict) else [tensors]
        self.bytes[kind] += sum(t.numel() * t.element_size() for t in items)
        self.messages[kind] += 1

    def total(self) -> int:
        return sum(self.bytes.values())


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

    def _deliver_slices(self, src: int, dst: int, stream: str, count: bool) -> int:
        """Move stage ``src``'s queued ``stream`` slices to stage ``dst``; returns the payload cver."""
        link = self.links[min(src, dst)]
        for sl in self.stages[src].take_slices(stream):
            if count:
                link.add("codebook" if stream == "act" else "grad_codebook",
                         {"codes": sl.codes, **({} if sl.index is None else {"index": sl.index})})
            self.stages[dst].apply_slice(sl)
        return self.stages[src].codebook_version(stream)

    def _forward(self, micro: int, ids: torch.Tensor, train: bool) -> tuple[float, int]:
        payload = None
        result = None
        cver = None
        for s, stage in enumerate(self.stages):
            result = stage.forward(micro, ids=ids if s == 0 else None, payload=payload, train=train, cver=cver)
            payload = result.payload
            if payload is not None:
                cver = self._deliver_slices(s, s + 1, "act", train)
            if payload is not None and train:
                self.links[s].add("act", payload["codes"] if "codes" in payload else payload["act"])
                self.links[s].add("ids", payload["ids"])
        assert result is not None and result.loss is not None
        return result.loss, result.tokens

    def accumulate(self, micro_batches: list[torch.Tensor]) -> tuple[list[float], int]:
        """Forward+backward every micro-batch (B, T+1); gradients accumulate, nothing steps."""
        losses, tokens = [], 0
        for micro, ids in enumerate(micro_batches):
            loss, n = self._forward(micro, ids, train=True)
            losses.append(loss)
            tokens += n
            grad = None
            cver = None
            for s in range(len(self.stages) - 1, -1, -1):
                grad = self.stages[s].backward(micro, grad, cver=cver)
                if grad is not None:
                    cver = self._deliver_slices(s, s - 1, "grad", True)
                    self.links[s - 1].add("grad", grad["codes"] if "codes" in grad else grad["grad"])
        return losses, tokens

    def finish_step(self) -> dict[str, float]:
        """The step's flush: projector gradients upstream, every stage steps, projectors downstream."""
        for b, link in enumerate(self.links):
            g = self.stages[b + 1].take_inbound_projector_grad()
            if g is not None:
                link.add("proj_grad", g)
                self.stages[b].add_outbound_projector_grad(g)
        self._maybe_refresh_ssn()
        metrics: dict[str, float] = {}
        for stage in self.stages:
            for k, v in stage.step().items():
                metrics[f"stage{stage.stage}/{k}"] = v
        for b, link in enumerate(self.links):
            proj = self.stages[b].outbound_projector()
            if proj is not None:
                link.add("proj", proj[0])
                self.stages[b + 1].load_inbound_projector(*proj)
        return metrics

    def train_step(self, micro_batches: list[torch.Tensor]) -> StepResult:
        """One optimizer step over ``micro_batches``."""
        losses, tokens = self.accumulate(micro_batches)
        metrics = self.finish_step()
        return StepResult(sum(losses) / len(losses), tokens, metrics)

    def _maybe_refresh_ssn(self) -> None:
        c = self.cfg.compression
        step = self.stages[0].step_count
        if c.codec != "ssn" or c.ssn_refresh_interval_steps == 0:
            return
        grads = [s.take_ssn_basis_grad() for s in self.stages]
        if (step + 1) % c.ssn_refresh_interval_steps != 0:
            return
        total = torch.stack([g.cpu() for g in grads if g is not None]).sum(0)
        new_basis = ssn.grassmann_step(self.stages[0].ssn_basis.detach().cpu(), total, c.ssn_refresh_lr)
        for stage in self.stages:
            stage.set_ssn_basis(new_basis)
        log.info("ssn: Grassmann refresh of U at step %d", step + 1)

    @torch.no_grad()
    def evaluate(self, batches: list[torch.Tensor]) -> float:
        """Mean loss over held-out micro-batches, forward only."""
        losses = [self._forward(-1 - i, ids, train=False)[0] for i, ids in enumerate(batches)]
        return sum(losses) / len(losses)

    def state_dicts(self) -> list[dict]:
        return [s.state_dict() for s in self.stages]
