"""A stage replica's step: its accumulated gradients averaged with the stage's other replicas.

Every replica of stage k processes some of the step's global micro-batches; the runtime scales each
micro-batch's loss by ``1 / num_micro_batches`` (the global count), so a replica's accumulated
gradient is its share of the global one. At the step's end each replica pre-scales its gradients to
the mean over its own micro-batches (``× num_micro_batches / n``; a replica that computed none sends
zeros with weight 0) and averages them with the other replicas weighted by ``n`` (hivemind's
all-reduce through :class:`~.averaging.StageAverager`): the result is the global batch's gradient,
the same bytes on every replica, and every replica takes the same optimizer step. A sender's
projector gradient holds what its receivers sent it (PROJ_GRAD), so it is averaged with the rest:
every replica of the sender applies the same SPEL step and sends the same next projector version.

Each replica gathers, with the round, the digest of its parameters before the step, its ``n`` and
(the last stage) the sum of its micro-batches' losses (hivemind's ``gather``): a round is whole when
the counts add up to the step's micro-batches and every digest is equal (:meth:`ReplicaStep.problem`);
its sorted peer ids rank the stage's replicas for the next step (stage 0 splits the data by them).
Before the first step a :meth:`ReplicaGradients.sync` round (nothing averaged) finds the replicas
that start together and checks that they hold the same parameters.
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
    """The replicas of a stage formed no group in time, or a round that was not whole."""


@dataclass(frozen=True)
class ReplicaStep:
    """What one averaging round gave (SPEC §9.10 item 6)."""

    me: str
    """This replica's peer id."""
    group: tuple[str, ...]
    """The members' peer ids, sorted: a replica's place in it is its rank."""
    digests: dict[str, str]
    """Each member's parameter digest before the step (peer id -> hex)."""
    counts: dict[str, int]
    """Each member's train micro-batches of the step."""
    loss_sum: float
    """The members' summed micro-batch losses (the last stage; 0 elsewhere)."""
    sent_bytes: int = 0
    received_bytes: int = 0
    """The tensor bytes this replica's all-reduce of the round sent and received."""

    @property
    def group_size(self) -> int:
        return len(self.group)

    @property
    def rank(self) -> int:
        return self.group.index(self.me)

    @property
    def in_sync(self) -> bool:
        """Every member started the step from the parameters this replica holds."""
        return len(set(self.digests.values())) == 1

    def problem(self, micro_batches: int) -> str | None:
        """Why the round cannot make the step (the counts do not add up to ``micro_batches``, or
        the members hold different parameters), or None."""
        counted = sum(self.counts.values())
        if counted != micro_batches:
            return (f"the replicas' micro-batches add up to {counted}, not the step's {micro_batches} "
                    f"({', '.join(f'{p[-8:]}: {n}' for p, n in sorted(self.counts.items()))})")
        if not self.in_sync:
            return f"the replicas held different parameters before the step ({len(set(self.digests.values()))} digests)"
        return None


class ReplicaGradients:
    """The gradients of stage replica ``runtime`` (a :class:`~mapl_swarm.pipeline.stage.StageRuntime`),
    averaged among the replicas of its stage in run ``run_id`` through ``dht`` (the replica's
    certified DHT node); a round starts at once when ``replicas`` are in. Create it before the event
    loop and torch threads (it forks); :meth:`attach` a session's runtime of the same shapes."""

    def __init__(self, runtime: Any, dht: Any, *, run_id: str, replicas: int, **averager_kwargs: Any) -> None:
        self.runtime = runtime
        self.params = list(runtime.optimized_parameters())
        buffers = [torch.zeros(p.shape, dtype=torch.float32) for p in self.params]  # contiguous, as hivemind needs
        self.averager = StageAverager(buffers, dht, run_id=run_id, stage=runtime.stage, replicas=replicas,
                                      state=lambda: self.runtime.state_dict(), start=True, **averager_kwargs)
        self.me = str(self.averager.peer_id)

    def attach(self, runtime: Any) -> None:
        """Average ``runtime``'s gradients from now on (a new session's stage, built the same way)."""
        params = list(runtime.optimized_parameters())
        if [p.shape for p in params] != [p.shape for p in self.params]:
            raise ValueError(f"stage {runtime.stage}: another runtime's parameters")
        self.runtime, self.params = runtime, params

    def _round(self, weight: float, gather: dict[str, Any], timeout: float) -> ReplicaStep:
        sent, received = self.averager.traffic
        gathered = self.averager.step(weight=weight, gather=gather, timeout=timeout)
        sent, received = (now - before for now, before in zip(self.averager.traffic, (sent, received)))
        if gathered is None:
            raise AveragingFailed(f"stage {self.runtime.stage}: the replicas formed no averaging group within "
                                  f"{timeout:g} s")
        data = {str(peer): value for peer, value in gathered.items()}
        if not all(isinstance(v, dict) and isinstance(v.get("digest"), str) and type(v.get("n")) is int
                   and isinstance(v.get("loss"), float) for v in data.values()):
            raise AveragingFailed(f"stage {self.runtime.stage}: a replica gathered something else than a round's "
                                  f"digest, count and loss")
        return ReplicaStep(self.me, tuple(sorted(data)), {p: v["digest"] for p, v in data.items()},
                           {p: v["n"] for p, v in data.items()}, sum(v["loss"] for v in data.values()), sent, received)

    def sync(self, *, timeout: float) -> ReplicaStep:
        """The round before the first step: the replicas that start together, each one's parameter
        digest (nothing is averaged into the gradients)."""
        with self.averager.get_tensors() as buffers:
            for buf in buffers:
                buf.zero_()
        return self._round(1.0, {"digest": state_digest(self.runtime.modules.state_dict()), "n": 0, "loss": 0.0},
                           timeout)

    def average(self, micro_batches: int, *, timeout: float, loss_sum: float = 0.0) -> ReplicaStep:
        """Average the gradients accumulated over this replica's ``micro_batches`` micro-batches of
        the step (0: none) with the other replicas' (module docstring) and hand the result to the
        runtime's parameters; the caller checks the round (:meth:`ReplicaStep.problem`) and steps."""
        if micro_batches < 0:
            raise ValueError(f"a replica averages the gradients of 0 or more micro-batches, not {micro_batches}")
        scale = self.runtime.cfg.pipeline.num_micro_batches / micro_batches if micro_batches else 0.0
        digest = state_digest(self.runtime.modules.state_dict())
        with self.averager.get_tensors() as buffers, torch.no_grad():
            for buf, p in zip(buffers, self.params, strict=True):
                if p.grad is None or not micro_batches:
                    buf.zero_()
                else:
                    buf.copy_(p.grad.detach().to("cpu", torch.float32)).mul_(scale)
        step = self._round(float(micro_batches), {"digest": digest, "n": micro_batches, "loss": float(loss_sum)},
                           timeout)
        with self.averager.get_tensors() as buffers, torch.no_grad():
            for buf, p in zip(buffers, self.params, strict=True):
                p.grad = buf.to(p.device, p.dtype, copy=True)
        return step

    def shutdown(self) -> None:
        self.averager.shutdown()
