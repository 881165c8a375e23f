"""Streamed codebook synchronisation for MAPL+VQ (SPEC §5.1): sender with mirror, receiver.

One **stream** (``act``: Z downstream, ``grad``: dL/dZ upstream) has a :class:`VQSender` on the
stage that encodes and a :class:`VQReceiver` on the stage that decodes. The sender learns its
codebooks (:class:`~mapl_swarm.compress.vq.EmaKMeans`) but encodes only with its **mirror** of what
the receiver holds; each encode first moves a slice of learned codes into the mirror and queues a
:class:`CodebookSlice` that the transport must deliver — and the receiver apply — before the codes:

======================  ==========================================================================
training micro-batch    before encoding
======================  ==========================================================================
first k-means batches   k-means init of the learned codebooks, full slice
resync requested        full slice (also in eval mode)
``sync = "full"``       full slice
``sync = "stream"``     partial slice of n = ceil(fraction x K) codes: ``round_robin`` a range
                        cycling over 0..K-1; ``priority`` an indexed slice (SPEC 1.2), per
                        codebook the n codes with the largest share x ||live - mirror||^2
======================  ==========================================================================

after encoding, the learned codebooks take one EMA k-means step on the micro-batch. Versions count
slices (a full slice too), so the codes carry the version (header ``cver``) they were encoded with
and a receiver at another version refuses them. The receiver checks every slice with the rules
of :mod:`mapl_swarm.wire.codebook_rules` (shared with the golden vectors) before touching its
codebooks, so a rejected slice never corrupts them. The in-process pipeline and the peers deliver the same slices in the
same order, so both decode the same numbers.

No host syncs per micro-batch: the sender's statistics (quantization error, dead codes
replaced, usage) stay on its device and :meth:`VQSender.metrics` reads them once per step; its
random draws use a generator on its device seeded with the keyed seed (:func:`stream_generator`).
The receiver validates what came off the wire on the host (:func:`host_codes_check`,
:func:`host_slice_check`: shape, dtype, range, finiteness) before copying it to its device, so an
invalid code never reaches a device kernel. Tensors already on a device never crossed a wire (the
in-process pipeline hands the sender's own codes and slices over): their metadata is checked,
their values are valid by construction (argmin over K codes; sorted top-k indices) and are not
read, which would be a sync. Only the k-means initialisation (first micro-batches) syncs.

:meth:`VQSender.warm_up` / :meth:`~mapl_swarm.compress.vq_stage.StageVQ.warm_up` size the search
for the device and compile the fused search before the handshake.
"""

from __future__ import annotations

import hashlib
import logging
import math
import time
from collections import defaultdict
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from mapl_swarm.wire.codebook_rules import (IGNORE, SLICE_VALUE_BOUND, CodebookError, SliceIndex, check_codes,
                                           check_slice)
from mapl_swarm.compress.vq import (
    EmaKMeans,
    chunk_tokens,
    code_stats,
    decode_codes,
    device_generator,
    distance_budget_bytes,
    kmeans_rounds,
    lookup,
    nearest_codes,
    quantize,
    random_points,
    to_groups,
    torch_code_dtype,
    warm_up_fused_search,
)
from mapl_swarm.config import VQConfig
from mapl_swarm.rng import derive_seed, generator

if TYPE_CHECKING:  # the wire package (msgpack, lz4) is only needed by peers, imported where used
    from mapl_swarm.wire import Message

log = logging.getLogger(__name__)

__all__ = ["CodebookSlice", "VQSender", "VQReceiver", "stream_generator", "host_codes_check", "host_slice_check"]

SAME_SLICE_RTOL, SAME_SLICE_ATOL = 1e-5, 1e-6
"""A full slice at the receiver's version whose codes are its codebooks within this is the same
slice (ignored, SPEC §5.1): replicas upstream on other kernels learn their codebooks to other last
bits."""

_CODE_TAGS = {torch.uint8: "uint8", torch.uint16: "uint16"}
_FULL_RANGE = {torch.uint8: 1 << 8, torch.uint16: 1 << 16}


def _stats_dtype(device: torch.device) -> torch.dtype:
    """float64 (the host's Python floats, exactly) where the device has it."""
    return torch.float32 if device.type == "mps" else torch.float64


