"""Certified DHT records: a hivemind record validator for a run of per-peer identities.

Record bytes as hivemind hands them to a validator (``hivemind.dht.validation.DHTRecord``):

- ``key``: the 20-byte hivemind ``DHTID`` of the key string, ``SHA-1(msgpack(key))``
  (:func:`dht_key_id`), e.g. of ``"mapl/<run>/stage/<k>"``;
- ``subkey``: ``msgpack(subkey)`` (hivemind's ``MSGPackSerializer``; a record without a subkey
  has ``msgpack(None) = b"\\xc0"``);
- ``value``: ``msgpack(value)`` (for discovery, of the endpoint string; ``""`` is a tombstone);
- ``expiration_time``: the record's expiration, seconds since the Unix epoch (a float64).

The announcing peer (:mod:`~mapl_swarm.net.identity`) signs each record with its own signing key
and carries its certificate (:func:`record_message`)::

    signed = b"mapl-dht-cert-v1"
             || u32be(len(key))    || key
             || u32be(len(subkey)) || subkey
             || u32be(len(value))  || value
             || f64be(expiration_time)        # IEEE-754 binary64, big-endian
    stored value = value || cert || u16be(len(cert)) || Ed25519(sign_key, signed)   # 64 bytes

``u32be`` / ``u16be`` are unsigned big-endian lengths; ``cert`` is the certificate as
:meth:`~mapl_swarm.net.identity.Signed.encode` writes it. A node accepts a record only when that
certificate is the run's authority's, for this run, valid and allows the stage of the record's key
(``mapl/<run>/stage/<k>``); the signature is its key's; the value (an endpoint string) is a
tombstone ``""`` or a contact whose CURVE key is the certificate's (so a dialer pins the key of the
peer the certificate names); the record has a subkey (hivemind lets a record without one replace
the key's whole subkey dictionary); and the expiration is finite and lies at most
:data:`CERTIFIED_MAX_TTL_S` ahead and before the certificate's end. A member can therefore
announce only the stages its certificate allows, only its own key, and only briefly. A captured
record can be stored again only unchanged, and a node keeps per subkey the record that expires
last, so a replay cannot displace its signer's later announcement or tombstone.
Under a stage's **member keys** (its replicas' averaging keys, SPEC §9.1 "Replica records") the
value is any one msgpack object and the subkey must be msgpack (bin) of the signer's own libp2p
peer id (:func:`~mapl_swarm.net.identity.libp2p_peer_id` of the certificate's signing key), so the
subkeys a reader sees there are the stage's certified members.
Under the run's **relay key** (``mapl/<run>/relays``, SPEC §9.12) any member of the run (a
certificate of any stage) announces a relay it runs: the subkey is its own peer id, as under the
member keys, and the value a tombstone or ``HOST:PORT#<hex key>`` whose key is the certificate's
CURVE key (so members seal their requests to the key the authority certified).
A record whose certificate is revoked (the live set a revocation watch fills) reads as withdrawn:
hivemind drops a node's whole answer for a key when one of its records fails validation, so a
refused record would hide the stage's other peers too.

This module imports hivemind (and with it torch): import it only where a DHT is started.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import math
import os
import struct
import time
from typing import AbstractSet, Mapping

from hivemind.dht.validation import DHTRecord, RecordValidatorBase

__all__ = ["NO_SUBKEY", "CERT_DOMAIN", "CERTIFIED_MAX_TTL_S", "CertifiedRecordValidator", "dht_key_id",
           "record_message"]

NO_SUBKEY = b"\xc0"
"""The subkey bytes hivemind uses for a record without a subkey (``msgpack(None)``)."""
CERT_DOMAIN = b"mapl-dht-cert-v1"
"""Prefix of what a record's signature covers (so it is never valid in another role)."""
CERTIFIED_MAX_TTL_S = 600.0
"""How far ahead of the validating node's clock a record's expiration may lie: a member cannot
keep a stale record ranked first for long (discovery's ``ttl_s`` must not exceed it)."""
_SIG_BYTES = 64

logger = logging.getLogger(__name__)


def dht_key_id(key: str) -> bytes:
    """The 20 bytes hivemind uses for ``key`` on the wire and in validators: SHA-1 of its msgpack
    encoding (``hivemind.dht.routing.DHTID.generate(source=key).to_bytes()``)."""
    import msgpack

    return hashlib.sha1(msgpack.packb(key, use_bin_type=True)).digest()


