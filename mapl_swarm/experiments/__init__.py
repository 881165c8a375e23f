"""Experiment suite: grids of runs (codec x rank x P x anchor x seed), tables and plots.

* :mod:`.grid` — strict TOML grid files expanding into run specs;
* :mod:`.sweep` — resumable in-process runner, one JSON per run (``mapl-swarm sweep``);
* :mod:`.analysis` — end-of-run boundary diagnostics (spectra, principal angles, cosines);
* :mod:`.tables` — markdown tables shaped like the MAPL paper's Tables 1, 5 and 6;
* :mod:`.plots` — Pareto frontier, loss curves, Fig. 3 / 4 style plots (matplotlib, imported lazily).

The package imports lazily, so that reading a grid (:mod:`.grid`) does not import torch: a bad grid
file is reported at once.
"""

from __future__ import annotations

from mapl_swarm.lazy import lazy_exports

_EXPORTS = {
    "Grid": "mapl_swarm.experiments.grid",
    "RunSpec": "mapl_swarm.experiments.grid",
    "grid_from_dict": "mapl_swarm.experiments.grid",
    "load_grid": "mapl_swarm.experiments.grid",
    "SweepReport": "mapl_swarm.experiments.sweep",
    "load_results": "mapl_swarm.experiments.sweep",
    "run_sweep": "mapl_swarm.experiments.sweep",
    "write_report": "mapl_swarm.experiments.sweep",
}

__all__ = list(_EXPORTS)


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
