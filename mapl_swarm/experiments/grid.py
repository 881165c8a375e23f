"""Experiment grids: strict TOML files expanding into one run spec per (codec, rank, P, anchor, seed).

A grid file (see ``bench/grids/``)::

    name = "cpu"                       # label used in reports
    description = "..."                # free text
    tokens_per_run = 491520            # equal token budget: every run trains this many tokens
    out_dir = "runs/sweep-cpu"         # default output folder (``--out`` overrides)

    [base]                             # a run config, same layout as peers/*.toml
    preset = "tiny"                    # (``run.steps`` is derived from tokens_per_run: leave it out)
    [base.pipeline]
    micro_batch_size = 4

    [[group]]                          # one cartesian product; repeat for more
    name = "table1"
    codecs = ["none", "mapl", "fixed", "naive", "ssn"]
    ranks = [32]                       # default: [base compression.rank]
    stages = [4]                       # default: [base pipeline.num_stages]
    anchors = ["factorized"]           # default: [base compression.anchor]
    seeds = [0, 1]                     # default: [base run.seed]
    variant = "adamw0.5"               # optional: a named variant of these runs (in their run id) ...
    set = { optim = { adamw_lr_ratio = 0.5 } }   # ... and the settings it changes over [base]

Runs that several groups produce are run once. The anchor only matters for codecs with a token
anchor and the rank only for projected codecs (not ``none``), so those runs collapse to one (both
facts come from :mod:`mapl_swarm.config.catalog`). Unknown keys and codecs
are errors naming the key and the file.
"""

from __future__ import annotations

import copy
import hashlib
import json
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from mapl_swarm import config as config_mod
from mapl_swarm.config.catalog import CODEC_INFO, CODEC_NAMES, codec_info
from mapl_swarm.config import (TrainConfig, config_from_dict, config_to_dict, digest_layout, read_toml,
                               reject_renamed_keys)
from mapl_swarm.errors import ConfigError

__all__ = ["Grid", "GridGroup", "RunSpec", "load_grid", "grid_from_dict", "ANCHORED_CODECS"]

ANCHORED_CODECS = tuple(name for name, info in CODEC_INFO.items() if info.anchored)
"""Codecs whose later stages use ``compression.anchor`` (the others ignore it); from the catalog."""

_TOP_KEYS = {"name", "description", "tokens_per_run", "out_dir", "base", "group"}
_GROUP_KEYS = {"name", "codecs", "ranks", "stages", "anchors", "seeds", "variant", "set"}


@dataclass(frozen=True)
class RunSpec:
    """One run of a grid."""

    codec: str
    rank: int
    stages: int
    anchor: str
    seed: int
    groups: tuple[str, ...]
    """Names of the grid groups that asked for this run."""
    variant: str = ""
    """Name of the group's ``set`` of settings over ``[base]`` (empty: the base settings)."""
    raw: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)
    """Nested config dict (base + this run's values), not yet validated."""

    @property
    def run_id(self) -> str:
        info = codec_info(self.codec)
        parts = [self.codec]
        if info.projected:
            parts.append(f"r{self.rank}")
        parts.append(f"P{self.stages}")
        if info.anchored:
            parts.append(f"anchor-{self.anchor}")
        if self.variant:
            parts.append(self.variant)
        parts.append(f"s{self.seed}")
        return "-".join(parts)

    @property
    def label(self) -> str:
        """Config label without the seed (runs differing only by seed share it)."""
        return self.run_id.rsplit("-s", 1)[0]

    def config(self, out_dir: str | Path) -> TrainConfig:
        raw = copy.deepcopy(self.raw)
        raw.setdefault("run", {})["out_dir"] = str(Path(out_dir))
        return config_from_dict(raw, f"grid run {self.run_id}")


ADDED_AT_DEFAULT: dict[tuple[str, str], Any] = {("replicas", "averaged"): "gradients"}
"""Settings added after a sweep's hashes were first made, left out of :func:`config_hash` while at
their default (the value every earlier run had), so that finished runs still count."""


