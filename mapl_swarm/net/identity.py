"""Per-peer identities under a run authority: key files, certificate requests and certificates.

A run has one **authority** (an Ed25519 key that stays with its operator) and each peer its own
**peer key**. A peer key is 32 random bytes from which two keys derive, each under its own label:

- the Ed25519 **signing key** that signs the peer's requests and records;
- the ZeroMQ **CURVE keypair** of the peer's links: its server key, its client key.

A host makes its key locally and sends only a **request** (its public keys, the stages it asks
for, signed by its own signing key: proof that it holds the key) to the operator, who **issues** a
**certificate**: the run id, the peer's public keys, the stages it may serve, what it may ask of
the whole swarm (``roles``), a validity interval and a serial, signed by the authority.

Files (``mapl-swarm keys``): the authority key and a peer key are secret key files
(:mod:`~.keyfiles`: mode 0600, read from files only, never shown); requests and certificates are
public text files: a header line, then the base64 (RFC 4648, with padding) of a msgpack map
``{"body": bytes, "sig": bytes}``, then a newline. ``body`` is itself msgpack (a map with string
keys, see :class:`CertificateBody` and :class:`RequestBody`) and ``sig`` the Ed25519 signature of
``SIGNING_CONTEXT[kind] + body``: a signature is checked over the exact bytes received, so no two
encoders need to agree on how to encode a map, and one kind of signed thing never passes for
another.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import logging
import os
import re
import secrets
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any, Literal, Protocol

import msgpack
import zmq
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat
from zmq.utils import z85

from mapl_swarm.when import iso_time

from mapl_swarm.errors import ConfigError, MaplError
from mapl_swarm.net.keyfiles import KEY_BYTES, read_key_file, write_key_file

log = logging.getLogger(__name__)

__all__ = [
    "AUTHORITY_HEADER", "PEER_KEY_HEADER", "REQUEST_HEADER", "CERTIFICATE_HEADER", "REVOCATIONS_HEADER", "ROLES",
    "MAX_VALIDITY_S", "MAX_REVOKED", "Authority", "PeerKey", "RequestBody", "CertificateBody", "RevocationsBody",
    "Signed", "CertificateError", "load_authority", "create_authority", "load_peer_key", "create_peer_key",
    "peer_key_at",
    "make_request", "verify_request", "issue", "revoke", "verify_certificate", "verify_revocations", "read_signed", "write_signed", "signed_text", "parse_signed",
    "libp2p_peer_id", "CurveKeys", "PeerIdentity", "drain_statement", "DRAIN_CONTEXT", "redo_statement", "REDO_CONTEXT", "work_statement", "WORK_CONTEXT", "load_identity", "LocalIdentities", "issue_local", "RevocationWatch", "REVOCATION_POLL_S",
]

AUTHORITY_HEADER = "mapl-run-authority v1"
PEER_KEY_HEADER = "mapl-peer-key v1"
REQUEST_HEADER = "mapl-cert-request v1"
CERTIFICATE_HEADER = "mapl-peer-cert v1"
REVOCATIONS_HEADER = "mapl-revocations v1"

Kind = Literal["request", "certificate", "revocations"]
SIGNING_CONTEXT: dict[str, bytes] = {"request": b"mapl-cert-request v1\x00", "certificate": b"mapl-peer-cert v1\x00",
                                     "revocations": b"mapl-revocations v1\x00"}
"""Prefixed to a body before it is signed: a request's signature never verifies as a certificate's."""
_HEADERS: dict[str, str] = {"request": REQUEST_HEADER, "certificate": CERTIFICATE_HEADER,
                            "revocations": REVOCATIONS_HEADER}

DRAIN_CONTEXT = b"mapl-drain v1\x00"
"""Prefixed to what stage 0 signs when it decides a drain (:func:`drain_statement`)."""
REDO_CONTEXT = b"mapl-redo v1\x00"
"""Prefixed to what a member signs when it decides a step is redone (:func:`redo_statement`)."""


def drain_statement(run_id: str, epoch: int, step: int) -> bytes:
    """What stage 0 signs when it decides the swarm drains at ``step`` of run epoch ``epoch``."""
    return DRAIN_CONTEXT + msgpack.packb([run_id, epoch, step], use_bin_type=True)


def redo_statement(run_id: str, epoch: int, step: int) -> bytes:
    """What a member signs when it decides ``step`` is redone in run epoch ``epoch``."""
    return REDO_CONTEXT + msgpack.packb([run_id, epoch, step], use_bin_type=True)


WORK_CONTEXT = b"mapl-work v1\x00"
"""Prefixed to what a member signs of each train ACT and GRAD it sends in a run whose replicas
check each other's work (:func:`work_statement`)."""


def work_statement(run_id: str, kind: str, step: int, micro: int, digest: bytes) -> bytes:
    """What a member signs of the train ``kind`` (``"ACT"`` or ``"GRAD"``) of micro-batch ``micro``
    of ``step`` whose tensors have ``digest`` (:func:`~mapl_swarm.wire.message.payload_digest`)."""
    return WORK_CONTEXT + msgpack.packb([run_id, kind, step, micro, digest], use_bin_type=True)


