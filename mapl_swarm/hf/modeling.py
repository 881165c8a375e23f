"""The trained swarm as one transformers model: :class:`MaplConfig` and :class:`MaplForCausalLM`.

The model is the whole decoder, every stage's layers in order (transformers' Llama components, as
the stages build them), with each stage boundary between the last layer of one stage and the first
of the next. A boundary computes what the wire did (:mod:`mapl_swarm.pipeline.stage`):

    Z = (X - send_offset[ids]) @ A            (fp32; no projector: Z = X)
    Z <- wire(Z)                              (the wire dtype's rounding, or MAPL+VQ's quantization
                                               against the receiver's codebooks)
    X_hat = Z @ A.T + recv_offset[ids]        (no projector: X_hat = Z)

with the offsets of the run's codec (``MaplConfig.mapl_boundary_offsets``): ``anchors`` (stage 0's
token embedding on boundary 0, then each stage's anchor table), ``t_fixed`` (SSN's frozen token
offsets on both sides) or ``zero``. Every boundary op works token by token, so the KV
cache of :class:`~transformers.DynamicCache` makes generation incremental exactly as for Llama.

Boundaries, anchors and offsets stay fp32 when the model is loaded in bf16 or fp16
(``_keep_in_fp32_modules_strict``): projectors and codebooks are fp32 on the wire too (DESIGN §3).
"""

from __future__ import annotations

import torch
from huggingface_hub.dataclasses import strict
from torch import nn
from transformers import GenerationMixin, LlamaConfig
from transformers.cache_utils import Cache, DynamicCache
from transformers.masking_utils import create_causal_mask
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast
from transformers.models.llama.modeling_llama import (
    LlamaDecoderLayer,
    LlamaPreTrainedModel,
    LlamaRMSNorm,
    LlamaRotaryEmbedding,
)

from mapl_swarm.compress.anchors import StageAnchor
from mapl_swarm.compress.ops import project, reconstruct
from mapl_swarm.compress.vq import decode_codes, quantize, to_groups

__all__ = ["MaplConfig", "MaplForCausalLM", "MaplModel", "MODEL_TYPE", "BOUNDARY_OFFSETS", "ANCHOR_KINDS"]

MODEL_TYPE = "mapl_llama"
BOUNDARY_OFFSETS = ("zero", "anchors", "t_fixed")
ANCHOR_KINDS = ("factorized", "full", "static", "none")
_WIRE_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
_VQ_KEYS = ("rounds", "groups", "codebook_size", "group_size")


@strict
class MaplConfig(LlamaConfig):
    """A Llama config plus the run's stage boundaries (``mapl_*`` fields, written to config.json)."""

    model_type = MODEL_TYPE

    mapl_codec: str = "mapl"
    """The run's boundary codec (for people; the fields below say what the boundaries compute)."""
    mapl_stage_starts: list[int] | None = None
    """First global layer of each stage, ascending from 0; a boundary precedes every start but the first."""
    mapl_wire_dtype: str = "bf16"
    """Dtype of activations on the wire: bf16, fp16 or fp32 (ignored with ``mapl_vq``)."""
    mapl_rank: int = 0
    """Width r of a boundary's projector (d x r); 0: no projector (the hidden state itself crosses)."""
    mapl_boundary_offsets: str = "zero"
    """zero | anchors | t_fixed: what a boundary subtracts before sending and adds after receiving."""
    mapl_input_offsets: bool = False
    """Stage 0 adds the frozen token offsets T_fixed to its embedding output (ssn, none_offsets)."""
    mapl_anchor: str = "none"
    """Anchor kind of stages 1..P-1 with ``anchors`` offsets: factorized | full | static | none."""
    mapl_anchor_rank: int = 0
    """Rank r_a of factorized anchors."""
    mapl_vq: dict | None = None
    """MAPL+VQ: {rounds, groups, codebook_size, group_size} of the residual VQ at every boundary."""

    def __post_init__(self, **kwargs):
        super().__post_init__(**kwargs)
        starts = self.mapl_stage_starts or [0]
        if starts[0] != 0 or any(b <= a for a, b in zip(starts, starts[1:])) or starts[-1] >= self.num_hidden_layers:
            raise ValueError(f"mapl_stage_starts {starts} must rise from 0 below num_hidden_layers "
                             f"{self.num_hidden_layers}")
        if self.mapl_boundary_offsets not in BOUNDARY_OFFSETS:
            raise ValueError(f"mapl_boundary_offsets must be one of {BOUNDARY_OFFSETS}, got {self.mapl_boundary_offsets!r}")
        if self.mapl_anchor not in ANCHOR_KINDS:
            raise ValueError(f"mapl_anchor must be one of {ANCHOR_KINDS}, got {self.mapl_anchor!r}")
        if self.mapl_wire_dtype not in _WIRE_DTYPES:
            raise ValueError(f"mapl_wire_dtype must be one of {tuple(_WIRE_DTYPES)}, got {self.mapl_wire_dtype!r}")
        if self.mapl_vq is not None and (sorted(self.mapl_vq) != sorted(_VQ_KEYS) or not self.mapl_rank):
            raise ValueError(f"mapl_vq needs exactly the keys {_VQ_KEYS} and a projector (mapl_rank > 0)")

    @property
    def num_stages(self) -> int:
        return len(self.mapl_stage_starts or [0])


