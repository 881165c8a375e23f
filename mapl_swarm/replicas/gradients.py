"""A stage replica's step: its accumulated gradients averaged with the stage's other replicas.

Every replica of stage k processes some of the step's global micro-batches; the runtime scales each
micro-batch's loss by ``1 / num_micro_batches`` (the global count), so a replica's accumulated
gradient is its share of the global one. At the step's end each replica pre-scales its gradients to
the mean over its own micro-batches (``× num_micro_batches / n``) and averages them with the other
replicas weighted by ``n`` (hivemind's all-reduce through :class:`~.averaging.StageAverager`): the
result is the global batch's gradient, the same bytes on every replica, and every replica takes the
same optimizer step. A sender's projector gradient holds what its receivers sent it (PROJ_GRAD), so
it is averaged with the rest: every replica of the sender applies the same SPEL step and sends the
same next projector version.

Each replica gathers the digest of its parameters before the step (hivemind's ``gather``): replicas
that start a step from different parameters are found there (:attr:`ReplicaStep.in_sync`), and the
one that differs re-syncs by downloading the stage's state (:meth:`~.averaging.StageAverager.download_state`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from mapl_swarm.errors import MaplError
from mapl_swarm.replicas.averaging import StageAverager
from mapl_swarm.replicas.state import state_digest

__all__ = ["ReplicaGradients", "ReplicaStep", "AveragingFailed"]


class AveragingFailed(MaplError):
    """The replicas of a stage formed no group in time: the step's gradients were not averaged."""


@dataclass(frozen=True)
class ReplicaStep:
    """What one averaging round gave: the group's size and whether every member started the step
    from the parameters this replica holds."""

    group_size: int
    in_sync: bool
    digests: dict[str, str]
    """Each group member's parameter digest (peer id -> hex)."""


class ReplicaGradients:
    """The gradients of stage replica ``runtime`` (a :class:`~mapl_swarm.pipeline.stage.StageRuntime`),
    averaged among ``replicas`` replicas of its stage in run ``run_id`` through ``dht`` (the
    replica's certified DHT node). Create it before the event loop and torch threads (it forks)."""

    def __init__(self, runtime: Any, dht: Any, *, run_id: str, replicas: int, **averager_kwargs: Any) -> None:
        self.runtime = runtime
        self.params = list(runtime.optimized_parameters())
        buffers = [torch.zeros(p.shape, dtype=torch.float32) for p in self.params]  # contiguous, as hivemind needs
        self.averager = StageAverager(buffers, dht, run_id=run_id, stage=runtime.stage, replicas=replicas,
                                      state=runtime.state_dict, start=True, **averager_kwargs)

    def average(self, micro_batches: int, *, timeout: float) -> ReplicaStep:
        """Average the gradients accumulated over this replica's ``micro_batches`` micro-batches of
        the step with the other replicas' (module docstring); the runtime then takes its step."""
        if micro_batches <= 0:
            raise ValueError(f"a replica averages the gradients of at least one micro-batch, not {micro_batches}")
        scale = self.runtime.cfg.pipeline.num_micro_batches / micro_batches
        digest = state_digest(self.runtime.modules.state_dict())
        with self.averager.get_tensors() as buffers, torch.no_grad():
            for buf, p in zip(buffers, self.params, strict=True):
                if p.grad is None:
                    buf.zero_()
                else:
                    buf.copy_(p.grad.detach().to("cpu", torch.float32)).mul_(scale)
        gathered = self.averager.step(weight=float(micro_batches), gather=digest, timeout=timeout)
        if gathered is None:
            raise AveragingFailed(f"stage {self.runtime.stage}: the replicas formed no averaging group within "
                                  f"{timeout:g} s")
        with self.averager.get_tensors() as buffers, torch.no_grad():
            for buf, p in zip(buffers, self.params, strict=True):
                p.grad = buf.to(p.device, p.dtype, copy=True)
        digests = {str(peer): value for peer, value in gathered.items()}
        return ReplicaStep(len(gathered), all(d == digest for d in digests.values()), digests)

    def shutdown(self) -> None:
        self.averager.shutdown()
