"""Residual vector quantization math for MAPL+VQ (SPEC §5.1): encoder, decoder, k-means, EMA.

A stream's codebooks are one fp32 tensor ``C`` of shape ``(R, r/G, K, G)``: R residual rounds,
r/G groups of G coordinates, K codes. A token's r-vector is split into its r/G groups; round k
quantizes, per group, what rounds < k left, so the codes of one token are ``(R, r/G)`` integers
(one byte each for K <= 256: r bytes per token at G = 2, R = 2).

Everything here is vectorised over groups and codes (batched matmuls, gathers and ``index_add_``);
the only Python loops run over the R rounds, the k-means iterations and token chunks. The encoder
finds the nearest code with ``argmin_c ||c||^2 - 2 x.c`` (``||x||^2`` is the same for every code)
as one ``baddbmm`` per chunk, so its distance tensor never exceeds a byte budget sized by the
device (:func:`distance_budget_bytes`: a fraction of free memory on CUDA, a cache-sized chunk on
CPU; ``compression.vq.max_distance_mib`` overrides it). With ``fused`` (config ``compression.vq.compile``) the same formula,
written pointwise, goes through ``torch.compile``, which fuses distances and argmin into one kernel
that never materialises the distances, so it runs unchunked (C++/OpenMP on CPU: ~3x faster than
eager here; Triton on CUDA). :func:`warm_up_fused_search` compiles it ahead of the first encode.
Device-agnostic: the same code runs on CPU and CUDA; a compile failure (a named dynamo/inductor
error, nothing broader) falls back to the eager path with one warning giving the cause.

No host syncs in the steady state: statistics stay on the device; random draws use a generator on
the tensors' device; only the k-means initialisation (first micro-batches) reads values.

Learning (:class:`EmaKMeans`): k-means initialisation (Lloyd) on the first micro-batch(es), then
EMA k-means — per code, EMA of its usage share and of the sum of the vectors assigned to it, the
code being their ratio — and **dead-code replacement**: a code whose EMA usage share falls below
``dead_code_ratio / K`` is replaced by a random vector of the current micro-batch and its share
reset to ``1 / K`` (uniform), so it cannot die again before the replacement reached the receiver.
"""

from __future__ import annotations

import importlib
import logging

import torch

from mapl_swarm.config import VQConfig

__all__ = [
    "torch_code_dtype",
    "distance_budget_bytes",
    "chunk_tokens",
    "fused_search_disabled_reason",
    "warm_up_fused_search",
    "to_groups",
    "nearest_codes",
    "lookup",
    "quantize",
    "decode_codes",
    "kmeans",
    "kmeans_rounds",
    "code_stats",
    "random_points",
    "EmaKMeans",
    "device_generator",
]

log = logging.getLogger(__name__)

_TORCH_CODE_DTYPES = {"uint8": torch.uint8, "uint16": torch.uint16}

_MIB = 1 << 20
CPU_DISTANCE_BYTES = 8 * _MIB
"""CPU budget of one chunk's (NG, chunk, K) fp32 distance tensor: cache-sized, and large enough that
per-chunk overhead does not dominate. Source: BENCHMARKS.md, "VQ encoder speed" (larger budgets
were no faster for the whole encode on the CPU measured there)."""
CUDA_FREE_FRACTION = 0.25
"""CUDA: share of the memory available to this process (driver-free plus the caching allocator's
reserved-but-unused) one chunk may take."""
CUDA_DISTANCE_CAP_BYTES = 1 << 30
"""CUDA: at most 1 GiB per chunk: the whole 150M-preset search (8192 x 128 x 256 x 4 B) at once."""
CUDA_DISTANCE_MIN_BYTES = 8 * _MIB
"""CUDA: at least 8 MiB per chunk, however full the device."""


def _pow2_floor(n: int) -> int:
    return 1 << (max(1, int(n)).bit_length() - 1)


