"""Run key files (issue 12 item 1): format, mode 0600, atomic creation, derived keys, no leaks."""

from __future__ import annotations

import hashlib
import os
import stat

import pytest
import zmq
from zmq.utils import z85

from mapl_swarm.errors import ConfigError
from mapl_swarm.net.runkey import RUN_KEY_HEADER, RunKey, create_run_key, load_run_key

SECRET = bytes(range(32))


def write(path, text: str, mode: int = 0o600):
    path.write_text(text)
    os.chmod(path, mode)
    return path


def test_create_then_load_round_trip(tmp_path):
    old = os.umask(0)  # a permissive umask must not matter
    try:
        key = create_run_key(tmp_path / "sub" / "run.key")
    finally:
        os.umask(old)
    path = tmp_path / "sub" / "run.key"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    lines = path.read_text().split("\n")
    assert lines[0] == RUN_KEY_HEADER and len(lines[1]) == 64 and lines[2] == ""
    loaded = load_run_key(path)
    assert loaded.secret == key.secret and loaded.key_id == key.key_id and loaded.path == str(path)
    assert [p.name for p in (tmp_path / "sub").iterdir()] == ["run.key"]  # no temporary left behind
    assert create_run_key(tmp_path / "other.key").key_id != key.key_id


def test_existing_file_kept_unless_forced(tmp_path):
    path = tmp_path / "run.key"
    first = create_run_key(path)
    with pytest.raises(ConfigError, match=r"run\.key already exists \(--force replaces it"):
        create_run_key(path)
    assert load_run_key(path).secret == first.secret
    second = create_run_key(path, force=True)
    assert load_run_key(path).secret == second.secret != first.secret
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    with pytest.raises(ConfigError, match="is a directory"):
        create_run_key(tmp_path, force=True)


def test_derived_values_follow_the_labels():
    key = RunKey(SECRET)
    assert key.key_id == hashlib.sha256(b"mapl-keyid-v1" + SECRET).digest()[:8].hex()
    assert key.auth_key == hashlib.sha256(b"mapl-auth-v1" + SECRET).digest()
    assert key.dht_key == hashlib.sha256(b"mapl-dht-v1" + SECRET).digest()
    assert key.curve_secret == z85.encode(hashlib.sha256(b"mapl-curve-v1" + SECRET).digest())
    assert key.curve_public == zmq.curve_public(key.curve_secret) and len(key.curve_public) == 40
    assert len({key.auth_key, key.dht_key, z85.decode(key.curve_secret), SECRET}) == 4
    assert RunKey(SECRET).curve == key.curve  # every member derives the same keypair


def test_repr_never_shows_secret_bytes(tmp_path):
    key = create_run_key(tmp_path / "run.key")
    for text in (repr(key), str(key), repr(key.curve), f"{key}"):
        for secret in (key.secret.hex(), key.curve_secret.decode(), key.auth_key.hex(), key.dht_key.hex()):
            assert secret not in text
    assert key.key_id in repr(key) and "run.key" in repr(key)


@pytest.mark.parametrize("mode", [0o640, 0o604, 0o644, 0o660, 0o700 | 0o007])
def test_group_or_other_bits_refused(tmp_path, mode):
    path = write(tmp_path / "run.key", RunKey(SECRET).file_text(), mode)
    with pytest.raises(ConfigError, match=rf"readable by others \(mode {mode:04o}\); run: chmod 600 {path}$"):
        load_run_key(path)
    os.chmod(path, 0o400)  # owner read-only is fine
    assert load_run_key(path).secret == SECRET


@pytest.mark.parametrize("text", [
    "",
    "mapl-run-key v1\n",
    "mapl-run-key v2\n" + SECRET.hex() + "\n",
    "mapl-run-key v1\n" + SECRET.hex(),  # no final newline
    "mapl-run-key v1\n" + SECRET.hex().upper() + "\n",
    "mapl-run-key v1\n" + SECRET.hex()[:-2] + "\n",
    "mapl-run-key v1\n" + SECRET.hex() + "00\n",
    "mapl-run-key v1\n" + SECRET.hex() + "\n\n",
    SECRET.hex() + "\n",
])
def test_bad_format_refused_without_echoing_the_content(tmp_path, text):
    path = write(tmp_path / "run.key", text)
    with pytest.raises(ConfigError, match=rf"run key file {path} is not a run key") as info:
        load_run_key(path)
    assert SECRET.hex()[:16] not in str(info.value).lower() and "\n" not in str(info.value)


def test_crlf_line_ends_read_as_lf(tmp_path):
    path = write(tmp_path / "run.key", f"{RUN_KEY_HEADER}\r\n{SECRET.hex()}\r\n")
    assert load_run_key(path).secret == SECRET


def test_missing_binary_and_directory(tmp_path):
    with pytest.raises(ConfigError, match=r"does not exist \(create one with `mapl-swarm keys --out"):
        load_run_key(tmp_path / "nope.key")
    path = tmp_path / "bin.key"
    path.write_bytes(b"\xff\xfe" * 40)
    os.chmod(path, 0o600)
    with pytest.raises(ConfigError, match="cannot read it as a run key"):
        load_run_key(path)
    with pytest.raises(ConfigError, match="is not a regular file"):
        load_run_key(tmp_path)


def test_key_bytes_checked():
    with pytest.raises(ConfigError, match="32 bytes"):
        RunKey(b"short")
