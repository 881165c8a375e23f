"""Golden vectors of identities and certified DHT records (SPEC §7.1, §7.2 item 5, §9.1).

    python -m mapl_swarm.net.identity_vectors --out protocol/vectors/v2/identity     # (re)write
    python -m mapl_swarm.net.identity_vectors --check protocol/vectors/v2/identity   # verify

One JSON file, ``manifest.json``: fixed keys and what derives from them, then requests,
certificates, revocation lists and DHT records, each with the check an implementation makes and
its outcome (``accept`` or the refusal code). Ed25519 signatures are deterministic (RFC 8032) and
every input is fixed, so the generator reproduces the file byte for byte; ``--check`` also runs
every entry through the reference checks (:mod:`~mapl_swarm.net.identity`,
:class:`~mapl_swarm.net.dht_validation.CertifiedRecordValidator`). The wire's own vectors
(:mod:`mapl_swarm.wire.golden`) stay free of this layer: these live beside them, in ``identity/``.
"""

from __future__ import annotations

import base64
import hashlib
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgpack

from mapl_swarm.errors import ConfigError
from mapl_swarm.net.discovery import member_keys, relay_key, stage_key
from mapl_swarm.net.identity import (
    CERTIFICATE_HEADER,
    SIGNING_CONTEXT,
    Authority,
    CertificateError,
    PeerKey,
    Signed,
    Kind,
    issue,
    key_id,
    libp2p_peer_id,
    make_request,
    parse_signed,
    revoke,
    signed_text,
    verify_certificate,
    verify_request,
    verify_revocations,
)
from mapl_swarm.wire.golden.vectors import check_manifest_file, json_value, manifest_main

__all__ = ["build_manifest", "check_manifest", "main"]

MANIFEST = "manifest.json"
FOLDER = "protocol/vectors/v2/identity"
COMMAND = "mapl_swarm.net.identity_vectors"
RUN = "vectors-run-0001"
NUM_STAGES = 4
NOW = 1_800_000_000
"""The checking clock of every entry (unix seconds) unless an entry names its own ``now``."""
NOT_BEFORE = NOW - 3600
VALID_S = 30 * 86400
AUTHORITY = Authority(bytes(range(32)))
OTHER_AUTHORITY = Authority(bytes(range(32, 64)))
PEERS = [PeerKey(hashlib.sha256(f"mapl vector peer {k}".encode()).digest()) for k in range(2)]
SUBKEY = msgpack.packb("12D3KooWVectorPeerOne", use_bin_type=True)
EXPIRATION = NOW + 30.5


def _fields(body: Any) -> dict[str, Any]:
    return {name: json_value(getattr(body, name)) for name in body.__dataclass_fields__}


def _keys() -> dict[str, Any]:
    def authority(a: Authority) -> dict[str, Any]:
        return {"seed": a.seed.hex(), "public": a.public.hex(), "key_id": a.key_id}

    return {
        "authority": authority(AUTHORITY),
        "other_authority": authority(OTHER_AUTHORITY),
        "peers": [_peer_entry(p) for p in PEERS],
    }


def _peer_entry(p: PeerKey) -> dict[str, Any]:
    """A peer key and everything SPEC §7.1 and §9.1 derive from it."""
    return {"key": p.secret.hex(), "sign_public": p.sign_public.hex(), "curve_secret_z85": p.curve_secret.decode("ascii"),
            "curve_secret": hashlib.sha256(b"mapl-peer-curve v1" + p.secret).digest().hex(),
            "curve_public": p.curve_public.hex(), "key_id": p.key_id, "libp2p_private_key": p.libp2p_private_key().hex(),
            "libp2p_peer_id": libp2p_peer_id(p.sign_public).hex(),
            "libp2p_peer_id_base58": _base58(libp2p_peer_id(p.sign_public))}


def _base58(data: bytes) -> str:
    import base58  # hivemind's dependency, as libp2p writes peer ids

    return base58.b58encode(data).decode("ascii")


