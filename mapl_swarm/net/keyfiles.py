"""Secret key files: one header line, then 32 key bytes as 64 lowercase hex digits; mode 0600.

A run authority's key and a peer's own key (:mod:`~.identity`) are both files of this shape, told apart by their header line. They are read from files only (never a
command line or an environment variable), refused when any group or other permission bit is set,
written atomically (a crash leaves no file or the whole key) and never shown: errors name the file
and what is wrong with it, not its content.
"""

from __future__ import annotations

import os
import re
import secrets
import stat
from pathlib import Path

from mapl_swarm.errors import ConfigError

__all__ = ["KEY_BYTES", "read_key_file", "write_key_file"]

KEY_BYTES = 32
"""Random bytes in every key file."""
_HEX_LINE = re.compile(r"[0-9a-f]{64}")


def read_key_file(path: str | os.PathLike[str], *, header: str, what: str, create: str) -> bytes:
    """The key bytes of the ``what`` file at ``path`` (first line ``header``); a missing file, a
    mode with any group/other bit or a bad format is a one-line :class:`ConfigError` naming the
    file (``create``: the command that makes one)."""
    p = Path(path)
    try:
        st = p.stat()
    except FileNotFoundError:
        raise ConfigError(f"{what} file {p} does not exist (create one with `{create}`)") from None
    except OSError as exc:
        raise ConfigError(f"{what} file {p}: cannot read it: {exc.strerror}") from None
    if not stat.S_ISREG(st.st_mode):
        raise ConfigError(f"{what} file {p} is not a regular file")
    if st.st_mode & 0o077:
        raise ConfigError(f"{what} file {p} is readable by others (mode {stat.S_IMODE(st.st_mode):04o}); "
                          f"run: chmod 600 {p}")
    try:
        text = p.read_text(encoding="ascii")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{what} file {p}: cannot read it as a {what}: {type(exc).__name__}") from None
    lines = text.replace("\r\n", "\n").split("\n")
    if len(lines) != 3 or lines[0] != header or not _HEX_LINE.fullmatch(lines[1]) or lines[2] != "":
        raise ConfigError(f"{what} file {p} is not a {what} (expected the line {header!r}, then "
                          f"{2 * KEY_BYTES} lowercase hex digits; create one with `{create}`)")
    return bytes.fromhex(lines[1])


def write_key_file(path: str | os.PathLike[str], key: bytes, *, header: str, what: str,
                   force: bool = False) -> None:
    """Write ``key`` as a ``what`` file at ``path`` (mode 0600 whatever the umask, atomically). An
    existing file is a ConfigError unless ``force`` replaces it."""
    p = Path(path)
    if p.is_dir():
        raise ConfigError(f"{what} file {p} is a directory")
    if p.exists() and not force:
        raise ConfigError(f"{what} file {p} already exists (--force replaces it)")
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_name(f".{p.name}.{secrets.token_hex(4)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        try:
            os.fchmod(fd, 0o600)
            os.write(fd, f"{header}\n{key.hex()}\n".encode("ascii"))
            os.fsync(fd)
        finally:
            os.close(fd)
        if force:
            os.replace(tmp, p)
        else:
            try:
                os.link(tmp, p)  # fails if the file appeared meanwhile: never overwrite without force
            except FileExistsError:
                raise ConfigError(f"{what} file {p} already exists (--force replaces it)") from None
    finally:
        tmp.unlink(missing_ok=True)
