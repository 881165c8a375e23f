"""Golden vectors: every stored vector behaves as protocol/vectors/v2/manifest.json says."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mapl_swarm.wire import ERRORS_BY_CODE, PROTOCOL_VERSION, MessageType
from mapl_swarm.wire.codebook import CODEBOOK_ERRORS_BY_CODE
from mapl_swarm.wire.content import CONTENT_CODES
from mapl_swarm.wire.golden.vectors import check_entry, check_vectors, main

ROOT = Path(__file__).resolve().parents[2] / "protocol" / "vectors" / "v2"
MANIFEST = json.loads((ROOT / "manifest.json").read_text(encoding="utf-8"))
ENTRIES = MANIFEST["vectors"]
LINK_STATE_CODES = {"replay", "wrong_session", "stage_taken", "queue_full"}
"""Content codes that need a link's state (the peer's): no single-message vector expresses them."""
MESSAGE_CONTENT_CODES = set(CONTENT_CODES) - LINK_STATE_CODES


@pytest.mark.parametrize("entry", ENTRIES, ids=[e["file"] for e in ENTRIES])
def test_vector_behaves_as_manifest_says(entry):
    check_entry(ROOT, entry)


def test_generator_reproduces_stored_vectors():
    assert check_vectors(ROOT) == []


def test_check_cli_passes(capsys):
    assert main(["--check", str(ROOT)]) == 0
    assert "OK" in capsys.readouterr().out


def test_check_cli_detects_tampering(tmp_path, capsys):
    assert main(["--out", str(tmp_path)]) == 0
    victim = tmp_path / "valid" / "act_train.mwv"
    data = bytearray(victim.read_bytes())
    data[-1] ^= 1
    victim.write_bytes(bytes(data))
    (tmp_path / "invalid" / "stale.mwv").write_bytes(b"\x90")
    assert main(["--check", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert "valid/act_train.mwv" in out and "stale" in out


def test_vectors_cover_every_error_and_message_type():
    errors = {e["error"] for e in ENTRIES if e["expect"] == "invalid"}
    assert errors == set(ERRORS_BY_CODE)
    types = {e["message"]["type"] for e in ENTRIES if e["expect"] == "valid"}
    assert types == {t.name for t in MessageType}
    kinds = {e["expect"] for e in ENTRIES}
    assert kinds == {"valid", "accept", "invalid", "codebook", "content"}
    outcomes = {e["outcome"] for e in ENTRIES if e["expect"] == "codebook"}
    assert outcomes == {"apply", "ignore", *CODEBOOK_ERRORS_BY_CODE}
    content = {e["outcome"] for e in ENTRIES if e["expect"] == "content"}
    assert content == {"accept", *MESSAGE_CONTENT_CODES}
    for e in ENTRIES:
        assert (ROOT / e["file"]).is_file()
        assert e["file"].startswith(e["expect"] + "/")


def test_vectors_are_of_this_version_and_carry_no_keys():
    """Every vector is a 2.0 message but those 2.1 and 2.2 added and the newer minors an accept vector
    shows; nothing is tagged (SPEC §7)."""
    from mapl_swarm.wire.golden.cases import CASES_2_1, CASES_2_2

    assert MANIFEST["protocol"] == f"{PROTOCOL_VERSION[0]}.{PROTOCOL_VERSION[1]}" == "2.2"
    assert "vectors/v2" in MANIFEST["regenerate"] and "vectors/v2" in MANIFEST["check"]
    assert not {"keys", "secret_hex"} & set(MANIFEST)
    newer = {"accept/newer_minor.mwv": [2, 1], "accept/unknown_header_key.mwv": [2, 3]}
    for e in ENTRIES:
        assert "secret" not in e, e["file"]
        if "message" in e:
            name = e["file"].split("/")[1].removesuffix(".mwv")
            minor = 2 if name in CASES_2_2 else 1 if name in CASES_2_1 else 0
            assert e["message"]["version"] == newer.get(e["file"], [2, minor]), e["file"]
    by_file = {e["file"]: e for e in ENTRIES}
    for major in (0, 1, 3):
        assert by_file[f"invalid/version_major_{major}.mwv"]["error"] == "version_mismatch"
    assert by_file["accept/auth_key_ignored.mwv"]["equivalent"] == "valid/act_train.mwv"


def test_epoch_vectors():
    """The header epoch in valid, accept, invalid and content vectors (SPEC §2, §6.1, §9.6)."""
    by_file = {e["file"]: e for e in ENTRIES}
    assert by_file["valid/act_epoch.mwv"]["message"]["epoch"] == 3
    assert by_file["valid/epoch_max.mwv"]["message"]["epoch"] == 2**64 - 1
    assert "rejoin" in by_file["valid/hello_rejoin.mwv"]["message"]["meta"]["capabilities"]
    assert by_file["valid/bye_rejoin.mwv"]["message"]["meta"] == {"lost": 1, "reason": "rejoin"}
    assert "epoch" not in by_file["valid/act_train.mwv"]["message"]  # 0: left out, as on the wire
    for name in ("epoch_negative", "epoch_string", "epoch_too_large"):
        assert by_file[f"invalid/{name}.mwv"]["error"] == "malformed_header"
    stale = [e for e in ENTRIES if e["expect"] == "content" and e["outcome"] == "stale_epoch"]
    assert stale and all(e["epoch"] > e["message"].get("epoch", 0) for e in stale)
