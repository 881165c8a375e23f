"""Crash-safe file writes: a file is written under a temporary name beside it, flushed, fsynced and
renamed, then its directory is fsynced. A crash, a kill or a full disk never leaves a half-written
file under the final name, and a failed write removes its temporary file.

One implementation serves text, bytes and streams (``torch.save`` into :func:`atomic_writer`); each
write also measures what it wrote (:class:`Written`: bytes and SHA-256), for checkpoint manifests.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Iterator

__all__ = ["Written", "atomic_writer", "atomic_write_bytes", "atomic_write_text", "fsync_dir", "temp_name_glob",
           "sha256_file"]

_CHUNK = 1 << 20


@dataclass(frozen=True)
class Written:
    """What an atomic write put under its final name."""

    path: Path
    nbytes: int
    sha256: str
    """Hex SHA-256 of the bytes written."""


class _DigestingFile:
    """A binary file that counts and hashes what goes through it (``write`` and ``flush`` only)."""

    def __init__(self, raw: BinaryIO) -> None:
        self._raw, self._hash, self.nbytes = raw, hashlib.sha256(), 0

    def write(self, data: bytes | bytearray | memoryview) -> int:
        view = memoryview(data).cast("B")
        self._raw.write(view)  # a buffered file writes it all or raises
        self._hash.update(view)
        self.nbytes += view.nbytes
        return view.nbytes

    def flush(self) -> None:
        self._raw.flush()

    def hexdigest(self) -> str:
        return self._hash.hexdigest()


def temp_name_glob(name: str) -> str:
    """The glob of the temporary files :func:`atomic_writer` uses for a file called ``name``."""
    return f".{name}.*tmp"


def fsync_dir(path: str | Path) -> None:
    """Make the entries of directory ``path`` (a rename, a new file) durable."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_writer(path: str | Path) -> Iterator[_DigestingFile]:
    """Yield a binary file to write ``path``'s new content into; on a clean exit it replaces
    ``path`` atomically and durably. Any exception (``OSError`` of a full disk included) removes
    the temporary file and propagates. After the block, the yielded file's ``nbytes`` and
    ``hexdigest()`` describe what was written."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}-{secrets.token_hex(4)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)  # the umask applies, as for any file
    try:
        with os.fdopen(fd, "wb") as raw:
            out = _DigestingFile(raw)
            yield out
            raw.flush()
            os.fsync(raw.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    fsync_dir(path.parent)


def atomic_write_bytes(path: str | Path, data: bytes) -> Written:
    """Write ``data`` to ``path`` atomically and durably (:func:`atomic_writer`)."""
    with atomic_writer(path) as f:
        f.write(data)
    return Written(Path(path), f.nbytes, f.hexdigest())


def atomic_write_text(path: str | Path, text: str) -> Path:
    """Write ``text`` (UTF-8) to ``path`` atomically and durably (:func:`atomic_writer`)."""
    atomic_write_bytes(path, text.encode())
    return Path(path)


def sha256_file(path: str | Path) -> tuple[int, str]:
    """The size in bytes and hex SHA-256 of the file at ``path``, read in 1 MiB chunks."""
    h, n = hashlib.sha256(), 0
    with open(path, "rb", buffering=0) as f:
        buf = bytearray(_CHUNK)
        view = memoryview(buf)
        while got := f.readinto(buf):
            h.update(view[:got])
            n += got
    return n, h.hexdigest()
