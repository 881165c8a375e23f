"""A replica's own optimizer step of its compressed matrices, taken aside (``replicas.averaged = "updates"``).

With ``"updates"`` the compressed weight matrices that Muon trains (:func:`updated`: the
transformer's hidden matrices) cross as what each replica's own Muon (from its own momentum) would
change them by from its own gradient, not as the gradient: compression and its error feedback then
act after Muon's orthogonalization, which no longer turns compression's error into full-size
directions of the step, and what compression delays reaches the parameters whole once it is sent.
Every replica adds the same averaged update; each keeps its own optimizer state for those matrices
(in its checkpoints and in the state it serves a joining replica). The matrices AdamW trains
(embeddings, output head, anchors) still cross as gradients: an average of AdamW steps each scaled
by moments of half the batch moves them less than one step from the whole batch's (BENCHMARKS.md
"Compressed averaging": +4.8 % of val loss with those alone as updates, none compressed, against
-1.0 % with Muon's alone).

The step is taken on shadow copies of the matrices, so the live parameters and optimizer state
stay those of the step's start until the round counts (:meth:`LocalUpdates.commit`); an attempt
that fails leaves nothing to undo, and a state served meanwhile is consistent.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from typing import Any

import torch

from mapl_swarm.errors import NonFiniteError
from mapl_swarm.optim.muon import Muon

__all__ = ["LocalUpdates", "updated"]


def updated(optimizers: Sequence[torch.optim.Optimizer], params: Sequence[torch.Tensor],
            compressed: Sequence[int]) -> tuple[int, ...]:
    """Which of the ``compressed`` tensors (indices among ``params``) cross as updates: those a
    Muon among ``optimizers`` trains."""
    muon = {id(p) for opt in optimizers if isinstance(opt, Muon) for g in opt.param_groups for p in g["params"]}
    return tuple(i for i in compressed if id(params[i]) in muon)


class LocalUpdates:
    """The optimizer updates of ``params`` (some of the tensors ``optimizers`` train) of a stage
    replica: :meth:`compute` from gradients, aside; :meth:`commit` with the averaged ones."""

    def __init__(self, optimizers: Sequence[torch.optim.Optimizer], params: Sequence[torch.Tensor],
                 stage: int) -> None:
        self.params, self.stage = list(params), stage
        owners = {id(p): opt for opt in optimizers for g in opt.param_groups for p in g["params"]}
        missing = [tuple(p.shape) for p in self.params if id(p) not in owners]
        if missing:
            raise ValueError(f"stage {stage}: no optimizer trains the tensors of shapes {missing}")
        self._owner = [owners[id(p)] for p in self.params]
        self._pending: list[dict[str, Any]] | None = None

    def compute(self, grads: Sequence[torch.Tensor | None], lr_multiplier: float) -> list[torch.Tensor]:
        """What one step of the optimizers, at ``lr_multiplier`` of their base rates, from ``grads``
        (one per parameter; None: no gradient, a zero update and no step) changes each parameter by
        (float32, on the CPU). The optimizer state it leads to is kept for :meth:`commit`."""
        shadows = [None if g is None else p.detach().clone().requires_grad_(True) for p, g in zip(self.params, grads)]
        for s, g in zip(shadows, grads):
            if s is not None:
                s.grad = g.detach().to(s.device, s.dtype)
        owners = {id(opt): opt for opt in self._owner}
        aside = {key: self._aside(opt, shadows, lr_multiplier) for key, opt in owners.items()}
        with torch.no_grad():
            for opt in aside.values():
                opt.step()
        self._pending = [{} if s is None else aside[id(opt)].state.get(s, {}) for s, opt in zip(shadows, self._owner)]
        return [torch.zeros(p.shape, dtype=torch.float32) if s is None else (s.detach() - p.detach()).float().cpu()
                for p, s in zip(self.params, shadows)]

    def _aside(self, opt: torch.optim.Optimizer, shadows: Sequence[torch.Tensor | None],
               lr_multiplier: float) -> torch.optim.Optimizer:
        """An optimizer of ``opt``'s kind and settings over the ``shadows`` of the parameters it
        trains, with copies of their state: the live optimizer, which a served state may be read
        from meanwhile, is not touched. (Its attributes are copied as they are: torch's pickling
        keeps only the base class's, so ``copy.copy`` would drop a subclass's own, as Muon's.)"""
        mine = {id(p): s for p, s, o in zip(self.params, shadows, self._owner) if o is opt and s is not None}
        twin = object.__new__(type(opt))
        twin.__dict__.update(opt.__dict__)
        twin.param_groups = [{**group, "params": [mine[id(p)] for p in group["params"] if id(p) in mine],
                              "lr": group["base_lr"] * lr_multiplier} for group in opt.param_groups]
        twin.state = defaultdict(dict)
        for p, s in zip(self.params, shadows):
            if id(p) in mine and p in opt.state:
                twin.state[s] = _copied(opt.state[p])
        return twin

    def commit(self, averaged: Sequence[torch.Tensor], step: int) -> None:
        """Add the stage's ``averaged`` updates (one per parameter, the same bytes at every replica)
        to the parameters, and make the optimizer state :meth:`compute` led to this replica's.
        Raises :class:`~mapl_swarm.errors.NonFiniteError` (of step ``step``), changing nothing, when
        an update is not finite."""
        for p, u in zip(self.params, averaged, strict=True):
            if not bool(torch.isfinite(u).all()):
                raise NonFiniteError(stage=self.stage, step=step,
                                     tensor=f"the averaged update of a {tuple(p.shape)} matrix")
        with torch.no_grad():
            for p, u in zip(self.params, averaged):
                p.add_(u.to(p.device, p.dtype))
        self.keep_state()

    def keep_state(self) -> None:
        """Make the optimizer state the last :meth:`compute` led to this replica's."""
        pending, self._pending = self._pending or [{}] * len(self.params), None
        for p, opt, state in zip(self.params, self._owner, pending):
            if state:
                opt.state[p] = state

    def discard(self) -> None:
        """Forget the state of the last :meth:`compute` (its round did not count)."""
        self._pending = None


def _copied(state: dict[str, Any]) -> dict[str, Any]:
    return {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in state.items()}

