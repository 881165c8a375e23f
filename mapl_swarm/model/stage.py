"""One pipeline stage of a LLaMA-style decoder.

Stage 0 owns the token embedding, every stage owns a contiguous slice of decoder layers
(:class:`~.llama.DecoderLayer`, transformers' ``LlamaDecoderLayer`` written out; with their
global layer indices) and a rotary embedding, and the last stage owns the final RMSNorm and the
lm_head. Weights are initialised from generators keyed by the *global* layer index, so the same
seed gives the same model whatever the partition (P=1 equals P=4 weight for weight). Parameter
names are transformers' Llama names, which the export (:mod:`mapl_swarm.hf`) relies on.
"""

from __future__ import annotations

import torch
from torch import nn

from mapl_swarm.config import ModelConfig
from mapl_swarm.model.llama import DecoderLayer, RMSNorm, RotaryEmbedding
from mapl_swarm.model.partition import partition_layers
from mapl_swarm.rng import generator

__all__ = ["StageModel"]


def _init_normal_(module: nn.Module, std: float, gen: torch.Generator) -> None:
    """Normal(0, std) for every 2D weight (Linear, Embedding); norms keep their ones."""
    with torch.no_grad():
        for _, p in sorted(module.named_parameters()):
            if p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=gen) * std)


class StageModel(nn.Module):
    """Layers ``layer_range`` of the decoder plus the embedding (first stage) and head (last stage)."""

    def __init__(self, cfg: ModelConfig, stage: int, num_stages: int, seed: int) -> None:
        super().__init__()
        self.cfg = cfg
        self.stage = stage
        self.num_stages = num_stages
        self.is_first = stage == 0
        self.is_last = stage == num_stages - 1
        self.layer_range = partition_layers(cfg.num_layers, num_stages)[stage]
        self.embed_tokens: nn.Embedding | None = None
        if self.is_first:
            self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
            _init_normal_(self.embed_tokens, cfg.init_std, generator(seed, "embed"))
        self.layers = nn.ModuleList()
        for i in self.layer_range:
            layer = DecoderLayer(cfg, layer_idx=i)
            _init_normal_(layer, cfg.init_std, generator(seed, "layer", i))
            self.layers.append(layer)
        self.rotary = RotaryEmbedding(cfg)
        self.norm: RMSNorm | None = None
        self.lm_head: nn.Linear | None = None
        if self.is_last:
            self.norm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
            self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
            _init_normal_(self.lm_head, cfg.init_std, generator(seed, "lm_head"))

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """(B, T) int ids -> (B, T, d) token embeddings (first stage only)."""
        assert self.embed_tokens is not None, "only the first stage embeds tokens"
        return self.embed_tokens(ids)

    def run_layers(self, x: torch.Tensor) -> torch.Tensor:
        """(B, T, d) -> (B, T, d) through this stage's causal decoder layers."""
        seq_len = x.shape[1]
        position_ids = torch.arange(seq_len, device=x.device).unsqueeze(0)  # (1, T)
        pos_emb = self.rotary(x, position_ids)
        for layer in self.layers:
            x = layer(x, pos_emb)
        return x

    def head(self, x: torch.Tensor) -> torch.Tensor:
        """(B, T, d) -> (B, T, V) logits (last stage only)."""
        assert self.norm is not None and self.lm_head is not None, "only the last stage has the head"
        return self.lm_head(self.norm(x))

    def hidden_matrices(self) -> list[tuple[str, nn.Parameter]]:
        """2D weights of the decoder layers (Muon's parameters)."""
        return [(f"layers.{n}", p) for n, p in self.layers.named_parameters() if p.dim() == 2]

    def residual_writers(self) -> list[nn.Parameter]:
        """Weights whose outputs are added to the residual stream: attention o_proj and MLP
        down_proj, in torch's (out, in) layout (SSN constrains their output dimension)."""
        out = []
        for layer in self.layers:
            out.append(layer.self_attn.o_proj.weight)
            out.append(layer.mlp.down_proj.weight)
        return out