def record_message(key: bytes, subkey: bytes, value: bytes, expiration_time: float) -> bytes:
    """The bytes a record's signature covers (module docstring)."""
    parts = [CERT_DOMAIN]
    for field in (key, subkey, value):
        parts += [struct.pack(">I", len(field)), bytes(field)]
    parts.append(struct.pack(">d", expiration_time))
    return b"".join(parts)


def _one_plain_object(data: bytes) -> bool:
    """Whether ``data`` is exactly one msgpack object without extension types. A value that is not
    would make hivemind's decoding fail (a lookup error on every reader), so a member's malformed
    record is refused like a forged one."""
    import msgpack

    def no_ext(code: int, _data: bytes) -> object:
        raise ValueError(f"msgpack extension type {code}")

    try:
        msgpack.unpackb(data, raw=False, ext_hook=no_ext)
    except Exception:  # noqa: BLE001 - msgpack raises several unrelated exception types
        return False
    return True


class CertifiedRecordValidator(RecordValidatorBase):
    """Sign (with ``identity``) and verify certified records of run ``run_id`` under the authority
    ``authority``; see the module docstring. A node without an identity (a bootstrap node) only
    verifies. ``stage_keys``: the run's stage keys (e.g. ``"mapl/<run>/stage/1"``) and their stages;
    a record under any other key is refused."""

    def __init__(self, *, run_id: str, authority: bytes, stage_keys: Mapping[str, int], identity=None,
                 member_keys: Mapping[str, int] | None = None, relay_keys: AbstractSet[str] = frozenset(),
                 revoked: AbstractSet[int] = frozenset(),
                 revocations: str | os.PathLike[str] | None = None, max_ttl_s: float = CERTIFIED_MAX_TTL_S) -> None:
        from mapl_swarm.net.identity import RevocationWatch

        self._run_id, self._authority, self._identity = run_id, bytes(authority), identity
        self._stage_of = {dht_key_id(key): s for key, s in stage_keys.items()}
        self._member_stage_of = {dht_key_id(key): s for key, s in (member_keys or {}).items()}
        """Keys of a stage's replicas (averaging, state download): a record's subkey must be its
        signer's own libp2p peer id, so a reader's subkeys are the stage's certified members."""
        self._relay_keys = frozenset(dht_key_id(key) for key in relay_keys)
        """The run's relay key: any member, at its own peer id, a relay address of its own CURVE key."""
        self.revoked: set[int] = set(revoked)
        self._watch = None if revocations is None else RevocationWatch(revocations)
        """The authority's revocation list file, re-read (at most every ``REVOCATION_POLL_S``) when a
        record is read: in the DHT's own process, which a set of the parent's would not reach."""
        self._next_poll = 0.0
        self._max_ttl_s = float(max_ttl_s)

    @property
    def run_id(self) -> str:
        return self._run_id

    @property
    def authority(self) -> bytes:
        return self._authority

    def _revoked_now(self) -> set[int]:
        """The serials revoked, the list file re-read if it changed."""
        from mapl_swarm.net.identity import REVOCATION_POLL_S

        if self._watch is not None and time.monotonic() >= self._next_poll:
            self._next_poll = time.monotonic() + REVOCATION_POLL_S
            if self._watch.poll(self):
                logger.warning("revocation list %s: the records of certificate serial(s) %s read as withdrawn",
                               self._watch.path, sorted(self.revoked))
        return self.revoked

    def __repr__(self) -> str:
        return f"CertifiedRecordValidator(run={self._run_id!r}, signs={self._identity is not None})"

    def sign_value(self, record: DHTRecord) -> bytes:
        if self._identity is None:
            return record.value
        cert = self._identity.encoded_cert
        signed = record_message(record.key, record.subkey, record.value, record.expiration_time)
        return record.value + cert + struct.pack(">H", len(cert)) + self._identity.key.sign(signed)

    def _split(self, value: bytes) -> tuple[bytes, bytes, bytes] | None:
        if len(value) < _SIG_BYTES + 2:
            return None
        (n,) = struct.unpack(">H", value[-_SIG_BYTES - 2:-_SIG_BYTES])
        end = len(value) - _SIG_BYTES - 2
        if n > end:
            return None
        return value[:end - n], value[end - n:end], value[-_SIG_BYTES:]

    def validate(self, record: DHTRecord) -> bool:
        return self.refusal(record, time.time()) is None

    def refusal(self, record: DHTRecord, now: float) -> str | None:
        """Why this node refuses ``record`` at ``now`` (unix seconds), or None when it accepts it
        (the codes of ``protocol/vectors/v2/identity``): ``not_a_stage_key``, ``unsigned``,
        ``no_subkey``, ``expiration_too_far``, a certificate code of SPEC §7.1, ``bad_signature``,
        ``after_certificate``, ``not_a_contact`` (the value) or ``wrong_key`` (the contact's); for a
        member key ``not_own_peer_id`` (the subkey) or ``not_msgpack`` (the value); for the relay key
        ``not_own_peer_id``, ``not_a_relay`` (the value) or ``wrong_key`` (the relay's)."""
        from cryptography.exceptions import InvalidSignature
        from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

        from mapl_swarm.net.identity import CertificateError, Signed, libp2p_peer_id, verify_certificate

        key = bytes(record.key)
        member = key in self._member_stage_of
        relay = key in self._relay_keys
        stage = self._member_stage_of[key] if member else self._stage_of.get(key)
        parts = self._split(bytes(record.value))
        if stage is None and not relay:
            return "not_a_stage_key"
        if parts is None:
            return "unsigned"
        if record.subkey == NO_SUBKEY:
            return "no_subkey"
        if not (math.isfinite(record.expiration_time) and record.expiration_time <= now + self._max_ttl_s):
            return "expiration_too_far"
        value, cert, sig = parts
        try:
            # revocation is strip_value's: refusing a record here would make hivemind drop the whole
            # stage dictionary a node returns, the stage's other peers' records with it
            body = verify_certificate(Signed.decode("certificate", cert), authority=self._authority,
                                      run_id=self._run_id, stage=stage, now=now)
        except CertificateError as exc:
            return exc.code
        try:
            Ed25519PublicKey.from_public_bytes(body.sign_key).verify(
                sig, record_message(record.key, record.subkey, value, record.expiration_time))
        except (InvalidSignature, ValueError):
            return "bad_signature"
        if record.expiration_time > body.not_after:
            return "after_certificate"
        if (member or relay) and record.subkey != _packed_bin(libp2p_peer_id(body.sign_key)):
            return "not_own_peer_id"
        if member:
            return None if _one_plain_object(value) else "not_msgpack"
        if relay:
            return _relay_refusal(value, body.curve_key)
        return _contact_refusal(value, body.curve_key)

    def strip_value(self, record: DHTRecord) -> bytes:
        """The announced value; a revoked certificate's record reads as withdrawn (a tombstone)."""
        from mapl_swarm.net.identity import CertificateBody, Signed

        parts = self._split(bytes(record.value))
        if parts is None:
            return record.value
        revoked = self._revoked_now()
        if revoked and CertificateBody.decode(Signed.decode("certificate", parts[1]).body).serial in revoked:
            return _TOMBSTONE
        return parts[0]

    @property
    def priority(self) -> int:
        return 100

    def merge_with(self, other: RecordValidatorBase) -> bool:
        return (isinstance(other, CertifiedRecordValidator) and other._run_id == self._run_id
                and other._authority == self._authority and other._identity is self._identity)