def host_codes_check(codes: torch.Tensor, codebook_size: int) -> int | None:
    """The largest code of a host (CPU) ``codes`` tensor for the range check of
    :func:`~mapl_swarm.wire.codebook_rules.check_codes`; None when there is nothing to check (empty,
    a dtype that is not a code dtype — refused by the dtype check —, or one whose every value is a
    valid code, uint8 for K = 256). Reads host memory only."""
    if codes.device.type != "cpu":
        raise ValueError(f"host_codes_check reads host tensors, got one on {codes.device}")
    full = _FULL_RANGE.get(codes.dtype)
    if full is None or full <= codebook_size or codes.numel() == 0:
        return None
    return int(codes.long().max())


def host_slice_check(codes: torch.Tensor, index: torch.Tensor | None) -> tuple[bool, SliceIndex | None]:
    """Value checks of a host (CPU) slice: are its fp32 codes finite and within ±``SLICE_VALUE_BOUND``
    (NaN fails the comparison), and the summary of its ``index`` (as :meth:`SliceIndex.of` of its
    values). Reads host memory only."""
    for t in (codes, index):
        if t is not None and t.device.type != "cpu":
            raise ValueError(f"host_slice_check reads host tensors, got one on {t.device}")
    finite = codes.dtype == torch.float32 and bool((codes.abs() <= SLICE_VALUE_BOUND).all())
    if index is None:
        return finite, None
    v = index.long()
    increasing = v.dim() == 0 or v.shape[-1] < 2 or bool((v.diff(dim=-1) > 0).all())  # every row
    return finite, SliceIndex(dtype=_CODE_TAGS.get(index.dtype, str(index.dtype)), shape=tuple(index.shape),
                              max_index=int(v.max()) if v.numel() else 0, increasing=increasing)


def _device_slice_summary(codes: torch.Tensor, index: torch.Tensor | None) -> tuple[bool | None, SliceIndex | None]:
    """Metadata-only summary of a slice already on a device (in-process: the sender's own mirror
    and sorted top-k indices, valid by construction); reading its values would be a sync. Codes
    that are not fp32 are refused (``finite`` False), fp32 ones are not read (``finite`` None)."""
    finite = None if codes.dtype == torch.float32 else False
    if index is None:
        return finite, None
    return finite, SliceIndex(dtype=_CODE_TAGS.get(index.dtype, str(index.dtype)), shape=tuple(index.shape),
                            max_index=0, increasing=True)


def stream_generator(seed: int, boundary: int, stream: str) -> torch.Generator:
    """The sender's random stream (k-means seeds, dead-code replacement) of one boundary stream: a
    CPU generator with the keyed seed; a sender on another device draws from a generator on its
    device seeded with the same seed (:func:`~mapl_swarm.compress.vq.device_generator`)."""
    return generator(seed, "vq", boundary, stream)


@dataclass
class CodebookSlice:
    """One CODEBOOK_SLICE: codes ``start .. start+n-1`` of every codebook of ``stream``."""

    stream: str
    """``act`` or ``grad``."""
    version: int
    """The stream's version after applying the slice (header ``cver``)."""
    start: int
    full: bool
    codes: torch.Tensor
    """fp32 (R, r/G, n, G)."""
    index: torch.Tensor | None = None
    """Indexed slice (SPEC 1.2): uint8/uint16 (R, r/G, n), the positions of ``codes`` in each
    codebook (rows strictly increasing; ``start`` is 0). None: codes ``start .. start+n-1``."""

    @property
    def nbytes(self) -> int:
        extra = 0 if self.index is None else self.index.numel() * self.index.element_size()
        return self.codes.numel() * self.codes.element_size() + extra

    def to_message(self, *, run_id: str, src: int, dst: int, step: int = 0, micro: int = 0,
                   version_tuple: tuple[int, int] | None = None) -> Message:
        """This slice as a CODEBOOK_SLICE (the wire's one encoder, :func:`~mapl_swarm.wire.codebook.slice_parts`,
        via ``slice_message``); :meth:`from_message` is its inverse."""
        from mapl_swarm.wire.codebook import slice_message

        kw = {} if version_tuple is None else {"version_tuple": version_tuple}
        codes = self.codes.detach().to("cpu", torch.float32).contiguous().numpy()
        index = None if self.index is None else self.index.to("cpu").contiguous().numpy()
        return slice_message(run_id=run_id, src=src, dst=dst, stream=self.stream, version=self.version,
                             start=self.start, full=self.full, codes=codes, step=step, micro=micro, index=index,
                             **kw)

    @classmethod
    def from_message(cls, msg: Message) -> "CodebookSlice":
        """Read a decoded CODEBOOK_SLICE (raises SliceMalformed on bad meta or tensors)."""
        from mapl_swarm.wire.codebook import slice_fields

        f = slice_fields(msg)
        codes = torch.from_numpy(np.array(f.codes, dtype=np.float32))  # own, writable copy
        index = None if f.index is None else torch.from_numpy(f.index.astype(f.index.dtype.newbyteorder("=")))
        return cls(stream=f.stream, version=f.version, start=f.start, full=f.full, codes=codes, index=index)


