"""Stage peers: one process per pipeline stage, talking the wire protocol over ZeroMQ.

Parts (each module one concern; none imports the in-process pipeline or the trainer's loop):
``runtime`` (:class:`Peer`: runs ``lifecycle``'s state machine) builds ``link`` (:class:`PeerLink` per neighbour)
with ``vq_link`` (its codebook stream side), ``ingress`` (the one way in: ``admission``'s rules,
held messages, into ``mailbox``, the one inbound queue, for the schedule or for ``control``'s
dispatch table), ``compute`` (compute thread, encode
lock, background tasks), ``host`` (the runtime's calls on the compute thread: wire tensors in,
host tensors out; ``tensors`` wraps them for the wire), ``waiting`` (waiting lines),
``linker`` (a link per DHT record of each neighbour stage, the handshake: HELLO until enough
peers welcomed it; chains and replicas alike), ``session`` (a link's inbound session), ``departures``
(neighbours gone silent or left) and ``driver`` (:class:`Schedule`: carries out what the pure
step core of :mod:`mapl_swarm.step` decides, for chains and replicas alike, given all of them and
the run hooks of ``checkpoints``: metrics, checkpoints, every CHECKPOINT phase with the drain); ``result`` is what a peer reports, ``main`` starts one
(``signals``: its SIGINT/SIGTERM; ``sessions``: one session after another, across re-forms). A swarm of peer
processes on one machine is :mod:`mapl_swarm.launch`'s, the layer above.

Import the submodules directly (``mapl_swarm.peer.main`` starts the DHT before importing torch).
"""