def distance_budget_bytes(device: torch.device | str, *, override_mib: float = 0.0,
                          free_bytes: int | None = None) -> int:
    """Bytes one chunk's (NG, chunk, K) fp32 distance tensor of the eager search may take.

    ``override_mib`` > 0 (config ``compression.vq.max_distance_mib``) wins. Otherwise on CUDA (or whenever
    ``free_bytes`` is given, for tests) :data:`CUDA_FREE_FRACTION` of the available memory, within
    [:data:`CUDA_DISTANCE_MIN_BYTES`, :data:`CUDA_DISTANCE_CAP_BYTES`] and rounded down to a power of
    two (so that a stage alone on its host and the same stage in a shared process chunk alike);
    on every other device :data:`CPU_DISTANCE_BYTES`. Calls ``torch.cuda.mem_get_info`` (no sync)."""
    if override_mib > 0:
        return max(1, int(override_mib * _MIB))
    device = torch.device(device)
    if free_bytes is None and device.type == "cuda":
        free_bytes = torch.cuda.mem_get_info(device)[0]
        free_bytes += torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    if free_bytes is None:
        return CPU_DISTANCE_BYTES
    share = int(free_bytes * CUDA_FREE_FRACTION)
    return _pow2_floor(min(max(share, CUDA_DISTANCE_MIN_BYTES), CUDA_DISTANCE_CAP_BYTES))


def chunk_tokens(budget_bytes: int, groups: int, codebook_size: int) -> int:
    """Tokens per chunk of the eager search: the (groups, chunk, K) fp32 distances within budget."""
    return max(1, budget_bytes // (groups * codebook_size * 4))


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


class _FusedSearch:
    """The process-wide compiled search: compiled once (lazily or by :func:`warm_up_fused_search`),
    or off for good, with the reason, after a named compile failure."""

    def __init__(self) -> None:
        self.fn = None
        self.disabled: str | None = None

    @staticmethod
    def _errors() -> tuple[type[BaseException], ...]:
        """What a failing torch.compile raises: dynamo's backend failure (inductor's InductorError
        is one) and unsupported-construct errors; inductor's compiler, missing-compiler and
        missing/too-old-Triton errors; Triton's kernel compilation errors (raised at the first call).
        Nothing else: any other exception is a bug and propagates."""
        from torch._dynamo import exc as dynamo_exc
        from torch._inductor import exc as inductor_exc

        errors: list[type[BaseException]] = [dynamo_exc.BackendCompilerFailed, dynamo_exc.Unsupported,
                                             dynamo_exc.InternalTorchDynamoError]
        errors += [getattr(inductor_exc, n) for n in ("InductorError", "CppCompileError", "CUDACompileError",
                                                      "InvalidCxxCompiler", "TritonMissing", "GPUTooOldForTriton")
                   if hasattr(inductor_exc, n)]
        for module, name in (("triton.compiler.errors", "CompilationError"), ("triton.runtime.errors", "OutOfResources")):
            try:
                errors.append(getattr(importlib.import_module(module), name))
            except (ImportError, AttributeError):  # no Triton (CPU builds), or another layout of it
                pass
        return tuple(errors)

    def _disable(self, reason: str) -> None:
        self.disabled = reason
        log.warning("vq: fused nearest-code search off, using the eager chunked path: %s", reason)

    def __call__(self, xt: torch.Tensor, codebook: torch.Tensor) -> torch.Tensor | None:
        if self.disabled is not None:
            return None
        if self.fn is None:
            import torch._dynamo

            if not torch._dynamo.is_dynamo_supported():
                self._disable("torch.compile is not supported on this Python/platform")
                return None
            self.fn = torch.compile(_fused_argmin, dynamic=True)
        try:
            return self.fn(xt, codebook)
        except self._errors() as exc:  # no compiler, no Triton, unsupported backend: correct, only slower
            cause = " ".join(str(exc).split())  # one line; compiler logs can be long
            self._disable(f"torch.compile failed: {type(exc).__name__}: {cause[:1000]}")
            return None


_FUSED = _FusedSearch()


def _fused(xt: torch.Tensor, codebook: torch.Tensor) -> torch.Tensor | None:
    """The compiled fused search (NG, N, G), (NG, K, G) -> (NG, N), or None when it is off."""
    return _FUSED(xt, codebook)


def fused_search_disabled_reason() -> str | None:
    """Why the fused search is off in this process (None: it is not, or was never tried)."""
    return _FUSED.disabled


def warm_up_fused_search(tokens: int, groups: int, codebook_size: int, group_size: int,
                         device: torch.device | str) -> bool:
    """Compile the fused search now, on dummy data of the real shapes (``tokens`` per encode), so
    that the first encode does not compile (~1 min, holding the interpreter lock). Returns whether
    the fused search is on. Synchronises the device (warm-up is not the hot path)."""
    xt = torch.zeros(groups, max(2, tokens), group_size, device=device)
    cb = torch.zeros(groups, codebook_size, group_size, device=device)
    with torch.no_grad():
        ok = _fused(xt, cb) is not None
    if ok and torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)
    return ok


