"""Golden-vector tooling of protocol/vectors/v2 (SPEC §11): sample messages, cases, generator, checker.

Not part of the runtime wire package: no module of :mod:`mapl_swarm.wire` imports this one (a test
enforces it); it only builds and checks the vectors with the runtime encoder and decoder.

* :mod:`.samples` — deterministic sample messages, one per message type (integer arithmetic only).
* :mod:`.cases` — every vector: valid, accept-only, invalid and codebook-receiver cases.
* :mod:`.vectors` — the container format, the manifest, ``write_vectors`` and ``check_vectors``.

Regenerate or check from the repository root::

    python -m mapl_swarm.wire.golden --out protocol/vectors/v2
    python -m mapl_swarm.wire.golden --check protocol/vectors/v2
"""

from .vectors import check_vectors, main, write_vectors

__all__ = ["check_vectors", "main", "write_vectors"]
