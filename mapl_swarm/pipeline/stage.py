"""The runtime of one pipeline stage: model slice, its boundary codec, optimizers, saved graphs.

What differs between codecs (anchors, projectors, payload encoding, their optimizer rows, hooks)
is the stage's codec object (:mod:`mapl_swarm.compress.codecs`); the optimizers come from one
parameter table (:mod:`mapl_swarm.optim.param_table`).

A :class:`StageRuntime` is transport-agnostic: it turns an inbound payload into an outbound one
(forward), an outbound gradient into an inbound one (backward), and steps its optimizers. The
single-process pipeline and the networked peer drive the very same object, so both compute the
same numbers. Payloads are dicts of tensors already cast to their wire dtype:

- ACT payload: ``{"act": (B, T, w) wire dtype, "ids": (B, T+1) uint16/uint32}``
- GRAD payload: ``{"grad": (B, T, w) wire dtype}``
- mapl_vq: ``"codes"`` (B, T, R, r/G) uint8/uint16 replaces ``"act"`` and ``"grad"``. Before a
  payload the driver delivers :meth:`slices_for` (``"act"`` downstream, ``"grad"`` upstream; the
  slices the encodes queued, or with ``compression.vq.update = step`` a full slice for a receiver
  that lacks the version) to the neighbour's :meth:`apply_slice`, and passes
  :meth:`codebook_version` along as the payload's ``cver`` (see :mod:`mapl_swarm.compress.vq_stage`).

Own non-finite values: :meth:`StageRuntime.step` checks the step's training losses
(last stage) and the gradients' total norm with one host sync before any optimizer update, and
:func:`check_finite` checks a host payload before it is sent; either raises
:class:`~mapl_swarm.errors.NonFiniteError` naming the step and the tensor, so a NaN/Inf is never
applied, sent or checkpointed.

Projector exchange once per step (DESIGN §2): the receiver hands its partial gradient with
:meth:`take_inbound_projector_grad`, the sender adds it with :meth:`add_outbound_projector_grad`,
steps, and hands the new projector with :meth:`outbound_projector` to
:meth:`load_inbound_projector`.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from mapl_swarm.compress.codebook_sync import CodebookSlice
from mapl_swarm.compress.codecs import StageCodec, build_codec
from mapl_swarm.compress.vq_stage import StageVQ
from mapl_swarm.config import TrainConfig
from mapl_swarm.errors import NonFiniteError
from mapl_swarm.model import StageModel
from mapl_swarm.optim import lr_multiplier
from mapl_swarm.optim.param_table import ParamRow, build_optimizers, model_rows
from mapl_swarm.pipeline.probe import BoundaryProbe

log = logging.getLogger(__name__)

__all__ = ["StageRuntime", "ForwardResult", "loss_values", "mean_loss", "check_finite", "KEPT_STEPS"]

KEPT_STEPS = 6
"""Steps whose inputs a recording stage keeps: a step's share is drawn for checking in the next
round, and its checkers ask for the inputs while this replica serves the steps after that (a
checker that comes later gives no verdict: it cannot tell a member that kept nothing from one
that withholds)."""


@dataclass
class ForwardResult:
    """What one forward of one micro-batch produced."""

    payload: dict[str, torch.Tensor] | None
    """ACT payload for the next stage (None on the last stage)."""
    loss: torch.Tensor | None
    """Mean token cross-entropy of the micro-batch (last stage only): a detached 0-d fp32 tensor on
    the stage's device, so a micro-batch costs no host sync; read a step's losses at once with
    :func:`mean_loss`."""
    tokens: int
    """Tokens in the micro-batch (B * T)."""
    logits: torch.Tensor | None = None
    """Last stage, when asked (``keep_logits``): the (B, T, V) fp32 logits, detached."""


def loss_values(losses: list[torch.Tensor]) -> list[float]:
    """Micro-batch losses (:attr:`ForwardResult.loss`) as floats with one host sync for all of them
    (each fp32 value widened exactly, as a per-item ``float()`` would)."""
    return torch.stack(losses).double().cpu().tolist()


def mean_loss(losses: list[torch.Tensor]) -> float:
    """Mean of micro-batch losses, one host sync."""
    values = loss_values(losses)
    return sum(values) / len(values)


def check_finite(tensors: Mapping[str, torch.Tensor], *, stage: int, step: int, what: str) -> None:
    """Raise :class:`NonFiniteError` if a floating tensor of ``tensors`` holds a NaN or Inf (``what``
    names the message, e.g. "ACT of micro-batch 3"). Meant for host tensors (no device sync);
    integer tensors (ids, VQ codes) are skipped."""
    for name, t in tensors.items():
        if t.is_floating_point() and t.numel() and not bool(torch.isfinite(t).all()):
            raise NonFiniteError(stage=stage, step=step, tensor=f"{what} tensor {name!r}")


class StageRuntime:
    """Stage ``stage`` (0-based) of a ``cfg.pipeline.num_stages``-stage pipeline."""

    def __init__(self, cfg: TrainConfig, stage: int, device: torch.device | str = "cpu") -> None:
        self.cfg = cfg
        self.stage = stage
        self.num_stages = cfg.pipeline.num_stages
        self.device = torch.device(device)
        self.is_first = stage == 0
        self.is_last = stage == self.num_stages - 1
        self.model = StageModel(cfg.model, stage, self.num_stages, cfg.run.seed)
        self.codec: StageCodec = build_codec(cfg, stage, self.device)
        """Everything codec-specific of this stage: anchor, boundaries, payloads, its param rows."""
        self.anchor, self.inbound, self.outbound = self.codec.anchor, self.codec.inbound, self.codec.outbound
        self.modules = nn.ModuleDict({"model": self.model, **self.codec.modules()})
        self.modules.to(self.device)
        self.codec.setup(self.model)
        self.param_rows: list[ParamRow] = self._param_rows()
        """The stage's parameter table (label -> optimizer, lr ratio, weight decay)."""
        self.optimizers = build_optimizers(self.param_rows, cfg.optim)
        self.step_count = 0
        self.tokens_trained = 0
        """Tokens of the training micro-batches this stage ran forward (its own throughput: with
        replicas, only the micro-batches routed to this one)."""
        self.loss_scale = 1.0 / cfg.pipeline.num_micro_batches
        self._saved: dict[int, tuple[torch.Tensor, torch.Tensor | None]] = {}
        self._origin_grads: dict[str, torch.Tensor] = {}
        """With replicas upstream: the inbound projector's gradient of the step, by the replica its
        micro-batches came from (:meth:`backward` ``origin``)."""
        self._step_losses: list[torch.Tensor] = []
        """Last stage: the current step's training losses (on the device), checked by :meth:`step`."""
        self.probe = BoundaryProbe(cfg.metrics.health_interval_steps)
        """Compression health metrics (metrics.health_interval_steps); see :mod:`.probe`."""
        self.recording = cfg.replicas.check_fraction > 0
        """Keep each train micro-batch's inputs (replicas that check each other's work, SPEC §9.10
        item 15): a partner recomputes this replica's gradient share of a step from them."""
        self._inputs: dict[int, dict[str, dict[str, Any]]] = {}
        self.kept_inputs: dict[int, dict[int, dict[str, dict[str, Any]]]] = {}
        """With :attr:`recording`: the inputs of the last :data:`KEPT_STEPS` steps taken, by step,
        then micro-batch: ``"fwd"`` (stage 0: ``{"ids": ...}``, else the ACT payload) and ``"bwd"``
        (the GRAD payload; none on the last stage), each with its sender's proof where one came
        (``"fwd_proof"``, ``"bwd_proof"``: ``cert`` and ``sig``), and what it made of them: the ACT
        payload it passed on (``"out"``, none on the last stage) and the GRAD payload it returned
        (``"back"``, none on stage 0)."""

    @property
    def vq(self) -> StageVQ | None:
        """MAPL+VQ: this stage's codebook streams (None for the other codecs)."""
        return self.codec.vq

    # ------------------------------------------------------------------ construction
    def _param_rows(self) -> list[ParamRow]:
        hidden = [p for _, p in self.model.hidden_matrices()]
        return (model_rows(self.model, hidden, self.cfg.optim, adamw_lr_ratio=self.codec.adamw_lr_ratio())
                + self.codec.param_rows())

    def optimized_parameters(self) -> list[torch.Tensor]:
        return [p for opt in self.optimizers for g in opt.param_groups for p in g["params"]]

    # ------------------------------------------------------------------ forward / backward
    def _autocast(self):
        """``runtime.autocast``: bf16 autocast on this stage's device type (CPU too), or none."""
        mode = self.cfg.runtime.autocast
        if mode == "bf16" or (mode == "auto" and self.device.type == "cuda"):
            return torch.autocast(self.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def forward(self, micro: int, *, ids: torch.Tensor | None = None,
                payload: dict[str, torch.Tensor] | None = None, train: bool = True,
                cver: int | None = None, keep_logits: bool = False, proof: Mapping[str, bytes] | None = None
                ) -> ForwardResult:
        """Run micro-batch ``micro``. Stage 0 takes ``ids`` (B, T+1); later stages take the ACT
        payload of the previous stage (mapl_vq: encoded at codebook version ``cver``; None skips
        the check). With ``train`` the graph is kept for :meth:`backward`; with ``keep_logits`` the
        last stage also returns its logits (the exported model is checked against them).
        ``proof``: what shows who sent the payload (kept with it, :attr:`kept_inputs`)."""
        if self.is_first:
            if ids is None:
                raise ValueError("the first stage needs token ids")
            host_ids = ids  # (B, T+1) int64 from the sampler, on the CPU
        else:
            if payload is None:
                raise ValueError(f"stage {self.stage} needs an ACT payload")
            host_ids = payload["ids"]  # (B, T+1) wire dtype, on the CPU (pinned on CUDA peers)
        # the device copy computes; the host ids go on to the next stage (no device round trip)
        if train and self.recording:
            self._inputs[micro] = {"fwd": {"ids": ids} if self.is_first else dict(payload),
                                   **({"fwd_proof": dict(proof)} if proof is not None else {})}
        all_ids = host_ids.to(self.device, non_blocking=True).long()
        tokens_in = all_ids[:, :-1]  # (B, T) inputs; labels are all_ids[:, 1:]
        probe_due = self.probe.due(self.step_count, micro, train)
        if train:
            self.tokens_trained += tokens_in.numel()
        with torch.set_grad_enabled(train), self._autocast():
            z_in = None
            anchor = self.codec.stage_anchor(tokens_in)
            embedded = None
            if self.is_first:
                embedded = self.model.embed(tokens_in)
                x = self.codec.first_stage_input(embedded, tokens_in)
            else:
                z_in = self.codec.decode_act(payload, cver)
                if train:
                    z_in.requires_grad_(True)
                x = self.inbound.decode(z_in, self.codec.offset(tokens_in, None, anchor))
                self.probe.on_recv(probe_due, x)
            x = self.model.run_layers(x)
            if self.is_last:
                logits = self.model.head(x).float()  # (B, T, V)
                loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), all_ids[:, 1:].reshape(-1))
                if train:
                    self._saved[micro] = (loss * self.loss_scale, z_in)
                    self._step_losses.append(loss.detach())
                return ForwardResult(None, loss.detach(), tokens_in.numel(), logits.detach() if keep_logits else None)
            offset = self.codec.offset(tokens_in, embedded, anchor)
            self.probe.on_send(probe_due, x, offset, tokens_in)
            z = self.outbound.encode(x, offset).float()
        if train:
            self._saved[micro] = (z, z_in)
        out = {**self.codec.encode_act(z, train=train, micro=micro), "ids": host_ids.to("cpu", self.codec.id_dtype)}
        if train and micro in self._inputs:  # recording: what this replica passes on is checked too
            self._inputs[micro]["out"] = dict(out)
        return ForwardResult(out, None, tokens_in.numel())

    def backward(self, micro: int, payload: dict[str, torch.Tensor] | None = None,
                 cver: int | None = None, origin: str | None = None,
                 proof: Mapping[str, bytes] | None = None) -> dict[str, torch.Tensor] | None:
        """Backward of micro-batch ``micro`` given the next stage's GRAD payload (None on the last
        stage; mapl_vq: codes at version ``cver``); returns the GRAD payload for the previous stage
        (None on the first). ``origin``: the upstream replica the micro-batch's ACT came from (SPEC
        §9.10): the inbound projector's gradient of this micro-batch is kept apart, by origin, for
        :meth:`take_inbound_projector_grad`. ``proof``: as :meth:`forward`'s, of the GRAD."""
        if micro not in self._saved:
            raise KeyError(f"stage {self.stage}: no saved forward for micro-batch {micro}")
        out, z_in = self._saved[micro]
        if self.is_last:
            grad = None
        else:
            if payload is None:
                raise ValueError(f"stage {self.stage} needs a GRAD payload")
            grad = self.codec.decode_grad(payload, cver)  # may raise and keep the forward (VQ retransmission)
            if grad.shape != out.shape:
                raise ValueError(f"GRAD shape {tuple(grad.shape)} != activation shape {tuple(out.shape)}")
        del self._saved[micro]
        if self.recording and payload is not None and micro in self._inputs:
            self._inputs[micro]["bwd"] = dict(payload)
            if proof is not None:
                self._inputs[micro]["bwd_proof"] = dict(proof)
        b = self.inbound
        split = origin is not None and b is not None and b.trainable
        before = b.projector.grad if split else None
        if split:
            b.projector.grad = None
        out.backward(grad)
        if split:  # this micro-batch's part, added to its origin's sum; the others' sum is back in place
            part, b.projector.grad = b.projector.grad, before
            if part is not None:
                kept = self._origin_grads.get(origin)
                self._origin_grads[origin] = part if kept is None else kept + part
        if z_in is None:
            return None
        grad_out = self.codec.encode_grad(z_in.grad, micro=micro)
        if micro in self._inputs:
            self._inputs[micro]["back"] = dict(grad_out)
        return grad_out

    # ------------------------------------------------------------------ codebook streams (mapl_vq)
    def take_slices(self, stream: str) -> list[CodebookSlice]:
        """Codebook slices queued by the last forward (``"act"``, for the next stage) or backward
        (``"grad"``, for the previous stage); deliver them before that payload. [] without VQ."""
        return self.vq.take_slices(stream) if self.vq is not None else []

    def slices_for(self, stream: str, have: int) -> list[CodebookSlice]:
        """The codebook slices to deliver before this stage's next ``stream`` payload to a receiver
        at version ``have`` (-1: unknown) (:meth:`StageVQ.slices_for`); [] without VQ."""
        return self.vq.slices_for(stream, have) if self.vq is not None else []

    def step_statistics(self) -> list[torch.Tensor]:
        """What the codec gathered over the step for the stage's replicas to average with the
        gradients (:meth:`~mapl_swarm.compress.codecs.StageCodec.step_statistics`)."""
        return self.codec.step_statistics()

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
            raise ValueError(f"stage {self.stage}: codec {self.codec.name} has no codebooks")
        return self.vq.apply_slice(sl)

    # ------------------------------------------------------------------ projector exchange
    def take_inbound_projector_grad(self, origin: str | None = None) -> torch.Tensor | None:
        """Receiver's partial dL/dA of the inbound projector summed over the step (d x r, fp32); with
        ``origin``, over the micro-batches whose ACT came from that upstream replica (:meth:`backward`)."""
        b = self.inbound
        if b is None or not b.trainable:
            return None
        if origin is not None:
            g = self._origin_grads.pop(origin, None)
        else:
            g, b.projector.grad = b.projector.grad, None
        return torch.zeros_like(b.projector, dtype=torch.float32) if g is None else g.detach().float().clone()

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

    def abandon_step(self) -> None:
        """Forget the current step's work: saved forwards, gradients (parameters and projectors),
        the upstream replicas' projector gradients and the step's losses. With replicas, a step is
        redone from its start when one of them left before the step could be taken (SPEC §9.10)."""
        self._saved.clear()
        self._origin_grads.clear()
        self._step_losses.clear()
        self._inputs = {}
        for p in [*self.modules.parameters(), *self.optimized_parameters()]:
            p.grad = None
        self.codec.abandon_step()

    # ------------------------------------------------------------------ optimizer
    def step(self) -> dict[str, float]:
        """One optimizer step after the step's last backward (and the projector grad)."""
        if self._saved or self._origin_grads:
            raise RuntimeError(f"stage {self.stage}: step with {len(self._saved)} micro-batches un-backwarded and "
                               f"{len(self._origin_grads)} upstream replicas' projector gradients not taken")
        o = self.cfg.optim
        mult = self.lr_multiplier()
        for opt in self.optimizers:
            for group in opt.param_groups:
                group["lr"] = group["base_lr"] * mult
        params = [p for p in self.optimized_parameters() if p.grad is not None]
        total_norm, grad_norm = self._check_finite_step(params)  # raises before anything is applied
        metrics = {"lr_mult": mult, **self.probe.collect(self.inbound, self.outbound, self.vq)}
        if o.grad_clip_norm > 0:
            torch.nn.utils.clip_grads_with_norm_(params, o.grad_clip_norm, total_norm)
            metrics["grad_norm"] = grad_norm
        for opt in self.optimizers:
            opt.step()
            opt.zero_grad(set_to_none=True)
        if self.outbound is not None and self.outbound.trainable:
            self.outbound.version += 1
        self.codec.after_step()
        metrics.update(self.codec.step_metrics())
        if self.recording:
            self.kept_inputs[self.step_count], self._inputs = self._inputs, {}
            for old in sorted(self.kept_inputs)[:-KEPT_STEPS]:
                del self.kept_inputs[old]
        self.step_count += 1
        return metrics

    def lr_multiplier(self) -> float:
        """The schedule's multiplier of every optimizer's base lr for this stage's next step."""
        o = self.cfg.optim
        return lr_multiplier(self.step_count, total_steps=self.cfg.run.steps, warmup_steps=o.warmup_steps,
                             schedule=o.schedule, min_lr_ratio=o.min_lr_ratio, wsd_decay_fraction=o.wsd_decay_fraction)

    def _check_finite_step(self, params: list[torch.Tensor]) -> tuple[torch.Tensor, float]:
        """The gradients' total 2-norm (as ``clip_grad_norm_`` computes it) and its value, after one
        host sync that also reads the step's training losses (last stage); raises
        :class:`NonFiniteError` naming the step and the first non-finite loss or gradient."""
        losses, self._step_losses = self._step_losses, []
        grads = [p.grad for p in params]
        total = (torch.nn.utils.get_total_norm(grads) if grads
                 else torch.zeros((), device=self.device))
        values = torch.stack([total.float().to(self.device), *(x.float() for x in losses)]).tolist()  # the sync
        for i, v in enumerate(values[1:]):
            if not math.isfinite(v):
                raise NonFiniteError(stage=self.stage, step=self.step_count, tensor=f"the loss of micro-batch {i}")
        if not math.isfinite(values[0]):
            names = {id(p): n for n, p in self.modules.named_parameters()}
            bad = next((p for p in params if not bool(torch.isfinite(p.grad).all())), None)
            what = ("the gradients' total norm (overflow)" if bad is None else
                    f"the gradient of {names.get(id(bad), f'a parameter of shape {tuple(bad.shape)}')}")
            raise NonFiniteError(stage=self.stage, step=self.step_count, tensor=what)
        return total, values[0]

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
            **self.codec.state_dict(),
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
        self.codec.load_state_dict(state)
