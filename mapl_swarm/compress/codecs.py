"""Boundary codec objects: one class per codec family, registered by name.

A codec object is built once per stage (:func:`build_codec`) and owns everything that differs
between codecs on that stage:

- its modules: the token anchor of a later stage, the inbound and outbound :class:`Boundary`
  (projectors), shared state (SSN's global basis and offsets), codebook streams (MAPL+VQ);
- its rows of the parameter table (:mod:`mapl_swarm.optim.param_table`);
- the offset rule (what is subtracted before projecting and added after reconstructing);
- payload encode/decode (ACT ``act`` or ``codes``; GRAD ``grad`` or ``codes``);
- per-step hooks (SSN's weight constraint), its metrics and extra checkpoint state;
- payload bytes per token (:meth:`StageCodec.payload_bytes`);
- its static facts (display name, baseline, ...) as :attr:`StageCodec.info` from the catalog.

=============  ============================  ==============================================
family         codecs                        boundary
=============  ============================  ==============================================
uncompressed   none, none_offsets            X (d channels) in the wire dtype (none_offsets: stage 1
                                             adds SSN's frozen T_fixed to its embedding output)
projected      mapl, fixed, naive            Z = (X - anchor[ids]) A  (r channels)
ssn            ssn                           Z = (X - T_fixed[ids]) U  (k channels, one U)
projected_vq   mapl_vq                       residual VQ codes of mapl's Z (codebooks streamed)
=============  ============================  ==============================================

This module and :mod:`mapl_swarm.config.catalog` are the only places that spell codec names.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import nn

from mapl_swarm.compress import ssn
from mapl_swarm.compress.anchors import StageAnchor
from mapl_swarm.compress.boundary import WIRE_TORCH_DTYPES, Boundary, BoundaryBytes, BoundaryShape, id_wire_dtype
from mapl_swarm.config.catalog import CodecInfo, codec_info
from mapl_swarm.config import VQConfig
from mapl_swarm.compress.vq_stage import StageVQ
from mapl_swarm.optim.param_table import ParamRow, adamw_rows
from mapl_swarm.compress.stiefel import random_stiefel
from mapl_swarm.rng import generator

if TYPE_CHECKING:
    from mapl_swarm.config import TrainConfig

log = logging.getLogger(__name__)

__all__ = [
    "StageCodec",
    "CODEC_CLASSES",
    "build_codec",
    "codec_class",
    "boundary_bytes",
    "boundary_projector",
    "config_boundary_bytes",
]

Payload = dict[str, torch.Tensor]


class StageCodec:
    """The uncompressed boundary (``none``) and the base of every codec family.

    Built for stage ``stage`` (0-based) of ``cfg``: ``inbound`` is the receiving side of boundary
    ``stage - 1`` (None on the first stage), ``outbound`` the sending side of boundary ``stage``
    (None on the last)."""

    names: ClassVar[tuple[str, ...]] = ("none",)
    """Catalog names this class implements."""
    boundary_offsets: ClassVar[str] = "zero"
    """What :meth:`offset` is, in the exported model's terms (:mod:`mapl_swarm.hf.modeling`): ``zero``,
    ``anchors`` (stage 0's token embedding, then each later stage's anchor) or ``t_fixed`` (the frozen
    token offsets)."""
    input_offsets: ClassVar[bool] = False
    """Whether :meth:`first_stage_input` adds the frozen token offsets ``self.offsets`` (T_fixed)."""

    def __init__(self, name: str, cfg: "TrainConfig", stage: int, device: torch.device) -> None:
        self.info: CodecInfo = codec_info(name)
        self.cfg = cfg
        self.stage = stage
        self.device = device
        P = cfg.pipeline.num_stages
        self.is_first, self.is_last = stage == 0, stage == P - 1
        self.wire_dtype = WIRE_TORCH_DTYPES[cfg.compression.wire_dtype]
        self.id_dtype = id_wire_dtype(cfg.model.vocab_size)
        self.anchor: StageAnchor | None = self._build_anchor()
        self.inbound = None if self.is_first else self._boundary("recv", stage - 1)
        self.outbound = None if self.is_last or P == 1 else self._boundary("send", stage)
        self.vq: StageVQ | None = None
        """MAPL+VQ: this stage's codebook streams (None for the other codecs)."""

    @property
    def name(self) -> str:
        return self.info.name

    # ------------------------------------------------------------------ construction
    def _build_anchor(self) -> StageAnchor | None:
        return None

    def _projector(self, index: int) -> tuple[torch.Tensor | None, bool]:
        """The initial projector of boundary ``index`` and whether it trains."""
        return None, False

    def _boundary(self, role: str, index: int) -> Boundary:
        projector, trainable = self._projector(index)
        return Boundary(role, index, projector, trainable=trainable)

    def modules(self) -> dict[str, nn.Module]:
        """The codec's modules by checkpoint name (``anchor``, ``inbound``, ``outbound``)."""
        mods = {"anchor": self.anchor, "inbound": self.inbound, "outbound": self.outbound}
        return {k: m for k, m in mods.items() if m is not None}

    def param_rows(self) -> list[ParamRow]:
        """This codec's rows of the stage's parameter table."""
        return []

    def adamw_lr_ratio(self) -> float:
        """AdamW lr ratio of the model's own AdamW rows (embeddings, norms, lm_head) under this codec."""
        return self.cfg.optim.adamw_lr_ratio

    def setup(self, model: nn.Module) -> None:
        """Called once the stage's modules (``model`` among them) are on their device, before the
        optimizers exist."""

    # ------------------------------------------------------------------ forward pieces
    def stage_anchor(self, tokens: torch.Tensor) -> torch.Tensor | None:
        """The anchor of a later stage for (B, T) ``tokens``: (B, T, d) or None."""
        return self.anchor(tokens) if self.anchor is not None else None

    def first_stage_input(self, embedded: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """Stage 0: what enters the first layer given the token embedding."""
        return embedded

    def offset(self, tokens: torch.Tensor, embedded: torch.Tensor | None,
               anchor: torch.Tensor | None) -> torch.Tensor | None:
        """What the sender subtracts before projecting and the receiver adds after reconstructing."""
        if self.is_first:
            return None if self.cfg.compression.anchor == "none" else embedded
        return anchor

    def encode_act(self, z: torch.Tensor, *, train: bool, micro: int) -> Payload:
        """ACT payload tensors (besides ``ids``) of the boundary output z (B, T, w), fp32."""
        return {"act": z.detach().to(self.wire_dtype)}

    def decode_act(self, payload: Payload, cver: int | None) -> torch.Tensor:
        """fp32 (B, T, w) on the stage's device from a received ACT payload (a pinned host payload
        is copied without blocking, then widened on the device)."""
        return payload["act"].to(self.device, non_blocking=True).float()

    def encode_grad(self, grad: torch.Tensor, *, micro: int) -> Payload:
        """GRAD payload of dL/dZ_in (B, T, w)."""
        return {"grad": grad.to(self.wire_dtype)}

    def decode_grad(self, payload: Payload, cver: int | None) -> torch.Tensor:
        """fp32 (B, T, w) from a received GRAD payload (undecodable VQ codes raise the named
        CodebookError, leaving the saved forward in place for a retransmission)."""
        return payload["grad"].to(self.device, non_blocking=True).float()

    # ------------------------------------------------------------------ steps, state
    def after_step(self) -> None:
        """After every optimizer step of the stage."""

    def abandon_step(self) -> None:
        """The step is redone from its start: forget what the codec gathered of it."""

    def step_statistics(self) -> list[torch.Tensor]:
        """Tensors the codec gathered over the step that the replicas of a stage average with
        their gradients (each replica's share of the step's value; written back averaged before
        the step): MAPL+VQ's ``update = step`` codebook statistics; none by default."""
        return []

    def replicated_state(self) -> dict[str, Any]:
        """Codec state beside the parameters that every replica of the stage holds alike (their
        digests are compared at every step): MAPL+VQ's learned and mirrored codebooks."""
        return {}

    def step_metrics(self) -> dict[str, float]:
        """Codec metrics of the step just taken."""
        return {}

    def warm_up(self, tokens_per_micro: int) -> dict:
        """Before the handshake: prepare device work (mapl_vq: size and compile the VQ search for
        micro-batches of ``tokens_per_micro`` tokens); returns what it decided (empty: nothing)."""
        return {}

    @staticmethod
    def before_pipeline_step(codecs: list["StageCodec"], step: int) -> None:
        """In-process pipeline only: a hook over every stage's codec before the stages step."""

    def state_dict(self) -> dict:
        """Checkpoint state beyond :meth:`modules` (e.g. codebooks)."""
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass

    # ------------------------------------------------------------------ bytes
    @classmethod
    def payload_bytes(cls, shape: BoundaryShape) -> BoundaryBytes:
        """Exact payload bytes per token of one boundary (headers not included)."""
        item = torch.empty((), dtype=WIRE_TORCH_DTYPES[shape.wire_dtype]).element_size()
        width = cls.payload_width(shape)
        return BoundaryBytes(forward_act_bytes=float(width * item), forward_ids_bytes=shape.ids_bytes_per_token,
                             backward_bytes=float(width * item))

    @classmethod
    def payload_width(cls, shape: BoundaryShape) -> int:
        """Channels per token of the boundary tensor."""
        return shape.hidden_size


class ProjectedCodec(StageCodec):
    """``Z = (X - anchor_send[ids]) A`` with A in St(d, r) seeded per boundary: learned by SPEL
    (``mapl``), frozen (``fixed``) or learned by plain Muon without the manifold (``naive``)."""

    names = ("mapl", "fixed", "naive")
    boundary_offsets = "anchors"

    def _build_anchor(self) -> StageAnchor | None:
        if self.is_first:
            return None  # stage 0's anchor is its own token embedding
        c, m = self.cfg.compression, self.cfg.model
        return StageAnchor(c.anchor, m.vocab_size, m.hidden_size, c.anchor_rank, c.anchor_init_std,
                           self.cfg.run.seed, self.stage)

    def _projector(self, index: int) -> tuple[torch.Tensor | None, bool]:
        a = boundary_projector(self.cfg.model.hidden_size, self.cfg.compression.rank, self.cfg.run.seed, index)
        return a, self.info.trainable_projector

    def param_rows(self) -> list[ParamRow]:
        o = self.cfg.optim
        rows = adamw_rows("anchor", self.anchor, o)
        out = self.outbound
        if out is not None and out.trainable:
            if self.info.name == "naive":
                # the projector as an ordinary 2D weight under Muon at the projector lr, no weight
                # decay: only the manifold constraint differs from SPEL
                rows.append(ParamRow("projector", "muon", o.projector_lr_ratio, 0.0, [out.projector]))
            else:
                rows.append(ParamRow("projector", "spel", o.projector_lr_ratio, 0.0, [out.projector]))
        return rows

    @classmethod
    def payload_width(cls, shape: BoundaryShape) -> int:
        return shape.rank


def frozen_offsets(cfg: "TrainConfig", device: torch.device) -> torch.Tensor:
    """SSN's frozen token offsets T_fixed (V, d) at ``compression.ssn_offset_std`` on ``device``."""
    m = cfg.model
    return ssn.ssn_offsets(m.vocab_size, m.hidden_size, cfg.run.seed, cfg.compression.ssn_offset_std).to(device)


class OffsetsCodec(StageCodec):
    """``none_offsets``: the uncompressed boundary with SSN's frozen token offsets added to stage 0's
    embedding output (no projection, the model's AdamW ratio): the reference that separates SSN's
    offset table from its compression."""

    names = ("none_offsets",)
    input_offsets = True

    def __init__(self, name: str, cfg: "TrainConfig", stage: int, device: torch.device) -> None:
        self.offsets = frozen_offsets(cfg, device) if stage == 0 else None
        super().__init__(name, cfg, stage, device)

    def first_stage_input(self, embedded: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        return embedded + self.offsets[tokens]


class SSNCodec(StageCodec):
    """Subspace Networks (:mod:`.ssn`): one global basis U for every boundary, frozen token offsets
    T_fixed added to stage 0's embedding output, residual writers projected onto span(U) after
    every step; U may take a Grassmann step every ``ssn_refresh_interval_steps`` (in-process only)."""

    names = ("ssn",)
    boundary_offsets = "t_fixed"
    input_offsets = True

    def __init__(self, name: str, cfg: "TrainConfig", stage: int, device: torch.device) -> None:
        c, m = cfg.compression, cfg.model
        self.basis = nn.Parameter(ssn.ssn_basis(m.hidden_size, c.rank, cfg.run.seed),
                                  requires_grad=c.ssn_refresh_interval_steps > 0)
        self.offsets = frozen_offsets(cfg, device)
        super().__init__(name, cfg, stage, device)
        self._model: nn.Module | None = None

    def adamw_lr_ratio(self) -> float:
        return self.cfg.compression.ssn_adamw_lr_ratio

    def _boundary(self, role: str, index: int) -> Boundary:
        return Boundary(role, index, self.basis, trainable=False)  # shared by both sides and stages

    def setup(self, model: nn.Module) -> None:
        self._model = model  # its residual writers are what the constraint projects
        self._constrain()

    def first_stage_input(self, embedded: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        return embedded + self.offsets[tokens]

    def offset(self, tokens, embedded, anchor):
        return self.offsets[tokens]

    def after_step(self) -> None:
        self._constrain()

    def _constrain(self) -> None:
        if self.is_last or self._model is None:
            return  # layers after the last boundary need no constraint (node0 exempts them)
        emb = self._model.embed_tokens.weight if self.is_first else None
        ssn.constrain_(self.basis, self._model.residual_writers(), emb)

    def take_basis_grad(self) -> torch.Tensor | None:
        """This stage's gradient of U since the last call (None when U is frozen)."""
        if not self.basis.requires_grad:
            return None
        g = self.basis.grad
        self.basis.grad = None
        return torch.zeros_like(self.basis) if g is None else g.detach().clone()

    def set_basis(self, basis: torch.Tensor) -> None:
        with torch.no_grad():
            self.basis.copy_(basis.to(self.basis.device))
        self._constrain()

    @staticmethod
    def before_pipeline_step(codecs: list["StageCodec"], step: int) -> None:
        """Grassmann refresh of U every ``ssn_refresh_interval_steps`` on the gradient summed over
        every stage (needs all stages, so in-process only)."""
        c = codecs[0].cfg.compression
        if c.ssn_refresh_interval_steps == 0:
            return
        grads = [codec.take_basis_grad() for codec in codecs if isinstance(codec, SSNCodec)]
        if (step + 1) % c.ssn_refresh_interval_steps != 0:
            return
        total = torch.stack([g.cpu() for g in grads if g is not None]).sum(0)
        first = codecs[0]
        assert isinstance(first, SSNCodec)
        new_basis = ssn.grassmann_step(first.basis.detach().cpu(), total, c.ssn_refresh_lr)
        for codec in codecs:
            assert isinstance(codec, SSNCodec)
            codec.set_basis(new_basis)
        log.info("ssn: Grassmann refresh of U at step %d", step + 1)

    @classmethod
    def payload_width(cls, shape: BoundaryShape) -> int:
        return shape.rank


class ProjectedVQCodec(ProjectedCodec):
    """MAPL+VQ: MAPL's projection (SPEL), then grouped residual VQ of Z and dL/dZ with streamed
    codebooks (:mod:`.vq_stage`); payloads carry ``codes`` (B, T, R, r/G) instead of act/grad."""

    names = ("mapl_vq",)

    def __init__(self, name: str, cfg: "TrainConfig", stage: int, device: torch.device) -> None:
        super().__init__(name, cfg, stage, device)
        self.vq = StageVQ(cfg.compression.vq, stage, has_inbound=self.inbound is not None,
                          has_outbound=self.outbound is not None, seed=cfg.run.seed, device=device,
                          micro_batches=cfg.pipeline.num_micro_batches)

    def encode_act(self, z, *, train, micro):
        # straight-through: the backward feeds the decoded dL/dZ_hat to z
        return {"codes": self.vq.encode("act", z.detach(), learn=train, key=micro)}

    def decode_act(self, payload, cver):
        # codes as received: the receiver checks host codes before copying them to the device
        return self.vq.decode("act", payload["codes"], cver)

    def encode_grad(self, grad, *, micro):
        return {"codes": self.vq.encode("grad", grad, learn=True, key=micro)}

    def decode_grad(self, payload, cver):
        return self.vq.decode("grad", payload["codes"], cver)

    def after_step(self) -> None:
        super().after_step()
        self.vq.end_step()

    def abandon_step(self) -> None:
        self.vq.clear_step()

    def step_statistics(self) -> list[torch.Tensor]:
        return self.vq.step_statistics()

    def replicated_state(self) -> dict[str, Any]:
        return self.vq.replicated_state()

    def step_metrics(self) -> dict[str, float]:
        return self.vq.metrics()

    def warm_up(self, tokens_per_micro: int) -> dict:
        return self.vq.warm_up(tokens_per_micro)

    def state_dict(self) -> dict:
        return {"vq": self.vq.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.vq.load_state_dict(state["vq"])

    @classmethod
    def payload_bytes(cls, shape: BoundaryShape) -> BoundaryBytes:
        """Codes (R x r/G bytes per token each way for K <= 256) and, with ``tokens_per_micro``
        (``update = step``: ``tokens_per_step``), the amortised steady-state codebook slices (the
        k-means initialisation's full slices come on top)."""
        vq = shape.vq
        if vq is None:
            raise ValueError("payload bytes of mapl_vq need its VQ settings")
        codes = float(vq.code_bytes_per_token)
        if vq.update == "step":  # one full slice per step
            slices = vq.slice_bytes(vq.codebook_size) / shape.tokens_per_step if shape.tokens_per_step else 0.0
        else:
            slices = vq.slice_bytes_per_micro / shape.tokens_per_micro if shape.tokens_per_micro else 0.0
        return BoundaryBytes(forward_act_bytes=codes, forward_ids_bytes=shape.ids_bytes_per_token,
                             backward_bytes=codes, codebook_bytes=slices)


CODEC_CLASSES: dict[str, type[StageCodec]] = {
    name: cls for cls in (StageCodec, OffsetsCodec, ProjectedCodec, SSNCodec, ProjectedVQCodec) for name in cls.names}
"""The registry: codec name -> its family's class."""


def codec_class(name: str) -> type[StageCodec]:
    """The class implementing codec ``name`` (ValueError naming the known codecs otherwise)."""
    codec_info(name)  # the catalog's error for unknown names
    return CODEC_CLASSES[name]


def build_codec(cfg: "TrainConfig", stage: int, device: torch.device) -> StageCodec:
    """Stage ``stage``'s codec object for ``cfg.compression.codec``."""
    name = cfg.compression.codec
    return codec_class(name)(name, cfg, stage, device)


def boundary_bytes(codec: str, hidden_size: int, rank: int, wire_dtype: str, vocab_size: int, seq_len: int,
                   *, vq: VQConfig | None = None, tokens_per_micro: int | None = None,
                   tokens_per_step: int | None = None) -> BoundaryBytes:
    """Exact payload bytes per token of one boundary of ``codec`` (``mapl_vq`` needs ``vq``; with
    ``tokens_per_micro`` its amortised codebook slices are in ``codebook_bytes``, with
    ``tokens_per_step`` a trainable projector's exchange in ``projector_bytes``)."""
    shape = BoundaryShape(hidden_size=hidden_size, rank=rank, wire_dtype=wire_dtype, vocab_size=vocab_size,
                          seq_len=seq_len, vq=vq, tokens_per_micro=tokens_per_micro, tokens_per_step=tokens_per_step)
    out = codec_class(codec).payload_bytes(shape)
    if codec_info(codec).trainable_projector and tokens_per_step:
        out = replace(out, projector_bytes=hidden_size * rank * 4 / tokens_per_step)  # fp32 d x r, once per step
    return out


def config_boundary_bytes(cfg: "TrainConfig") -> BoundaryBytes:
    """:func:`boundary_bytes` of a run config (micro-batch of B x T tokens, M micro-batches a step)."""
    c, m = cfg.compression, cfg.model
    vq = c.vq if codec_info(c.codec).quantized else None
    return boundary_bytes(c.codec, m.hidden_size, c.rank, c.wire_dtype, m.vocab_size, m.context_length, vq=vq,
                          tokens_per_micro=cfg.pipeline.micro_batch_size * m.context_length,
                          tokens_per_step=cfg.tokens_per_step)


def boundary_projector(hidden_size: int, rank: int, seed: int, index: int) -> torch.Tensor:
    """The initial projector of boundary ``index``: random orthonormal (d, r), seeded by
    (run seed, "projector", index) so both sides and every partition agree."""
    return random_stiefel(hidden_size, rank, generator(seed, "projector", index))