def config_hash(cfg: TrainConfig) -> str:
    """Digest of everything that shapes a run's numbers (the output folder excluded)."""
    d = digest_layout(config_to_dict(cfg))  # the layout hashes were first made in: finished runs still count
    d["run"].pop("out_dir", None)
    d.pop("net", None)
    for (table, key), default in ADDED_AT_DEFAULT.items():
        if d.get(table, {}).get(key, default) == default:
            d.get(table, {}).pop(key, None)
    metrics = d.pop("metrics", {})  # what is left once the legacy keys moved: where figures go, not what they are
    for exported in ("prometheus_port", "prometheus_host", "tensorboard"):
        metrics.pop(exported, None)
    if metrics:
        d["metrics"] = metrics
    return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:16]


@dataclass(frozen=True)
class GridGroup:
    name: str
    codecs: tuple[str, ...]
    ranks: tuple[int, ...]
    stages: tuple[int, ...]
    anchors: tuple[str, ...]
    seeds: tuple[int, ...]
    variant: str = ""
    settings: dict[str, Any] = field(default_factory=dict)
    """The group's ``set`` table: settings over ``[base]`` for its runs (same layout as ``[base]``)."""


def _merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    """``base`` with the tables of ``over`` merged in, recursively (both unchanged)."""
    out = copy.deepcopy(base)
    for key, value in over.items():
        out[key] = _merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) \
            else copy.deepcopy(value)
    return out