ROLES = frozenset({"drain"})
"""What a certificate may allow beyond serving its stages: ``drain`` (ask the whole swarm to drain)."""
MAX_VALIDITY_S = 366 * 86400
"""The longest validity a certificate may have (a year and a day): an identity expires."""
MAX_STAGES = 65536
MAX_NAME = 64
MAX_SIGNED_BYTES = 4096
"""Largest request or certificate file body accepted (they are a few hundred bytes)."""
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")


class CertificateError(MaplError):
    """A request or certificate that cannot be used; ``code`` says why (for counters and drops)."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


def _label(label: bytes, key: bytes) -> bytes:
    return hashlib.sha256(label + key).digest()


def _raw(public: Ed25519PublicKey) -> bytes:
    return public.public_bytes(Encoding.Raw, PublicFormat.Raw)


def key_id(public: bytes) -> str:
    """A short public name of a key for logs: hex of SHA-256(public)[:8]."""
    return hashlib.sha256(public).digest()[:8].hex()


# ---------------------------------------------------------------------- keys
@dataclass(frozen=True, eq=False)
class Authority:
    """A run authority: the Ed25519 private key (its 32-byte seed) that signs certificates."""

    seed: bytes = field(repr=False)
    path: str = ""

    @cached_property
    def _private(self) -> Ed25519PrivateKey:
        return Ed25519PrivateKey.from_private_bytes(self.seed)

    @cached_property
    def public(self) -> bytes:
        """The authority's 32-byte Ed25519 public key: what every peer of the run trusts."""
        return _raw(self._private.public_key())

    @property
    def key_id(self) -> str:
        return key_id(self.public)

    def sign(self, data: bytes) -> bytes:
        return self._private.sign(data)

    def __repr__(self) -> str:
        return f"Authority(key_id={self.key_id!r}, path={self.path!r})"


@dataclass(frozen=True, eq=False)
class PeerKey:
    """A peer's own key (32 secret bytes) and the two keys derived from it (module docstring)."""

    secret: bytes = field(repr=False)
    path: str = ""

    @cached_property
    def _signing(self) -> Ed25519PrivateKey:
        return Ed25519PrivateKey.from_private_bytes(_label(b"mapl-peer-sign v1", self.secret))

    @cached_property
    def sign_public(self) -> bytes:
        """The 32-byte Ed25519 public key of the peer's signing key."""
        return _raw(self._signing.public_key())

    def sign(self, data: bytes) -> bytes:
        return self._signing.sign(data)

    @cached_property
    def curve_secret(self) -> bytes:
        """The peer's CURVE secret key, z85 (40 bytes): z85(SHA-256(b"mapl-peer-curve v1" + key))."""
        return z85.encode(_label(b"mapl-peer-curve v1", self.secret))

    @cached_property
    def curve_public(self) -> bytes:
        """The peer's CURVE public key, raw (32 bytes): what its certificate names (libsodium's X25519)."""
        return z85.decode(zmq.curve_public(self.curve_secret))

    @property
    def key_id(self) -> str:
        return key_id(self.sign_public)

    def libp2p_private_key(self) -> bytes:
        """The peer's libp2p identity (its DHT node's, so its averager's): the signing key as a
        libp2p ``PrivateKey`` protobuf, so its peer id derives from any certificate of the peer
        (:func:`libp2p_peer_id`). libp2p signs its handshakes under its own prefix, so the same
        key never signs anything one of this module's contexts could pass for."""
        seed = _label(b"mapl-peer-sign v1", self.secret)
        return _protobuf_key(seed + self.sign_public)

    def __repr__(self) -> str:
        return f"PeerKey(key_id={self.key_id!r}, path={self.path!r})"


def _protobuf_key(data: bytes) -> bytes:
    """libp2p's ``{PublicKey|PrivateKey}{key_type = Ed25519 (1), data}`` protobuf (fields 1 and 2)."""
    return bytes([0x08, 0x01, 0x12, len(data)]) + data


def libp2p_peer_id(sign_key: bytes) -> bytes:
    """The libp2p peer id (bytes) of a peer whose certificate names ``sign_key``: the identity
    multihash (code 0, length 36) of its Ed25519 public key protobuf (libp2p's peer-id rule for
    keys of at most 42 bytes); base58 gives the familiar ``12D3KooW…``."""
    public = _protobuf_key(sign_key)
    return bytes([0x00, len(public)]) + public


def load_authority(path: str | os.PathLike[str]) -> Authority:
    return Authority(read_key_file(path, header=AUTHORITY_HEADER, what="run authority key",
                                   create=f"mapl-swarm keys authority --out {path}"), str(path))


def create_authority(path: str | os.PathLike[str], *, force: bool = False) -> Authority:
    """A new authority key at ``path`` (mode 0600); an existing file only with ``force``."""
    authority = Authority(secrets.token_bytes(KEY_BYTES), str(path))
    write_key_file(path, authority.seed, header=AUTHORITY_HEADER, what="run authority key", force=force)
    return authority