class ExportedAnchor(StageAnchor):
    """A later stage's token anchor (its forward and state names are :class:`StageAnchor`'s), without
    the random initialisation: the values come from the checkpoint."""

    def __init__(self, kind: str, vocab_size: int, hidden_size: int, rank: int) -> None:
        nn.Module.__init__(self)
        self.kind = kind
        self.table = None
        if kind == "factorized":
            self.table = nn.Parameter(torch.zeros(vocab_size, rank))
            self.register_buffer("basis", torch.zeros(rank, hidden_size))
        elif kind == "full":
            self.table = nn.Parameter(torch.zeros(vocab_size, hidden_size))
        elif kind == "static":
            self.register_buffer("frozen", torch.zeros(vocab_size, hidden_size))


class ExportedBoundary(nn.Module):
    """One stage boundary: encode, the wire's rounding or quantization, decode (module docstring)."""

    def __init__(self, config: MaplConfig) -> None:
        super().__init__()
        d, r = config.hidden_size, config.mapl_rank
        self.wire_dtype = _WIRE_DTYPES[config.mapl_wire_dtype]
        self.register_buffer("projector", torch.zeros(d, r) if r else None)  # (d, r) fp32
        v = config.mapl_vq
        self.group_size = int(v["group_size"]) if v else 0
        self.register_buffer("codebooks", torch.zeros(v["rounds"], v["groups"], v["codebook_size"], self.group_size)
                             if v else None)  # (R, r/G, K, G) fp32

    def wire(self, z: torch.Tensor) -> torch.Tensor:
        """fp32 (B, T, w) -> what the receiver decoded: the wire dtype's rounding, or the residual VQ
        codes of z against the receiver's codebooks, decoded (the sender's mirror equals them)."""
        if self.codebooks is None:
            return z.to(self.wire_dtype).float()
        codes, _ = quantize(to_groups(z, self.group_size), self.codebooks)  # (N, R, NG)
        return decode_codes(codes, self.codebooks).reshape(z.shape)  # (B, T, r)

    def forward(self, x: torch.Tensor, send_offset: torch.Tensor | None,
                recv_offset: torch.Tensor | None) -> torch.Tensor:
        dtype = x.dtype
        if self.projector is None:
            return self.wire(x.float()).to(dtype)
        r = x if send_offset is None else x - send_offset
        z = self.wire(project(r, self.projector).float())  # (B, T, r)
        x_hat = reconstruct(z, self.projector)
        return (x_hat if recv_offset is None else x_hat + recv_offset).to(dtype)


class MaplPreTrainedModel(LlamaPreTrainedModel):
    config_class = MaplConfig
    config: MaplConfig
    _keep_in_fp32_modules_strict = ["boundaries", "anchors", "offsets"]
    _can_compile_fullgraph = False  # the VQ search is data-dependent