def nearest_codes(x: torch.Tensor, codebook: torch.Tensor, max_distance_bytes: int | None = None, *,
                  fused: bool = False) -> torch.Tensor:
    """Index of the nearest code per token and group: x (N, NG, G), codebook (NG, K, G) -> (N, NG).

    One ``baddbmm`` per chunk of tokens computes ``||c||^2 - 2 x.c`` for every group at once; the
    chunk keeps the (NG, chunk, K) fp32 distance tensor under ``max_distance_bytes`` (None: the
    device's budget, :func:`distance_budget_bytes`). With ``fused`` a compiled kernel computes
    distances and argmin of all tokens at once without storing the distances (no chunks).
    """
    N, NG, G = x.shape
    K = codebook.shape[1]
    xt = x.transpose(0, 1).contiguous()  # (NG, N, G)
    if fused:
        idx = _fused(xt, codebook)
        if idx is not None:
            return idx.T  # (N, NG)
    if max_distance_bytes is None:
        max_distance_bytes = distance_budget_bytes(x.device)
    cb_t = codebook.transpose(1, 2)  # (NG, G, K)
    c2 = (codebook * codebook).sum(-1).unsqueeze(1)  # (NG, 1, K)
    chunk = chunk_tokens(max_distance_bytes, NG, K)
    out = torch.empty(NG, N, dtype=torch.long, device=x.device)
    for i in range(0, N, chunk):
        # (NG, n, G) @ (NG, G, K) -> (NG, n, K) distances -> (NG, n) nearest
        out[:, i:i + chunk] = torch.baddbmm(c2, xt[:, i:i + chunk], cb_t, alpha=-2.0).argmin(-1)
    return out.T  # (N, NG)


