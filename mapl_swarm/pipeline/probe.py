"""Live compression health of one stage's boundaries (``metrics.health_interval_steps``).

A :class:`BoundaryProbe` rides in a :class:`~mapl_swarm.pipeline.stage.StageRuntime`. On every
health step (``step % health_interval_steps == 0``, counted after the step) it keeps the first
micro-batch's boundary tensors and turns them into per-boundary metrics when the stage steps,
before the optimizer moves the projector:

- sender side (boundary b = this stage's outbound): with ``R = X − anchor_send`` (the residual the
  projector sees), ``health/b{b}/energy_captured`` = ‖R A‖²/‖R‖² and ``health/b{b}/orth_error`` =
  ‖AᵀA − I‖_F;
- receiver side (boundary b = inbound): ``health/b{b}/grad_fidelity`` = cos(g, g A Aᵀ) for the
  receiver's gradient g = dL/dX̂;
- codec hook: a boundary object with a ``health() -> dict[str, float]`` method is called on health
  steps on both sides and its keys are logged as ``health/b{b}/{key}``; other stage-level codec
  objects passed to :meth:`BoundaryProbe.collect` may do the same with keys naming their boundary
  (``"b{b}/name"``, logged as ``health/b{b}/name``);
- MAPL+VQ (``StageRuntime.vq``): the probed micro-batch's Z = R A (outbound ``act`` stream) and
  dL/dZ = g A (inbound ``grad`` stream) are quantized against the sender's mirror codebooks:
  ``health/b{b}/vq_act_cos`` = cos(Z, Ẑ), ``vq_act_rel_error`` = ‖Z − Ẑ‖/‖Z‖,
  ``vq_act_dead_code_fraction`` = share of codes no token selects (and ``vq_grad_*``).

Because the peers run the same StageRuntime, a swarm computes the same numbers per stage. The
probe can also record every forward (``record_all``), which the end-of-run analysis uses.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from mapl_swarm.compress.codebook_sync import VQSender
from mapl_swarm.compress.vq import decode_codes, quantize, to_groups
from mapl_swarm.compress.vq_stage import StageVQ
from mapl_swarm.metrics import JsonlWriter, health

__all__ = ["BoundaryProbe", "Capture", "append_health", "vq_stream_health"]


@dataclass
class Capture:
    """Sender-side tensors of one forward: the boundary activation and its offset (anchor)."""

    x: torch.Tensor
    """(B, T, d) boundary activation before the offset is subtracted (detached)."""
    offset: torch.Tensor | None
    """(B, T, d) anchor subtracted before projection, or None."""
    ids: torch.Tensor
    """(B, T) input token ids."""

    @property
    def residual(self) -> torch.Tensor:
        return self.x if self.offset is None else self.x - self.offset


class BoundaryProbe:
    """Captures boundary tensors on health steps and computes the health metrics of a stage."""

    def __init__(self, interval_steps: int) -> None:
        self.interval = interval_steps
        self.record_all = False
        """When set, every forward's sender tensors are appended to :attr:`records` (analysis)."""
        self.records: list[Capture] = []
        self._send: Capture | None = None
        self._recv_grad: torch.Tensor | None = None

    def due(self, step_count: int, micro: int, train: bool) -> bool:
        """Is this forward the probed one (first micro-batch of a health step)?"""
        return bool(train and self.interval and micro == 0 and (step_count + 1) % self.interval == 0)

    def on_send(self, due: bool, x: torch.Tensor, offset: torch.Tensor | None, ids: torch.Tensor) -> None:
        if not (due or self.record_all):
            return
        cap = Capture(x.detach(), None if offset is None else offset.detach(), ids.detach())
        if due:
            self._send = cap
        if self.record_all:
            self.records.append(cap)

    def on_recv(self, due: bool, x_hat: torch.Tensor) -> None:
        """Keep dL/dX̂ of the receiver's decoded activation when its backward runs."""
        if due and x_hat.requires_grad:
            def keep(g: torch.Tensor) -> None:
                self._recv_grad = g.detach()
            x_hat.register_hook(keep)

    def collect(self, inbound, outbound, *extras) -> dict[str, float]:
        """Metrics of the probed micro-batch (empty when this step is not a health step).

        ``extras`` are other codec objects of the stage (e.g. its VQ streams); one with a
        ``health()`` method returns keys that name their boundary themselves (``"b1/vq_cos"``),
        logged as ``health/{key}``."""
        out: dict[str, float] = {}
        send, grad = self._send, self._recv_grad
        self._send = self._recv_grad = None
        if send is not None and outbound is not None and outbound.projector is not None:
            a = outbound.projector
            pre = f"health/b{outbound.index}/"
            out[pre + "energy_captured"] = health.energy_captured(send.residual, a)
            out[pre + "orth_error"] = health.orthonormality_error(a)
        if grad is not None and inbound is not None and inbound.projector is not None:
            out[f"health/b{inbound.index}/grad_fidelity"] = health.gradient_fidelity(grad, inbound.projector)
        if send is not None or grad is not None:
            for side in (inbound, outbound):
                hook = getattr(side, "health", None)
                if callable(hook):
                    out.update({f"health/b{side.index}/{k}": float(v) for k, v in hook().items()})
            for extra in extras:
                if isinstance(extra, StageVQ):
                    out.update(_stage_vq_health(extra, send, grad, inbound, outbound))
                hook = getattr(extra, "health", None)
                if callable(hook):
                    out.update({f"health/{k}": float(v) for k, v in hook().items()})
        return out


