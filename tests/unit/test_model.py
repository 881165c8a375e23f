"""Stage construction, partition, and the transformers decoder-layer contract we rely on."""

import pytest
import torch
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

from mapl_swarm.config import ModelConfig
from mapl_swarm.errors import ConfigError
from mapl_swarm.model import StageModel, llama_config, partition_layers

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
