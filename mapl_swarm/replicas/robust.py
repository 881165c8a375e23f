"""Robust aggregation of a stage's replicas' gradient shares, per all-reduce part: CenteredClip or a trimmed mean.

With ``replicas.aggregation = "centered_clip"`` or ``"trimmed_mean"`` the reducer of each part of
the stage's all-reduce (:mod:`.exact_allreduce`) keeps every member's share of that part and
returns :data:`AGGREGATES`' function of them instead of the weighted mean.

**CenteredClip** (Karimireddy, He and Jaggi, ICML 2021; per all-reduce partition as BTARD, Gorbunov
et al., ICML 2022, does):

    v_0 = the coordinate-wise median of the members' shares (members of weight 0 left out),
    τ = CLIP_SCALE × the median over members of ‖x_i − v_0‖,
    v_{l+1} = v_l + Σ_i w_i (x_i − v_l) min(1, τ / ‖x_i − v_l‖) / Σ_i w_i,   l < ITERATIONS,

``w_i`` the member's weight (its micro-batches of the step). Every member receives the reducer's
bytes, so the replicas still end the step equal.

**The bound.** Whatever a dishonest member b sends, its term of each iteration's step has norm at
most w_b τ / Σ w, so over the iterations the dishonest members add at most ITERATIONS × ω × τ to
the part (ω: their weight share); v_0 is a coordinate-wise median, which a minority moves only
within the honest members' range, and τ is set by the median distance, which a minority cannot
make large. With 3 replicas and one dishonest (ω = 1/3 at equal weights) a share scaled by −10, a
sign flip or noise of any norm adds at most 5 × 1/3 × τ = 3.3 × (the median member's distance
from v_0) to each part: of the order of the honest members' spread, not of the attack's size.
**Honest members.** When every member lies within τ of every iterate, no share is clipped and the
result is the weighted mean to floating-point rounding (the first iteration from v_0 reaches it);
a member beyond τ (an honest outlier of sampling) pulls less than its weight. With fewer than 3
members of positive weight a median is no defence: the weighted mean is returned.

**Trimmed mean** (coordinate-wise; Yin et al., ICML 2018): of the members of positive weight, each
coordinate's largest and smallest values are dropped and the rest averaged (each share is already
scaled to the whole batch, so they count alike). **The bound.** With one dishonest member, every
coordinate of the result lies between the smallest and the largest honest value of that
coordinate, whatever it sends: it can pick where in the honest members' range each coordinate
falls, not leave it. With 3 replicas that is the coordinate-wise median. **Honest members.** It
is not their mean: each coordinate drops two honest values, so the result moves by up to the
honest spread (the price of the bound). Fewer than 3 members of positive weight: the weighted mean.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["centered_clip", "trimmed_mean", "AGGREGATES", "CLIP_SCALE", "ITERATIONS"]

CLIP_SCALE = 2.0
"""τ in units of the members' median distance from the coordinate-wise median."""
ITERATIONS = 5
"""CenteredClip iterations per part."""


def centered_clip(shares: Sequence[torch.Tensor], weights: Sequence[float]) -> torch.Tensor:
    """The robust aggregate of ``shares`` (one part, one tensor per member) weighted by ``weights``
    (module docstring), in fp32, deterministic for the same inputs in the same order."""
    kept = [(x.float(), float(w)) for x, w in zip(shares, weights, strict=True) if w > 0]
    if not kept:
        return torch.zeros_like(shares[0], dtype=torch.float32)
    xs = torch.stack([x for x, _ in kept])
    ws = torch.tensor([w for _, w in kept], dtype=torch.float32)
    total = ws.sum()
    shape = [-1] + [1] * (xs.dim() - 1)
    mean = (xs * ws.view(shape)).sum(0) / total
    if len(kept) < 3:
        return mean
    v = xs.median(dim=0).values
    dist = (xs - v).flatten(1).norm(dim=1)
    tau = CLIP_SCALE * float(dist.median())
    if tau == 0.0:  # a majority equal to the median: it is the aggregate
        return v
    for _ in range(ITERATIONS):
        diff = xs - v
        norms = diff.flatten(1).norm(dim=1)
        scale = torch.clamp(tau / torch.clamp(norms, min=1e-30), max=1.0)
        v = v + (diff * (ws * scale).view(shape)).sum(0) / total
    return v


def trimmed_mean(shares: Sequence[torch.Tensor], weights: Sequence[float]) -> torch.Tensor:
    """The coordinate-wise trimmed mean of ``shares`` of positive ``weights`` (module docstring), in
    fp32, deterministic for the same inputs."""
    kept = [x.float() for x, w in zip(shares, weights, strict=True) if w > 0]
    if not kept:
        return torch.zeros_like(shares[0], dtype=torch.float32)
    if len(kept) < 3:
        ws = [float(w) for w in weights if w > 0]
        return sum(x * (w / sum(ws)) for x, w in zip(kept, ws))
    xs = torch.stack(kept).sort(dim=0).values
    return xs[1:-1].mean(dim=0)


AGGREGATES = {"centered_clip": centered_clip, "trimmed_mean": trimmed_mean}
"""``replicas.aggregation`` -> the function a reducer returns of its part's shares (``"mean"``: hivemind's own)."""