def vq_stream_health(sender: VQSender, z: torch.Tensor) -> dict[str, float]:
    """Quantize z (..., r) against the sender's mirror codebooks (bit-identical to what the receiver
    decodes with): ``vq_cos`` = cos(Z, Ẑ), ``vq_rel_error`` = ‖Z − Ẑ‖/‖Z‖, and
    ``vq_dead_code_fraction`` = share of the R x r/G x K codes that no token of z selects."""
    s = sender.s
    x = to_groups(z.detach().float(), s.group_size)  # (N, NG, G)
    codes, _ = quantize(x, sender.mirror, sender.distance_bytes)  # (N, R, NG)
    z_hat = decode_codes(codes, sender.mirror)  # (N, NG*G)
    R, NG, K, _ = sender.mirror.shape
    offs = (torch.arange(R, device=codes.device)[:, None] * NG + torch.arange(NG, device=codes.device)) * K
    counts = torch.bincount((codes + offs).reshape(-1), minlength=R * NG * K)  # (R*NG*K,)
    out = health.quantization_stats(x.reshape(x.shape[0], -1), z_hat)
    out["vq_dead_code_fraction"] = health.dead_code_fraction(counts)
    return out


def _stage_vq_health(vq: StageVQ, send: Capture | None, grad: torch.Tensor | None, inbound,
                     outbound) -> dict[str, float]:
    """MAPL+VQ streams of a stage on the probed micro-batch: Z = R A on the outbound ``act`` stream,
    dL/dZ = g A on the inbound ``grad`` stream."""
    out: dict[str, float] = {}
    tx = vq.tx
    if send is not None and "act" in tx and outbound is not None:
        z = health.as_tokens(send.residual) @ outbound.projector.detach().float()  # (N, d)@(d, r)
        out.update({f"health/b{outbound.index}/{k.replace('vq_', 'vq_act_')}": v
                    for k, v in vq_stream_health(tx["act"], z).items()})
    if grad is not None and "grad" in tx and inbound is not None:
        dz = health.as_tokens(grad) @ inbound.projector.detach().float()  # (N, d)@(d, r)
        out.update({f"health/b{inbound.index}/{k.replace('vq_', 'vq_grad_')}": v
                    for k, v in vq_stream_health(tx["grad"], dz).items()})
    return out


def append_health(out_dir: str | Path, stage: int, step: int, metrics: dict[str, float]) -> None:
    """Append a stage's health metrics (keys ``health/...``) of ``step`` to
    ``out_dir/metrics_stage{stage}.jsonl`` — the metrics stream of a networked peer. No-op without any."""
    health_keys = {k: v for k, v in sorted(metrics.items()) if k.startswith("health/")}
    if not health_keys:
        return
    with JsonlWriter(Path(out_dir) / f"metrics_stage{stage}.jsonl") as w:
        w.write({"step": step, "stage": stage, **health_keys})