def load_peer_key(path: str | os.PathLike[str]) -> PeerKey:
    return PeerKey(read_key_file(path, header=PEER_KEY_HEADER, what="peer key",
                                 create=f"mapl-swarm keys peer --out {path}"), str(path))


def create_peer_key(path: str | os.PathLike[str], *, force: bool = False) -> PeerKey:
    """A new peer key at ``path`` (mode 0600); an existing file only with ``force``."""
    key = PeerKey(secrets.token_bytes(KEY_BYTES), str(path))
    write_key_file(path, key.secret, header=PEER_KEY_HEADER, what="peer key", force=force)
    return key


def peer_key_at(path: str | os.PathLike[str]) -> PeerKey:
    """The peer key at ``path``, created there first when missing (an identity kept across restarts)."""
    return load_peer_key(path) if Path(path).exists() else create_peer_key(path)


# ---------------------------------------------------------------------- signed bodies
@dataclass(frozen=True)
class Signed:
    """A signed body as it travels and is stored: the body's exact bytes and their signature."""

    kind: Kind
    body: bytes
    sig: bytes

    def encode(self) -> bytes:
        """The msgpack map ``{"body", "sig"}`` (what a HELLO or a DHT record carries)."""
        return msgpack.packb({"body": self.body, "sig": self.sig}, use_bin_type=True)

    @classmethod
    def decode(cls, kind: Kind, data: Any) -> Signed:
        """From :meth:`encode`'s bytes (received: checked for shape only, not yet verified)."""
        if not isinstance(data, bytes) or len(data) > MAX_SIGNED_BYTES:
            raise CertificateError("malformed", f"a {kind} is bytes, at most {MAX_SIGNED_BYTES} of them")
        try:
            outer = msgpack.unpackb(data, raw=False, strict_map_key=True, max_bin_len=MAX_SIGNED_BYTES,
                                    max_array_len=0, max_map_len=2)
        except (ValueError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError) as exc:
            raise CertificateError("malformed", f"a {kind} that is not msgpack: {type(exc).__name__}") from None
        if not isinstance(outer, dict) or set(outer) != {"body", "sig"} or not isinstance(outer["body"], bytes) \
                or not isinstance(outer["sig"], bytes) or len(outer["sig"]) != 64:
            raise CertificateError("malformed", f"a {kind} is a map of body (bytes) and sig (64 bytes)")
        return cls(kind, outer["body"], outer["sig"])

    def verify(self, public: bytes) -> None:
        """The signature is ``public``'s over ``SIGNING_CONTEXT[kind] + body``, else ``bad_signature``."""
        try:
            Ed25519PublicKey.from_public_bytes(public).verify(self.sig, SIGNING_CONTEXT[self.kind] + self.body)
        except (InvalidSignature, ValueError):
            raise CertificateError("bad_signature", f"the {self.kind}'s signature does not verify") from None


def _body_map(data: bytes, kind: str, fields: dict[str, type]) -> dict[str, Any]:
    try:
        body = msgpack.unpackb(data, raw=False, strict_map_key=True, max_map_len=len(fields), max_array_len=MAX_STAGES)
    except (ValueError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError) as exc:
        raise CertificateError("malformed", f"a {kind} body that is not msgpack: {type(exc).__name__}") from None
    if not isinstance(body, dict) or set(body) != set(fields):
        raise CertificateError("malformed", f"a {kind} body has exactly the fields {sorted(fields)}")
    for name, typ in fields.items():
        value = body[name]
        if type(value) is not typ:
            raise CertificateError("malformed", f"{kind} field {name!r} must be {typ.__name__}")
    return body


def _check_keys(body: dict[str, Any], kind: str) -> None:
    for name in ("sign_key", "curve_key"):
        if len(body[name]) != 32:
            raise CertificateError("malformed", f"{kind} field {name!r} must be 32 bytes")


def _check_name(name: str, kind: str) -> None:
    if not _NAME.fullmatch(name):
        raise CertificateError("malformed", f"{kind} name {name!r}: 1-{MAX_NAME} letters, digits, '.', '_' or '-'")


def _check_stages(stages: list[Any], kind: str) -> tuple[int, ...]:
    ints = all(type(s) is int and 0 <= s < MAX_STAGES for s in stages)
    if not stages or not ints or stages != sorted(set(stages)):  # types first: sorted() needs ints
        raise CertificateError("malformed", f"{kind} stages must be distinct ascending ints in 0..{MAX_STAGES - 1}")
    return tuple(stages)