def _packed_bin(data: bytes) -> bytes:
    """msgpack of ``data`` as a bin (how hivemind's serializer writes a bytes subkey)."""
    import msgpack

    return msgpack.packb(data, use_bin_type=True)


_TOMBSTONE = b"\xa0"
"""msgpack of the empty string: a withdrawn entry (SPEC §9.1)."""


def _relay_refusal(value: bytes, curve_key: bytes) -> str | None:
    """None when ``value`` is msgpack of ``""`` (a tombstone) or of a relay address
    ``HOST:PORT#<hex key>`` naming ``curve_key``; else ``not_a_relay`` or ``wrong_key``."""
    import msgpack

    from mapl_swarm.config.run import relay_address

    if not _one_plain_object(value):
        return "not_a_relay"
    text = msgpack.unpackb(value, raw=False)
    if text == "":
        return None
    address = relay_address(text) if isinstance(text, str) else None
    if address is None:
        return "not_a_relay"
    return None if hmac.compare_digest(address[2], curve_key) else "wrong_key"


def _contact_refusal(value: bytes, curve_key: bytes) -> str | None:
    """None when ``value`` is msgpack of ``""`` (a tombstone) or of a contact naming ``curve_key``;
    else ``not_a_contact`` or ``wrong_key``."""
    import msgpack

    from mapl_swarm.net.errors import NetError
    from mapl_swarm.net.transport import split_contact

    if not _one_plain_object(value):
        return "not_a_contact"
    text = msgpack.unpackb(value, raw=False)
    if text == "":
        return None
    if not isinstance(text, str):
        return "not_a_contact"
    try:
        _, key = split_contact(text)
    except NetError:
        return "not_a_contact"
    if key is None:
        return "not_a_contact"
    return None if hmac.compare_digest(key, curve_key) else "wrong_key"
