"""Optimizers: Polar Express ``msign``, Muon for 2D hidden weights, SPEL for Stiefel projectors,
and the learning-rate schedule.

* :mod:`.polar` — ``msign(G, steps, dtype)``, the one orthogonalization everything uses.
* :mod:`.muon` — ``Muon`` (Nesterov momentum, Polar Express direction, decoupled weight decay).
* :mod:`.spel` — ``SPEL`` (momentum, tangent projection, msign direction, fp32 msign retraction)
  plus ``stiefel_error`` and ``project_tangent`` (random Stiefel points: :mod:`mapl_swarm.compress.stiefel`).
* :mod:`.schedule` — ``lr_multiplier`` (warmup, then cosine / WSD / constant).
"""

from mapl_swarm.optim.muon import Muon, muon_scale
from mapl_swarm.optim.polar import POLAR_EXPRESS_COEFFS, msign, polar_express_coeffs
from mapl_swarm.optim.schedule import SCHEDULE_NAMES, lr_multiplier
from mapl_swarm.optim.spel import SPEL, project_tangent, stiefel_error

__all__ = [
    "POLAR_EXPRESS_COEFFS",
    "SCHEDULE_NAMES",
    "SPEL",
    "Muon",
    "lr_multiplier",
    "msign",
    "muon_scale",
    "polar_express_coeffs",
    "project_tangent",
    "stiefel_error",
]