# ---------------------------------------------------------------------- signed bodies
def _signed(kind: Kind, body: dict[str, Any], signer: Callable[[bytes], bytes]) -> Signed:
    data = msgpack.packb(body, use_bin_type=True)
    return Signed(kind, data, signer(SIGNING_CONTEXT[kind] + data))


def _cert_body(peer: PeerKey = PEERS[1], **changes: Any) -> dict[str, Any]:
    body = {"v": 1, "run": RUN, "name": "stage1-host-b", "sign_key": peer.sign_public, "curve_key": peer.curve_public,
            "stages": [1], "roles": [], "serial": 1001, "not_before": NOT_BEFORE, "not_after": NOT_BEFORE + VALID_S,
            "authority": AUTHORITY.public}
    body.update(changes)
    return {k: v for k, v in body.items() if v is not _DROP}


_DROP = object()


def _cert(**changes: Any) -> Signed:
    return _signed("certificate", _cert_body(**changes), AUTHORITY.sign)


def certificate_of(stage: int, peer: PeerKey, **changes: Any) -> Signed:
    """The vectors' valid certificate of ``peer`` for ``stage`` (serial 1000 + stage)."""
    return _cert(peer=peer, name=f"stage{stage}-host", stages=[stage], serial=1000 + stage, **changes)


def _resigned(signed: Signed) -> Signed:
    return Signed(signed.kind, signed.body, AUTHORITY.sign(SIGNING_CONTEXT[signed.kind] + signed.body))


@dataclass(frozen=True)
class Case:
    """One signed thing and how it is checked (``check``) with its expected outcome."""

    name: str
    description: str
    signed: Signed
    check: dict[str, Any]


def _certificate_cases() -> list[Case]:
    good = _cert()
    flipped = bytearray(good.sig)
    flipped[0] ^= 1
    default = {"authority": AUTHORITY.public.hex(), "run": RUN, "stage": 1, "now": NOW, "revoked": []}

    def case(name: str, description: str, signed: Signed, **check: Any) -> Case:
        return Case(name, description, signed, {**default, **check})

    return [
        case("valid", "stage 1's certificate, checked for stage 1 an hour after it starts", good),
        case("valid_drain_role", "a certificate with the role drain (it may ask the swarm to drain)",
             _cert(roles=["drain"], serial=1002)),
        case("valid_no_stage_check", "any stage: the check a bootstrap node makes (stage null)", good, stage=None),
        case("valid_two_stages", "a certificate for stages 1 and 2, checked for stage 2",
             _cert(stages=[1, 2], serial=1003), stage=2),
        case("valid_last_second", "checked at not_after - 1", good, now=NOT_BEFORE + VALID_S - 1),
        case("malformed_missing_field", "the body lacks serial", _cert(serial=_DROP)),
        case("malformed_extra_field", "the body has a field no version 1 body has", _cert(extra=1)),
        case("malformed_bool_serial", "serial is a msgpack true, not an int", _cert(serial=True)),
        case("malformed_version", "v is 2", _cert(v=2)),
        case("malformed_stages_order", "stages not ascending", _cert(stages=[2, 1])),
        case("malformed_stages_empty", "no stage at all", _cert(stages=[])),
        case("malformed_name", "a name starting with '-'", _cert(name="-stage1")),
        case("malformed_role", "a role this version does not know", _cert(roles=["admin"])),
        case("malformed_validity", "valid for 367 days (at most 366)",
             _cert(not_after=NOT_BEFORE + 367 * 86400)),
        case("malformed_short_key", "a curve_key of 31 bytes", _cert(curve_key=PEERS[1].curve_public[:31])),
        case("malformed_sig_length", "a 63-byte signature", Signed("certificate", good.body, good.sig[:63])),
        case("wrong_authority", "signed by another authority than the run's",
             _signed("certificate", _cert_body(authority=OTHER_AUTHORITY.public), OTHER_AUTHORITY.sign)),
        case("bad_signature", "the signature's first byte flipped", Signed("certificate", good.body, bytes(flipped))),
        case("bad_signature_other_context", "the body signed as a request, not as a certificate",
             Signed("certificate", good.body, AUTHORITY.sign(SIGNING_CONTEXT["request"] + good.body))),
        case("wrong_run", "checked by a peer of run vectors-run-0002", good, run="vectors-run-0002"),
        case("not_yet_valid", "checked one second before not_before", good, now=NOT_BEFORE - 1),
        case("expired", "checked at not_after (the interval is half-open)", good, now=NOT_BEFORE + VALID_S),
        case("revoked", "its serial 1001 is on the revocation list", good, revoked=[7, 1001]),
        case("stage_not_allowed", "checked for stage 2", good, stage=2),
    ]


