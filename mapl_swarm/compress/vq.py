"""Residual vector quantization math for MAPL+VQ (SPEC §5.1): encoder, decoder, k-means, EMA.

A stream's codebooks are one fp32 tensor ``C`` of shape ``(R, r/G, K, G)``: R residual rounds,
r/G groups of G coordinates, K codes. A token's r-vector is split into its r/G groups; round k
quantizes, per group, what rounds < k left, so the codes of one token are ``(R, r/G)`` integers
(one byte each for K <= 256: r bytes per token at G = 2, R = 2).

Everything here is vectorised over groups and codes (batched matmuls, gathers and ``index_add_``);
the only Python loops run over the R rounds, the k-means iterations and token chunks. The encoder
finds the nearest code with ``argmin_c ||c||^2 - 2 x.c`` (``||x||^2`` is the same for every code)
as one ``baddbmm`` per chunk, so its distance tensor never exceeds ``max_distance_bytes``.
With ``fused`` (config ``compression.vq.compile``) the same formula, written pointwise, goes through
``torch.compile``, which fuses distances and argmin into one kernel that never materialises the
distances (C++/OpenMP on CPU, Triton on CUDA; speed: BENCHMARKS.md, "VQ encoder speed").
Device-agnostic: the same code runs on CPU and CUDA; a compile failure falls back to the eager path
with a warning.

Learning (:class:`EmaKMeans`): k-means initialisation (Lloyd) on the first micro-batch(es), then
EMA k-means — per code, EMA of its usage share and of the sum of the vectors assigned to it, the
code being their ratio — and **dead-code replacement**: a code whose EMA usage share falls below
``dead_code_ratio / K`` is replaced by a random vector of the current micro-batch and its share
reset to ``1 / K`` (uniform), so it cannot die again before the replacement reached the receiver.
"""

from __future__ import annotations

import logging

import torch

from mapl_swarm.config import VQConfig

__all__ = [
    "torch_code_dtype",
    "to_groups",
    "nearest_codes",
    "lookup",
    "quantize",
    "decode_codes",
    "kmeans",
    "EmaKMeans",
]

log = logging.getLogger(__name__)

_TORCH_CODE_DTYPES = {"uint8": torch.uint8, "uint16": torch.uint16}


def torch_code_dtype(s: VQConfig) -> torch.dtype:
    """The torch dtype of codes: uint8 for K <= 256, else uint16."""
    return _TORCH_CODE_DTYPES[s.code_dtype]


