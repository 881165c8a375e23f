"""protocol/ and the code say the same: one version everywhere, every code and capability listed."""

from __future__ import annotations

import json
import re
from pathlib import Path

import mapl_swarm.wire as wire
from mapl_swarm.wire import spec
from mapl_swarm.wire.codebook import CODEBOOK_ERRORS_BY_CODE, INDEXED_SLICES_CAPABILITY, RETRANSMIT_CAPABILITY, \
    VQ_CAPABILITY
from mapl_swarm.wire.content import CONTENT_CODES
from mapl_swarm.wire.errors import ERRORS_BY_CODE
from mapl_swarm.wire.message import META_SCHEMA

PROTOCOL = Path(__file__).resolve().parents[2] / "protocol"
SPEC = (PROTOCOL / "SPEC.md").read_text(encoding="utf-8")
VERSION = f"{spec.PROTOCOL_VERSION[0]}.{spec.PROTOCOL_VERSION[1]}"


def section(start: str, end: str) -> str:
    return SPEC[SPEC.index(start):SPEC.index(end)]


def test_one_version_everywhere():
    assert re.search(r"^# mapl_swarm wire protocol — version (\d+\.\d+)$", SPEC, re.M).group(1) == VERSION
    assert f"`[{spec.PROTOCOL_VERSION[0]}, {spec.PROTOCOL_VERSION[1]}]` for this text" in SPEC
    readme = (PROTOCOL / "README.md").read_text(encoding="utf-8")
    assert re.findall(r"version (\d+\.\d+)", readme) == [VERSION]
    changelog = (PROTOCOL / "CHANGELOG.md").read_text(encoding="utf-8")
    assert re.search(r"^## (\d+\.\d+) ", changelog, re.M).group(1) == VERSION
    manifest = json.loads((PROTOCOL / "vectors" / f"v{spec.PROTOCOL_VERSION[0]}" / "manifest.json")
                          .read_text(encoding="utf-8"))
    assert manifest["protocol"] == VERSION
    assert wire.__doc__.startswith(f"Wire protocol {VERSION}:")
    assert spec.__doc__.startswith(f"Constants of wire protocol {VERSION}:")


def test_every_wire_error_is_in_section_6():
    table = section("## 6. Errors", "### 6.1")
    assert set(re.findall(r"^\| `\w+` \| `(\w+)` \|", table, re.M)) == set(ERRORS_BY_CODE)


def test_every_content_code_is_in_section_6_1():
    table = section("### 6.1", "### 6.2")
    codes = set(re.findall(r"^\| \d+ \| `(\w+)` \|", table, re.M))
    assert codes | {"stage_taken"} == set(CONTENT_CODES)
    assert "`stage_taken`" in table


def test_error_codes_section_6_2_names_every_family():
    text = section("### 6.2", "## 7.")
    assert "§6, §6.1 or §5.1" in text and "`retransmit_unavailable`" in text and "`internal`" in text
    codebook = section("### 5.1", "### 5.2")
    assert all(f"`{code}`" in codebook for code in CODEBOOK_ERRORS_BY_CODE)


def test_reject_codes_and_capabilities_are_listed():
    m = re.search(r"`REJECT\.code` is one of ((?:`\w+`,?\s*(?:or\s*)?)+)", SPEC)
    assert tuple(re.findall(r"`(\w+)`", m.group(1))) == spec.REJECT_CODES
    caps = set(re.findall(r"^\| `(\w+)` \| ", section("### 5.3", "## 6."), re.M))
    assert caps == {spec.PIPELINE_CAPABILITY, VQ_CAPABILITY, RETRANSMIT_CAPABILITY, INDEXED_SLICES_CAPABILITY,
                    spec.CHECKPOINT_CAPABILITY, spec.DRAIN_CAPABILITY, spec.REJOIN_CAPABILITY,
                    spec.CHECKPOINT_UNSAVED_CAPABILITY, spec.CHECKPOINT_ABANDONED_CAPABILITY}


def test_every_checkpoint_phase_is_in_section_5_2():
    table = section("### 5.2", "### 5.3")
    rows = dict(re.findall(r"^\| `\"(\w+)\"` \| ((?:up|down)stream) \|", table, re.M))
    assert set(rows) == set(spec.CHECKPOINT_PHASES)
    assert {p for p, way in rows.items() if way == "upstream"} == set(spec.CHECKPOINT_UPSTREAM_PHASES)


def test_every_meta_field_is_in_the_type_table():
    table = section("## 5. Message types", "- **HELLO / WELCOME / REJECT**")
    for required, optional in META_SCHEMA.values():
        for key in (*required, *optional):
            assert f"`{key}`" in table, key


def test_header_table_lists_every_key_in_canonical_order():
    table = section("## 2. Header", "## 3.")
    keys = re.findall(r"^\| \d+ \| `(\w+)` \|", table, re.M)
    assert keys == [*spec.HEADER_KEYS[:10], *spec.OPTIONAL_HEADER_KEYS, *spec.HEADER_KEYS[10:]]
    assert "`auth`" not in table.split("**Unknown keys.**")[0]  # no tag key in the table (SPEC §7)


def test_sections_cited_exist():
    """Every ``§N`` / ``§N.M`` the spec cites is one of its headings."""
    headings = set(re.findall(r"^#{2,3} (\d+(?:\.\d+)?)\.? ", SPEC, re.M))
    cited = set(re.findall(r"§(\d+(?:\.\d+)?)", SPEC))
    assert cited <= headings, sorted(cited - headings)
    assert "### 9.6 Rejoin after a departure (capability `rejoin`)" in SPEC
    assert "`stale_epoch`" in section("### 9.6", "### 9.7")


def test_one_major_and_no_1x_history():
    """2.0 is the spec of one version: no run key, no tags, no "since 1.x" qualifiers; vectors in v2/.
    The changelog is the one place history belongs."""
    assert set(re.findall(r"vectors/v(\d+)", SPEC)) == {"2"}
    # history qualifiers such as "(1.5)", "1.6:", "since 1.4" (not section numbers, not "peer speaks 1.9")
    qualifier = r"(?<![\d.§])(?<!speaks )1\.\d(?=[),;:])|since 1\.\d|until 1\.\d|\b1\.x\b"
    assert not re.search(qualifier, SPEC), re.findall(rf".{{30}}(?:{qualifier}).{{20}}", SPEC)
    gone = r"(?i)hmac|run[ _-]key|auth[ _-]key|auth_?failed|maplwire|mapl-session|mapl-dht-record"
    assert re.findall(gone, SPEC) == []
    assert "peer speaks 1.9, this peer speaks 2.0" in SPEC
    headings = re.findall(r"^### (7\.\d) (.+)$", SPEC, re.M)
    assert headings == [("7.1", "Per-peer identities"), ("7.2", "Certified peers"),
                        ("7.3", "What a dishonest party can still do (informative)")]
    assert "`auth` is no key of this version" in section("## 2. Header", "## 3.")
    readme = (PROTOCOL / "README.md").read_text(encoding="utf-8")
    assert set(re.findall(r"vectors/v(\d+)", readme)) == {"2"}