def _outcome(check: Callable[[], Any]) -> dict[str, Any]:
    try:
        body = check()
    except CertificateError as exc:
        return {"outcome": exc.code}
    return {"outcome": "accept", "body": _fields(body)}


def _certificate_entry(case: Case) -> dict[str, Any]:
    c = case.check
    return {"name": case.name, "description": case.description, "file": signed_text(case.signed),
            "signed": case.signed.encode().hex(), "check": c,
            **_outcome(lambda: verify_certificate(Signed.decode("certificate", case.signed.encode()),
                                                  authority=bytes.fromhex(c["authority"]), run_id=c["run"],
                                                  stage=c["stage"], now=c["now"], revoked=set(c["revoked"])))}


def _request_entries() -> list[dict[str, Any]]:
    good = make_request(PEERS[1], "stage1-host-b", [1, 2])
    by_other = Signed("request", good.body, PEERS[0].sign(SIGNING_CONTEXT["request"] + good.body))
    issued = issue(AUTHORITY, good, run_id=RUN, stages=[1], serial=1001, now=NOW - 3600, valid_s=VALID_S)
    cases = [("valid", "a host's request for stages 1 and 2, signed by its own signing key", good),
             ("bad_signature", "signed by another peer's key than the one it names", by_other)]
    entries = [{"name": n, "description": d, "file": signed_text(s), **_outcome(lambda s=s: verify_request(s))}
               for n, d, s in cases]
    entries[0]["issued"] = {"stages": [1], "serial": 1001, "now": NOW - 3600, "valid_s": VALID_S,
                            "file": signed_text(issued),
                            "note": "the certificate the authority issues for it (equal to certificates/valid)"}
    return entries


def _revocation_entries() -> list[dict[str, Any]]:
    first = revoke(AUTHORITY, [1001, 7], run_id=RUN, now=NOW)
    later = revoke(AUTHORITY, [1002], run_id=RUN, previous=first, now=NOW)
    other = _signed("revocations", {"v": 1, "run": RUN, "serials": [1001], "issued": NOW,
                                    "authority": OTHER_AUTHORITY.public}, OTHER_AUTHORITY.sign)
    flipped = bytearray(first.sig)
    flipped[5] ^= 0x40
    cases = [("valid", "serials 7 and 1001 revoked", first, RUN),
             ("valid_later", "a later list (issued + 1) adding 1002: it replaces the first", later, RUN),
             ("wrong_authority", "a list signed by another authority", other, RUN),
             ("bad_signature", "a signature byte flipped", Signed("revocations", first.body, bytes(flipped)), RUN),
             ("wrong_run", "checked by a peer of run vectors-run-0002", first, "vectors-run-0002")]
    return [{"name": n, "description": d, "file": signed_text(s), "check": {"authority": AUTHORITY.public.hex(),
             "run": run}, **_outcome(lambda s=s, run=run: verify_revocations(s, authority=AUTHORITY.public,
                                                                            run_id=run))}
            for n, d, s, run in cases]