def to_groups(z: torch.Tensor, group_size: int) -> torch.Tensor:
    """(..., r) -> (N, r/G, G) float32."""
    r = z.shape[-1]
    return z.reshape(-1, r // group_size, group_size).float()


def _fused_argmin(xt: torch.Tensor, codebook: torch.Tensor) -> torch.Tensor:
    """(NG, n, G), (NG, K, G) -> (NG, n): ``argmin ||c||^2 - 2 x.c`` written pointwise (the loop
    unrolls the G coordinates at trace time) so that torch.compile fuses it with the argmin."""
    d = (codebook * codebook).sum(-1)[:, None, :]  # (NG, 1, K)
    for j in range(codebook.shape[-1]):
        d = d - 2.0 * xt[:, :, j, None] * codebook[:, None, :, j]  # (NG, n, K), fused, never stored
    return d.argmin(-1)


_compiled_argmin = None
_compile_failed = False


def _fused(xt: torch.Tensor, codebook: torch.Tensor) -> torch.Tensor | None:
    """The compiled fused search, or None once compiling failed (eager fallback)."""
    global _compiled_argmin, _compile_failed
    if _compile_failed:
        return None
    try:
        if _compiled_argmin is None:
            _compiled_argmin = torch.compile(_fused_argmin, dynamic=True)
        return _compiled_argmin(xt, codebook)
    except Exception as exc:  # no compiler, unsupported backend...: stay correct, only slower
        _compile_failed = True
        log.warning("vq: torch.compile of the fused nearest-code search failed (%s: %s); using the eager "
                    "path", type(exc).__name__, exc)
        return None


def nearest_codes(x: torch.Tensor, codebook: torch.Tensor, max_distance_bytes: int, *,
                  fused: bool = False) -> torch.Tensor:
    """Index of the nearest code per token and group: x (N, NG, G), codebook (NG, K, G) -> (N, NG).

    One ``baddbmm`` per chunk of tokens computes ``||c||^2 - 2 x.c`` for every group at once; the
    chunk keeps the (NG, chunk, K) fp32 distance tensor under ``max_distance_bytes``. With
    ``fused`` a compiled kernel computes distances and argmin without storing the distances.
    """
    N, NG, G = x.shape
    K = codebook.shape[1]
    cb_t = codebook.transpose(1, 2)  # (NG, G, K)
    c2 = (codebook * codebook).sum(-1).unsqueeze(1)  # (NG, 1, K)
    xt = x.transpose(0, 1).contiguous()  # (NG, N, G)
    chunk = max(1, max_distance_bytes // (NG * K * 4))
    out = torch.empty(NG, N, dtype=torch.long, device=x.device)
    for i in range(0, N, chunk):
        idx = _fused(xt[:, i:i + chunk], codebook) if fused else None
        if idx is None:
            idx = torch.baddbmm(c2, xt[:, i:i + chunk], cb_t, alpha=-2.0).argmin(-1)  # (NG, n, K) -> (NG, n)
        out[:, i:i + chunk] = idx
    return out.T  # (N, NG)


def lookup(codebook: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """codebook (NG, K, G), idx (N, NG) -> (N, NG, G)."""
    NG, K, G = codebook.shape
    flat = idx + torch.arange(NG, device=idx.device) * K  # (N, NG) rows of the (NG*K, G) table
    return codebook.reshape(NG * K, G).index_select(0, flat.reshape(-1)).view(*idx.shape, G)


def quantize(x: torch.Tensor, codebooks: torch.Tensor, max_distance_bytes: int, *, fused: bool = False
             ) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Greedy residual quantization of x (N, NG, G) with codebooks (R, NG, K, G).

    Returns codes (N, R, NG) long and the R + 1 residuals: the input of each round, then what is
    left after the last round.
    """
    residuals = [x]
    codes = []
    for k in range(codebooks.shape[0]):
        idx = nearest_codes(residuals[-1], codebooks[k], max_distance_bytes, fused=fused)
        codes.append(idx)
        residuals.append(residuals[-1] - lookup(codebooks[k], idx))
    return torch.stack(codes, 1), residuals


def decode_codes(codes: torch.Tensor, codebooks: torch.Tensor) -> torch.Tensor:
    """SPEC §5.1 decoding: codes (..., R, NG) -> (..., NG*G) fp32, rounds summed in order."""
    R, NG, K, G = codebooks.shape
    lead = codes.shape[:-2]
    c = codes.reshape(-1, R, NG).long()
    offs = (torch.arange(R, device=c.device)[:, None] * NG + torch.arange(NG, device=c.device)) * K
    v = codebooks.reshape(R * NG * K, G).index_select(0, (c + offs).reshape(-1)).view(-1, R, NG, G)
    out = v[:, 0]
    for k in range(1, R):
        out = out + v[:, k]
    return out.reshape(*lead, NG * G)


def _stats(x: torch.Tensor, idx: torch.Tensor, K: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per group and code: hit count (NG, K) and sum of assigned vectors (NG, K, G)."""
    N, NG, G = x.shape
    flat = (idx + torch.arange(NG, device=x.device) * K).reshape(-1)  # (N*NG,)
    counts = torch.zeros(NG * K, device=x.device).index_add_(0, flat, torch.ones_like(flat, dtype=torch.float32))
    sums = torch.zeros(NG * K, G, device=x.device).index_add_(0, flat, x.reshape(-1, G))
    return counts.view(NG, K), sums.view(NG, K, G)


def _random_points(x: torch.Tensor, K: int, gen: torch.Generator) -> torch.Tensor:
    """K random vectors of x per group: (NG, K, G); always draws NG*K indices (deterministic)."""
    N, NG, G = x.shape
    pick = torch.randint(0, N, (NG, K), generator=gen).to(x.device)  # (NG, K)
    return x[pick, torch.arange(NG, device=x.device)[:, None]]  # (NG, K, G)


def kmeans(x: torch.Tensor, K: int, iters: int, gen: torch.Generator, max_distance_bytes: int,
           init: torch.Tensor | None = None, *, fused: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Lloyd's k-means per group on x (N, NG, G): centroids (NG, K, G) and usage shares (NG, K).

    Starts from ``init`` or random points; an empty cluster is re-seeded with a random point."""
    c = _random_points(x, K, gen) if init is None else init.clone()
    N = x.shape[0]
    counts = torch.zeros(x.shape[1], K, device=x.device)
    for _ in range(iters):
        idx = nearest_codes(x, c, max_distance_bytes, fused=fused)
        counts, sums = _stats(x, idx, K)
        reseed = _random_points(x, K, gen)
        c = torch.where(counts[..., None] > 0, sums / counts.clamp_min(1)[..., None], reseed)
    return c, counts / N


class EmaKMeans:
    """The sender's learned codebooks ``live`` (R, NG, K, G) and their EMA statistics."""

    def __init__(self, s: VQConfig, device: torch.device) -> None:
        self.s = s
        R, NG, K, G = s.layout.shape
        self.live = torch.zeros(R, NG, K, G, device=device)
        self.share = torch.zeros(R, NG, K, device=device)
        """EMA of each code's share of the tokens."""
        self.sums = torch.zeros(R, NG, K, G, device=device)
        """EMA of the per-token sum of the vectors assigned to each code (live = sums / share)."""
        self.dead_replaced = 0
        """Codes replaced so far (dead-code replacement)."""

    def init_round(self, k: int, x: torch.Tensor, gen: torch.Generator) -> None:
        """k-means-initialise round ``k`` on its inputs x (N, NG, G) (warm start after the first)."""
        warm = self.live[k] if bool(self.share[k].sum() > 0) else None
        c, share = kmeans(x, self.s.codebook_size, self.s.kmeans_iters, gen, self.s.max_distance_bytes, warm,
                          fused=self.s.compile)
        self.live[k] = c
        self.share[k] = share
        self.sums[k] = c * share[..., None]

    def update_round(self, k: int, x: torch.Tensor, idx: torch.Tensor, gen: torch.Generator) -> int:
        """EMA step of round ``k`` with inputs x (N, NG, G) assigned to codes idx (N, NG); returns
        the number of dead codes replaced."""
        K, d = self.s.codebook_size, self.s.ema_decay
        counts, sums = _stats(x, idx, K)
        n = float(x.shape[0])
        self.share[k].mul_(d).add_(counts / n, alpha=1 - d)
        self.sums[k].mul_(d).add_(sums / n, alpha=1 - d)
        alive = self.share[k] > 1e-20
        self.live[k] = torch.where(alive[..., None], self.sums[k] / self.share[k].clamp_min(1e-20)[..., None],
                                   self.live[k])
        if self.s.dead_code_ratio <= 0:
            return 0
        cand = _random_points(x, K, gen)  # (NG, K, G), drawn every step: deterministic stream
        dead = self.share[k] < self.s.dead_code_ratio / K  # (NG, K)
        self.live[k] = torch.where(dead[..., None], cand, self.live[k])
        self.share[k] = torch.where(dead, torch.full_like(self.share[k], 1.0 / K), self.share[k])
        self.sums[k] = torch.where(dead[..., None], cand / K, self.sums[k])
        n_dead = int(dead.sum())
        self.dead_replaced += n_dead
        return n_dead

    def usage_perplexity(self) -> float:
        """exp(entropy) of the round-0 usage shares, averaged over groups (K = all codes used)."""
        p = self.share[0] / self.share[0].sum(-1, keepdim=True).clamp_min(1e-20)
        ent = -(p * p.clamp_min(1e-20).log()).sum(-1)
        return float(ent.exp().mean())

    def state_dict(self) -> dict:
        return {"live": self.live.clone(), "share": self.share.clone(), "sums": self.sums.clone(),
                "dead_replaced": self.dead_replaced}

    def load_state_dict(self, st: dict) -> None:
        for name in ("live", "share", "sums"):
            getattr(self, name).copy_(st[name])
        self.dead_replaced = int(st["dead_replaced"])
