"""Honest baselines (issue 11): SSN's offset scale and AdamW ratio, the none_offsets reference."""

from __future__ import annotations

import json

import pytest
import torch

from mapl_swarm.compress.codecs import build_codec
from mapl_swarm.config import config_from_dict, config_to_dict
from mapl_swarm.errors import ConfigError
from mapl_swarm.pipeline.stage import StageRuntime

SMALL = {"model": {"vocab_size": 512, "hidden_size": 64, "num_layers": 2, "num_heads": 2,
                   "ffn_hidden_size": 128, "context_length": 16},
         "data": {"vocab_size": 512}, "pipeline": {"num_stages": 2}, "compression": {"rank": 16}}


def _cfg(codec: str, **compression) -> object:
    raw = json.loads(json.dumps(SMALL))
    raw["compression"].update(codec=codec, **compression)
    return config_from_dict(raw)


def test_offset_std_defaults_to_the_embedding_init_std_and_is_recorded():
    cfg = _cfg("ssn")
    assert cfg.compression.ssn_offset_std == cfg.model.init_std == 0.02
    assert config_to_dict(cfg)["compression"]["ssn_offset_std"] == 0.02  # what the run manifest records
    raw = json.loads(json.dumps(SMALL))
    raw["model"]["init_std"] = 0.05
    raw["compression"]["codec"] = "ssn"
    assert config_from_dict(raw).compression.ssn_offset_std == 0.05
    assert _cfg("ssn", ssn_offset_std=1).compression.ssn_offset_std == 1.0  # an int in TOML is a float
    with pytest.raises(ConfigError, match="ssn_offset_std must be >= 0"):
        _cfg("ssn", ssn_offset_std=-0.1)
    with pytest.raises(ConfigError, match="ssn_offset_std must be float"):
        _cfg("ssn", ssn_offset_std="big")


@pytest.mark.parametrize("std", [0.02, 1.0])
def test_ssn_offsets_have_the_configured_std(std):
    codec = build_codec(_cfg("ssn", ssn_offset_std=std), 0, torch.device("cpu"))
    t = codec.offsets
    assert t.shape == (512, 64)
    assert t.std().item() == pytest.approx(std, rel=0.02)  # 32k draws: std of the estimate ~0.4%
    assert t.mean().abs().item() < 0.02 * std


def test_none_offsets_adds_the_same_table_as_ssn():
    dev = torch.device("cpu")
    ssn = build_codec(_cfg("ssn"), 0, dev)
    ref = build_codec(_cfg("none_offsets"), 0, dev)
    assert torch.equal(ref.offsets, ssn.offsets)
    tokens = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(0))
    emb = torch.randn(2, 16, 64)
    assert torch.equal(ref.first_stage_input(emb, tokens), ssn.first_stage_input(emb, tokens))
    torch.testing.assert_close(ref.first_stage_input(emb, tokens) - emb, ssn.offsets[tokens])
    # no projection: the boundary carries all d channels, like `none`
    later = build_codec(_cfg("none_offsets"), 1, dev)
    assert later.inbound.projector is None and build_codec(_cfg("none_offsets"), 0, dev).outbound.projector is None


def _adamw_ratios(cfg, stage: int = 0) -> set[float]:
    rt = StageRuntime(cfg, stage, torch.device("cpu"))
    return {r.lr_ratio for r in rt.param_rows if r.optimizer == "adamw" and r.params}


def test_ssn_uses_its_own_adamw_ratio_and_the_others_keep_theirs():
    assert _cfg("ssn").compression.ssn_adamw_lr_ratio == 0.1
    assert _adamw_ratios(_cfg("ssn")) == {0.1}
    assert _adamw_ratios(_cfg("ssn", ssn_adamw_lr_ratio=0.5)) == {0.5}
    for codec in ("none", "none_offsets", "mapl"):
        assert _adamw_ratios(_cfg(codec)) == {0.5}, codec
    rt = StageRuntime(_cfg("ssn"), 0, torch.device("cpu"))
    adamw = rt.optimizers[1]
    assert [g["lr"] for g in adamw.param_groups if g["params"]] == pytest.approx([0.02 * 0.1] * 2)


def test_vq_refresh_default_is_one_sixteenth_in_priority_order():
    """Kept after measuring 1/5 (the paper's Table 8) against it: BENCHMARKS.md, "Honest baselines"."""
    vq = _cfg("mapl_vq").compression.vq
    assert (vq.slice_fraction, vq.slice_order, vq.sync) == (0.0625, "priority", "stream")
    assert vq.slice_codes == 16  # of K = 256 per codebook and micro-batch