# ---------------------------------------------------------------------- DHT records
def _contact(peer: PeerKey, port: int = 7001) -> str:
    return f"tcp://10.0.0.2:{port}#{peer.curve_public.hex()}"


def _record(*, stage: int = 1, peer: PeerKey = PEERS[1], cert: Signed | None = None, value: str | bytes | None = None,
            subkey: bytes = SUBKEY, expiration: float = EXPIRATION, signer: PeerKey | None = None,
            key: str | None = None) -> dict[str, Any]:
    from mapl_swarm.net.dht_validation import dht_key_id, record_message

    cert = certificate_of(stage, peer) if cert is None else cert
    key = stage_key(RUN, stage) if key is None else key
    k = dht_key_id(key)
    v = value if isinstance(value, bytes) else msgpack.packb(_contact(peer) if value is None else value,
                                                             use_bin_type=True)
    enc = cert.encode()
    sig = (signer or peer).sign(record_message(k, subkey, v, expiration))
    return {"key_string": key, "key": k.hex(), "subkey": subkey.hex(),
            "value": v.hex(), "expiration_time": expiration,
            "stored": (v + enc + struct.pack(">H", len(enc)) + sig).hex()}


def _record_cases() -> list[tuple[str, str, dict[str, Any], dict[str, Any]]]:
    check = {"authority": AUTHORITY.public.hex(), "run": RUN, "num_stages": NUM_STAGES, "now": NOW, "revoked": []}
    expired_cert = certificate_of(1, PEERS[1], not_after=NOW + 10)
    return [
        ("valid", "stage 1's contact, expiring 30.5 s ahead", _record(), check),
        ("valid_tombstone", "the empty string: stage 1 withdraws its entry", _record(value=""), check),
        ("valid_ttl_bound", "expiring exactly 600 s ahead", _record(expiration=NOW + 600.0), check),
        ("revoked_reads_withdrawn", "a revoked certificate's record: accepted, read as the tombstone",
         _record(), {**check, "revoked": [1001]}),
        ("not_a_stage_key", "a key that is no stage key of the run", _record(key=f"mapl/{RUN}/stage/9"), check),
        ("no_subkey", "a record without a subkey (msgpack nil)", _record(subkey=b"\xc0"), check),
        ("expiration_too_far", "expiring 600.5 s ahead", _record(expiration=NOW + 600.5), check),
        ("stage_not_allowed", "stage 0's certificate on a stage 1 record",
         _record(cert=certificate_of(0, PEERS[1])), check),
        ("bad_signature", "signed by another peer's key than its certificate's", _record(signer=PEERS[0]), check),
        ("after_certificate", "expiring after the certificate's not_after",
         _record(cert=expired_cert, expiration=NOW + 11.0), check),
        ("wrong_key", "a contact naming another CURVE key than the certificate's",
         _record(value=_contact(PEERS[0])), check),
        ("valid_dial_out", "2.2: stage 1's dial-out contact (its CURVE key, no address: SPEC §1.2)",
         _record(value="dialout#" + PEERS[1].curve_public.hex()), check),
        ("dial_out_wrong_key", "2.2: a dial-out contact naming another CURVE key than the certificate's",
         _record(value="dialout#" + PEERS[0].curve_public.hex()), check),
        ("not_a_contact", "a value that is msgpack of an int, not of a string",
         _record(value=msgpack.packb(7)), check),
        ("expired_certificate", "a record checked after its certificate expired",
         _record(cert=expired_cert, expiration=NOW + 5.0), {**check, "now": NOW + 10}),
        ("member_valid", "a stage 1 replica's state-download record at its own peer id",
         _record(key=member_keys(RUN, 1)[1], subkey=_peer_subkey(PEERS[1]), value=msgpack.packb(1.0)), check),
        ("member_matchmaking", "a stage 1 replica looking for a group (matchmaking key, value true)",
         _record(key=member_keys(RUN, 1)[0], subkey=_peer_subkey(PEERS[1]), value=msgpack.packb(True)), check),
        ("member_not_own_peer_id", "a replica's record at another peer's id",
         _record(key=member_keys(RUN, 1)[1], subkey=_peer_subkey(PEERS[0]), value=msgpack.packb(1.0)), check),
        ("member_stage_not_allowed", "stage 1's certificate on stage 2's averaging key",
         _record(key=member_keys(RUN, 2)[1], cert=certificate_of(1, PEERS[1]), subkey=_peer_subkey(PEERS[1]),
                 value=msgpack.packb(1.0)), check),
        ("member_status", "a stage 1 peer's status record at its own peer id",
         _record(key=member_keys(RUN, 1)[2], subkey=_peer_subkey(PEERS[1]),
                 value=msgpack.packb({"state": "training", "step": 7, "tokens_per_s": 1234.5, "queue": 2})), check),
        ("member_status_not_own_peer_id", "a status record of stage 1 at another peer's id",
         _record(key=member_keys(RUN, 1)[2], subkey=_peer_subkey(PEERS[0]), value=msgpack.packb({"step": 7})),
         check),
        ("member_not_msgpack", "a replica's record whose value is no msgpack object",
         _record(key=member_keys(RUN, 1)[1], subkey=_peer_subkey(PEERS[1]), value=b"\xc1"), check),
        ("relay_valid", "2.2: a member's relay (SPEC §9.12) at its own peer id, with its certificate's CURVE key",
         _relay(f"10.0.0.2:7400#{PEERS[1].curve_public.hex()}"), check),
        ("relay_tombstone", "2.2: the empty string: the member withdraws its relay", _relay(""), check),
        ("relay_wrong_key", "2.2: a relay address naming another CURVE key than the certificate's",
         _relay(f"10.0.0.2:7400#{PEERS[0].curve_public.hex()}"), check),
        ("relay_not_own_peer_id", "2.2: a relay record at another peer's id",
         _relay(f"10.0.0.2:7400#{PEERS[1].curve_public.hex()}", subkey=_peer_subkey(PEERS[0])), check),
        ("relay_not_a_relay", "2.2: a stage contact under the relay key (no HOST:PORT#key)",
         _relay(_contact(PEERS[1])), check),
    ]


