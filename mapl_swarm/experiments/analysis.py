"""End-of-run analysis of a trained in-process pipeline (MAPL paper Fig. 3 and Fig. 4).

:func:`analyze_pipeline` runs held-out micro-batches forward with every stage's probe recording,
then per boundary b computes, on the residual the projector sees (``R = X − anchor_send``):

- the cumulative singular-value energy of R (Fig. 3) and the ranks holding 90 / 99 % of it; for the
  uncompressed codec (no anchor on later stages) the paper's centring ``X − E[ids]`` with stage 0's
  token embedding is used instead, and ``residual`` says which;
- the energy a projector captures, ``‖R A‖² / ‖R‖²``, and its orthonormality error;
- token-pair cosine similarity before vs after projection and its Pearson r (Fig. 4c);

and across boundaries the pairwise mean principal angles between projectors (Fig. 4a) plus each
projector's angle to its random initialisation. Everything returned is plain JSON data.
"""

from __future__ import annotations

import torch

from mapl_swarm.config.catalog import codec_info
from mapl_swarm.metrics import health
from mapl_swarm.compress.stiefel import random_stiefel
from mapl_swarm.rng import generator

__all__ = ["analyze_pipeline", "link_bytes"]


def _round(values, digits: int = 5) -> list[float]:
    return [round(float(v), digits) for v in values]


def link_bytes(pipe, tokens: int) -> list[dict[str, float]]:
    """Measured payload bytes per trained token of every boundary, per message kind."""
    tokens = max(tokens, 1)
    return [{kind: n / tokens for kind, n in sorted(link.bytes.items())} for link in pipe.links]


@torch.no_grad()
def analyze_pipeline(pipe, val_batches: list[torch.Tensor], *, max_tokens: int = 4096,
                     num_pairs: int = 500, seed: int = 0) -> dict:
    """Diagnostics of a trained :class:`~mapl_swarm.pipeline.inprocess.InProcessPipeline`."""
    cfg = pipe.cfg
    codec = codec_info(cfg.compression.codec)
    d = cfg.model.hidden_size
    tokens_per_batch = val_batches[0][:, :-1].numel() if val_batches else 1
    n_batches = max(1, min(len(val_batches), -(-max_tokens // tokens_per_batch)))
    for st in pipe.stages:
        st.probe.record_all, st.probe.records = True, []
    try:
        pipe.evaluate(val_batches[:n_batches])
        boundaries, projectors = [], []
        for b, st in enumerate(pipe.stages[:-1]):
            caps = st.probe.records
            x = torch.cat([c.x.float() for c in caps]).reshape(-1, d)  # (N, d)
            ids = torch.cat([c.ids for c in caps]).reshape(-1)  # (N,)
            if codec.uncompressed:  # no anchors: the paper's centring X - E[ids]
                res = x - pipe.stages[0].model.embed(ids.to(st.device)).float().reshape(-1, d)
                kind = "X − E[ids]"
            elif caps[0].offset is not None:
                res = x - torch.cat([c.offset.float() for c in caps]).reshape(-1, d)
                kind = "X − anchor"
            else:
                res, kind = x, "X"
            cum = health.cumulative_energy(res)
            info = {"boundary": b, "residual": kind, "tokens": int(res.shape[0]),
                    "cumulative_energy": _round(cum), "rank90": health.rank_for_energy(cum, 0.90),
                    "rank99": health.rank_for_energy(cum, 0.99)}
            a = st.outbound.projector if st.outbound is not None else None
            if a is not None:
                a = a.detach().float()
                projectors.append(a)
                before, after, r = health.cosine_pairs(res, a, num_pairs=num_pairs, seed=seed + b)
                info.update(energy_captured=health.energy_captured(res, a),
                            orth_error=health.orthonormality_error(a),
                            cos_before=_round(before, 4), cos_after=_round(after, 4), cos_pearson=r)
                if codec.anchored:  # a projector of its own per boundary, seeded (run seed, "projector", b)
                    init = random_stiefel(d, a.shape[1], generator(cfg.run.seed, "projector", b))
                    info["angle_from_init"] = health.mean_principal_angle(a, init.to(a.device))
            boundaries.append(info)
    finally:
        for st in pipe.stages:
            st.probe.record_all, st.probe.records = False, []
    angles = health.pairwise_mean_angles(projectors) if len(projectors) > 1 else []
    out = {"boundaries": boundaries, "projector_angles": [_round(row, 3) for row in angles]}
    if projectors:  # reference: two independent random subspaces of the same rank
        r = projectors[0].shape[1]
        out["random_pair_angle"] = health.mean_principal_angle(
            random_stiefel(d, r, generator(seed, "analysis", 0)), random_stiefel(d, r, generator(seed, "analysis", 1)))
    return out