def lookup(codebook: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """codebook (NG, K, G), idx (N, NG) -> (N, NG, G)."""
    NG, K, G = codebook.shape
    flat = idx + torch.arange(NG, device=idx.device) * K  # (N, NG) rows of the (NG*K, G) table
    return codebook.reshape(NG * K, G).index_select(0, flat.reshape(-1)).view(*idx.shape, G)


def quantize(x: torch.Tensor, codebooks: torch.Tensor, max_distance_bytes: int | None = None, *,
             fused: bool = False) -> tuple[torch.Tensor, list[torch.Tensor]]:
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


def code_stats(x: torch.Tensor, idx: torch.Tensor, K: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per group and code: hit count (NG, K) and sum of assigned vectors (NG, K, G)."""
    N, NG, G = x.shape
    flat = (idx + torch.arange(NG, device=x.device) * K).reshape(-1)  # (N*NG,)
    counts = torch.zeros(NG * K, device=x.device).index_add_(0, flat, torch.ones_like(flat, dtype=torch.float32))
    sums = torch.zeros(NG * K, G, device=x.device).index_add_(0, flat, x.reshape(-1, G))
    return counts.view(NG, K), sums.view(NG, K, G)


def random_points(x: torch.Tensor, K: int, gen: torch.Generator) -> torch.Tensor:
    """K random vectors of x per group: (NG, K, G); always draws NG*K indices (deterministic).

    The indices are drawn on ``gen``'s device: give a generator on x's device (the sender does:
    :func:`device_generator`) and nothing crosses to the host; a CPU generator with device data
    costs a (non-blocking) host-to-device copy."""
    N, NG, G = x.shape
    pick = torch.randint(0, N, (NG, K), generator=gen, device=gen.device)  # (NG, K)
    if pick.device != x.device:
        pick = pick.to(x.device, non_blocking=True)
    return x[pick, torch.arange(NG, device=x.device)[:, None]]  # (NG, K, G)


def device_generator(gen: torch.Generator, device: torch.device | str) -> torch.Generator:
    """The generator to draw with on ``device``: ``gen`` itself on its own device (CPU: the keyed
    CPU stream, unchanged numbers), else a generator on ``device`` seeded with ``gen``'s seed (the
    same keyed seed, so a stage alone on its host draws what it draws in a shared process)."""
    device = torch.device(device)
    if gen.device.type == device.type and device.index in (None, gen.device.index):
        return gen
    dev_gen = torch.Generator(device=device)
    dev_gen.manual_seed(gen.initial_seed())
    return dev_gen


def kmeans(x: torch.Tensor, K: int, iters: int, gen: torch.Generator, max_distance_bytes: int | None = None,
           init: torch.Tensor | None = None, *, fused: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Lloyd's k-means per group on x (N, NG, G): centroids (NG, K, G) and usage shares (NG, K).

    Starts from ``init`` or random points; an empty cluster is re-seeded with a random point."""
    c = random_points(x, K, gen) if init is None else init.clone()
    N = x.shape[0]
    counts = torch.zeros(x.shape[1], K, device=x.device)
    for _ in range(iters):
        idx = nearest_codes(x, c, max_distance_bytes, fused=fused)
        counts, sums = code_stats(x, idx, K)
        reseed = random_points(x, K, gen)
        c = torch.where(counts[..., None] > 0, sums / counts.clamp_min(1)[..., None], reseed)
    return c, counts / N


def kmeans_rounds(x: torch.Tensor, rounds: int, K: int, iters: int, gen: torch.Generator,
                  max_distance_bytes: int | None = None, *, fused: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Residual k-means of x (N, NG, G): round k's codebooks (k-means of what rounds < k left),
    (rounds, NG, K, G), and their usage shares (rounds, NG, K); the initialisation of ``update =
    step`` codebooks (the same k-means as :meth:`EmaKMeans.init_round` from scratch)."""
    books, shares = [], []
    for _ in range(rounds):
        c, share = kmeans(x, K, iters, gen, max_distance_bytes, fused=fused)
        books.append(c)
        shares.append(share)
        x = x - lookup(c, nearest_codes(x, c, max_distance_bytes, fused=fused))
    return torch.stack(books), torch.stack(shares)


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
        self.dead_total = torch.zeros((), dtype=torch.long, device=device)
        """Codes replaced so far (dead-code replacement), kept on the device: read it per step."""

    @property
    def dead_replaced(self) -> int:
        """Codes replaced so far (reads the device counter: a host sync)."""
        return int(self.dead_total)

    def init_round(self, k: int, x: torch.Tensor, gen: torch.Generator, max_distance_bytes: int | None = None
                   ) -> None:
        """k-means-initialise round ``k`` on its inputs x (N, NG, G) (warm start after the first).
        Reads a value (one host sync): initialisation runs on the first micro-batches only."""
        warm = self.live[k] if bool(self.share[k].sum() > 0) else None
        c, share = kmeans(x, self.s.codebook_size, self.s.kmeans_iters, gen, max_distance_bytes, warm,
                          fused=self.s.compile)
        self.live[k] = c
        self.share[k] = share
        self.sums[k] = c * share[..., None]

    def update_round(self, k: int, x: torch.Tensor, idx: torch.Tensor, gen: torch.Generator) -> None:
        """EMA step of round ``k`` with inputs x (N, NG, G) assigned to codes idx (N, NG), with
        dead-code replacement; no host sync (the count of replaced codes adds to :attr:`dead_total`)."""
        K, d = self.s.codebook_size, self.s.ema_decay
        counts, sums = code_stats(x, idx, K)
        n = float(x.shape[0])
        self.share[k].mul_(d).add_(counts / n, alpha=1 - d)
        self.sums[k].mul_(d).add_(sums / n, alpha=1 - d)
        alive = self.share[k] > 1e-20
        self.live[k] = torch.where(alive[..., None], self.sums[k] / self.share[k].clamp_min(1e-20)[..., None],
                                   self.live[k])
        if self.s.dead_code_ratio <= 0:
            return
        # candidates for every code, drawn every step whoever is dead: a fixed-size draw keeps the
        # random stream independent of the data (deterministic) and needs no count on the host
        cand = random_points(x, K, gen)  # (NG, K, G)
        dead = self.share[k] < self.s.dead_code_ratio / K  # (NG, K)
        self.live[k] = torch.where(dead[..., None], cand, self.live[k])
        self.share[k] = torch.where(dead, torch.full_like(self.share[k], 1.0 / K), self.share[k])
        self.sums[k] = torch.where(dead[..., None], cand / K, self.sums[k])
        self.dead_total += dead.sum()

    def start(self, codebooks: torch.Tensor, share: torch.Tensor) -> None:
        """Take ``codebooks`` (R, NG, K, G) as the learned codes at usage ``share`` (R, NG, K)
        (``update = step``: the k-means initialisation; an unused code is dead at the next update)."""
        self.live.copy_(codebooks)
        self.share.copy_(share)
        self.sums.copy_(codebooks * share[..., None])

    def update_step(self, share: torch.Tensor, sums: torch.Tensor, candidates: torch.Tensor, decay: float) -> None:
        """One EMA step of every round from a whole step's statistics (``update = step``): ``share``
        (R, NG, K) and ``sums`` (R, NG, K, G) are the step's per-token means (usage share and sum of
        the assigned vectors), ``candidates`` (R, NG, K, G) replace the codes that are then dead (as
        :meth:`update_round` does per micro-batch). No host sync."""
        K = self.s.codebook_size
        self.share.mul_(decay).add_(share, alpha=1 - decay)
        self.sums.mul_(decay).add_(sums, alpha=1 - decay)
        alive = self.share > 1e-20
        self.live.copy_(torch.where(alive[..., None], self.sums / self.share.clamp_min(1e-20)[..., None], self.live))
        if self.s.dead_code_ratio <= 0:
            return
        dead = self.share < self.s.dead_code_ratio / K  # (R, NG, K)
        self.live.copy_(torch.where(dead[..., None], candidates, self.live))
        self.share.copy_(torch.where(dead, torch.full_like(self.share, 1.0 / K), self.share))
        self.sums.copy_(torch.where(dead[..., None], candidates / K, self.sums))
        self.dead_total += dead.sum()

    def usage_perplexity_tensor(self) -> torch.Tensor:
        """exp(entropy) of the round-0 usage shares, averaged over groups (K = all codes used): a
        0-dim device tensor (no sync)."""
        p = self.share[0] / self.share[0].sum(-1, keepdim=True).clamp_min(1e-20)
        ent = -(p * p.clamp_min(1e-20).log()).sum(-1)
        return ent.exp().mean()

    def usage_perplexity(self) -> float:
        """:meth:`usage_perplexity_tensor` read on the host (a sync)."""
        return float(self.usage_perplexity_tensor())

    def state_dict(self) -> dict:
        return {"live": self.live.clone(), "share": self.share.clone(), "sums": self.sums.clone(),
                "dead_replaced": self.dead_replaced}

    def load_state_dict(self, st: dict) -> None:
        for name in ("live", "share", "sums"):
            getattr(self, name).copy_(st[name])
        self.dead_total.fill_(int(st["dead_replaced"]))
