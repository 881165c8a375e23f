"""The run key: one secret file that makes a peer a member of a run.

Every member of a run holds the same key file (``mapl-swarm keys --out FILE`` creates one; ``peer``
and ``dht`` take it with ``--key-file``). ``launch``, ``lab`` and compose use per-peer identities
instead (:mod:`~.identity`, protocol 1.8), which keep members apart. Everything a member
proves or protects is derived from it, each value under its own label, so no derived value reveals
another or the key:

- ``curve_secret`` / ``curve_public``: the run's ZeroMQ CURVE keypair (z85). Every member's ROUTER
  is a CURVE server with it, every DEALER a CURVE client with it, and the ZAP handler admits only
  clients presenting ``curve_public``: a party without the key completes no handshake, so no frame
  of it is delivered and it learns no plaintext (:mod:`mapl_swarm.net.transport`);
- ``auth_key``: the HMAC key of the wire's authentication tag (SPEC §7);
- ``dht_key``: the HMAC key of signed DHT records (:mod:`mapl_swarm.net.discovery`);
- ``key_id``: a short public name of the key for logs (not secret, reveals nothing of it).

File format (``mapl-run-key v1``), mode 0600 (no group or other permission bit)::

    mapl-run-key v1
    <64 lowercase hex digits: the 32 random key bytes>

Each line ends with a newline (CRLF line ends are read as LF).

Keys are read from files only: never from a command line or an environment variable, never
printed or logged (``repr`` shows the key id and the path).
"""

from __future__ import annotations

import hashlib
import os
import secrets
from dataclasses import dataclass, field
from functools import cached_property

import zmq
from zmq.utils import z85

from mapl_swarm.errors import ConfigError
from mapl_swarm.net.keyfiles import KEY_BYTES, read_key_file, write_key_file

__all__ = ["RunKey", "CurveKeys", "load_run_key", "create_run_key", "RUN_KEY_HEADER", "RUN_KEY_BYTES"]

RUN_KEY_HEADER = "mapl-run-key v1"
"""First line of a run key file."""
RUN_KEY_BYTES = KEY_BYTES
"""Random bytes in a run key."""


def _derive(label: bytes, key: bytes) -> bytes:
    return hashlib.sha256(label + key).digest()


@dataclass(frozen=True)
class CurveKeys:
    """A ZeroMQ CURVE keypair, z85-encoded (40 bytes each). A run's members all hold the same one:
    it is their server key, their client key and the only client key their ZAP handler admits."""

    public: bytes
    """z85 public key (the server key clients dial, and the one client key admitted)."""
    secret: bytes = field(repr=False)
    """z85 secret key."""

    def __post_init__(self) -> None:
        if len(self.public) != 40 or len(self.secret) != 40:
            raise ConfigError("CURVE keys must be 40-byte z85 strings")


@dataclass(frozen=True, eq=False)
class RunKey:
    """A run key (32 secret bytes) and what derives from it (see the module docstring). Compare
    keys by :attr:`key_id`; ``repr`` never shows secret bytes."""

    secret: bytes = field(repr=False)
    """The 32 key bytes."""
    path: str = ""
    """The file it was read from or written to (empty for a key built in memory)."""

    def __post_init__(self) -> None:
        if not isinstance(self.secret, bytes) or len(self.secret) != RUN_KEY_BYTES:
            raise ConfigError(f"a run key is {RUN_KEY_BYTES} bytes")

    pinned = False
    """Every member shares one CURVE keypair: the dialer's server key is that one (1.x membership)."""

    def __repr__(self) -> str:
        return f"RunKey(key_id={self.key_id!r}, path={self.path!r})"

    def describe(self) -> str:
        return f"run key {self.key_id} ({self.path})"

    __str__ = __repr__

    @cached_property
    def key_id(self) -> str:
        """Hex of SHA-256(b"mapl-keyid-v1" + key)[:8]: names the key in logs (not secret)."""
        return _derive(b"mapl-keyid-v1", self.secret)[:8].hex()

    @cached_property
    def curve(self) -> CurveKeys:
        """The run's CURVE keypair: secret = z85(SHA-256(b"mapl-curve-v1" + key)), public derived."""
        secret = z85.encode(_derive(b"mapl-curve-v1", self.secret))
        return CurveKeys(public=zmq.curve_public(secret), secret=secret)

    @property
    def curve_secret(self) -> bytes:
        """z85 CURVE secret key (40 bytes)."""
        return self.curve.secret

    @property
    def curve_public(self) -> bytes:
        """z85 CURVE public key (40 bytes)."""
        return self.curve.public

    @cached_property
    def auth_key(self) -> bytes:
        """SHA-256(b"mapl-auth-v1" + key): HMAC key of the wire tag of HELLO/WELCOME/REJECT."""
        return _derive(b"mapl-auth-v1", self.secret)

    @cached_property
    def dht_key(self) -> bytes:
        """SHA-256(b"mapl-dht-v1" + key): HMAC key of signed DHT records."""
        return _derive(b"mapl-dht-v1", self.secret)

    @classmethod
    def generate(cls, path: str = "") -> "RunKey":
        """A new random key (not written anywhere; :func:`create_run_key` writes one)."""
        return cls(secrets.token_bytes(RUN_KEY_BYTES), path)

    def file_text(self) -> str:
        """The key file's content."""
        return f"{RUN_KEY_HEADER}\n{self.secret.hex()}\n"


def load_run_key(path: str | os.PathLike[str]) -> RunKey:
    """Read a run key file; a missing file, a mode with any group/other bit, or a bad format is a
    one-line :class:`ConfigError` naming the file (never showing its content)."""
    key = read_key_file(path, header=RUN_KEY_HEADER, what="run key", create=f"mapl-swarm keys --out {path}")
    return RunKey(key, str(path))


def create_run_key(path: str | os.PathLike[str], *, force: bool = False) -> RunKey:
    """Write a new random run key to ``path`` (mode 0600, atomically: a crash leaves either no file
    or the whole key). An existing file is a ConfigError unless ``force`` replaces it (every peer
    then needs the new file)."""
    key = RunKey.generate(str(path))
    write_key_file(path, key.secret, header=RUN_KEY_HEADER, what="run key", force=force)
    return key
