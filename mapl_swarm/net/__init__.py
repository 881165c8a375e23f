"""Networking for pipeline peers: ZeroMQ transport, link emulator, heartbeats, DHT discovery.

- :mod:`~mapl_swarm.net.emulator` — token-bucket bandwidth + latency delay line per link direction.
- :mod:`~mapl_swarm.net.identity` — the run authority, per-peer keys, certificates, revocation lists.
- :mod:`~mapl_swarm.net.transport` — asyncio ZeroMQ ROUTER/DEALER transport with shaped links,
  members-only CURVE links pinned to certified peers.
- :mod:`~mapl_swarm.net.limits` — the largest legitimate message of a run, from its config.
- :mod:`~mapl_swarm.net.counters` — payload / wire byte accounting by link, direction and kind.
- :mod:`~mapl_swarm.net.heartbeat` — periodic heartbeats and silent-peer detection.
- :mod:`~mapl_swarm.net.discovery` — hivemind DHT announce / lookup of ``(run, stage)`` endpoints.
  Start it before the event loop, ZeroMQ and torch (its DHT forks a process).
- :mod:`~mapl_swarm.net.dht_node` — the DHT node process: fail-fast address and port checks, dies
  with its parent (p2pd too), shuts down without hard kills.
- :mod:`~mapl_swarm.net.dht_validation` — certified DHT records (imports hivemind; loaded by
  discovery only for certified runs).

Importing this package does not import hivemind or torch.
"""

from mapl_swarm.net.counters import Frame, Traffic, TrafficCounters, payload_bytes, zmtp_wire_bytes
from mapl_swarm.net.discovery import Discovery, DiscoveryConfig, run_bootstrap_node, start_dht
from mapl_swarm.net.emulator import LinkConfig, LinkShaper, ShaperStats
from mapl_swarm.net.errors import (DiscoveryError, DiscoveryTimeoutError, LinkClosedError, NetError,
                                   NetTimeoutError)
from mapl_swarm.net.heartbeat import HeartbeatConfig, HeartbeatMonitor, attach_heartbeat
from mapl_swarm.net.limits import derived_max_message_bytes, max_message_bytes
from mapl_swarm.net.identity import CurveKeys, PeerIdentity, load_identity
from mapl_swarm.net.transport import Transport, TransportConfig, new_event_loop, run, tcp_endpoint

__all__ = [
    "Frame", "Traffic", "TrafficCounters", "payload_bytes", "zmtp_wire_bytes",
    "Discovery", "DiscoveryConfig", "run_bootstrap_node", "start_dht",
    "LinkConfig", "LinkShaper", "ShaperStats",
    "NetError", "NetTimeoutError", "LinkClosedError", "DiscoveryError", "DiscoveryTimeoutError",
    "HeartbeatConfig", "HeartbeatMonitor", "attach_heartbeat",
    "derived_max_message_bytes", "max_message_bytes",
    "CurveKeys", "PeerIdentity", "load_identity",
    "Transport", "TransportConfig", "new_event_loop", "run", "tcp_endpoint",
]
