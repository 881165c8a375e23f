"""Stage construction, partition, and our decoder blocks against transformers' Llama ones."""

import pytest
import torch
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRMSNorm, LlamaRotaryEmbedding

from mapl_swarm.config import ModelConfig
from mapl_swarm.errors import ConfigError
from mapl_swarm.hf.convert import llama_config
from mapl_swarm.model import StageModel, partition_layers
from mapl_swarm.model.llama import DecoderLayer, RMSNorm, RotaryEmbedding

SMALL = ModelConfig(vocab_size=128, hidden_size=32, num_layers=4, num_heads=4, ffn_hidden_size=64,
                    context_length=12)


def test_partition_balanced_contiguous():
    parts = partition_layers(9, 4)
    assert [len(p) for p in parts] == [3, 2, 2, 2]
    assert [i for p in parts for i in p] == list(range(9))
    assert partition_layers(8, 1) == [range(8)]


def test_partition_impossible():
    with pytest.raises(ConfigError, match="cannot split 3 layers over 4 stages"):
        partition_layers(3, 4)


def test_decoder_layer_contract_returns_causal_tensor():
    """transformers >= 5.17: the layer returns a tensor (4.x returned a tuple), is causal with
    sdpa and no mask, and takes rotary embeddings as position_embeddings."""
    lc = llama_config(SMALL)
    torch.manual_seed(0)
    layer = LlamaDecoderLayer(lc, layer_idx=0).eval()
    rot = LlamaRotaryEmbedding(lc)
    x = torch.randn(2, 10, 32)
    pos = rot(x, torch.arange(10).unsqueeze(0))
    out = layer(x, attention_mask=None, position_embeddings=pos)
    assert isinstance(out, torch.Tensor) and out.shape == x.shape
    x2 = x.clone()
    x2[:, 7:] = torch.randn(2, 3, 32)  # changing the future must not change the past
    out2 = layer(x2, attention_mask=None, position_embeddings=pos)
    torch.testing.assert_close(out[:, :7], out2[:, :7])
    assert not torch.allclose(out[:, 7:], out2[:, 7:])


@pytest.mark.parametrize("kv_heads", [0, 2], ids=["mha", "gqa"])
@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16-autocast"])
def test_our_decoder_blocks_compute_transformers_bits(kv_heads, autocast):
    """model.llama's layer, norm and rotary embedding equal transformers' Llama ones bit for bit:
    the same RNG draws at construction, the same parameter names, the same forward output and the
    same gradients of the input and of every weight (fp32, and bf16 autocast on the CPU)."""
    cfg = ModelConfig(vocab_size=128, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=kv_heads,
                      ffn_hidden_size=64, context_length=12)
    lc = llama_config(cfg)
    torch.manual_seed(5)
    theirs = [LlamaDecoderLayer(lc, layer_idx=1), LlamaRMSNorm(32, eps=cfg.rms_norm_eps)]
    after_theirs = torch.get_rng_state()
    torch.manual_seed(5)
    ours = [DecoderLayer(cfg, layer_idx=1), RMSNorm(32, eps=cfg.rms_norm_eps)]
    assert torch.equal(torch.get_rng_state(), after_theirs)  # the same construction draws
    for a, b in zip(theirs, ours):
        assert list(dict(a.named_parameters())) == list(dict(b.named_parameters()))
        b.load_state_dict(a.state_dict())
    x = torch.randn(2, 10, 32)
    runs = []
    for (layer, norm), rot in ((theirs, LlamaRotaryEmbedding(lc)), (ours, RotaryEmbedding(cfg))):
        xi = x.clone().requires_grad_(True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            pos = rot(xi, torch.arange(10).unsqueeze(0))
            out = layer(xi, attention_mask=None, position_embeddings=pos) if layer is theirs[0] else layer(xi, pos)
            y = norm(out).float()
        y.pow(2).sum().backward()
        runs.append((y.detach(), xi.grad, [p.grad for p in (*layer.parameters(), *norm.parameters())]))
    (y_t, gx_t, gp_t), (y_o, gx_o, gp_o) = runs
    assert torch.equal(y_t, y_o) and torch.equal(gx_t, gx_o)
    assert all(torch.equal(a, b) for a, b in zip(gp_t, gp_o, strict=True))


def test_stage_owns_embedding_and_head():
    first, last = StageModel(SMALL, 0, 2, seed=1), StageModel(SMALL, 1, 2, seed=1)
    assert first.embed_tokens is not None and first.lm_head is None
    assert last.embed_tokens is None and last.lm_head is not None and last.norm is not None
    assert [l.self_attn.layer_idx for l in last.layers] == [2, 3]


def test_weights_independent_of_partition():
    whole = StageModel(SMALL, 0, 1, seed=3)
    split = [StageModel(SMALL, s, 4, seed=3) for s in range(4)]
    for s, stage in enumerate(split):
        for a, b in zip(stage.layers[0].parameters(), whole.layers[s].parameters()):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
    torch.testing.assert_close(split[0].embed_tokens.weight, whole.embed_tokens.weight, rtol=0, atol=0)
    torch.testing.assert_close(split[3].lm_head.weight, whole.lm_head.weight, rtol=0, atol=0)
    other = StageModel(SMALL, 0, 1, seed=4)
    assert not torch.equal(other.embed_tokens.weight, whole.embed_tokens.weight)
