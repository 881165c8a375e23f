"""The parameter table: which optimizer trains which tensors, at which lr and weight decay.

In the style of modded-nanogpt's parameter config: every trainable tensor of a stage appears in
one :class:`ParamRow` (label -> optimizer, lr ratio to the Muon lr, weight-decay multiplier).
The model contributes its rows (:func:`model_rows`), the boundary codec its own (anchors,
projectors), and :func:`build_optimizers` turns the table into optimizers. No component decides
elsewhere who trains what.

Rows with the same (optimizer, lr ratio, weight-decay multiplier) share one torch param group, in
order of first appearance, so the table maps onto the fewest groups.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

import torch
from torch import nn

from mapl_swarm.config import OptimConfig
from mapl_swarm.optim.muon import Muon
from mapl_swarm.optim.spel import SPEL

__all__ = ["ParamRow", "OptimizerName", "adamw_rows", "model_rows", "build_optimizers", "table_lines"]

OptimizerName = Literal["muon", "adamw", "spel"]


@dataclass(frozen=True)
class ParamRow:
    """One line of the table."""

    label: str
    """What the tensors are (for logs and tests): ``hidden``, ``embed_matrices``, ``anchor``..."""
    optimizer: OptimizerName
    """Muon (2D hidden weights), AdamW (everything else) or SPEL (Stiefel projectors)."""
    lr_ratio: float
    """Learning rate as a multiple of ``optim.muon_lr``."""
    weight_decay: float
    """Multiplier of ``optim.weight_decay`` (0 or 1); ignored by SPEL."""
    params: list[nn.Parameter] = field(default_factory=list, compare=False)


def model_rows(model: nn.Module, hidden: Sequence[nn.Parameter], o: OptimConfig, *,
               adamw_lr_ratio: float | None = None) -> list[ParamRow]:
    """The model's rows: hidden matrices under Muon; other matrices (embeddings, lm_head) under
    AdamW with weight decay; vectors (norms, biases) under AdamW without. Frozen tensors are left out.
    ``adamw_lr_ratio`` overrides ``o.adamw_lr_ratio`` (a codec's own setting, e.g. SSN's)."""
    return [ParamRow("hidden", "muon", 1.0, 1.0, list(hidden)),
            *adamw_rows("model", model, o, exclude=hidden, lr_ratio=adamw_lr_ratio)]


def adamw_rows(label: str, module: nn.Module | None, o: OptimConfig, *,
               exclude: Sequence[nn.Parameter] = (), lr_ratio: float | None = None) -> list[ParamRow]:
    """``module``'s trainable tensors under AdamW at ``lr_ratio`` (default ``o.adamw_lr_ratio``):
    matrices with weight decay, vectors without (no rows without a module)."""
    if module is None:
        return []
    ratio = o.adamw_lr_ratio if lr_ratio is None else lr_ratio
    skip = {id(p) for p in exclude}
    params = [p for p in module.parameters() if p.requires_grad and id(p) not in skip]
    return [ParamRow(f"{label}_matrices", "adamw", ratio, 1.0, [p for p in params if p.dim() >= 2]),
            ParamRow(f"{label}_vectors", "adamw", ratio, 0.0, [p for p in params if p.dim() < 2])]


def _groups(rows: Sequence[ParamRow], optimizer: str, o: OptimConfig) -> list[dict]:
    groups: dict[tuple[float, float], dict] = {}
    for row in rows:
        if row.optimizer != optimizer:
            continue
        lr = o.muon_lr * row.lr_ratio
        g = groups.setdefault((row.lr_ratio, row.weight_decay),
                              dict(params=[], lr=lr, base_lr=lr, weight_decay=o.weight_decay * row.weight_decay))
        g["params"].extend(row.params)
    return list(groups.values())


def build_optimizers(rows: Sequence[ParamRow], o: OptimConfig) -> list[torch.optim.Optimizer]:
    """Muon and AdamW always (their groups may be empty), SPEL when a row asks for it; every group
    carries ``base_lr`` for the lr schedule."""
    muon = _groups(rows, "muon", o)
    adamw = _groups(rows, "adamw", o)
    opts: list[torch.optim.Optimizer] = [
        Muon(muon, lr=o.muon_lr, momentum=o.muon_momentum, ns_steps=o.muon_ns_steps),
        torch.optim.AdamW(adamw, lr=o.muon_lr * o.adamw_lr_ratio, betas=(o.adam_beta1, o.adam_beta2),
                          eps=o.adam_eps),
    ]
    spel = _groups(rows, "spel", o)
    if spel:
        for g in spel:
            g.pop("weight_decay")
        opts.append(SPEL(spel, lr=spel[0]["lr"], momentum=o.spel_momentum, direction_steps=o.spel_direction_steps,
                         retraction_steps=o.spel_retraction_steps))
    return opts


def table_lines(rows: Sequence[ParamRow]) -> list[str]:
    """Human-readable table (label, optimizer, lr ratio, wd multiplier, tensor count, numel)."""
    return [f"{r.label:<18} {r.optimizer:<6} lr x{r.lr_ratio:<6g} wd x{r.weight_decay:<3g} "
            f"{len(r.params):>3} tensors {sum(p.numel() for p in r.params):>10,d} values" for r in rows]
