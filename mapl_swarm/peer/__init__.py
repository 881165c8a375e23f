"""Stage peers: one process per pipeline stage, talking the wire protocol over ZeroMQ.

Import the submodules directly (``mapl_swarm.peer.main`` starts the DHT before importing torch).
"""
