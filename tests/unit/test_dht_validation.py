"""RunKeyValidator without a DHT: byte layout, sign / validate / strip, tampering, key scope."""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import pickle
import struct
import time
import warnings

import msgpack
import pytest

with warnings.catch_warnings():  # hivemind imports torch, whose jit module warns; not ours to fix
    warnings.simplefilter("ignore", DeprecationWarning)
    from hivemind.dht.crypto import RSASignatureValidator
    from hivemind.dht.routing import DHTID
    from hivemind.dht.validation import CompositeValidator, DHTRecord
    from hivemind.utils import MSGPackSerializer

from mapl_swarm.errors import ConfigError
from mapl_swarm.net import discovery
from mapl_swarm.net.dht_validation import (MAX_TTL_S, NO_SUBKEY, TAG_BYTES, RunKeyValidator, dht_key_id,
                                           record_message, record_tag)
from mapl_swarm.net.discovery import MAX_STAGES, dht_validators, stage_key

KEY = bytes(range(32))
OTHER = bytes(range(1, 33))
STAGE1 = stage_key("run-v", 1)


def record(key: str = STAGE1, subkey: object = "stage1.00ff", value: object = "tcp://10.0.0.1:5001",
           expiration: float = 1_700_000_000.25) -> DHTRecord:
    """A record as hivemind hands it to a validator before signing."""
    return DHTRecord(DHTID.generate(source=key).to_bytes(), MSGPackSerializer.dumps(subkey),
                     MSGPackSerializer.dumps(value), expiration)


def signed(v: RunKeyValidator, r: DHTRecord) -> DHTRecord:
    return dataclasses.replace(r, value=v.sign_value(r))


def test_layout_is_the_documented_one() -> None:
    """The SPEC's discovery paragraph, computed independently of the module."""
    assert dht_key_id(STAGE1) == DHTID.generate(source=STAGE1).to_bytes()
    assert len(STAGE1) == 18  # a msgpack fixstr: one byte 0xa0 + length, then UTF-8
    assert dht_key_id(STAGE1) == hashlib.sha1(b"\xb2" + STAGE1.encode()).digest()
    r = record()
    message = (b"mapl-dht-record-v1" + struct.pack(">I", 20) + r.key + struct.pack(">I", 12) + r.subkey
               + struct.pack(">I", 20) + r.value + struct.pack(">d", r.expiration_time))
    assert NO_SUBKEY == MSGPackSerializer.dumps(None)
    assert r.subkey == b"\xab" + b"stage1.00ff" and r.value == b"\xb3" + b"tcp://10.0.0.1:5001"
    assert record_message(r.key, r.subkey, r.value, r.expiration_time) == message
    tag = hmac.new(KEY, message, hashlib.sha256).digest()
    assert record_tag(KEY, r.key, r.subkey, r.value, r.expiration_time) == tag
    assert RunKeyValidator(KEY).sign_value(r) == r.value + tag and len(tag) == TAG_BYTES
    # Pinned example (the SPEC's discovery vector): key bytes 00..1f, this record.
    assert r.key.hex() == "6862ebdff0a7ee815130e971a2567f672c6004cd"
    assert tag.hex() == "e4d20281c1fec2c664ba89a0f7f2cdbeb2f7917dba50da763088819d91767ecf"