@dataclass(frozen=True)
class RequestBody:
    """What a host asks the authority for: its name, its public keys, the stages it would serve."""

    name: str
    sign_key: bytes
    curve_key: bytes
    stages: tuple[int, ...]

    FIELDS = {"v": int, "name": str, "sign_key": bytes, "curve_key": bytes, "stages": list}

    def encode(self) -> bytes:
        return msgpack.packb({"v": 1, "name": self.name, "sign_key": self.sign_key, "curve_key": self.curve_key,
                              "stages": list(self.stages)}, use_bin_type=True)

    @classmethod
    def decode(cls, data: bytes) -> RequestBody:
        body = _body_map(data, "request", cls.FIELDS)
        if body["v"] != 1:
            raise CertificateError("malformed", f"request version {body['v']}, this peer reads 1")
        _check_keys(body, "request")
        _check_name(body["name"], "request")
        return cls(body["name"], body["sign_key"], body["curve_key"], _check_stages(body["stages"], "request"))


@dataclass(frozen=True)
class CertificateBody:
    """What the authority signed: who a peer is (its keys), in which run, what it may do, when."""

    run: str
    name: str
    sign_key: bytes
    curve_key: bytes
    stages: tuple[int, ...]
    roles: tuple[str, ...]
    serial: int
    not_before: int
    not_after: int
    authority: bytes

    FIELDS = {"v": int, "run": str, "name": str, "sign_key": bytes, "curve_key": bytes, "stages": list,
              "roles": list, "serial": int, "not_before": int, "not_after": int, "authority": bytes}

    def encode(self) -> bytes:
        return msgpack.packb({"v": 1, "run": self.run, "name": self.name, "sign_key": self.sign_key,
                              "curve_key": self.curve_key, "stages": list(self.stages), "roles": list(self.roles),
                              "serial": self.serial, "not_before": self.not_before, "not_after": self.not_after,
                              "authority": self.authority}, use_bin_type=True)

    @classmethod
    def decode(cls, data: bytes) -> CertificateBody:
        body = _body_map(data, "certificate", cls.FIELDS)
        if body["v"] != 1:
            raise CertificateError("malformed", f"certificate version {body['v']}, this peer reads 1")
        _check_keys(body, "certificate")
        _check_name(body["name"], "certificate")
        roles = body["roles"]
        if any(r not in ROLES for r in roles) or roles != sorted(set(roles)):
            raise CertificateError("malformed", f"certificate roles must be distinct, ascending, of {sorted(ROLES)}")
        if len(body["authority"]) != 32 or not body["run"] or body["serial"] < 0:
            raise CertificateError("malformed", "certificate authority (32 bytes), run (not empty) or serial (>= 0)")
        if not 0 <= body["not_before"] < body["not_after"] or body["not_after"] - body["not_before"] > MAX_VALIDITY_S:
            raise CertificateError("malformed", f"certificate validity must be an interval of at most "
                                                f"{MAX_VALIDITY_S // 86400} days")
        return cls(body["run"], body["name"], body["sign_key"], body["curve_key"],
                   _check_stages(body["stages"], "certificate"), tuple(roles), body["serial"], body["not_before"],
                   body["not_after"], body["authority"])


@dataclass(frozen=True)
class RevocationsBody:
    """The authority's list of revoked certificate serials of a run; a newer ``issued`` replaces
    an older list (each list holds every serial revoked so far)."""

    run: str
    serials: tuple[int, ...]
    issued: int
    authority: bytes

    FIELDS = {"v": int, "run": str, "serials": list, "issued": int, "authority": bytes}

    def encode(self) -> bytes:
        return msgpack.packb({"v": 1, "run": self.run, "serials": list(self.serials), "issued": self.issued,
                              "authority": self.authority}, use_bin_type=True)

    @classmethod
    def decode(cls, data: bytes) -> RevocationsBody:
        body = _body_map(data, "revocations", cls.FIELDS)
        serials = body["serials"]
        if body["v"] != 1 or len(body["authority"]) != 32 or not body["run"] or body["issued"] < 0:
            raise CertificateError("malformed", "revocations: v 1, authority (32 bytes), run, issued (>= 0)")
        if len(serials) > MAX_REVOKED or any(type(x) is not int or x < 0 for x in serials) \
                or serials != sorted(set(serials)):
            raise CertificateError("malformed", f"revocations: at most {MAX_REVOKED} distinct ascending serials")
        return cls(body["run"], tuple(serials), body["issued"], body["authority"])


MAX_REVOKED = 200
"""Serials one revocation list may hold (it fits one signed body; re-key the run beyond that)."""


# ---------------------------------------------------------------------- making and checking
def make_request(key: PeerKey, name: str, stages: list[int]) -> Signed:
    """A request for ``stages`` under ``name``, signed by ``key`` (proof that the host holds it)."""
    _check_name(name, "request")
    body = RequestBody(name, key.sign_public, key.curve_public, _check_stages(sorted(set(stages)), "request"))
    data = body.encode()
    return Signed("request", data, key.sign(SIGNING_CONTEXT["request"] + data))


def verify_request(request: Signed) -> RequestBody:
    """The request's body, when its fields are well formed and its own signing key signed it."""
    body = RequestBody.decode(request.body)
    request.verify(body.sign_key)
    return body


