"""Golden vectors of identities and certified DHT records (protocol/vectors/v2/identity): the stored
file is what the generator writes, every entry's outcome is the reference checks', every refusal
code of SPEC §7.1 and of a record validator appears, and a wrong entry is reported."""

from __future__ import annotations

import json
from pathlib import Path

from mapl_swarm.net import identity_vectors as V
from mapl_swarm.wire.golden.vectors import manifest_text
from mapl_swarm.net.identity import parse_signed, verify_certificate

ROOT = Path(__file__).resolve().parents[2] / V.FOLDER
STORED = json.loads((ROOT / V.MANIFEST).read_text(encoding="utf-8"))
CERT_CODES = {"malformed", "wrong_authority", "bad_signature", "wrong_run", "not_yet_valid", "expired", "revoked",
              "stage_not_allowed"}


def test_the_stored_vectors_pass_their_check():
    assert V.check_manifest(ROOT) == []
    assert V.main(["--check", str(ROOT)]) == 0


def test_every_refusal_code_appears():
    assert {e["outcome"] for e in STORED["certificates"]} == CERT_CODES | {"accept"}
    assert {e["outcome"] for e in STORED["revocations"]} >= {"accept", "wrong_authority", "bad_signature", "wrong_run"}
    records = {e["outcome"] for e in STORED["records"]}
    assert records >= {"accept", "not_a_stage_key", "no_subkey", "expiration_too_far", "stage_not_allowed",
                       "bad_signature", "after_certificate", "wrong_key", "not_a_contact", "expired",
                       "not_own_peer_id", "not_msgpack"}


def test_a_revoked_record_reads_as_the_tombstone_and_a_live_one_as_its_contact():
    by_name = {e["name"]: e for e in STORED["records"]}
    assert by_name["revoked_reads_withdrawn"]["reads"] == "a0"  # msgpack of ""
    assert by_name["valid"]["reads"] == by_name["valid"]["record"]["value"]
    stored = bytes.fromhex(by_name["valid"]["record"]["stored"])
    assert stored.startswith(bytes.fromhex(by_name["valid"]["record"]["value"]))


def test_the_issued_certificate_is_the_valid_vector():
    """issue() from the request vector gives byte for byte the certificate vector the checks accept."""
    issued = STORED["requests"][0]["issued"]["file"]
    valid = next(e for e in STORED["certificates"] if e["name"] == "valid")
    assert issued == valid["file"]
    body = verify_certificate(parse_signed(issued, "certificate", source="vector"),
                              authority=bytes.fromhex(STORED["keys"]["authority"]["public"]), run_id=V.RUN, stage=1,
                              now=V.NOW)
    assert body.curve_key.hex() == STORED["keys"]["peers"][1]["curve_public"]


def test_a_wrong_outcome_or_a_changed_byte_is_reported(tmp_path):
    bad = json.loads(json.dumps(STORED))
    bad["certificates"][0]["outcome"] = "expired"
    signed = bytearray.fromhex(bad["records"][0]["record"]["stored"])
    signed[-1] ^= 1
    bad["records"][0]["record"]["stored"] = signed.hex()
    bad["keys"]["peers"][0]["curve_public"] = "00" * 32
    (tmp_path / V.MANIFEST).write_text(manifest_text(bad), encoding="utf-8")
    problems = V.check_manifest(tmp_path)
    assert any(p.startswith("certificates/valid: expected expired") for p in problems), problems
    assert any(p.startswith("records/valid: expected accept, the reference gives bad_signature") for p in problems)
    assert any(p.startswith("keys.peers[0]") for p in problems)
    assert any("differs from what the generator writes" in p for p in problems)
