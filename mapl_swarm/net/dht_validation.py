"""Signed DHT records: a hivemind record validator keyed by the run's ``dht_key``.

Every member of a keyed run holds the same 32-byte ``dht_key`` (``RunKey.dht_key``, derived from
the run key file). :class:`RunKeyValidator` is installed on every DHT node of the run, peers and
bootstrap alike; it appends an HMAC tag to each record the node stores and accepts — for storing,
for caching and in lookup answers — only records whose tag verifies. A party without the key
can therefore neither add nor alter a record on a keyed node, and a forged record that expires
later cannot evict an honest one there.

Record bytes as hivemind hands them to a validator (``hivemind.dht.validation.DHTRecord``):

- ``key``: the 20-byte hivemind ``DHTID`` of the key string, ``SHA-1(msgpack(key))``
  (:func:`dht_key_id`), e.g. of ``"mapl/<run>/stage/<k>"``;
- ``subkey``: ``msgpack(subkey)`` (hivemind's ``MSGPackSerializer``; a record without a subkey
  has ``msgpack(None) = b"\\xc0"``);
- ``value``: ``msgpack(value)`` (for discovery, of the endpoint string; ``""`` is a tombstone);
- ``expiration_time``: the record's expiration, seconds since the Unix epoch (a float64).

The tag authenticates all four (:func:`record_message`)::

    message = b"mapl-dht-record-v1"
              || u32be(len(key))    || key
              || u32be(len(subkey)) || subkey
              || u32be(len(value))  || value
              || f64be(expiration_time)        # IEEE-754 binary64, big-endian
    tag     = HMAC-SHA256(dht_key, message)    # 32 bytes
    stored value = value || tag

``u32be`` is a 4-byte unsigned big-endian length. Validation recomputes the tag over the stored
value minus its last 32 bytes and compares in constant time. Also refused, so that a key
holder cannot break discovery for everyone: a record without a subkey (hivemind lets such a
record with a later expiration replace the whole subkey dictionary of its key); an expiration
that is not finite or lies more than ``max_ttl_s`` (default :data:`MAX_TTL_S`, one day) ahead of
the validating node's clock; a value shorter than a tag; a value (without the tag) that is not
exactly one msgpack object free of extension types (hivemind could not decode it; unless built
with ``plain_values=False``); with ``allowed_keys``, any other key.

Replays: a captured record can be stored again only unchanged (same subkey, value and
expiration). A node keeps, per subkey, the record that expires last, so a replay cannot displace
its signer's later announcement or tombstone, and it disappears at its own expiration.

This module imports hivemind (and with it torch): import it only where a DHT is started.
"""

from __future__ import annotations

import hashlib
import hmac
import math
import struct
import time
from typing import Iterable

from hivemind.dht.validation import DHTRecord, RecordValidatorBase

__all__ = ["DOMAIN", "TAG_BYTES", "DHT_KEY_BYTES", "MAX_TTL_S", "NO_SUBKEY", "RunKeyValidator",
           "dht_key_id", "record_message", "record_tag"]

DOMAIN = b"mapl-dht-record-v1"
"""Domain label that starts every signed message (so the tag is never valid in another role)."""
TAG_BYTES = 32
"""Length of the HMAC-SHA256 tag appended to each value."""
DHT_KEY_BYTES = 32
"""Length of ``RunKey.dht_key``."""
MAX_TTL_S = 86400.0
"""Default bound on how far ahead of the validating node's clock an expiration may lie."""
NO_SUBKEY = b"\xc0"
"""The subkey bytes hivemind uses for a record without a subkey (``msgpack(None)``)."""


def dht_key_id(key: str) -> bytes:
    """The 20 bytes hivemind uses for ``key`` on the wire and in validators: SHA-1 of its msgpack
    encoding (``hivemind.dht.routing.DHTID.generate(source=key).to_bytes()``)."""
    import msgpack

    return hashlib.sha1(msgpack.packb(key, use_bin_type=True)).digest()