def issue(authority: Authority, request: Signed, *, run_id: str, stages: list[int] | None = None,
          roles: Sequence[str] = (), valid_s: int = 30 * 86400, serial: int | None = None,
          now: float | None = None) -> Signed:
    """A certificate for ``request`` (checked: its own signature, its fields) in run ``run_id``, for
    ``stages`` (default: those requested; never one it did not ask for), with ``roles``, valid from
    now for ``valid_s`` seconds, signed by ``authority``."""
    body = verify_request(request)
    granted = body.stages if stages is None else _check_stages(sorted(set(stages)), "certificate")
    if not set(granted) <= set(body.stages):
        raise CertificateError("stage_not_allowed", f"stages {sorted(set(granted) - set(body.stages))} were not "
                                                    f"requested (the request asks for {list(body.stages)})")
    if not run_id:
        raise ConfigError("a certificate needs a run id")
    if not 0 < valid_s <= MAX_VALIDITY_S:
        raise ConfigError(f"a certificate is valid for 1 s to {MAX_VALIDITY_S // 86400} days, not {valid_s} s")
    unknown = sorted(set(roles) - ROLES)
    if unknown:
        raise ConfigError(f"unknown role(s) {unknown}; the roles are {sorted(ROLES)}")
    start = int(time.time() if now is None else now)
    cert = CertificateBody(run_id, body.name, body.sign_key, body.curve_key, tuple(granted), tuple(sorted(set(roles))),
                           secrets.randbits(63) if serial is None else serial, start, start + valid_s,
                           authority.public)
    data = cert.encode()
    return Signed("certificate", data, authority.sign(SIGNING_CONTEXT["certificate"] + data))


def revoke(authority: Authority, serials: Sequence[int], *, run_id: str, previous: Signed | None = None,
           now: float | None = None) -> Signed:
    """A revocation list of run ``run_id``: ``serials`` and those of ``previous`` (an earlier list
    of this authority and run), issued now (a later time than ``previous``)."""
    if any(type(x) is not int or x < 0 for x in serials):
        raise ConfigError("serials are ints >= 0")
    before: tuple[int, ...] = ()
    issued = int(time.time() if now is None else now)
    if previous is not None:
        old = verify_revocations(previous, authority=authority.public, run_id=run_id)
        before, issued = old.serials, max(issued, old.issued + 1)
    merged = tuple(sorted(set(before) | set(serials)))
    if len(merged) > MAX_REVOKED:
        raise ConfigError(f"a revocation list holds at most {MAX_REVOKED} serials: start the run under a new "
                          f"authority instead")
    data = RevocationsBody(run_id, merged, issued, authority.public).encode()
    return Signed("revocations", data, authority.sign(SIGNING_CONTEXT["revocations"] + data))


def verify_revocations(signed: Signed, *, authority: bytes, run_id: str) -> RevocationsBody:
    """The list's body when ``authority`` signed it for ``run_id``; else :class:`CertificateError`."""
    body = RevocationsBody.decode(signed.body)
    if body.authority != authority:
        raise CertificateError("wrong_authority", f"revocation list signed by authority {key_id(body.authority)}, "
                                                  f"this run's is {key_id(authority)}")
    signed.verify(authority)
    if body.run != run_id:
        raise CertificateError("wrong_run", f"revocation list of run {body.run!r}, not {run_id!r}")
    return body


def verify_certificate(cert: Signed, *, authority: bytes, run_id: str, stage: int | None = None,
                       now: float | None = None, revoked: frozenset[int] | set[int] = frozenset()) -> CertificateBody:
    """The certificate's body, when ``authority`` signed it for run ``run_id``, it is valid at
    ``now`` and (``stage`` given) allows that stage; else :class:`CertificateError` with its code:
    ``malformed``, ``wrong_authority``, ``bad_signature``, ``wrong_run``, ``not_yet_valid``,
    ``expired``, ``revoked`` (its serial is in ``revoked``, from :func:`verify_revocations`),
    ``stage_not_allowed``."""
    body = CertificateBody.decode(cert.body)
    if body.authority != authority:
        raise CertificateError("wrong_authority", f"certificate of {body.name!r} is signed by authority "
                                                  f"{key_id(body.authority)}, this run's is {key_id(authority)}")
    cert.verify(authority)
    if body.run != run_id:
        raise CertificateError("wrong_run", f"certificate of {body.name!r} is for run {body.run!r}, not {run_id!r}")
    t = time.time() if now is None else now
    if t < body.not_before:
        raise CertificateError("not_yet_valid", f"certificate of {body.name!r} is valid from {iso_time(body.not_before)}, "
                                                f"now is {iso_time(t)} (are the two hosts' clocks set?)")
    if t >= body.not_after:
        raise CertificateError("expired", f"certificate of {body.name!r} expired at {iso_time(body.not_after)} "
                                          f"(now {iso_time(t)})")
    if body.serial in revoked:
        raise CertificateError("revoked", f"certificate of {body.name!r} (serial {body.serial}) is revoked")
    if stage is not None and stage not in body.stages:
        raise CertificateError("stage_not_allowed", f"certificate of {body.name!r} allows stage(s) "
                                                    f"{list(body.stages)}, not {stage}")
    return body