def _relay(value: str, subkey: bytes | None = None) -> dict[str, Any]:
    """A record under the run's relay key, signed by stage 1's peer."""
    return _record(key=relay_key(RUN), subkey=_peer_subkey(PEERS[1]) if subkey is None else subkey, value=value)


def _peer_subkey(peer: PeerKey) -> bytes:
    """A replica record's subkey: msgpack (bin) of its libp2p peer id, as hivemind's averager stores it."""
    return msgpack.packb(libp2p_peer_id(peer.sign_public), use_bin_type=True)


def _record_entry(name: str, description: str, record: dict[str, Any], check: dict[str, Any]) -> dict[str, Any]:
    from hivemind.dht.validation import DHTRecord

    from mapl_swarm.net.dht_validation import CertifiedRecordValidator

    stages = range(check["num_stages"])
    validator = CertifiedRecordValidator(
        run_id=check["run"], authority=bytes.fromhex(check["authority"]), revoked=set(check["revoked"]),
        stage_keys={stage_key(check["run"], s): s for s in stages},
        member_keys={key: s for s in stages for key in member_keys(check["run"], s)},
        relay_keys={relay_key(check["run"])})
    r = DHTRecord(bytes.fromhex(record["key"]), bytes.fromhex(record["subkey"]), bytes.fromhex(record["stored"]),
                  record["expiration_time"])
    refusal = validator.refusal(r, check["now"])
    out = {"name": name, "description": description, "record": record, "check": check,
           "outcome": "accept" if refusal is None else refusal}
    if refusal is None:
        out["reads"] = validator.strip_value(r).hex()
    return out