_TOTALS = ("slices", "full_slices", "slice_bytes", "encodes", "tokens")


def _digest(codebooks: torch.Tensor, version: int) -> str:
    h = hashlib.sha256(codebooks.detach().to("cpu", torch.float32).contiguous().numpy().tobytes())
    h.update(int(version).to_bytes(8, "little"))
    return h.hexdigest()


class VQSender:
    """The encoding side of one stream: learned codebooks, mirror, version, pending slices.

    With ``update = step`` (:meth:`step_statistics`, :meth:`end_step`) the mirror changes only at a
    step's end: every micro-batch of the step is encoded against the same codebooks whichever
    replica encodes it, each encode adds its usage statistics to the step's (and the step's first
    micro-batch, index 0, keeps its residuals); at the end the learned codebooks take one EMA
    k-means step from the step's statistics (averaged across a stage's replicas first,
    :mod:`mapl_swarm.replicas.gradients`), the mirror becomes them, the version moves by one and
    no slice is queued: whoever delivers asks :meth:`full_slice` for the receivers that lack it."""

    def __init__(self, s: VQConfig, stream: str, gen: torch.Generator,
                 device: torch.device | str = "cpu", *, micro_batches: int = 1) -> None:
        self.s, self.stream, self.gen = s, stream, gen
        self.micro_batches = micro_batches
        """Training micro-batches per step (``update = step``: each adds 1 / this of its statistics)."""
        self.device = torch.device(device)
        self.draw_gen = device_generator(gen, self.device)
        """The generator every draw uses: ``gen`` on CPU, a device generator with its seed elsewhere."""
        self.learner = EmaKMeans(s, self.device)
        self.mirror = torch.zeros(s.layout.shape, device=self.device)
        """What the receiver holds: the only codebooks the encoder uses."""
        self.version = 0
        self.cursor = 0
        self.init_done = 0
        self.resync_pending = False
        self._pending: list[CodebookSlice] = []
        self._err = torch.zeros(3, dtype=_stats_dtype(self.device), device=self.device)
        """Since the last :meth:`metrics`: sums of the relative error (all rounds, round 1) and the
        number of encodes measured (non-zero input), on the device."""
        self._dead_seen = 0
        """The learner's dead-code total at the last :meth:`metrics`."""
        self._distance_bytes: int | None = None
        self.totals: dict[str, int] = defaultdict(int, {k: 0 for k in _TOTALS})
        """Lifetime counters: slices, full_slices, slice_bytes, encodes, tokens (every key from the
        start: the state's form does not depend on what was sent, which a joining replica checks)."""
        R, NG, K, G = s.layout.shape
        self.step_share = torch.zeros(R, NG, K, device=self.device)
        self.step_sums = torch.zeros(R, NG, K, G, device=self.device)
        self.step_proposal = torch.zeros(R, NG, K, G, device=self.device)
        """``update = step``: this sender's share of the step's per-token mean usage and assigned
        sums (its micro-batches' means over the step's count), and its proposal (the k-means
        initialisation, then the dead-code candidates) from the step's first micro-batch, zero when
        it did not encode it: the tensors replicas average (:meth:`step_statistics`)."""
        self._first: torch.Tensor | None = None
        """``update = step``: the residuals (R, N, NG, G) of the step's first micro-batch, if encoded here."""
        self._proposed = False

    # ------------------------------------------------------------------ slices
    @property
    def per_step(self) -> bool:
        """``update = step``: the codebooks learn once per step (class docstring)."""
        return self.s.update == "step"

    def request_resync(self) -> None:
        """The receiver asked for a RESYNC: the next encode sends the mirror whole at its version
        first, then its own slice as without the RESYNC (``update = step``: whoever delivers sends
        :meth:`full_slice` again; nothing changes here). So a RESYNC, honest or not, changes no
        codebook: the stream is the one a run without it sends, with one more slice."""
        self.resync_pending = not self.per_step

    def full_slice(self) -> CodebookSlice:
        """The mirror whole at its version (``update = step``: what a receiver that lacks this
        version gets before the next codes; counted as sent)."""
        sl = CodebookSlice(self.stream, self.version, 0, True, self.mirror.clone())
        self.totals["slices"] += 1
        self.totals["full_slices"] += 1
        self.totals["slice_bytes"] += sl.nbytes
        return sl

    def take_slices(self) -> list[CodebookSlice]:
        """Slices queued by the last encodes, oldest first; deliver them before the codes."""
        out, self._pending = self._pending, []
        return out

    def _emit(self, start: int, n: int, full: bool) -> None:
        live = self.learner.live
        if full:
            self.mirror.copy_(live)
        else:
            self.mirror[:, :, start:start + n] = live[:, :, start:start + n]
        self.version += 1
        self._queue(CodebookSlice(self.stream, self.version, start, full, self.mirror[:, :, start:start + n].clone()))

    def _emit_priority(self, n: int) -> None:
        """Indexed slice: per codebook the n codes whose staleness share x ||live - mirror||^2 is
        largest (codes in use that moved most, freshly replaced dead codes)."""
        R, NG, K, G = self.s.layout.shape
        score = self.learner.share * (self.learner.live - self.mirror).pow(2).sum(-1)  # (R, NG, K)
        idx = score.topk(n, dim=-1).indices.sort(-1).values.reshape(R * NG, n)  # rows increasing
        rows = torch.arange(R * NG, device=idx.device)[:, None]
        mirror = self.mirror.view(R * NG, K, G)
        mirror[rows, idx] = self.learner.live.reshape(R * NG, K, G)[rows, idx]
        self.version += 1
        self._queue(CodebookSlice(self.stream, self.version, 0, False, mirror[rows, idx].reshape(R, NG, n, G),
                                  index=idx.reshape(R, NG, n).to(torch_code_dtype(self.s))))

    def _queue(self, sl: CodebookSlice) -> None:
        self._pending.append(sl)
        self.totals["slices"] += 1
        self.totals["full_slices"] += int(sl.full)
        self.totals["slice_bytes"] += sl.nbytes

    @property
    def distance_bytes(self) -> int:
        """The eager search's per-chunk distance budget on this sender's device, sized once (at
        :meth:`warm_up` or the first encode; ``compression.vq.max_distance_mib`` > 0 overrides it)."""
        if self._distance_bytes is None:
            self._distance_bytes = distance_budget_bytes(self.device, override_mib=self.s.max_distance_mib)
        return self._distance_bytes

    def warm_up(self, tokens: int) -> dict[str, float]:
        """Get ready for encodes of ``tokens`` tokens (a micro-batch's B x T) before the handshake:
        size the eager search for this device and, with ``compression.vq.compile``, compile the fused search on
        dummy data of the real shapes. Touches no codebook, statistic or random stream (the codes
        stay the same with or without it). Returns ``fused`` (1.0 if on), ``distance_mib``,
        ``chunks`` (eager chunks per round) and ``compile_s``."""
        s = self.s
        budget = self.distance_bytes
        t0 = time.perf_counter()
        fused = s.compile and warm_up_fused_search(tokens, s.groups, s.codebook_size, s.group_size, self.device)
        compile_s = time.perf_counter() - t0 if s.compile else 0.0
        chunks = 1 if fused else math.ceil(max(1, tokens) / chunk_tokens(budget, s.groups, s.codebook_size))
        if fused:
            log.info("vq %s: fused nearest-code search compiled in %.1f s", self.stream, compile_s)
        else:
            log.info("vq %s: eager nearest-code search%s: %d chunk(s) per round of %d tokens, %.0f MiB distances",
                     self.stream, "" if s.compile else " (compression.vq.compile = false)", chunks, tokens,
                     budget / (1 << 20))
        return {"fused": float(fused), "distance_mib": budget / (1 << 20), "chunks": float(chunks),
                "compile_s": compile_s}

    def _kmeans_init(self, x: torch.Tensor) -> None:
        for k in range(self.s.rounds):
            self.learner.init_round(k, x, self.draw_gen, self.distance_bytes)
            idx = nearest_codes(x, self.learner.live[k], self.distance_bytes, fused=self.s.compile)
            x = x - lookup(self.learner.live[k], idx)

    # ------------------------------------------------------------------ encode
    @torch.no_grad()
    def encode(self, z: torch.Tensor, *, learn: bool, first: bool = False) -> torch.Tensor:
        """Codes (..., R, r/G) of z (..., r) against the mirror, after queueing this micro-batch's
        slice; with ``learn`` (training) the learned codebooks then take an EMA step (``update =
        step``: the micro-batch's statistics join the step's; ``first``: it is the step's
        micro-batch 0, whose residuals make the step's proposal)."""
        s = self.s
        lead = z.shape[:-1]
        x = to_groups(z.detach(), s.group_size)  # (N, NG, G)
        init = learn and not self.per_step and self.init_done < s.kmeans_init_batches
        if self.per_step:
            pass  # the mirror moves at the step's end only
        elif init:
            self._kmeans_init(x)
            self.init_done += 1
            self._emit(0, s.codebook_size, True)
        else:
            if self.resync_pending:  # the mirror whole as it is; the stream goes on as it would have without
                self._queue(CodebookSlice(self.stream, self.version, 0, True, self.mirror.clone()))
            if learn and s.sync == "full":
                self._emit(0, s.codebook_size, True)
            elif learn and s.slice_order == "priority":
                self._emit_priority(s.slice_codes)
            elif learn:
                n = min(s.slice_codes, s.codebook_size - self.cursor)
                self._emit(self.cursor, n, False)
                self.cursor = (self.cursor + n) % s.codebook_size
        if init or self.resync_pending:
            self.resync_pending = False
        codes, residuals = quantize(x, self.mirror, self.distance_bytes, fused=s.compile)  # (N, R, NG)
        if learn and self.per_step:
            self._add_step_stats(residuals, codes, first)
        elif learn and not init:
            for k in range(s.rounds):
                self.learner.update_round(k, residuals[k], codes[:, k], self.draw_gen)
        # ||x||^2, ||left after all rounds||^2, ||left after round 1||^2: fp32 sums, then float64 as
        # the host's Python floats were; accumulated on the device, read by metrics()
        sq = torch.stack([residuals[0].pow(2).sum(), residuals[-1].pow(2).sum(), residuals[1].pow(2).sum()])
        sq = sq.to(self._err.dtype)  # (3,)
        energy = sq[0]
        measured = energy > 0
        self._err += torch.where(measured, torch.stack([sq[1] / energy, sq[2] / energy, torch.ones_like(energy)]),
                                 torch.zeros_like(sq))
        self.totals["encodes"] += 1
        self.totals["tokens"] += x.shape[0]
        return codes.to(torch_code_dtype(s)).reshape(*lead, s.rounds, s.groups)

    # ------------------------------------------------------------------ update = step
    def _add_step_stats(self, residuals: list[torch.Tensor], codes: torch.Tensor, first: bool) -> None:
        K, M = self.s.codebook_size, self.micro_batches
        n = float(residuals[0].shape[0])
        for k in range(self.s.rounds):
            counts, sums = code_stats(residuals[k], codes[:, k], K)
            self.step_share[k].add_(counts, alpha=1.0 / (n * M))
            self.step_sums[k].add_(sums, alpha=1.0 / (n * M))
        if first:
            self._first = torch.stack(residuals[:-1])  # the input of each round
            self._proposed = False

    def _step_generator(self) -> torch.Generator:
        """The draws of the step that ends at version :attr:`version` + 1: keyed by the stream's
        seed and the version, so whichever replica encoded the step's first micro-batch draws the
        same numbers, and nothing of it is carried from step to step."""
        gen = torch.Generator(device="cpu")
        gen.manual_seed(derive_seed(self.gen.initial_seed(), "step", self.version))
        return device_generator(gen, self.device)

    def step_statistics(self) -> list[torch.Tensor]:
        """``update = step``: this sender's shares of the step's statistics (usage, sums, proposal),
        the tensors a stage's replicas average (weighted by micro-batches, each pre-scaled to its
        mean as gradients are: the average is the sum of the replicas' shares) and write back
        before :meth:`end_step`. The proposal is made once per step from the first micro-batch's
        residuals: until the codebooks have one, the k-means initialisation (and, in place of the
        usage, its codes' usage of that micro-batch: the other replicas' usage of the all-zero
        codebooks says nothing), then a candidate point per code for dead-code replacement."""
        s = self.s
        if not self._proposed:
            self.step_proposal.zero_()
            if self.init_done == 0:
                self.step_share.zero_()
                self.step_sums.zero_()
            if self._first is not None:
                gen = self._step_generator()
                if self.init_done == 0:
                    books, share = kmeans_rounds(self._first[0], s.rounds, s.codebook_size, s.kmeans_iters, gen,
                                                 self.distance_bytes, fused=s.compile)
                    self.step_proposal.copy_(books)
                    self.step_share.copy_(share)
                elif s.dead_code_ratio > 0:
                    for k in range(s.rounds):
                        self.step_proposal[k] = random_points(self._first[k], s.codebook_size, gen)
            self._proposed = True
        return [self.step_share, self.step_sums, self.step_proposal]

    def end_step(self) -> None:
        """``update = step``: learn from the step's (averaged) statistics, the mirror becomes the
        learned codebooks at the next version, and the step's statistics are cleared. Until a
        step's first micro-batch carries a non-zero value (a stream whose upstream decoded all-zero
        codes in the first step sends zero gradients) the codebooks stay empty, at version 0."""
        self.step_statistics()
        if self.init_done == 0:
            if bool(self.step_proposal.any()):  # one host read, until the stream is initialised
                self.learner.start(self.step_proposal, self.step_share)
                self.init_done = 1
        else:
            decay = self.s.ema_decay ** self.micro_batches
            self.learner.update_step(self.step_share, self.step_sums, self.step_proposal, decay)
        if self.init_done:
            self.mirror.copy_(self.learner.live)
            self.version += 1
        self.clear_step()

    def clear_step(self) -> None:
        """Forget the step's statistics (its end, or a step that is redone)."""
        for t in (self.step_share, self.step_sums, self.step_proposal):
            t.zero_()
        self._first = None
        self._proposed = False

    def metrics(self) -> dict[str, float]:
        """Mean relative error ||z - z_hat||^2 / ||z||^2 (all rounds and round 1 only), dead codes
        replaced and round-0 usage perplexity since the last call; then resets. The step's one
        host read of the statistics (a sync on a GPU): call it once per step."""
        dt = self._err.dtype
        stats = torch.cat([self._err, self.learner.dead_total.to(dt).reshape(1),
                           self.learner.usage_perplexity_tensor().to(dt).reshape(1)])
        rel, rel1, measured, dead_total, perplexity = stats.tolist()  # the one read
        self._err.zero_()
        dead, self._dead_seen = int(dead_total) - self._dead_seen, int(dead_total)
        n = max(measured, 1.0)
        return {"rel_error": rel / n, "rel_error_round1": rel1 / n, "dead_replaced": float(dead),
                "perplexity": perplexity, "version": float(self.version)}

    def digest(self) -> str:
        """SHA-256 of the mirror and its version (equals the receiver's :meth:`VQReceiver.digest`)."""
        return _digest(self.mirror, self.version)

    # ------------------------------------------------------------------ checkpoint
    def state_dict(self) -> dict:
        if self._pending:
            raise RuntimeError(f"vq {self.stream} sender: checkpoint with {len(self._pending)} undelivered slices")
        return {"learner": self.learner.state_dict(), "mirror": self.mirror.clone(), "version": self.version,
                "cursor": self.cursor, "init_done": self.init_done, "resync_pending": self.resync_pending,
                "gen": self.gen.get_state(), "totals": dict(self.totals),
                **({} if self.draw_gen is self.gen else {"draw_gen": self.draw_gen.get_state()})}

    def load_state_dict(self, st: dict) -> None:
        self.learner.load_state_dict(st["learner"])
        self.mirror.copy_(st["mirror"])
        self.version, self.cursor, self.init_done = int(st["version"]), int(st["cursor"]), int(st["init_done"])
        self.resync_pending = bool(st["resync_pending"])
        self.gen.set_state(st["gen"])
        if self.draw_gen is not self.gen and "draw_gen" in st:
            self.draw_gen.set_state(st["draw_gen"])
        self.totals = defaultdict(int, {**{k: 0 for k in _TOTALS}, **st["totals"]})
        self._dead_seen = self.learner.dead_replaced  # metrics count replacements after the restore


