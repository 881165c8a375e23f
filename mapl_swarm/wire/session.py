"""Handshake nonces (SPEC §5, §9.2).

Every HELLO and every WELCOME carries 16 fresh random bytes in ``meta["nonce"]``; WELCOME and
REJECT echo the HELLO's in ``meta["hello_nonce"]``, so a dialer takes only the answer to the HELLO
it is waiting for::

    nonce = new_nonce()                                   # HELLO meta["nonce"]
    ...                                                   # WELCOME meta["nonce"], ["hello_nonce"]
"""

from __future__ import annotations

import secrets

from . import spec

__all__ = ["new_nonce"]


def new_nonce() -> bytes:
    """16 fresh random bytes for a HELLO's or WELCOME's ``meta["nonce"]``."""
    return secrets.token_bytes(spec.NONCE_BYTES)
