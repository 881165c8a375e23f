"""Payload names, wire names, streams and link-counter kinds are defined once (pipeline/payload)."""

import json

import torch

from mapl_swarm.pipeline.payload import (
    ACT_WIRE,
    BACKWARD_KINDS,
    FORWARD_KINDS,
    GRAD_WIRE,
    LinkCounter,
    LinkKind,
    PayloadKey,
    Stream,
    WireName,
    act_kind,
    kind_bytes,
)
from mapl_swarm.wire import spec


def test_streams_are_the_specs_and_map_to_their_slice_kinds():
    assert tuple(Stream) == spec.STREAMS
    assert Stream.ACT.slice_kind is LinkKind.CODEBOOK and Stream.GRAD.slice_kind is LinkKind.GRAD_CODEBOOK


def test_payload_keys_map_to_the_conventional_wire_names():
    assert {str(k): str(v) for k, v in ACT_WIRE.items()} == {"act": "z", "codes": "codes", "ids": "ids"}
    assert {str(k): str(v) for k, v in GRAD_WIRE.items()} == {"grad": "dz", "codes": "codes"}
    assert act_kind(PayloadKey.IDS) is LinkKind.IDS and act_kind("codes", eval_mode=True) is LinkKind.EVAL_ACT
    assert {WireName.PROJ, WireName.PROJ_GRAD, WireName.INDEX} == {"proj", "grad", "index"}


def test_counter_kinds_keep_their_string_keys():
    c = LinkCounter()
    c.add(LinkKind.ACT, torch.zeros(2, 3, dtype=torch.bfloat16))
    c.add(LinkKind.PROJ_GRAD, {"grad": torch.zeros(4, dtype=torch.float32)})
    assert c.bytes["act"] == 12 and c.messages["proj_grad"] == 1 and c.total() == 28
    assert json.loads(json.dumps(c.bytes)) == {"act": 12, "proj_grad": 16}
    assert kind_bytes(json.loads(json.dumps(c.bytes)), FORWARD_KINDS) == 12
    assert kind_bytes(c.bytes, BACKWARD_KINDS) == 16
    assert not set(FORWARD_KINDS) & set(BACKWARD_KINDS)
