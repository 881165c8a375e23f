"""Config layout: renamed keys refused, Literal choices checked in one place, vocab sizes, round trips."""

import logging
import re
import subprocess
import sys
from dataclasses import fields
from typing import get_args

import pytest

from mapl_swarm.config.catalog import CODEC_NAMES
from mapl_swarm.config import (LEGACY_KEYS, Codec, CompressionConfig, OptimConfig, RuntimeConfig, TrainConfig,
                               VQConfig, config_from_dict, config_to_dict, load_config, model_fingerprint)
from mapl_swarm.errors import ConfigError


def test_codec_literal_is_the_catalog():
    assert get_args(Codec) == CODEC_NAMES


def test_renamed_keys_are_errors_naming_the_new_key(tmp_path):
    p = tmp_path / "old.toml"
    p.write_text("[run]\nnum_stages = 2\nval_batches = 3\nsteps = 5\n"
                 "[compression]\ncodec = \"mapl_vq\"\nrank = 16\nanchor_rank = 16\nvq_rounds = 3\n")
    with pytest.raises(ConfigError) as err:
        load_config(p)
    assert str(err.value) == (f"{p}: renamed keys: run.num_stages is now pipeline.num_stages; run.val_batches is "
                              f"now eval.batches; compression.vq_rounds is now compression.vq.rounds")
    new = tmp_path / "new.toml"
    new.write_text("[pipeline]\nnum_stages = 2\n")
    with pytest.raises(ConfigError, match=r"^--set: renamed key: run\.threads is now runtime\.threads$"):
        load_config(new, {"run": {"threads": 1}})


def test_every_renamed_key_is_refused_by_name():
    for old, new in LEGACY_KEYS.items():
        section, key = old.split(".")
        with pytest.raises(ConfigError, match=rf"renamed key: {re.escape(old)} is now {re.escape(new)}$"):
            config_from_dict({section: {key: 1}})


def test_set_overrides_the_file(tmp_path):
    p = tmp_path / "new.toml"
    p.write_text("[pipeline]\nnum_stages = 4\n")
    assert load_config(p, {"pipeline": {"num_stages": 3}}).pipeline.num_stages == 3


@pytest.mark.parametrize("raw, key, bad", [
    ({"compression": {"codec": "mpal"}}, "compression.codec", "'mpal'"),
    ({"compression": {"anchor": "partial"}}, "compression.anchor", "'partial'"),
    ({"compression": {"wire_dtype": "int8"}}, "compression.wire_dtype", "'int8'"),
    ({"compression": {"vq": {"sync": "sometimes"}}}, "compression.vq.sync", "'sometimes'"),
    ({"compression": {"vq": {"slice_order": "random"}}}, "compression.vq.slice_order", "'random'"),
    ({"optim": {"schedule": "linear"}}, "optim.schedule", "'linear'"),
    ({"runtime": {"device": "tpu"}}, "runtime.device", "'tpu'"),
    ({"runtime": {"device": 3}}, "runtime.device", "3"),
])
def test_literal_choices_name_key_allowed_values_and_bad_value(raw, key, bad):
    with pytest.raises(ConfigError) as err:
        config_from_dict(raw)
    msg = str(err.value)
    assert msg.startswith(f"{key} must be one of (") and msg.endswith(f"got {bad}"), msg


def test_literal_choices_are_checked_for_sections_built_in_code():
    with pytest.raises(ConfigError, match=r"compression\.codec must be one of \('none', 'none_offsets', 'ssn'"):
        CompressionConfig(codec="bogus")
    with pytest.raises(ConfigError, match=r"compression\.vq\.sync must be one of \('stream', 'full'\)"):
        VQConfig(sync="often")
    with pytest.raises(ConfigError, match=r"optim\.schedule must be one of"):
        OptimConfig(schedule="step")
    with pytest.raises(ConfigError, match=r"runtime\.device must be one of \('auto', 'cpu', 'cuda'\)"):
        RuntimeConfig(device="gpu")


def test_group_size_divides_rank_only_for_quantized_codecs():
    CompressionConfig(codec="mapl", rank=9)
    with pytest.raises(ConfigError, match="compression.rank 9 is not divisible by compression.vq.group_size 2"):
        CompressionConfig(codec="mapl_vq", rank=9)


def test_vq_section_carries_the_compression_rank():
    c = CompressionConfig(codec="mapl_vq", rank=16, vq=VQConfig(codebook_size=64, rank=4))
    assert c.vq.rank == 16 and c.vq.groups == 8 and c.vq.code_bytes_per_token == 2 * 8
    from dataclasses import replace
    assert replace(c, rank=32).vq.rank == 32
    with pytest.raises(ConfigError, match=r"\[compression\.vq\]: rank is not a key of its own: set compression\.rank"):
        config_from_dict({"compression": {"vq": {"rank": 8}}})


def test_config_to_dict_round_trips():
    cfg = config_from_dict({"preset": "tiny", "compression": {"codec": "mapl_vq", "rank": 32, "vq": {"rounds": 3}},
                            "pipeline": {"num_stages": 2}, "eval": {"batches": 7}, "checkpoint": {"keep": 5},
                            "metrics": {"health_interval_steps": 3}, "runtime": {"threads": 2},
                            "net": {"initial_peers": ["/ip4/1.2.3.4/tcp/1"]}})
    d = config_to_dict(cfg)
    assert "rank" not in d["compression"]["vq"] and d["compression"]["vq"]["rounds"] == 3
    assert config_from_dict(d) == cfg


