"""A received message's fate and a neighbour's inbound session (:mod:`.admission` uses both)."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Rejected", "HelloRefused", "Early", "RxSession", "Unbound", "Unlinked"]


class Rejected(Exception):
    """A received message dropped with a stable ``code`` (SPEC §6 and §6.1 content errors)."""

    def __init__(self, code: str, text: str) -> None:
        super().__init__(f"{code}: {text}")
        self.code = code
        self.text = text


class Superseded(Rejected):
    """An authentic answer to one of this peer's earlier HELLOs, which a newer HELLO replaced (it
    resends HELLO until one is answered): not used, and not a bad message (logged at debug)."""


class Unlinked(Rejected):
    """A HELLO from a replica of a neighbour stage this peer has no link to yet, certified for that
    stage (or from any sender in a run without identities): it joined after this peer last read the
    stage's records, which are read now; it resends HELLO until answered. Not a bad message (logged
    at debug, not counted)."""


class Unbound(Rejected):
    """A HEARTBEAT on a connection that is not its stage's bound session (``wrong_session``): after a
    stall or a re-form it is what a neighbour queued for the session this peer ended, one per
    heartbeat interval: counted, logged at debug."""


class HelloRefused(Rejected):
    """A HELLO refused: answered with REJECT ``code`` (reason ``text``, ``hello_nonce`` the HELLO's
    when it was readable) on the HELLO's own connection."""

    def __init__(self, code: str, text: str, hello_nonce: object = None) -> None:
        super().__init__(code, text)
        self.hello_nonce = hello_nonce


class Early(Exception):
    """A pipeline message of neighbour ``link``'s live session, in sequence, that came before this
    peer's training started: held, and admitted with the remaining checks once it starts (SPEC
    §6.1 "Before training starts")."""

    def __init__(self, link: str, text: str) -> None:
        super().__init__(text)
        self.link = link


@dataclass
class RxSession:
    """What this peer received from a neighbour's connection, bound at the handshake that opened it."""

    routing_id: str
    """The connection's routing id: messages of that stage from any other are ``wrong_session``."""
    heard_at: float
    """Event-loop time of the last message accepted on it."""
    last_seq: int = 0
    """``seq`` of the last message accepted (the HELLO's is 0)."""
    lost: int = 0
    """Messages missing from the sequence (gaps)."""

    def accept(self, seq: int, now: float) -> int:
        """Take ``seq``; returns how many messages are missing before it. ``replay`` if not above the last."""
        if seq <= self.last_seq:
            raise Rejected("replay", f"seq {seq} is not above {self.last_seq}, the last accepted on the session")
        gap = seq - self.last_seq - 1
        self.last_seq, self.heard_at = seq, now
        self.lost += gap
        return gap

    def alive(self, now: float, timeout_s: float) -> bool:
        return now - self.heard_at < timeout_s