class VQReceiver:
    """The decoding side of one stream: codebooks, version, awaiting-resync flag, counters."""

    def __init__(self, s: VQConfig, stream: str, device: torch.device | str = "cpu") -> None:
        self.s, self.stream = s, stream
        self.device = torch.device(device)
        self.codebooks = torch.zeros(s.layout.shape, device=self.device)
        self.version = 0
        self.awaiting_resync = False
        self.applied = 0
        self.ignored = 0
        self.rejected: dict[str, int] = defaultdict(int)
        """Rejected slices and code tensors by error code."""

    def apply(self, sl: CodebookSlice) -> str:
        """Check and apply one slice (SPEC §5.1); returns ``apply`` or ``ignore``. A rejected slice
        raises its :class:`~mapl_swarm.wire.codebook_rules.CodebookError` (counted, logged) and leaves
        the codebooks and version untouched."""
        codes = sl.codes
        try:
            host = codes.device.type == "cpu" and (sl.index is None or sl.index.device.type == "cpu")
            # wire slices are host tensors: values checked here, before any device copy
            finite, index = host_slice_check(codes, sl.index) if host else _device_slice_summary(codes, sl.index)
            # a full slice at this version: with replicas upstream every one sends the same (SPEC §9.10),
            # to rounding when they run on other kernels
            same = (sl.full and sl.version == self.version and codes.shape == self.codebooks.shape
                    and torch.allclose(codes.to(self.device), self.codebooks, rtol=SAME_SLICE_RTOL, atol=SAME_SLICE_ATOL))
            outcome = check_slice(stream=sl.stream, version=sl.version, start=sl.start, full=sl.full,
                                  shape=tuple(codes.shape), finite=finite, expect_stream=self.stream,
                                  layout=self.s.layout, have=self.version, awaiting_resync=self.awaiting_resync,
                                  index=index, same=same)
        except CodebookError as exc:
            self._reject(exc)
            raise
        if outcome == IGNORE:
            self.ignored += 1
            return outcome
        n = codes.shape[2]
        codes = codes.to(self.device, non_blocking=True)  # checked: a host-to-device copy, no sync
        if sl.index is None:
            self.codebooks[:, :, sl.start:sl.start + n] = codes
        else:
            R, NG, K, G = self.s.layout.shape
            idx = sl.index.to(self.device, non_blocking=True).long().reshape(R * NG, n)
            rows = torch.arange(R * NG, device=self.device)[:, None]
            self.codebooks.view(R * NG, K, G)[rows, idx] = codes.reshape(R * NG, n, G)
        self.version = sl.version
        self.awaiting_resync = False
        self.applied += 1
        return outcome

    def _reject(self, exc: CodebookError) -> None:
        self.rejected[exc.code] += 1  # logged by the caller, which knows the link (once per rejection)
        log.debug("vq %s receiver (version %d): rejected: %s: %s (%d rejected so far)", self.stream,
                    self.version, type(exc).__name__, exc, sum(self.rejected.values()))

    @torch.no_grad()
    def decode(self, codes: torch.Tensor, cver: int) -> torch.Tensor:
        """Codes (..., R, r/G) encoded at version ``cver`` -> fp32 (..., r); raises
        CodebookVersionMismatch or BadCodes (counted) instead of decoding wrong numbers.

        Host (CPU) codes, as they come off the wire, are checked in full on the host and only then
        copied to the device (non-blocking); codes already on a device (the in-process pipeline:
        this process's encoder, in range by construction) get the version, dtype and shape checks
        without a read of their values, which would be a sync."""
        tag = _CODE_TAGS.get(codes.dtype, str(codes.dtype))
        try:
            max_code = host_codes_check(codes, self.s.codebook_size) if codes.device.type == "cpu" else None
            check_codes(cver=cver, have=self.version, dtype=tag, shape=tuple(codes.shape), max_code=max_code,
                        layout=self.s.layout)
        except CodebookError as exc:
            self._reject(exc)
            raise
        return decode_codes(codes.to(self.device, non_blocking=True), self.codebooks)

    def request_resync(self) -> int:
        """Enter the awaiting-resync state; returns the version to put in RESYNC ``have``."""
        self.awaiting_resync = True
        return self.version

    def digest(self) -> str:
        """SHA-256 of the codebooks and version."""
        return _digest(self.codebooks, self.version)

    def state_dict(self) -> dict:
        return {"codebooks": self.codebooks.clone(), "version": self.version,
                "awaiting_resync": self.awaiting_resync}

    def load_state_dict(self, st: dict) -> None:
        self.codebooks.copy_(st["codebooks"])
        self.version = int(st["version"])
        self.awaiting_resync = bool(st["awaiting_resync"])