# ---------------------------------------------------------------------- manifest
def build_manifest() -> dict[str, Any]:
    """Everything ``manifest.json`` holds, computed by the reference code."""
    return {
        "protocol": "2.0",
        "regenerate": f"python -m {COMMAND} --out {FOLDER}",
        "check": f"python -m {COMMAND} --check {FOLDER}",
        "now": NOW,
        "keys": _keys(),
        "requests": _request_entries(),
        "certificates": [_certificate_entry(c) for c in _certificate_cases()],
        "revocations": _revocation_entries(),
        "records": [_record_entry(*c) for c in _record_cases()],
    }


def _check_derivations(keys: dict[str, Any]) -> list[str]:
    problems = []
    for label, a in (("authority", keys["authority"]), ("other_authority", keys["other_authority"])):
        if Authority(bytes.fromhex(a["seed"])).public.hex() != a["public"] or key_id(bytes.fromhex(a["public"])) \
                != a["key_id"]:
            problems.append(f"keys.{label}: public key or key id does not derive from the seed")
    for i, p in enumerate(keys["peers"]):
        derived = _peer_entry(PeerKey(bytes.fromhex(p["key"])))
        problems += [f"keys.peers[{i}].{name}: does not derive from the key" for name in derived
                     if p.get(name) != derived[name]]
    return problems


def check_manifest(root: Path) -> list[str]:
    """Every problem with the stored vectors under ``root``: each entry re-checked by the reference
    code from its stored bytes alone, then the whole file against the generator's."""
    return check_manifest_file(root, MANIFEST, build_manifest, _recheck)


def _recheck(stored: dict[str, Any]) -> list[str]:
    """Every entry of ``stored`` re-checked by the reference code from its stored bytes alone."""
    problems = _check_derivations(stored["keys"])
    for e in stored["certificates"]:
        c, data = e["check"], bytes.fromhex(e["signed"])
        if e["file"] != f"{CERTIFICATE_HEADER}\n{base64.b64encode(data).decode('ascii')}\n":
            problems.append(f"certificates/{e['name']}: file and signed differ")
        got = _outcome(lambda: verify_certificate(Signed.decode("certificate", data),
                                                  authority=bytes.fromhex(c["authority"]), run_id=c["run"],
                                                  stage=c["stage"], now=c["now"], revoked=set(c["revoked"])))
        if got["outcome"] != e["outcome"] or got.get("body") != e.get("body"):
            problems.append(f"certificates/{e['name']}: expected {e['outcome']}, the reference gives {got['outcome']}")
    for group, kind, verify in (("requests", "request", lambda s, e: verify_request(s)),
                                ("revocations", "revocations", lambda s, e: verify_revocations(
                                    s, authority=bytes.fromhex(e["check"]["authority"]), run_id=e["check"]["run"]))):
        for e in stored[group]:
            try:
                signed = parse_signed(e["file"], kind, source=f"{group}/{e['name']}")
            except ConfigError as exc:
                problems.append(str(exc))
                continue
            got = _outcome(lambda: verify(signed, e))
            if got["outcome"] != e["outcome"] or got.get("body") != e.get("body"):
                problems.append(f"{group}/{e['name']}: expected {e['outcome']}, the reference gives {got['outcome']}")
    for e in stored["records"]:
        got = _record_entry(e["name"], e["description"], e["record"], e["check"])
        if (got["outcome"], got.get("reads")) != (e["outcome"], e.get("reads")):
            problems.append(f"records/{e['name']}: expected {e['outcome']}, the reference gives {got['outcome']}")
    return problems


def main(argv: list[str] | None = None) -> int:
    """Command line entry point; returns the exit status."""
    return manifest_main(argv, command=COMMAND, description=__doc__.split("\n")[0], build=build_manifest,
                         check=check_manifest, name=MANIFEST)


if __name__ == "__main__":
    raise SystemExit(main())
