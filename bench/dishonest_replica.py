"""A dishonest replica for benchmarks and tests: ``mapl-swarm`` whose gradient share is altered before each round.

    python bench/dishonest_replica.py ATTACK peer --config ... --stage K ...

Runs the real peer (``python -m mapl_swarm`` with the remaining arguments) with one change, as a
certified member running modified code would: before each averaging round its accumulated
gradients (each tensor g) are altered by ATTACK:

- a number S: g × S (−10: a share scaled by −10; −1: a sign flip);
- ``sign``: g × −1;
- ``noise``: g replaced by Gaussian noise of g's norm;
- ``bias``: g + 0.1 ‖g‖ u, u a fixed unit direction per tensor (a 10% bias toward it);
- ``digest``: its share is honest, but every round it gathers a random parameter digest and a
  sketch 1.5 times its own (it lies about the parameters it holds).

Everything it sends is well-formed; only its share (or its word on its parameters) is wrong. For ``bench/robust_attack.py``,
``bench/checking.py`` and the slow tests; never a peer of a real run.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def alter(attack: str):
    """The change ATTACK makes to one gradient tensor (in place)."""
    import torch

    directions: dict[int, torch.Tensor] = {}

    def bias(i: int, g: torch.Tensor) -> None:
        if i not in directions:
            u = torch.randn(g.shape, generator=torch.Generator().manual_seed(1000 + i)).to(g.device, g.dtype)
            directions[i] = u / u.norm()
        g.add_(directions[i], alpha=0.1 * float(g.norm()))

    def noise(_i: int, g: torch.Tensor) -> None:
        n = torch.randn_like(g)
        g.copy_(n * (g.norm() / n.norm().clamp_min(1e-30)))

    if attack == "sign":
        return lambda _i, g: g.mul_(-1.0)
    if attack == "noise":
        return noise
    if attack == "bias":
        return bias
    scale = float(attack)
    return lambda _i, g: g.mul_(scale)


def lie_about_digest() -> None:
    """Every round gathers a random digest and a sketch that is not close to the stage's."""
    import secrets

    from mapl_swarm.replicas.gradients import ReplicaGradients

    honest = ReplicaGradients._gather

    def gather(self, *args, **kwargs):
        data = honest(self, *args, **kwargs)
        return {**data, "digest": secrets.token_hex(32), "sketch": [x * 1.5 for x in data["sketch"]]}

    ReplicaGradients._gather = gather


def main() -> None:
    if sys.argv[1] == "digest":
        lie_about_digest()
        from mapl_swarm.cli import main as cli_main

        sys.exit(cli_main(sys.argv[2:]))
    change = alter(sys.argv[1])
    from mapl_swarm.replicas.gradients import ReplicaGradients

    honest = ReplicaGradients.average

    def average(self, micro, **kwargs):
        for i, p in enumerate(self.params):
            if p.grad is not None:
                change(i, p.grad)
        return honest(self, micro, **kwargs)

    ReplicaGradients.average = average
    from mapl_swarm.cli import main as cli_main

    sys.exit(cli_main(sys.argv[2:]))


if __name__ == "__main__":
    main()
