"""Typed run configuration: frozen dataclasses, presets, strict TOML loading, fingerprint.

A run is described by one :class:`TrainConfig` made of one small section per concern: ``model``,
``compression`` (with its ``compression.vq`` sub-table), ``optim``, ``data``, ``run`` (seed, steps,
output), ``pipeline`` (stages and batch sizes), ``eval``, ``checkpoint``, ``metrics``, ``runtime``
(device, threads), ``net`` and ``replicas`` (several peers per stage). TOML files mirror that layout; an optional top-level ``preset`` key
picks a model preset whose fields the ``[model]`` table may then override. Unknown keys are errors
that name the key and the file.

Choice fields are typed ``Literal[...]`` and checked in one place (:func:`_check_choices`, called by
every section's ``__post_init__``). A key of the older layout (``run.num_stages``,
``compression.vq_rounds``...) is an error naming its new place (:data:`LEGACY_KEYS`).
"""

from mapl_swarm.config import base, loading, run, sections
from mapl_swarm.config.base import *  # noqa: F401,F403 (re-exports, each module's __all__)
from mapl_swarm.config.loading import *  # noqa: F401,F403
from mapl_swarm.config.run import *  # noqa: F401,F403
from mapl_swarm.config.sections import *  # noqa: F401,F403

__all__ = [*base.__all__, *sections.__all__, *run.__all__, *loading.__all__]