def record_message(key: bytes, subkey: bytes, value: bytes, expiration_time: float) -> bytes:
    """The bytes the tag authenticates (layout in the module docstring)."""
    parts = [DOMAIN]
    for field in (key, subkey, value):
        parts += [struct.pack(">I", len(field)), bytes(field)]
    parts.append(struct.pack(">d", expiration_time))
    return b"".join(parts)


def record_tag(dht_key: bytes, key: bytes, subkey: bytes, value: bytes, expiration_time: float) -> bytes:
    """HMAC-SHA256 tag of one record under ``dht_key``."""
    return hmac.new(dht_key, record_message(key, subkey, value, expiration_time), hashlib.sha256).digest()


def _one_plain_object(data: bytes) -> bool:
    """Whether ``data`` is exactly one msgpack object without extension types. A signed value that
    is not would make hivemind's decoding fail (a lookup error on every reader), so a key holder's
    malformed record is refused like a forged one."""
    import msgpack

    def no_ext(code: int, _data: bytes) -> object:
        raise ValueError(f"msgpack extension type {code}")

    try:
        msgpack.unpackb(data, raw=False, ext_hook=no_ext)
    except Exception:  # noqa: BLE001 - msgpack raises several unrelated exception types
        return False
    return True


class RunKeyValidator(RecordValidatorBase):
    """Sign and verify DHT records with a run's ``dht_key``; see the module docstring.

    ``allowed_keys`` (key strings, e.g. every stage key of one run) restricts the records a node
    accepts to those keys; None accepts any key that carries a valid tag (a bootstrap node that
    does not know the run id). ``max_ttl_s`` bounds expirations (module docstring).
    ``plain_values`` also refuses values that are not exactly one msgpack object; turn it off
    only when another validator adds its own bytes to the value (hivemind's
    ``RSASignatureValidator`` does)."""

    def __init__(self, dht_key: bytes, *, allowed_keys: Iterable[str] | None = None,
                 plain_values: bool = True, max_ttl_s: float = MAX_TTL_S) -> None:
        if not isinstance(dht_key, (bytes, bytearray)) or len(dht_key) != DHT_KEY_BYTES:
            raise ValueError(f"dht_key must be {DHT_KEY_BYTES} bytes")
        self._dht_key = bytes(dht_key)
        self._allowed: frozenset[bytes] | None = (
            None if allowed_keys is None else frozenset(dht_key_id(k) for k in allowed_keys))
        self._plain_values = plain_values
        self._max_ttl_s = float(max_ttl_s)

    def __repr__(self) -> str:  # never shows the key
        keys = "any key" if self._allowed is None else f"{len(self._allowed)} keys"
        return f"RunKeyValidator({keys})"

    def sign_value(self, record: DHTRecord) -> bytes:
        return record.value + record_tag(self._dht_key, record.key, record.subkey, record.value,
                                         record.expiration_time)

    def validate(self, record: DHTRecord) -> bool:
        value = record.value
        if len(value) < TAG_BYTES or record.subkey == NO_SUBKEY:
            return False
        if not (math.isfinite(record.expiration_time)
                and record.expiration_time <= time.time() + self._max_ttl_s):
            return False
        if self._allowed is not None and bytes(record.key) not in self._allowed:
            return False
        expected = record_tag(self._dht_key, record.key, record.subkey, value[:-TAG_BYTES],
                              record.expiration_time)
        return hmac.compare_digest(expected, value[-TAG_BYTES:]) and (
            not self._plain_values or _one_plain_object(value[:-TAG_BYTES]))

    def strip_value(self, record: DHTRecord) -> bytes:
        return record.value[:-TAG_BYTES]

    @property
    def priority(self) -> int:
        # Signs last and verifies first: the tag is the outermost layer, covering whatever
        # lower-priority validators (hivemind's RSASignatureValidator has 10) add to the value.
        return 100

    def merge_with(self, other: RecordValidatorBase) -> bool:
        # A second copy of the same validator adds nothing; one for another key (or key set)
        # stays separate, so a record must then carry both tags.
        return (isinstance(other, RunKeyValidator) and hmac.compare_digest(other._dht_key, self._dht_key)
                and other._allowed == self._allowed and other._plain_values == self._plain_values
                and other._max_ttl_s == self._max_ttl_s)