@dataclass(frozen=True)
class Grid:
    """A parsed grid file."""

    name: str
    description: str
    tokens_per_run: int
    out_dir: str
    base: dict[str, Any]
    groups: tuple[GridGroup, ...]
    source: str = "<dict>"

    @property
    def base_config(self) -> TrainConfig:
        return config_from_dict(copy.deepcopy(self.base), f"{self.source} [base]")

    def expand(self) -> list[RunSpec]:
        """Every distinct run, ordered seed-major (all configs of the first seed come first)."""
        specs: dict[tuple, RunSpec] = {}
        for g in self.groups:
            for seed in g.seeds:
                for stages in g.stages:
                    for codec in g.codecs:
                        for rank in g.ranks:
                            for anchor in g.anchors:
                                spec = self._spec(g, codec, rank, stages, anchor, seed)
                                key = (spec.run_id,)
                                if key in specs:
                                    old = specs[key]
                                    if g.name not in old.groups:
                                        specs[key] = replace(old, groups=old.groups + (g.name,))
                                else:
                                    specs[key] = spec
        order = {key: i for i, key in enumerate(specs)}
        return sorted(specs.values(), key=lambda s: (s.seed, order[(s.run_id,)]))

    def _spec(self, group: GridGroup, codec: str, rank: int, stages: int, anchor: str, seed: int) -> RunSpec:
        base_cfg = self.base_config
        info = codec_info(codec)
        if not info.projected:
            rank = base_cfg.compression.rank
        if not info.anchored:
            anchor = base_cfg.compression.anchor
        raw = _merge(self.base, group.settings)
        comp = raw.setdefault("compression", {})
        comp.update(codec=codec, rank=rank, anchor=anchor)
        raw.setdefault("pipeline", {})["num_stages"] = stages
        raw.setdefault("run", {}).update(seed=seed, steps=self.tokens_per_run // base_cfg.tokens_per_step)
        return RunSpec(codec=codec, rank=rank, stages=stages, anchor=anchor, seed=seed, groups=(group.name,),
                       variant=group.variant, raw=raw)


def _typed_list(value: Any, kind: type, key: str, where: str) -> tuple:
    if not isinstance(value, list) or not value:
        raise ConfigError(f"{where}: {key} must be a non-empty list, got {value!r}")
    for v in value:
        if not isinstance(v, kind) or (kind is int and isinstance(v, bool)):
            raise ConfigError(f"{where}: {key} entries must be {kind.__name__}, got {v!r}")
    return tuple(value)


def grid_from_dict(raw: dict[str, Any], source: str = "<dict>") -> Grid:
    """Validate a grid given as plain data; errors name the key and the file."""
    for key in raw:
        if key not in _TOP_KEYS:
            raise ConfigError(f"{source}: unknown key {key!r} (known: {', '.join(sorted(_TOP_KEYS))})")
    for key in ("name", "tokens_per_run", "base", "group"):
        if key not in raw:
            raise ConfigError(f"{source}: missing key {key!r}")
    name, desc, out_dir = raw["name"], raw.get("description", ""), raw.get("out_dir", f"runs/sweep-{raw['name']}")
    if not all(isinstance(v, str) for v in (name, desc, out_dir)):
        raise ConfigError(f"{source}: name, description and out_dir must be strings")
    tokens = raw["tokens_per_run"]
    if not isinstance(tokens, int) or isinstance(tokens, bool) or tokens <= 0:
        raise ConfigError(f"{source}: tokens_per_run must be a positive integer, got {tokens!r}")
    base = raw["base"]
    if not isinstance(base, dict):
        raise ConfigError(f"{source}: base must be a table")
    if "steps" in base.get("run", {}):
        raise ConfigError(f"{source}: [base.run] steps is derived from tokens_per_run; remove it")
    base_cfg = config_from_dict(copy.deepcopy(base), f"{source} [base]")  # strict: unknown keys raise
    if tokens < base_cfg.tokens_per_step:
        raise ConfigError(f"{source}: tokens_per_run {tokens} is less than one step "
                          f"({base_cfg.tokens_per_step} tokens)")
    if tokens % base_cfg.tokens_per_step:
        raise ConfigError(f"{source}: tokens_per_run {tokens} is not a multiple of the tokens per step "
                          f"{base_cfg.tokens_per_step} (micro_batch_size x num_micro_batches x context_length)")
    groups_raw = raw["group"]
    if not isinstance(groups_raw, list) or not groups_raw:
        raise ConfigError(f"{source}: group must be a non-empty array of tables ([[group]])")
    groups = []
    for i, g in enumerate(groups_raw):
        where = f"{source} [[group]] #{i + 1}"
        if not isinstance(g, dict):
            raise ConfigError(f"{where} must be a table")
        for key in g:
            if key not in _GROUP_KEYS:
                raise ConfigError(f"{where}: unknown key {key!r} (known: {', '.join(sorted(_GROUP_KEYS))})")
        if "codecs" not in g:
            raise ConfigError(f"{where}: missing key 'codecs'")
        c, r, p = base_cfg.compression, base_cfg.run, base_cfg.pipeline
        codecs = _typed_list(g["codecs"], str, "codecs", where)
        for codec in codecs:
            if codec not in CODEC_NAMES:
                raise ConfigError(f"{where}: codecs entry {codec!r} is not one of {CODEC_NAMES}")
        variant, settings = g.get("variant", ""), g.get("set", {})
        if not isinstance(variant, str) or not isinstance(settings, dict) or bool(variant) != bool(settings):
            raise ConfigError(f"{where}: variant (a name) and set (a table of settings over [base]) come together")
        if variant and not variant.replace("_", "").replace(".", "").isalnum():
            raise ConfigError(f"{where}: variant {variant!r} may hold only letters, digits, '.' and '_'")
        if "run" in settings and "steps" in settings["run"]:
            raise ConfigError(f"{where}: set.run.steps is derived from tokens_per_run; remove it")
        anchors = _typed_list(g.get("anchors", [c.anchor]), str, "anchors", where)
        for a in anchors:
            if a not in config_mod.ANCHORS:
                raise ConfigError(f"{where}: anchors entry {a!r} is not one of {config_mod.ANCHORS}")
        groups.append(GridGroup(
            name=str(g.get("name", f"group{i + 1}")),
            codecs=codecs,
            ranks=_typed_list(g.get("ranks", [c.rank]), int, "ranks", where),
            stages=_typed_list(g.get("stages", [p.num_stages]), int, "stages", where),
            anchors=anchors,
            seeds=_typed_list(g.get("seeds", [r.seed]), int, "seeds", where),
            variant=variant,
            settings=_checked_settings(settings, where),
        ))
    grid = Grid(name=name, description=desc, tokens_per_run=tokens, out_dir=out_dir, base=base,
                groups=tuple(groups), source=source)
    for spec in grid.expand():  # every run must form a valid config (unknown keys in a set raise)
        spec.config("/tmp/x")
    return grid


def _checked_settings(settings: dict, where: str) -> dict:
    reject_renamed_keys(settings, where)
    return copy.deepcopy(settings)


def load_grid(path: str | Path) -> Grid:
    """Load a grid TOML file strictly."""
    path = Path(path)
    return grid_from_dict(read_toml(path, "grid"), str(path))