class MaplModel(MaplPreTrainedModel):
    """The decoder of every stage with the stage boundaries in between; returns the final-normed
    hidden states, as :class:`~transformers.LlamaModel` does."""

    def __init__(self, config: MaplConfig) -> None:
        super().__init__(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList([LlamaDecoderLayer(config, i) for i in range(config.num_hidden_layers)])
        self.norm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = LlamaRotaryEmbedding(config=config)
        starts = config.mapl_stage_starts or [0]
        self.boundary_after = {start - 1: b for b, start in enumerate(starts[1:])}
        """Global layer index -> the boundary that follows it."""
        self.boundaries = nn.ModuleList([ExportedBoundary(config) for _ in starts[1:]])
        self.anchors = nn.ModuleDict()
        if config.mapl_boundary_offsets == "anchors" and config.mapl_anchor != "none":
            for stage in range(1, len(starts)):
                self.anchors[str(stage)] = ExportedAnchor(config.mapl_anchor, config.vocab_size,
                                                          config.hidden_size, config.mapl_anchor_rank)
        offsets = config.mapl_input_offsets or config.mapl_boundary_offsets == "t_fixed"
        self.register_buffer("offsets", torch.zeros(config.vocab_size, config.hidden_size) if offsets else None)
        self.post_init()

    def _anchor(self, stage: int, ids: torch.Tensor) -> torch.Tensor | None:
        anchor = self.anchors[str(stage)] if str(stage) in self.anchors else None
        return anchor(ids) if anchor is not None else None

    def _offsets(self, boundary: int, ids: torch.Tensor, embedded: torch.Tensor):
        """(send offset, receive offset) of ``boundary`` for ``ids``, as the codec's ``offset``."""
        kind = self.config.mapl_boundary_offsets
        if kind == "t_fixed":
            t = self.offsets[ids]
            return t, t
        if kind == "anchors":
            first_anchored = self.config.mapl_anchor != "none"
            send = (embedded if first_anchored else None) if boundary == 0 else self._anchor(boundary, ids)
            return send, self._anchor(boundary + 1, ids)
        return None, None

    def forward(self, input_ids: torch.LongTensor | None = None, attention_mask: torch.Tensor | None = None,
                position_ids: torch.LongTensor | None = None, cache: Cache | None = None,
                inputs_embeds: torch.Tensor | None = None, use_cache: bool | None = None,
                past_key_values: Cache | None = None, **kwargs) -> BaseModelOutputWithPast:
        if input_ids is None:
            raise ValueError("MaplModel needs input_ids: the boundaries look up token anchors and offsets")
        cache = cache if cache is not None else past_key_values
        use_cache = self.config.use_cache if use_cache is None else use_cache
        embedded = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds  # (B, T, d)
        if use_cache and cache is None:
            cache = DynamicCache(config=self.config)
        if position_ids is None:
            past = cache.get_seq_length() if cache is not None else 0
            position_ids = (torch.arange(embedded.shape[1], device=embedded.device) + past).unsqueeze(0)  # (1, T)
        mask = create_causal_mask(config=self.config, inputs_embeds=embedded, attention_mask=attention_mask,
                                  cache=cache, position_ids=position_ids)
        hidden = embedded
        if self.config.mapl_input_offsets:
            hidden = (embedded + self.offsets[input_ids]).to(embedded.dtype)
        position_embeddings = self.rotary_emb(hidden, position_ids=position_ids)
        for i, layer in enumerate(self.layers):
            hidden = layer(hidden, attention_mask=mask, position_embeddings=position_embeddings,
                           position_ids=position_ids, cache=cache, use_cache=use_cache, **kwargs)
            b = self.boundary_after.get(i)
            if b is not None:
                hidden = self.boundaries[b](hidden, *self._offsets(b, input_ids, embedded))
        return BaseModelOutputWithPast(last_hidden_state=self.norm(hidden), cache=cache)


class MaplForCausalLM(MaplPreTrainedModel, GenerationMixin):
    """:class:`MaplModel` and the untied lm_head; logits in fp32, as the last stage computes them."""

    def __init__(self, config: MaplConfig) -> None:
        super().__init__(config)
        self.model = MaplModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def forward(self, input_ids: torch.LongTensor | None = None, attention_mask: torch.Tensor | None = None,
                position_ids: torch.LongTensor | None = None, cache: Cache | None = None,
                inputs_embeds: torch.Tensor | None = None, labels: torch.LongTensor | None = None,
                use_cache: bool | None = None, logits_to_keep: int | torch.Tensor = 0,
                past_key_values: Cache | None = None, **kwargs) -> CausalLMOutputWithPast:
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                         cache=cache, past_key_values=past_key_values, inputs_embeds=inputs_embeds,
                         use_cache=use_cache, **kwargs)
        hidden = out.last_hidden_state
        if isinstance(logits_to_keep, int) and logits_to_keep:
            hidden = hidden[:, -logits_to_keep:]
        elif not isinstance(logits_to_keep, int):
            hidden = hidden[:, logits_to_keep]
        logits = self.lm_head(hidden).float()  # (B, T, V)
        loss = None
        if labels is not None:
            loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size, **kwargs)
        return CausalLMOutputWithPast(loss=loss, logits=logits, cache=out.cache)
