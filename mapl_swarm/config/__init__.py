"""Typed run configuration: frozen dataclasses, presets, strict TOML loading, fingerprint.

A run is described by one :class:`TrainConfig` made of one small section per concern: ``model``,
``compression`` (with its ``compression.vq`` sub-table), ``optim``, ``data``, ``run`` (seed, steps,
output), ``pipeline`` (stages and batch sizes), ``eval``, ``checkpoint``, ``metrics``, ``runtime``
(device, threads) and ``net``. TOML files mirror that layout; an optional top-level ``preset`` key
picks a model preset whose fields the ``[model]`` table may then override. Unknown keys are errors
that name the key and the file.

Choice fields are typed ``Literal[...]`` and checked in one place (:func:`_check_choices`, called by
every section's ``__post_init__``). Keys of the older layout (``run.num_stages``,
``compression.vq_rounds``...) still load: :data:`LEGACY_KEYS` maps each to its new place and a
warning names the new key.
"""

from mapl_swarm.config.base import (
    ANCHORS,
    CODECS,
    MIN_BPE_VOCAB,
    SCHEDULES,
    Anchor,
    Autocast,
    Codec,
    Device,
    Schedule,
    VQSliceOrder,
    VQSync,
    WireDtype,
)
from mapl_swarm.config.loading import (
    LEGACY_KEYS,
    config_from_dict,
    config_to_dict,
    legacy_layout,
    load_config,
    model_fingerprint,
    read_toml,
    upgrade_legacy_keys,
)
from mapl_swarm.config.run import (
    CheckpointConfig,
    EvalConfig,
    MetricsConfig,
    NetConfig,
    PipelineConfig,
    RunConfig,
    RuntimeConfig,
    TrainConfig,
)
from mapl_swarm.config.sections import (
    MODEL_PRESETS,
    CompressionConfig,
    DataConfig,
    ModelConfig,
    OptimConfig,
    VQConfig,
)

__all__ = [
    "ModelConfig",
    "VQConfig",
    "CompressionConfig",
    "OptimConfig",
    "DataConfig",
    "RunConfig",
    "PipelineConfig",
    "EvalConfig",
    "CheckpointConfig",
    "MetricsConfig",
    "RuntimeConfig",
    "NetConfig",
    "TrainConfig",
    "MODEL_PRESETS",
    "LEGACY_KEYS",
    "Codec",
    "Anchor",
    "WireDtype",
    "Schedule",
    "VQSync",
    "VQSliceOrder",
    "Device",
    "Autocast",
    "CODECS",
    "ANCHORS",
    "SCHEDULES",
    "MIN_BPE_VOCAB",
    "load_config",
    "read_toml",
    "upgrade_legacy_keys",
    "config_from_dict",
    "config_to_dict",
    "legacy_layout",
    "model_fingerprint",
]
