"""The runtime of one pipeline stage: model slice, boundary codecs, optimizers, saved graphs.

A :class:`StageRuntime` is transport-agnostic: it turns an inbound payload into an outbound one
(forward), an outbound gradient into an inbound one (backward), and steps its optimizers. The
single-process pipeline and the networked peer drive the very same object, so both compute the
same numbers. Payloads are dicts of tensors already cast to their wire dtype:

- ACT payload: ``{"act": (B, T, w) wire dtype, "ids": (B, T+1) uint16/uint32}``
- GRAD payload: ``{"grad": (B, T, w) wire dtype}``
- mapl_vq: ``"codes"`` (B, T, R, r/G) uint8/uint16 replaces ``"act"`` and ``"grad"``. Each forward
  or backward that encodes may queue codebook slices: the driver delivers
  :meth:`take_slices` (``"act"`` downstream, ``"grad"`` upstream) to the neighbour's
  :meth:`apply_slice` *before* the payload, and passes :meth:`codebook_version` along as the
  payload's ``cver`` (see :mod:`mapl_swarm.compress.vq_stage`).

Projector exchange once per step (DESIGN §2): the receiver hands its partial gradient with
:meth:`take_inbound_projector_grad`, the sender adds it with :meth:`add_outbound_projector_grad`,
steps, and hands the new projector with :meth:`outbound_projector` to
:meth:`load_inbound_projector`.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from mapl_swarm.compress import WIRE_TORCH_DTYPES, Boundary, StageAnchor, id_wire_dtype
from mapl_swarm.compress import ssn
from mapl_swarm.compress.codebook_sync import CodebookSlice
from mapl_swarm.compress.vq_stage import StageVQ
from mapl_swarm.config import TrainConfig
from mapl_swarm.model import StageModel
from mapl_swarm.optim import SPEL, Muon, lr_multiplier
from mapl_swarm.pipeline.probe import BoundaryProbe

log = logging.getLogger(__name__)

__all__ = ["StageRuntime", "ForwardResult"]


@dataclass
class ForwardResult:
    """What one forward of one micro-batch produced."""

    payload: dict[str, torch.Tensor] | None
    """ACT payload for the next stage (None on the last stage)."""
    loss: float | None
    """Mean token cross-entropy of the micro-batch (last stage only)."""
    tokens: int
    """Tokens in the micro-batch (B * T)."""


class StageRuntime:
    """Stage ``stage`` (0-based) of a ``cfg.pipeline.num_stages``-stage pipeline."""

    def __init__(self, cfg: TrainConfig, stage: int, device: torch.device | str = "cpu") -> None:
        self.cfg = cfg
        self.stage = stage
        self.num_stages = cfg.pipeline.num_stages
        self.device = torch.device(device)
        self.is_first = stage == 0
        self.is_last = stage == self.num_stages - 1
        m, c, seed = cfg.model, cfg.compression, cfg.run.seed
        self.codec = c.codec
        self.wire_dtype = WIRE_TORCH_DTYPES[c.wire_dtype]
        self.id_dtype = id_wire_dtype(m.vocab_size)

        self.model = StageModel(m, stage, self.num_stages, seed)
        self.anchor: StageAnchor | None = None
        if not self.is_first and c.codec in ("mapl", "fixed", "naive", "mapl_vq"):
            self.anchor = StageAnchor(c.anchor, m.vocab_size, m.hidden_size, c.anchor_rank,
                                      c.anchor_init_std, seed, stage)
        self.ssn_basis: nn.Parameter | None = None
        if c.codec == "ssn":
            self.ssn_basis = nn.Parameter(ssn.ssn_basis(m.hidden_size, c.rank, seed),
                                          requires_grad=c.ssn_refresh_interval_steps > 0)
            self.register_ssn_offsets(ssn.ssn_offsets(m.vocab_size, m.hidden_size, seed))
        self.inbound = None if self.is_first else Boundary(
            c.codec, "recv", stage - 1, m.hidden_size, c.rank, seed, self.ssn_basis)
        self.outbound = None if self.is_last or self.num_stages == 1 else Boundary(
            c.codec, "send", stage, m.hidden_size, c.rank, seed, self.ssn_basis)

        self.modules = nn.ModuleDict({"model": self.model})
        for name, mod in (("anchor", self.anchor), ("inbound", self.inbound), ("outbound", self.outbound)):
            if mod is not None:
                self.modules[name] = mod
        self.modules.to(self.device)
        if self.ssn_basis is not None:
            self._ssn_constrain()
        self.vq: StageVQ | None = None
        """mapl_vq: this stage's codebook streams."""
        if c.codec == "mapl_vq":
            self.vq = StageVQ(c.vq, stage, has_inbound=self.inbound is not None,
                              has_outbound=self.outbound is not None, seed=seed, device=self.device)

        self.optimizers = self._build_optimizers()
        self.step_count = 0
        self.loss_scale = 1.0 / cfg.pipeline.num_micro_batches
        self._saved: dict[int, tuple[torch.Tensor, torch.Tensor | None]] = {}
        self.probe = BoundaryProbe(cfg.metrics.health_interval_steps)
        """Compression health metrics (metrics.health_interval_steps); see :mod:`.probe`."""

    # ------------------------------------------------------------------ construction
    def register_ssn_offsets(self, offsets: torch.Tensor) -> None:
        self.ssn_offsets = offsets.to(self.device)

    def _build_optimizers(self) -> list[torch.optim.Optimizer]:
        o = self.cfg.optim
        muon_lr, adam_lr, proj_lr = o.muon_lr, o.muon_lr * o.adamw_lr_ratio, o.muon_lr * o.projector_lr_ratio
        hidden = [p for _, p in self.model.hidden_matrices()]
        hidden_ids = {id(p) for p in hidden}
        decay, no_decay = [], []
        for mod in (self.model, self.anchor):
            if mod is None:
                continue
            for p in mod.parameters():
                if id(p) in hidden_ids or not p.requires_grad:
                    continue
                (decay if p.dim() >= 2 else no_decay).append(p)
        muon_groups = [dict(params=hidden, lr=muon_lr, base_lr=muon_lr, weight_decay=o.weight_decay)]
        out = self.outbound
        if out is not None and out.codec == "naive":
            # The naive baseline: the projector as an ordinary 2D weight under Muon at the projector
            # lr, no weight decay, so only the manifold constraint differs from SPEL.
            muon_groups.append(dict(params=[out.projector], lr=proj_lr, base_lr=proj_lr, weight_decay=0.0))
        opts: list[torch.optim.Optimizer] = [
            Muon(muon_groups, lr=muon_lr, momentum=o.muon_momentum, ns_steps=o.muon_ns_steps),
            torch.optim.AdamW(
                [dict(params=decay, lr=adam_lr, base_lr=adam_lr, weight_decay=o.weight_decay),
                 dict(params=no_decay, lr=adam_lr, base_lr=adam_lr, weight_decay=0.0)],
                lr=adam_lr, betas=(o.adam_beta1, o.adam_beta2), eps=o.adam_eps),
        ]
        if out is not None and out.codec in ("mapl", "mapl_vq"):
            opts.append(SPEL([dict(params=[out.projector], lr=proj_lr, base_lr=proj_lr)], lr=proj_lr,
                             momentum=o.spel_momentum, direction_steps=o.spel_direction_steps,
                             retraction_steps=o.spel_retraction_steps))
        return opts

    def optimized_parameters(self) -> list[torch.Tensor]:
        return [p for opt in self.optimizers for g in opt.param_groups for p in g["params"]]

    # ------------------------------------------------------------------ forward / backward
    def _autocast(self):
        if self.device.type == "cuda":
            return torch.autocast("cuda", dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def _offset(self, ids: torch.Tensor, embedded: torch.Tensor | None,
                anchor: torch.Tensor | None) -> torch.Tensor | None:
        if self.codec == "ssn":
            return self.ssn_offsets[ids]
        if self.is_first:
            return None if self.cfg.compression.anchor == "none" else embedded
        return anchor

    def forward(self, micro: int, *, ids: torch.Tensor | None = None,
                payload: dict[str, torch.Tensor] | None = None, train: bool = True,
                cver: int | None = None) -> ForwardResult:
        """Run micro-batch ``micro``. Stage 1 takes ``ids`` (B, T+1); later stages take the ACT
        payload of the previous stage (mapl_vq: encoded at codebook version ``cver``; None skips
        the check). With ``train`` the graph is kept for :meth:`backward`."""
        if self.is_first:
            if ids is None:
                raise ValueError("the first stage needs token ids")
            all_ids = ids.to(self.device, torch.long)
        else:
            if payload is None:
                raise ValueError(f"stage {self.stage} needs an ACT payload")
            all_ids = payload["ids"].to(self.device).long()
        tokens_in = all_ids[:, :-1]  # (B, T) inputs; labels are all_ids[:, 1:]
        probe_due = self.probe.due(self.step_count, micro, train)
        with torch.set_grad_enabled(train), self._autocast():
            z_in = None
            anchor = self.anchor(tokens_in) if self.anchor is not None else None
            embedded = None
            if self.is_first:
                embedded = self.model.embed(tokens_in)
                x = embedded if self.codec != "ssn" else embedded + self.ssn_offsets[tokens_in]
            else:
                if self.vq is not None:
                    z_in = self.vq.decode("act", payload["codes"].to(self.device), cver)
                else:
                    z_in = payload["act"].to(self.device, torch.float32)
                if train:
                    z_in.requires_grad_(True)
                x = self.inbound.decode(z_in, self._offset(tokens_in, None, anchor))
                self.probe.on_recv(probe_due, x)
            x = self.model.run_layers(x)
            if self.is_last:
                logits = self.model.head(x).float()  # (B, T, V)
                loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), all_ids[:, 1:].reshape(-1))
                if train:
                    self._saved[micro] = (loss * self.loss_scale, z_in)
                return ForwardResult(None, float(loss.detach()), tokens_in.numel())
            offset = self._offset(tokens_in, embedded, anchor)
            self.probe.on_send(probe_due, x, offset, tokens_in)
            z = self.outbound.encode(x, offset).float()
        if train:
            self._saved[micro] = (z, z_in)
        if self.vq is not None:  # straight-through: backward feeds the decoded dL/dZ_hat to z
            out = {"codes": self.vq.encode("act", z.detach(), learn=train, key=micro),
                   "ids": all_ids.to(self.id_dtype)}
        else:
            out = {"act": z.detach().to(self.wire_dtype), "ids": all_ids.to(self.id_dtype)}
        return ForwardResult(out, None, tokens_in.numel())

    def backward(self, micro: int, payload: dict[str, torch.Tensor] | None = None,
                 cver: int | None = None) -> dict[str, torch.Tensor] | None:
        """Backward of micro-batch ``micro`` given the next stage's GRAD payload (None on the last
        stage; mapl_vq: codes at version ``cver``); returns the GRAD payload for the previous stage
        (None on the first)."""
        if micro not in self._saved:
            raise KeyError(f"stage {self.stage}: no saved forward for micro-batch {micro}")
        out, z_in = self._saved[micro]
        if self.is_last:
            grad = None
        else:
            if payload is None:
                raise ValueError(f"stage {self.stage} needs a GRAD payload")
            if self.vq is not None:  # undecodable codes raise here and keep the forward for a retransmission
                grad = self.vq.decode("grad", payload["codes"].to(self.device), cver)
            else:
                grad = payload["grad"].to(self.device, torch.float32)
            if grad.shape != out.shape:
                raise ValueError(f"GRAD shape {tuple(grad.shape)} != activation shape {tuple(out.shape)}")
        del self._saved[micro]
        out.backward(grad)
        if z_in is None:
            return None
        if self.vq is not None:
            return {"codes": self.vq.encode("grad", z_in.grad, learn=True, key=micro)}
        return {"grad": z_in.grad.to(self.wire_dtype)}

    @property
    def pending_micro_batches(self) -> int:
        return len(self._saved)

    # ------------------------------------------------------------------ codebook streams (mapl_vq)
    def take_slices(self, stream: str) -> list[CodebookSlice]:
        """Codebook slices queued by the last forward (``"act"``, for the next stage) or backward
        (``"grad"``, for the previous stage); deliver them before that payload. [] without VQ."""
        return self.vq.take_slices(stream) if self.vq is not None else []

    def codebook_version(self, stream: str) -> int:
        """``cver`` of the last payload this stage encoded on ``stream`` (0 without VQ)."""
        return self.vq.version(stream) if self.vq is not None and stream in self.vq.tx else 0

    def reencode(self, stream: str, micro: int) -> torch.Tensor | None:
        """mapl_vq retransmission: the codes of micro-batch ``micro``'s last ``stream`` payload
        (the forward's ``micro``: negative for eval) encoded again after a full slice; None when
        this stage no longer holds its values."""
        if self.vq is None or stream not in self.vq.tx:
            return None
        return self.vq.reencode(stream, micro)

    def apply_slice(self, sl: CodebookSlice) -> str:
        """Apply a neighbour's slice (raises the named CodebookError when rejected)."""
        if self.vq is None:
            raise ValueError(f"stage {self.stage}: codec {self.codec} has no codebooks")
        return self.vq.apply_slice(sl)

    # ------------------------------------------------------------------ projector exchange
    def take_inbound_projector_grad(self) -> torch.Tensor | None:
        """Receiver's partial dL/dA of the inbound projector summed over the step (d x r, fp32)."""
        b = self.inbound
        if b is None or not b.trainable:
            return None
        g = b.projector.grad
        grad = torch.zeros_like(b.projector, dtype=torch.float32) if g is None else g.detach().float().clone()
        b.projector.grad = None
        return grad

    def add_outbound_projector_grad(self, grad: torch.Tensor) -> None:
        b = self.outbound
        assert b is not None and b.trainable, "no trainable outbound projector"
        grad = grad.to(self.device, torch.float32)
        if grad.shape != b.projector.shape:
            raise ValueError(f"PROJ_GRAD shape {tuple(grad.shape)} != projector {tuple(b.projector.shape)}")
        b.projector.grad = grad if b.projector.grad is None else b.projector.grad + grad

    def outbound_projector(self) -> tuple[torch.Tensor, int] | None:
        b = self.outbound
        if b is None or not b.trainable:
            return None
        return b.projector.detach().float().clone(), b.version

    def load_inbound_projector(self, value: torch.Tensor, version: int) -> None:
        assert self.inbound is not None
        self.inbound.load_projector(value.to(self.device), version)

    # ------------------------------------------------------------------ optimizer
    def step(self) -> dict[str, float]:
        """One optimizer step after the step's last backward (and the projector grad)."""
        if self._saved:
            raise RuntimeError(f"stage {self.stage}: step with {len(self._saved)} micro-batches un-backwarded")
        o = self.cfg.optim
        mult = lr_multiplier(self.step_count, total_steps=self.cfg.run.steps, warmup_steps=o.warmup_steps,
                             schedule=o.schedule, min_lr_ratio=o.min_lr_ratio,
                             wsd_decay_fraction=o.wsd_decay_fraction)
        for opt in self.optimizers:
            for group in opt.param_groups:
                group["lr"] = group["base_lr"] * mult
        metrics = {"lr_mult": mult, **self.probe.collect(self.inbound, self.outbound, self.vq)}
        if o.grad_clip_norm > 0:
            params = [p for p in self.optimized_parameters() if p.grad is not None]
            metrics["grad_norm"] = float(torch.nn.utils.clip_grad_norm_(params, o.grad_clip_norm))
        for opt in self.optimizers:
            opt.step()
            opt.zero_grad(set_to_none=True)
        if self.outbound is not None and self.outbound.trainable:
            self.outbound.version += 1
        if self.ssn_basis is not None:
            self._ssn_constrain()
        if self.vq is not None:
            metrics.update(self.vq.metrics())
        self.step_count += 1
        return metrics

    # ------------------------------------------------------------------ ssn
    def _ssn_constrain(self) -> None:
        if self.is_last:
            return  # layers after the last boundary need no constraint (node0 exempts them)
        emb = self.model.embed_tokens.weight if self.is_first else None
        ssn.constrain_(self.ssn_basis, self.model.residual_writers(), emb)

    def take_ssn_basis_grad(self) -> torch.Tensor | None:
        if self.ssn_basis is None or not self.ssn_basis.requires_grad:
            return None
        g = self.ssn_basis.grad
        self.ssn_basis.grad = None
        return torch.zeros_like(self.ssn_basis) if g is None else g.detach().clone()

    def set_ssn_basis(self, basis: torch.Tensor) -> None:
        with torch.no_grad():
            self.ssn_basis.copy_(basis.to(self.device))
        self._ssn_constrain()

    # ------------------------------------------------------------------ checkpoint state
    def state_dict(self) -> dict:
        versions = {k: getattr(self, k).version for k in ("inbound", "outbound") if getattr(self, k) is not None}
        return {
            "stage": self.stage,
            "step": self.step_count,
            "modules": self.modules.state_dict(),
            "optimizers": [opt.state_dict() for opt in self.optimizers],
            "versions": versions,
            "rng_cpu": torch.get_rng_state(),
            **({"vq": self.vq.state_dict()} if self.vq is not None else {}),
        }

    def load_state_dict(self, state: dict) -> None:
        if state["stage"] != self.stage:
            raise ValueError(f"checkpoint is for stage {state['stage']}, not {self.stage}")
        self.modules.load_state_dict(state["modules"])
        for opt, st in zip(self.optimizers, state["optimizers"], strict=True):
            opt.load_state_dict(st)
        for k, v in state["versions"].items():
            getattr(self, k).version = int(v)
        self.step_count = int(state["step"])
        torch.set_rng_state(state["rng_cpu"])
        if self.vq is not None:
            self.vq.load_state_dict(state["vq"])
