"""The codec registry: one class per family, each owning its parameter-table rows and payloads."""

from __future__ import annotations

import pytest
import torch

from mapl_swarm.config.catalog import CODEC_INFO, CODEC_NAMES, codec_info
from mapl_swarm.compress.codecs import CODEC_CLASSES, build_codec, codec_class, config_boundary_bytes
from mapl_swarm.pipeline.stage import StageRuntime


def test_registry_implements_exactly_the_catalog():
    assert set(CODEC_CLASSES) == set(CODEC_NAMES)
    for name in CODEC_NAMES:
        assert name in codec_class(name).names
    with pytest.raises(ValueError, match="unknown codec 'zip'.*mapl"):
        codec_class("zip")


def test_catalog_roles():
    assert [i.name for i in CODEC_INFO.values() if i.uncompressed] == ["none"]
    assert not codec_info("mapl").baseline and not codec_info("mapl_vq").baseline
    assert {i.name for i in CODEC_INFO.values() if i.trainable_projector} == {"mapl", "naive", "mapl_vq"}
    assert sorted(CODEC_NAMES, key=lambda n: codec_info(n).order)[0] == "none"


def _rows(stage: StageRuntime) -> dict[str, tuple[str, float, float, int]]:
    return {r.label: (r.optimizer, r.lr_ratio, r.weight_decay, len(r.params)) for r in stage.param_rows}


@pytest.mark.parametrize("codec,projector", [("mapl", "spel"), ("mapl_vq", "spel"), ("naive", "muon"),
                                             ("fixed", None), ("none", None), ("ssn", None)])
def test_param_table_rows_per_codec(make_config, codec, projector):
    cfg = make_config(compression={"codec": codec})
    o = cfg.optim
    first, middle = StageRuntime(cfg, 0), StageRuntime(cfg, 1)
    rows = _rows(middle)
    assert rows["hidden"][:3] == ("muon", 1.0, 1.0)
    if projector is None:
        assert "projector" not in rows
    else:
        assert rows["projector"] == (projector, o.projector_lr_ratio, 0.0, 1)
    # later stages of anchored codecs train their anchor table under AdamW; stage 1 has none
    assert (rows.get("anchor_matrices", (0, 0, 0, 0))[3] == 1) == codec_info(codec).anchored
    assert "anchor_matrices" not in _rows(first)
    # every trainable tensor is in exactly one row, and the optimizers hold exactly the table
    table = [p for r in middle.param_rows for p in r.params]
    assert len({id(p) for p in table}) == len(table)
    assert {id(p) for p in table} == {id(p) for p in middle.optimized_parameters()}
    # ... except the receiver's copy of the inbound projector (its gradient goes to the sender)
    # and SSN's shared basis (refreshed by the Grassmann step, not an optimizer)
    not_local = {id(middle.inbound.projector)} if middle.inbound.projector is not None else set()
    trainable = {id(p) for p in middle.modules.parameters() if p.requires_grad} - not_local
    assert trainable == {id(p) for p in table}


@pytest.mark.parametrize("codec", CODEC_NAMES)
def test_payload_names_and_bytes_match_the_codec(make_config, codec):
    cfg = make_config(compression={"codec": codec})
    c0 = build_codec(cfg, 0, torch.device("cpu"))
    z = torch.randn(2, 16, c0.payload_width(_shape(cfg)))
    payload = c0.encode_act(z, train=False, micro=0)
    exp = config_boundary_bytes(cfg)
    nbytes = sum(t.numel() * t.element_size() for t in payload.values())
    assert nbytes == exp.forward_act_bytes * 2 * 16
    assert set(payload) == ({"codes"} if codec_info(codec).quantized else {"act"})


def _shape(cfg):
    from mapl_swarm.compress.boundary import BoundaryShape

    m, c = cfg.model, cfg.compression
    return BoundaryShape(hidden_size=m.hidden_size, rank=c.rank, wire_dtype=c.wire_dtype, vocab_size=m.vocab_size,
                         seq_len=m.context_length)
