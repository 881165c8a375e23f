"""Stage peers: one process per pipeline stage, talking the wire protocol over ZeroMQ.

Parts (each module one concern; none imports the in-process pipeline or the trainer's loop):
``runtime`` (:class:`Peer`: lifecycle, receive loop, dispatch table) builds ``link``
(:class:`PeerLink` per neighbour) with ``vq_link`` (its codebook stream side), ``mailbox``,
``compute`` (compute thread, encode lock, background tasks), ``host`` (the runtime's calls on
the compute thread: wire tensors in, host tensors out; ``tensors`` wraps them for the wire),
``waiting`` (waiting lines) and ``schedule`` (the 1F1B :class:`PipelineSchedule`, given all of
them and the run hooks of ``checkpoints``: metrics, checkpoints and their agreement across the
swarm); ``result`` is what a peer reports, ``main`` starts one, ``launch`` starts a swarm.

Import the submodules directly (``mapl_swarm.peer.main`` starts the DHT before importing torch).
"""