# ---------------------------------------------------------------------- files
def write_signed(path: str | os.PathLike[str], signed: Signed, *, force: bool = False) -> None:
    """A request or certificate file (public: mode 0644); an existing file only with ``force``."""
    p = Path(path)
    if p.exists() and not force:
        raise ConfigError(f"{signed.kind} file {p} already exists (--force replaces it)")
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_name(f".{p.name}.{secrets.token_hex(4)}.tmp")
    tmp.write_text(signed_text(signed), encoding="ascii")
    os.replace(tmp, p)


def read_signed(path: str | os.PathLike[str], kind: Kind) -> Signed:
    """A request or certificate file (its shape checked; verify a certificate before using it)."""
    p = Path(path)
    try:
        text = p.read_text(encoding="ascii")
    except FileNotFoundError:
        raise ConfigError(f"{kind} file {p} does not exist") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{kind} file {p}: cannot read it: {type(exc).__name__}") from None
    return parse_signed(text, kind, source=f"{kind} file {p}")


def signed_text(signed: Signed) -> str:
    """A request, certificate or revocation list as its file holds it (§7.1): header, base64, newline."""
    return f"{_HEADERS[signed.kind]}\n{base64.b64encode(signed.encode()).decode('ascii')}\n"


def parse_signed(text: str, kind: Kind, *, source: str) -> Signed:
    """:func:`signed_text`'s inverse (its shape checked, not yet verified); a
    :class:`~mapl_swarm.errors.ConfigError` names ``source`` and what is wrong."""
    lines = text.replace("\r\n", "\n").split("\n")
    if len(lines) != 3 or lines[0] != _HEADERS[kind] or lines[2] != "":
        raise ConfigError(f"{source} is not a {kind} (expected the line {_HEADERS[kind]!r}, then base64)")
    try:
        data = base64.b64decode(lines[1], validate=True)
    except (binascii.Error, ValueError):
        raise ConfigError(f"{source}: its second line is not base64") from None
    try:
        return Signed.decode(kind, data)
    except CertificateError as exc:
        raise ConfigError(f"{source}: {exc}") from None


# ---------------------------------------------------------------------- a peer's identity in a run
@dataclass(frozen=True)
class CurveKeys:
    """A ZeroMQ CURVE keypair, z85-encoded (40 bytes each): a peer's server key and client key."""

    public: bytes
    """z85 public key (the server key clients dial)."""
    secret: bytes = field(repr=False)
    """z85 secret key."""

    def __post_init__(self) -> None:
        if len(self.public) != 40 or len(self.secret) != 40:
            raise ConfigError("CURVE keys must be 40-byte z85 strings")


