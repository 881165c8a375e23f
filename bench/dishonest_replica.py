"""A dishonest replica for benchmarks: ``mapl-swarm`` whose gradient share is scaled before each round.

    python bench/dishonest_replica.py SCALE peer --config ... --stage K ...

Runs the real peer (``python -m mapl_swarm`` with the remaining arguments) with one change, as a
certified member running modified code would: before each averaging round its accumulated
gradients are multiplied by SCALE (−10: a share scaled by −10; −1: a sign flip). Everything it
sends is well-formed; only its share is wrong. For ``bench/robust_attack.py``; never a peer of a
real run.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    scale = float(sys.argv[1])
    from mapl_swarm.replicas.gradients import ReplicaGradients

    honest = ReplicaGradients.average

    def average(self, micro, **kwargs):
        for p in self.params:
            if p.grad is not None:
                p.grad.mul_(scale)
        return honest(self, micro, **kwargs)

    ReplicaGradients.average = average
    from mapl_swarm.cli import main as cli_main

    sys.exit(cli_main(sys.argv[2:]))


if __name__ == "__main__":
    main()