def test_fingerprint_unchanged_by_the_new_layout():
    """Pinned values: the layout (flat compression.vq_*, grab-bag [run] or the sections) does not
    move the digest. (Re-pinned when the host-local VQ knobs max_distance_mib and compile left the
    fingerprint, when SSN's offset std and AdamW ratio joined [compression], and when
    compression.vq.update joined it.)"""
    cfg = config_from_dict({"pipeline": {"num_stages": 2}, "runtime": {"threads": 1}, "eval": {"batches": 3}})
    assert model_fingerprint(cfg, "abc", 8192) == "a32c6454aa1f05920c33fcf3f153ea13"
    local = config_from_dict({"pipeline": {"num_stages": 2}, "compression": {"vq": {"max_distance_mib": 4.0,
                                                                                     "compile": True}}})
    assert model_fingerprint(local, "abc", 8192) == model_fingerprint(cfg, "abc", 8192)
    vq = config_from_dict({"pipeline": {"num_stages": 2},
                           "compression": {"codec": "mapl_vq", "rank": 16, "anchor_rank": 16, "vq": {"rounds": 3}}})
    assert model_fingerprint(vq, "abc", 8192) == "5177b5e0ba4d566716c603c5da4dc87b"


def test_vocab_sizes_derived_when_only_one_is_set():
    assert config_from_dict({"data": {"vocab_size": 4096}}).model.vocab_size == 4096
    assert config_from_dict({"model": {"vocab_size": 1000}}).data.vocab_size == 1000
    big = config_from_dict({"preset": "150M"})  # neither set: the preset's size for both
    assert big.model.vocab_size == big.data.vocab_size == 32000
    assert config_from_dict({"preset": "150M", "data": {"vocab_size": 8192}}).model.vocab_size == 8192
    same = config_from_dict({"model": {"vocab_size": 512}, "data": {"vocab_size": 512}})
    assert same.model.vocab_size == same.data.vocab_size == 512


def test_vocab_sizes_that_differ_are_an_error_naming_both():
    with pytest.raises(ConfigError, match=r"c\.toml: model\.vocab_size 512 != data\.vocab_size 1024"):
        config_from_dict({"model": {"vocab_size": 512}, "data": {"vocab_size": 1024}}, "c.toml")


def test_vocab_sizes_not_derived_with_an_external_tokenizer():
    cfg = config_from_dict({"model": {"vocab_size": 50257}, "data": {"tokenizer": "gpt2", "vocab_size": 8192}})
    assert (cfg.model.vocab_size, cfg.data.vocab_size) == (50257, 8192)


def test_sections_split_by_concern():
    names = [f.name for f in fields(TrainConfig)]
    assert names == ["model", "compression", "optim", "data", "run", "pipeline", "eval", "checkpoint", "metrics",
                     "runtime", "net", "replicas"]
    assert {f.name for f in fields(TrainConfig().run)} == {"seed", "steps", "out_dir", "run_id"}


def test_replicas_section_loads_strictly():
    cfg = config_from_dict({"replicas": {"enabled": True, "routing": "uniform", "routing_seed": 3}})
    assert cfg.replicas.enabled and cfg.replicas.routing == "uniform" and cfg.replicas.routing_seed == 3
    for bad, match in (({"routing": "random"}, "replicas.routing must be one of"),
                       ({"matchmaking_s": 0}, "replicas.matchmaking_s must be"),
                       ({"averaging_timeout_s": 1.0}, r"replicas.averaging_timeout_s \(1.0\) must exceed"),
                       ({"replica_count": 2}, "unknown key")):
        with pytest.raises(ConfigError, match=match):
            config_from_dict({"replicas": bad})


def test_config_and_vq_sizes_need_no_torch():
    code = ("import sys\nfrom mapl_swarm.config import config_from_dict\n"
            "c = config_from_dict({'compression': {'codec': 'mapl_vq', 'rank': 64}}).compression.vq\n"
            "print(c.code_bytes_per_token, c.slice_bytes_per_micro, c.layout.shape, 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.split()[-1] == "False"


def test_spec_lists_every_fingerprinted_field_with_its_default():
    """SPEC §9.8's table of fields and defaults is what an empty config fingerprints, no more, no less."""
    import json
    import re
    from pathlib import Path

    from mapl_swarm.config.loading import _fingerprint_payload

    spec = (Path(__file__).resolve().parents[2] / "protocol" / "SPEC.md").read_text(encoding="utf-8")
    section = spec[spec.index("### 9.8 Config fingerprint"):spec.index("### 9.9")]
    listed = dict(re.findall(r"^\| `([a-z_.]+)` \| `(.+)` \|$", section, re.M))
    payload = _fingerprint_payload(config_from_dict({}), "h", 0)
    expected = {f"{name}.{key}": json.dumps(value) for name in ("model", "compression")
                for key, value in payload[name].items()}
    expected |= {key: json.dumps(payload[key]) for key in ("seed", "num_stages", "context_length")}
    assert listed == expected
    assert set(payload) == {"model", "compression", "seed", "num_stages", "context_length", "tokenizer_hash",
                            "vocab_size"}