@dataclass(frozen=True, eq=False)
class PeerIdentity:
    """What a peer proves and checks in a certified run: its own key, its certificate (verified when
    loaded) and, from that certificate, the run and the authority it trusts. It is the peer's
    membership (:mod:`~.transport`: CURVE links pinned to named peers; :mod:`~.discovery`: records
    signed with its own key). Every peer trusts the authority that signed its own certificate."""

    key: PeerKey
    cert: Signed
    body: CertificateBody
    revoked: set[int] = field(default_factory=set)
    """Certificate serials of the run's revocation list, if the peer was given one (grows as
    :attr:`watch` reads newer lists)."""
    watch: RevocationWatch | None = None
    """The revocation list file, read again when it changes (the peer polls it)."""

    @property
    def run_id(self) -> str:
        return self.body.run

    @property
    def authority(self) -> bytes:
        return self.body.authority

    @property
    def key_id(self) -> str:
        return self.key.key_id

    @cached_property
    def curve(self) -> CurveKeys:
        """The peer's CURVE keypair (z85) as the transport takes it."""
        return CurveKeys(public=z85.encode(self.key.curve_public), secret=self.key.curve_secret)

    @cached_property
    def encoded_cert(self) -> bytes:
        """The certificate as a HELLO and a DHT record carry it (:meth:`Signed.encode`)."""
        return self.cert.encode()

    def describe(self) -> str:
        return (f"certified as {self.body.name!r} (peer key {self.key_id}, stage(s) {list(self.body.stages)}, "
                f"authority {key_id(self.authority)})")

    def sign_drain(self, epoch: int, step: int) -> dict[str, bytes]:
        """Stage 0's proof that it decided the swarm drains at ``step`` of run epoch ``epoch``: its
        certificate and its key's signature of that decision (CHECKPOINT ``drain``, SPEC §5.2)."""
        return {"cert": self.encoded_cert, "sig": self.key.sign(drain_statement(self.run_id, epoch, step))}

    def verify_drain(self, meta: dict[str, Any], *, epoch: int, step: int, now: float | None = None) -> CertificateBody:
        """The body of the certificate whose key signed the drain at ``step`` of run epoch ``epoch``
        that ``meta`` carries, when this run's authority certified it for stage 0; else
        :class:`CertificateError` (``unsigned`` when ``meta`` carries no proof)."""
        return self._verify_decision(meta, drain_statement(self.run_id, epoch, step), "drain", stage=0, now=now,
                                     what=f"step {step} of run epoch {epoch}")

    def sign_redo(self, epoch: int, step: int) -> dict[str, bytes]:
        """This member's proof that it decided ``step`` is redone in run epoch ``epoch`` (ROUTE
        ``redo``, SPEC §9.10 item 10): its certificate and its key's signature of that decision."""
        return {"cert": self.encoded_cert, "sig": self.key.sign(redo_statement(self.run_id, epoch, step))}

    def verify_redo(self, meta: dict[str, Any], *, epoch: int, step: int, now: float | None = None) -> CertificateBody:
        """The body of the certificate (of this run, any stage) whose key signed the redo of ``step``
        in run epoch ``epoch`` that ``meta`` carries; else :class:`CertificateError`."""
        return self._verify_decision(meta, redo_statement(self.run_id, epoch, step), "redo", stage=None, now=now,
                                     what=f"step {step} in run epoch {epoch}")

    def sign_work(self, kind: str, step: int, micro: int, digest: bytes) -> bytes:
        """This member's signature of a train ACT or GRAD it sends (:func:`work_statement`)."""
        return self.key.sign(work_statement(self.run_id, kind, step, micro, digest))

    def verify_work(self, proof: dict[str, Any], *, kind: str, step: int, micro: int, digest: bytes,
                    stage: int, now: float | None = None) -> CertificateBody:
        """The body of the certificate (of this run, for ``stage``) whose key signed the train ``kind``
        of ``micro`` in ``step`` with ``digest`` that ``proof`` (``cert``, ``sig``) carries; else
        :class:`CertificateError`. A certificate revoked since still proves what its member sent."""
        return self._verify_decision(proof, work_statement(self.run_id, kind, step, micro, digest), "work",
                                     stage=stage, now=now, what=f"the {kind} of micro-batch {micro} of step {step}",
                                     revoked=frozenset())

    def _verify_decision(self, meta: dict[str, Any], statement: bytes, kind: str, *, stage: int | None,
                         now: float | None, what: str, revoked: Any = None) -> CertificateBody:
        if not isinstance(meta.get("cert"), bytes) or not isinstance(meta.get("sig"), bytes):
            raise CertificateError("unsigned", f"a {kind} decision without its maker's certificate and signature")
        body = verify_certificate(Signed.decode("certificate", meta["cert"]), authority=self.authority,
                                  run_id=self.run_id, stage=stage, now=now,
                                  revoked=self.revoked if revoked is None else revoked)
        try:
            Ed25519PublicKey.from_public_bytes(body.sign_key).verify(meta["sig"], statement)
        except (InvalidSignature, ValueError):
            raise CertificateError("bad_signature", f"the {kind} decision's signature is not {body.name!r}'s for "
                                                    f"{what}") from None
        return body

    def verify_peer(self, data: Any, *, stage: int, curve_key: bytes | None,
                    now: float | None = None) -> CertificateBody:
        """The body of another peer's certificate ``data`` (as received) when this run's authority
        signed it for ``stage`` and its CURVE key is ``curve_key`` (the key its connection proved);
        else :class:`CertificateError` (``wrong_key`` for a certificate of another key)."""
        body = verify_certificate(Signed.decode("certificate", data), authority=self.authority, run_id=self.run_id,
                                  stage=stage, now=now, revoked=self.revoked)
        if curve_key is None or not secrets.compare_digest(body.curve_key, curve_key):
            raise CertificateError("wrong_key", f"certificate of {body.name!r} names another CURVE key than the "
                                                f"one its connection proved")
        return body

    def __repr__(self) -> str:
        return f"PeerIdentity({self.body.name!r}, key_id={self.key_id!r}, run={self.run_id!r})"


def load_identity(key_path: str | os.PathLike[str], cert_path: str | os.PathLike[str], *, run_id: str,
                  stage: int | None = None, revocations: str | os.PathLike[str] | None = None) -> PeerIdentity:
    """A peer's identity from its key file and certificate file, checked before any other work: the
    certificate is valid now for run ``run_id`` (and ``stage``), not revoked (``revocations``: the
    authority's list file) and names this key; else a one-line :class:`ConfigError` naming the file."""
    key = load_peer_key(key_path)
    cert = read_signed(cert_path, "certificate")
    try:
        body = CertificateBody.decode(cert.body)
        revoked: set[int] = set()
        if revocations is not None:
            revoked.update(verify_revocations(read_signed(revocations, "revocations"), authority=body.authority,
                                              run_id=run_id).serials)
        verify_certificate(cert, authority=body.authority, run_id=run_id, stage=stage, revoked=revoked)
    except CertificateError as exc:
        raise ConfigError(f"certificate {cert_path}: {exc} ({exc.code})") from None
    if body.sign_key != key.sign_public or body.curve_key != key.curve_public:
        raise ConfigError(f"certificate {cert_path} is for another peer key than {key_path} "
                          f"(it names {key_id(body.sign_key)}, the key is {key.key_id})")
    identity = PeerIdentity(key, cert, body, revoked, RevocationWatch(revocations) if revocations else None)
    if identity.watch is not None:
        identity.watch.poll(identity)  # remembers the list just read
    return identity


