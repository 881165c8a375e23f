"""Errors raised by the network layer (transport, link emulator, discovery, heartbeats).

All of them derive from :class:`mapl_swarm.errors.MaplError`, so the CLI reports them on one
line. Timeouts also derive from the built-in :class:`TimeoutError`, so callers can catch either.
"""

from __future__ import annotations

from mapl_swarm.errors import MaplError

__all__ = ["NetError", "NetTimeoutError", "LinkClosedError", "RelayNeeded", "DiscoveryError", "DiscoveryTimeoutError"]


class NetError(MaplError):
    """A network operation failed (bad endpoint, closed transport, failed send)."""


class NetTimeoutError(NetError, TimeoutError):
    """A network await did not complete within its deadline; the message says which and how long."""


class LinkClosedError(NetError):
    """A message was sent on a link (shaper or transport) that was already closed."""


class RelayNeeded(NetError):
    """A dial-out peer cannot link a dial-out neighbour: neither accepts a connection and no relay
    is known (SPEC §9.12)."""


class DiscoveryError(NetError):
    """The DHT could not be started, joined, written or read."""


class DiscoveryTimeoutError(DiscoveryError, NetTimeoutError):
    """A neighbour's ``(run, stage)`` announcement did not appear in the DHT within the deadline."""
