"""A pipeline's stages (their trained state) -> one transformers model.

:func:`to_hf_model` copies every stage's weights and its codec's boundary state (projectors,
anchors, SSN's offsets, the receiver's VQ codebooks) into a :class:`~.modeling.MaplForCausalLM`,
or into a plain :class:`~transformers.LlamaForCausalLM` when the boundaries change nothing but the
wire dtype (no projector, no offsets, no quantization: ``codec = "none"``). What the codec's
boundaries compute comes from the codec class (:attr:`StageCodec.boundary_offsets`,
:attr:`StageCodec.input_offsets`), never from its name.
"""

from __future__ import annotations

import logging

import torch
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedModel

from mapl_swarm.config import ModelConfig, TrainConfig
from mapl_swarm.hf.modeling import MaplConfig, MaplForCausalLM
from mapl_swarm.pipeline.inprocess import InProcessPipeline

log = logging.getLogger(__name__)

__all__ = ["to_hf_model", "exports_plain_llama", "maplconfig_of", "llama_config"]


def llama_config(cfg: ModelConfig) -> LlamaConfig:
    """The transformers LlamaConfig of our model shape (sdpa attention, no bias, untied head)."""
    lc = LlamaConfig(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.ffn_hidden_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.kv_heads,
        max_position_embeddings=cfg.context_length,
        rms_norm_eps=cfg.rms_norm_eps,
        rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta},
        attention_bias=False,
        mlp_bias=False,
        tie_word_embeddings=False,
    )
    lc._attn_implementation = "sdpa"
    return lc


def exports_plain_llama(pipe: InProcessPipeline) -> bool:
    """Whether the run's boundaries only cast to the wire dtype, so that a plain Llama is the model
    (exact with an fp32 wire; with bf16 or fp16 it skips the boundary rounding)."""
    codec = pipe.stages[0].codec
    out = pipe.stages[0].outbound
    return (codec.boundary_offsets == "zero" and not codec.input_offsets and pipe.stages[0].vq is None
            and (out is None or out.projector is None))


def _stage_starts(pipe: InProcessPipeline) -> list[int]:
    return [stage.model.layer_range[0] for stage in pipe.stages]


def maplconfig_of(cfg: TrainConfig, pipe: InProcessPipeline, *, eos_token_id: int | None) -> MaplConfig:
    """The :class:`MaplConfig` of a run config and its stages."""
    base = llama_config(cfg.model).to_dict()
    for key in ("model_type", "transformers_version", "architectures", "_attn_implementation"):
        base.pop(key, None)
    c, vq = cfg.compression, pipe.stages[0].vq
    codec = pipe.stages[0].codec
    out = pipe.stages[0].outbound
    vq_layout = None
    if vq is not None:
        rounds, groups, size, group = vq.s.layout.shape
        vq_layout = {"rounds": rounds, "groups": groups, "codebook_size": size, "group_size": group}
    return MaplConfig(**{**base, "bos_token_id": None, "eos_token_id": eos_token_id, "pad_token_id": None},
                      mapl_codec=codec.name, mapl_stage_starts=_stage_starts(pipe), mapl_wire_dtype=c.wire_dtype,
                      mapl_rank=int(out.projector.shape[1]) if out is not None and out.projector is not None else 0,
                      mapl_boundary_offsets=codec.boundary_offsets, mapl_input_offsets=codec.input_offsets,
                      mapl_anchor=c.anchor if codec.boundary_offsets == "anchors" else "none",
                      mapl_anchor_rank=c.anchor_rank, mapl_vq=vq_layout)


def _copy_decoder(model, pipe: InProcessPipeline) -> None:
    """Embedding, every stage's layers (at their global index), final norm and lm_head."""
    first, last = pipe.stages[0].model, pipe.stages[-1].model
    model.model.embed_tokens.load_state_dict(first.embed_tokens.state_dict())
    for stage in pipe.stages:
        for layer, i in zip(stage.model.layers, stage.model.layer_range, strict=True):
            model.model.layers[i].load_state_dict(layer.state_dict())
    model.model.norm.load_state_dict(last.norm.state_dict())
    model.lm_head.load_state_dict(last.lm_head.state_dict())


@torch.no_grad()
def _copy_boundaries(model: MaplForCausalLM, pipe: InProcessPipeline) -> None:
    inner = model.model
    for b, boundary in enumerate(inner.boundaries):
        sender, receiver = pipe.stages[b], pipe.stages[b + 1]
        if boundary.projector is not None:
            # the sender owns A; the receiver installs the same A before it decodes again
            boundary.projector.copy_(sender.outbound.projector.detach())
        if boundary.codebooks is not None:
            boundary.codebooks.copy_(receiver.vq.rx["act"].codebooks)  # what the receiver decodes with
    for key, anchor in inner.anchors.items():
        anchor.load_state_dict(pipe.stages[int(key)].anchor.state_dict())
    if inner.offsets is not None:
        inner.offsets.copy_(pipe.stages[0].codec.offsets)


def to_hf_model(cfg: TrainConfig, pipe: InProcessPipeline, *, eos_token_id: int | None) -> PreTrainedModel:
    """One CPU fp32 transformers model holding every stage of ``pipe`` (eval mode)."""
    if exports_plain_llama(pipe):
        lc = llama_config(cfg.model)
        lc.bos_token_id, lc.eos_token_id, lc.pad_token_id = None, eos_token_id, None
        model: PreTrainedModel = LlamaForCausalLM(lc)
        _copy_decoder(model, pipe)
    else:
        model = MaplForCausalLM(maplconfig_of(cfg, pipe, eos_token_id=eos_token_id))
        _copy_decoder(model, pipe)
        _copy_boundaries(model, pipe)
    return model.eval()
