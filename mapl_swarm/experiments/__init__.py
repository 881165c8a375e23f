"""Experiment suite: grids of runs (codec x rank x P x anchor x seed), tables and plots.

* :mod:`.grid` — strict TOML grid files expanding into run specs;
* :mod:`.sweep` — resumable in-process runner, one JSON per run (``mapl-swarm sweep``);
* :mod:`.analysis` — end-of-run boundary diagnostics (spectra, principal angles, cosines);
* :mod:`.tables` — markdown tables shaped like the MAPL paper's Tables 1, 5 and 6;
* :mod:`.plots` — Pareto frontier, loss curves, Fig. 3 / 4 style plots (matplotlib, imported lazily).
"""

from mapl_swarm.experiments.grid import Grid, RunSpec, grid_from_dict, load_grid
from mapl_swarm.experiments.sweep import SweepReport, load_results, run_sweep, write_report

__all__ = ["Grid", "RunSpec", "grid_from_dict", "load_grid", "SweepReport", "load_results", "run_sweep",
           "write_report"]