REVOCATION_POLL_S = 2.0
"""How often a certified peer given a revocation list looks whether the file changed."""


class Trust(Protocol):
    """What a revocation list is checked against and adds to: a :class:`PeerIdentity`, or the
    record validator of its DHT node (:class:`~mapl_swarm.net.dht_validation.CertifiedRecordValidator`)."""

    @property
    def authority(self) -> bytes: ...

    @property
    def run_id(self) -> str: ...

    @property
    def revoked(self) -> set[int]: ...


class RevocationWatch:
    """A certified peer's revocation list file (``peer --revocations``), read again when it changes:
    the operator replaces it on every host (``mapl-swarm keys revoke``, then copy it); running peers
    cut the revoked ones off within :data:`REVOCATION_POLL_S`, and their DHT nodes read the revoked
    ones' records as withdrawn (SPEC §7.2 item 8)."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self._seen: tuple[int, int] | None = None
        self._issued = -1

    def poll(self, identity: Trust) -> bool:
        """Read the file if it changed; a newer valid list adds its serials to ``identity.revoked``.
        True when that revoked a serial not revoked before. A missing or bad file keeps what was
        revoked (logged once per change of the file)."""
        try:
            st = self.path.stat()
        except OSError:
            return False
        if (st.st_mtime_ns, st.st_size) == self._seen:
            return False
        self._seen = (st.st_mtime_ns, st.st_size)
        try:
            body = verify_revocations(read_signed(self.path, "revocations"), authority=identity.authority,
                                      run_id=identity.run_id)
        except (ConfigError, CertificateError) as exc:
            log.warning("revocation list %s not used (what it revoked before stays revoked): %s", self.path, exc)
            return False
        if body.issued <= self._issued:
            return False
        self._issued = body.issued
        new = set(body.serials) - identity.revoked
        identity.revoked.update(new)
        return bool(new)


@dataclass(frozen=True)
class LocalIdentities:
    """The identities a local swarm (``launch``, ``lab``, compose) issues itself: one authority and,
    per stage (and per replica of a stage, SPEC §9.10), a key file and a certificate file."""

    folder: Path
    authority: Authority

    def _name(self, stage: int, replica: int) -> str:
        return f"stage{stage}" + (f"r{replica}" if replica else "")

    def key_file(self, stage: int, replica: int = 0) -> Path:
        return self.folder / f"{self._name(stage, replica)}.key"

    def cert_file(self, stage: int, replica: int = 0) -> Path:
        return self.folder / f"{self._name(stage, replica)}.cert"

    def args(self, stage: int, replica: int = 0) -> list[str]:
        """The ``peer`` options that give stage ``stage`` (its replica ``replica``) its identity."""
        return ["--peer-key", str(self.key_file(stage, replica)), "--cert", str(self.cert_file(stage, replica))]


LOCAL_VALIDITY_S = 30 * 86400
"""Validity of the certificates a local swarm issues (renewed when less than a day is left)."""


def issue_local(folder: str | os.PathLike[str], *, run_id: str, num_stages: int,
                roles: Sequence[str] = ("drain",), authority_file: str | os.PathLike[str] | None = None,
                replicas: Sequence[int] = ()) -> LocalIdentities:
    """An authority (``authority_file``, default ``folder/authority.key``) and per stage a peer key
    and a certificate for that stage alone, with ``roles`` (a local swarm lets each of its own peers
    drain it); ``replicas[s]`` peers of stage s (default one), each with its own key (SPEC §9.10).
    What exists and still fits (this authority, run and key, a day of validity left) is kept, so a
    resumed run keeps its identities; anything else is issued anew."""
    root = Path(folder)
    root.mkdir(parents=True, exist_ok=True)
    path = Path(authority_file) if authority_file is not None else root / "authority.key"
    authority = load_authority(path) if path.exists() else create_authority(path)
    local = LocalIdentities(root, authority)
    for stage, replica in ((s, r) for s in range(num_stages) for r in range(replicas[s] if replicas else 1)):
        key_path, cert_path = local.key_file(stage, replica), local.cert_file(stage, replica)
        key = peer_key_at(key_path)
        if cert_path.exists():
            try:
                body = verify_certificate(read_signed(cert_path, "certificate"), authority=authority.public,
                                          run_id=run_id, stage=stage, now=time.time() + 86400)
                if body.sign_key == key.sign_public and body.stages == (stage,) and body.roles == tuple(sorted(roles)):
                    continue
            except (CertificateError, ConfigError):
                pass
        cert = issue(authority, make_request(key, local._name(stage, replica), [stage]), run_id=run_id, roles=roles,
                     valid_s=LOCAL_VALIDITY_S)
        write_signed(cert_path, cert, force=True)
    return local
