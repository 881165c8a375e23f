"""The LLaMA decoder blocks a stage runs: RMSNorm, rotary embedding, attention and SwiGLU MLP.

These are transformers' Llama components (``LlamaDecoderLayer`` with the sdpa attention,
``LlamaRMSNorm``, ``LlamaRotaryEmbedding`` with default RoPE; transformers 5.x) written out in
plain torch, with the same parameter names, the same construction order (so the same draws of the
global RNG) and the same operations in the same order, so that they compute the same bits
(``tests/unit/test_model.py`` compares them with transformers' own, fp32 and bf16 autocast,
forward and backward). Why not import them: ``transformers.models.llama.modeling_llama`` pulls in
torch.distributed, dynamo, scipy and sympy, 3.5 s of CPU at every peer start on a 2-core machine,
twice what torch itself costs; the stage needs none of it. The exported model
(:mod:`mapl_swarm.hf`) is transformers' own and loads these weights by name.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mapl_swarm.config import ModelConfig

__all__ = ["RMSNorm", "RotaryEmbedding", "Attention", "MLP", "DecoderLayer"]

_GQA_MAX_HEAD_DIM = 256
"""sdpa's grouped-query path takes head dimensions up to this (transformers' ``use_gqa_in_sdpa``)."""


class RMSNorm(nn.Module):
    """``weight * x / sqrt(mean(x²) + eps)``, computed in fp32 and cast back (``LlamaRMSNorm``)."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states.to(input_dtype)


class RotaryEmbedding(nn.Module):
    """Default RoPE: ``(cos, sin)`` of shape (1, T, head_dim) for positions (1, T), in ``x``'s dtype."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        dim = cfg.hidden_size // cfg.num_heads
        inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
        self.inv_freq = nn.Buffer(inv_freq, persistent=False)

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = position_ids[..., None].float() * self.inv_freq.to(device=x.device, dtype=torch.float)
        emb = torch.cat((freqs, freqs), dim=-1)  # (1, T, head_dim)
        return emb.cos().to(dtype=x.dtype), emb.sin().to(dtype=x.dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


class Attention(nn.Module):
    """Causal multi-head (grouped-query when ``num_kv_heads`` < ``num_heads``) self-attention with
    rotary positions, through ``scaled_dot_product_attention``; no bias."""

    def __init__(self, cfg: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.head_dim = cfg.hidden_size // cfg.num_heads
        self.num_key_value_groups = cfg.num_heads // cfg.kv_heads
        self.scaling = self.head_dim ** -0.5
        d = cfg.hidden_size
        self.q_proj = nn.Linear(d, cfg.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(d, cfg.kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(d, cfg.kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(cfg.num_heads * self.head_dim, d, bias=False)

    def forward(self, hidden_states: torch.Tensor, position_embeddings: tuple[torch.Tensor, torch.Tensor]
                ) -> torch.Tensor:
        input_shape = hidden_states.shape[:-1]  # (B, T)
        hidden_shape = (*input_shape, -1, self.head_dim)
        q = self.q_proj(hidden_states).view(hidden_shape).transpose(1, 2)  # (B, H, T, hd)
        k = self.k_proj(hidden_states).view(hidden_shape).transpose(1, 2)  # (B, Hkv, T, hd)
        v = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        cos, sin = (t.unsqueeze(1) for t in position_embeddings)  # (1, 1, T, hd)
        q = (q * cos) + (_rotate_half(q) * sin)
        k = (k * cos) + (_rotate_half(k) * sin)
        extra = {}
        groups = self.num_key_value_groups
        if groups > 1:
            if k.shape[-1] == v.shape[-1] <= _GQA_MAX_HEAD_DIM:
                extra["enable_gqa"] = True
            else:  # (B, Hkv, T, hd) -> (B, H, T, hd)
                b, hkv, t, hd = k.shape
                k = k[:, :, None].expand(b, hkv, groups, t, hd).reshape(b, hkv * groups, t, hd)
                v = v[:, :, None].expand(b, hkv, groups, t, hd).reshape(b, hkv * groups, t, hd)
        q_len = q.shape[2]
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=None, dropout_p=0.0, scale=self.scaling,
                                             is_causal=q_len > 1, **extra)
        out = out.reshape(out.shape[0], -1, q_len, v.shape[-1]).transpose(1, 2).contiguous()  # (B, T, H, hd)
        return self.o_proj(out.reshape(*input_shape, -1).contiguous())


class MLP(nn.Module):
    """SwiGLU: ``down(silu(gate(x)) * up(x))``, no bias."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.ffn_hidden_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.ffn_hidden_size, bias=False)
        self.down_proj = nn.Linear(cfg.ffn_hidden_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    """Pre-norm decoder layer ``layer_idx``: ``x + attn(norm(x))``, then ``x + mlp(norm(x))``."""

    def __init__(self, cfg: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.self_attn = Attention(cfg, layer_idx)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, hidden_states: torch.Tensor, position_embeddings: tuple[torch.Tensor, torch.Tensor]
                ) -> torch.Tensor:
        residual = hidden_states
        hidden_states = residual + self.self_attn(self.input_layernorm(hidden_states), position_embeddings)
        residual = hidden_states
        return residual + self.mlp(self.post_attention_layernorm(hidden_states))