def test_sign_validate_strip_and_tampering() -> None:
    v = RunKeyValidator(KEY)
    honest = signed(v, record())
    assert v.validate(honest)
    assert msgpack.unpackb(v.strip_value(honest)) == "tcp://10.0.0.1:5001"
    tombstone = signed(v, record(value=""))
    assert v.validate(tombstone) and v.strip_value(tombstone) == MSGPackSerializer.dumps("")

    rejected = {
        "unsigned": record(),
        "empty value": dataclasses.replace(honest, value=b""),
        "wrong key": signed(RunKeyValidator(OTHER), record()),
        "value": dataclasses.replace(honest, value=MSGPackSerializer.dumps("tcp://6.6.6.6:1")
                                     + honest.value[-TAG_BYTES:]),
        "expiration": dataclasses.replace(honest, expiration_time=honest.expiration_time + 3600),
        "subkey": dataclasses.replace(honest, subkey=MSGPackSerializer.dumps("stage1.6666")),
        "subkey removed": dataclasses.replace(honest, subkey=MSGPackSerializer.dumps(None)),
        "key": dataclasses.replace(honest, key=dht_key_id(stage_key("run-v", 2))),
        "tag bit": dataclasses.replace(honest, value=honest.value[:-1] + bytes([honest.value[-1] ^ 1])),
        "nan expiration": signed(v, record(expiration=float("nan"))),
        "inf expiration": signed(v, record(expiration=float("inf"))),
        "no subkey": signed(v, record(subkey=None)),  # could evict the whole subkey dictionary
        "expiring in > 1 day": signed(v, record(expiration=time.time() + MAX_TTL_S + 60)),
    }
    assert v.validate(signed(v, record(expiration=time.time() + MAX_TTL_S - 60)))
    assert not RunKeyValidator(KEY, max_ttl_s=60).validate(signed(v, record(expiration=time.time() + 120)))
    # A key holder's value that hivemind could not decode would break every reader's lookup.
    raw = dataclasses.replace(record(), value=b"")
    for name, body in {"not msgpack": b"\xc1", "truncated": MSGPackSerializer.dumps("tcp://x")[:-1],
                       "two objects": MSGPackSerializer.dumps("a") * 2,
                       "ext type": msgpack.packb(msgpack.ExtType(64, b"x"))}.items():
        rejected[name] = signed(v, dataclasses.replace(raw, value=body))
    assert [name for name, r in rejected.items() if v.validate(r)] == []


def test_key_scope_and_dht_validators() -> None:
    assert discovery.MAX_TTL_S == MAX_TTL_S
    with pytest.raises(ConfigError, match="ttl_s must be at most"):
        discovery.DiscoveryConfig(ttl_s=MAX_TTL_S + 1)
    class Key:
        dht_key = KEY

    assert dht_validators(None, "run-v") == []
    with pytest.raises(ConfigError, match="32 bytes"):
        dht_validators(type("Short", (), {"dht_key": b"x"})(), "run-v")
    [scoped] = dht_validators(Key(), "run-v")
    [anykey] = dht_validators(Key())
    ok = signed(scoped, record())
    last = signed(scoped, record(key=stage_key("run-v", MAX_STAGES - 1)))
    beyond = signed(scoped, record(key=stage_key("run-v", MAX_STAGES)))
    other_run = signed(scoped, record(key=stage_key("run-w", 1)))
    assert scoped.validate(ok) and scoped.validate(last)
    assert not scoped.validate(beyond) and not scoped.validate(other_run)
    assert all(anykey.validate(r) for r in (ok, last, beyond, other_run))
    assert "KEY" not in repr(scoped) and KEY.hex() not in repr(scoped)
    with pytest.raises(ValueError, match="32 bytes"):
        RunKeyValidator(KEY[:16])
    clone = pickle.loads(pickle.dumps(scoped))  # a spawned DHT child would receive a pickled copy
    assert clone.validate(ok) and not clone.validate(beyond)


def test_composition_with_hivemind_validators() -> None:
    """Same key merges into one validator; another key stacks; the tag wraps RSA signatures."""
    v = RunKeyValidator(KEY)
    assert v.merge_with(RunKeyValidator(KEY)) and not v.merge_with(RunKeyValidator(OTHER))
    assert not v.merge_with(RunKeyValidator(KEY, allowed_keys=[STAGE1]))
    assert v.priority > RSASignatureValidator().priority

    assert not v.merge_with(RunKeyValidator(KEY, plain_values=False))
    ours = RunKeyValidator(KEY, plain_values=False)  # the RSA signature follows the msgpack value
    both = CompositeValidator([RSASignatureValidator(), ours, RunKeyValidator(KEY, plain_values=False)])
    rsa = RSASignatureValidator()
    owned = record(subkey=rsa.local_public_key.decode())  # an RSA-protected record
    value = both.sign_value(owned)
    stored = dataclasses.replace(owned, value=value)
    assert both.validate(stored)
    assert ours.validate(stored) and not v.validate(stored)  # the outermost layer is our tag
    assert both.strip_value(stored) == owned.value
    assert not both.validate(dataclasses.replace(stored, value=value[:-TAG_BYTES]))
