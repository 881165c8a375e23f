"""Handshake nonces and the per-session authentication key (SPEC §7.2, protocol 1.4).

A run with a key tags HELLO, WELCOME and REJECT with the run's auth key and every later message
of a session with :func:`session_key` of the handshake that opened it, so a message captured in
one session fails authentication in every other::

    nonce = new_nonce()                                   # HELLO meta["nonce"]
    ...                                                   # WELCOME meta["nonce"], ["hello_nonce"]
    key = session_key(auth_key, hello_nonce, welcome_nonce)
    frames = encode(msg, secret=key)

:func:`handshake_secret` picks the key a received header is checked with (pass it, bound to the
session's key, as ``secret`` to :func:`mapl_swarm.wire.frames.decode_header`).
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from typing import Callable

from . import spec
from .errors import AuthFailed
from .header import Header

__all__ = ["new_nonce", "session_key", "handshake_secret"]


def new_nonce() -> bytes:
    """16 fresh random bytes for a HELLO's or WELCOME's ``meta["nonce"]``."""
    return secrets.token_bytes(spec.NONCE_BYTES)


def _check(value: object, what: str, size: int | None = None) -> bytes:
    if not isinstance(value, (bytes, bytearray, memoryview)):
        raise TypeError(f"{what} must be bytes, got {type(value).__name__}")
    value = bytes(value)
    if size is not None and len(value) != size:
        raise ValueError(f"{what} must be {size} bytes, got {len(value)}")
    if not value:
        raise ValueError(f"{what} must not be empty")
    return value


def session_key(auth_key: bytes, hello_nonce: bytes, welcome_nonce: bytes) -> bytes:
    """HMAC-SHA256(auth_key, b"mapl-session-v1" || hello_nonce || welcome_nonce) (SPEC §7.2).

    ``hello_nonce`` is the HELLO's ``meta["nonce"]``, ``welcome_nonce`` the WELCOME's; both are 16
    bytes. The key tags every message the HELLO's sender sends on that connection after WELCOME.
    """
    key = _check(auth_key, "auth_key")
    h = _check(hello_nonce, "hello_nonce", spec.NONCE_BYTES)
    w = _check(welcome_nonce, "welcome_nonce", spec.NONCE_BYTES)
    return hmac.new(key, spec.SESSION_DOMAIN + h + w, hashlib.sha256).digest()


def handshake_secret(auth_key: bytes | None, session: bytes | None) -> Callable[[Header], bytes | None]:
    """The ``secret`` callable for one inbound connection: ``auth_key`` for HELLO/WELCOME/REJECT,
    ``session`` otherwise; before the handshake (``session`` None) any other message fails with
    :class:`AuthFailed`. With ``auth_key`` None (an insecure run) every message must come untagged.
    """
    if auth_key is None:
        return lambda header: None

    def pick(header: Header) -> bytes | None:
        if header.type in spec.HANDSHAKE_TYPES:
            return auth_key
        if session is None:
            raise AuthFailed(f"{header.type.name} before the handshake: no session key to check it with")
        return session

    return pick
