"""Strict loading of configs: TOML files and nested dicts, legacy keys, ``--set`` merges; the
plain-dict form and the config fingerprint peers compare."""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
import logging
import tomllib
from dataclasses import fields, replace
from pathlib import Path
from types import UnionType
from typing import Any, get_args, get_origin

from mapl_swarm.errors import ConfigError
from mapl_swarm.config.base import _hints
from mapl_swarm.config.run import TrainConfig, _SECTIONS
from mapl_swarm.config.sections import MODEL_PRESETS, ModelConfig

__all__ = [
    "LEGACY_KEYS",
    "load_config",
    "read_toml",
    "reject_renamed_keys",
    "config_from_dict",
    "config_to_dict",
    "digest_layout",
    "model_fingerprint",
    "config_summary",
]

log = logging.getLogger(__name__)

LEGACY_KEYS: dict[str, str] = {
    "run.num_stages": "pipeline.num_stages",
    "run.micro_batch_size": "pipeline.micro_batch_size",
    "run.num_micro_batches": "pipeline.num_micro_batches",
    "run.val_interval_steps": "eval.interval_steps",
    "run.val_batches": "eval.batches",
    "run.checkpoint_interval_steps": "checkpoint.interval_steps",
    "run.keep_checkpoints": "checkpoint.keep",
    "run.log_interval_steps": "metrics.log_interval_steps",
    "run.health_interval_steps": "metrics.health_interval_steps",
    "run.device": "runtime.device",
    "run.threads": "runtime.threads",
    **{f"compression.vq_{name}": f"compression.vq.{name}" for name in (
        "codebook_size", "rounds", "group_size", "slice_fraction", "slice_order", "sync", "ema_decay",
        "kmeans_init_batches", "kmeans_iters", "dead_code_ratio", "max_distance_mib", "compile", "update")},
}
"""Keys of the older config layout -> their place now (dotted paths). A config that sets one is
refused with the new name (:func:`reject_renamed_keys`); config digests are still taken in the older
layout (:func:`digest_layout`), so fingerprints and sweep hashes stay what they were."""


def _lookup(raw: dict[str, Any], path: list[str]) -> tuple[dict[str, Any] | None, bool]:
    """The table holding ``path``'s last key (None when a table on the way is missing) and
    whether that key is set."""
    node: Any = raw
    for part in path[:-1]:
        node = node.get(part) if isinstance(node, dict) else None
        if not isinstance(node, dict):
            return None, False
    return node, path[-1] in node


def reject_renamed_keys(raw: dict[str, Any], source: str = "<dict>") -> None:
    """ConfigError naming every :data:`LEGACY_KEYS` key that ``raw`` sets, with its new name."""
    found = [(old, new) for old, new in LEGACY_KEYS.items() if _lookup(raw, old.split("."))[1]]
    if found:
        renames = "; ".join(f"{old} is now {new}" for old, new in found)
        raise ConfigError(f"{source}: renamed key{'s' if len(found) > 1 else ''}: {renames}")


def _coerce(cls: type, name: str, value: Any, where: str) -> Any:
    hint = _hints(cls)[name]
    if get_origin(hint) is UnionType and type(None) in get_args(hint):  # optional: the other type
        if value is None:  # not set (a dumped config's JSON form; TOML has no null)
            return None
        hint = next(h for h in get_args(hint) if h is not type(None))
    if dataclasses.is_dataclass(hint):
        return _section(hint, value, f"{where.rstrip(']')}.{name}]")
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if get_origin(hint) is tuple:
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{where}: {name} must be a list, got {value!r}")
        return tuple(value)
    base = hint if isinstance(hint, type) else None
    if base is not None and (not isinstance(value, base) or (base is int and isinstance(value, bool))):
        raise ConfigError(f"{where}: {name} must be {base.__name__}, got {value!r}")
    return value  # Literal choices are checked by the section's __post_init__ (_check_choices)


def _keys(cls: type) -> set[str]:
    """TOML keys of a section (derived fields such as ``compression.vq.rank`` are not keys)."""
    return {f.name for f in fields(cls) if "derived_from" not in f.metadata}


def _section(cls: type, values: dict[str, Any], where: str, base: Any = None) -> Any:
    if not isinstance(values, dict):
        raise ConfigError(f"{where} must be a table")
    known = _keys(cls)
    for key in values:
        if key not in known:
            derived = next((f.metadata["derived_from"] for f in fields(cls)
                            if f.name == key and "derived_from" in f.metadata), None)
            if derived:
                raise ConfigError(f"{where}: {key} is not a key of its own: set {derived}")
            raise ConfigError(f"{where}: unknown key {key!r} (known: {', '.join(sorted(known))})")
    kwargs = {k: _coerce(cls, k, v, where) for k, v in values.items()}
    if base is not None:
        return replace(base, **kwargs)
    return cls(**kwargs)


def _derive_vocab(raw: dict[str, Any], preset: ModelConfig, source: str) -> None:
    """Make ``model.vocab_size`` and ``data.vocab_size`` agree when the tokenizer is trained here.

    Values set in the file (or ``--set``) win over the preset's: only ``data.vocab_size`` set ->
    ``model.vocab_size`` follows it; only ``model.vocab_size`` set -> ``data.vocab_size`` follows it;
    neither -> both take the preset's ``model.vocab_size``; both set to different values -> ConfigError
    naming both. With an external tokenizer (``data.tokenizer``) nothing is derived: the trainer checks
    ``model.vocab_size`` against the tokenizer's size.
    """
    model, data = raw.get("model", {}), raw.get("data", {})
    if not isinstance(model, dict) or not isinstance(data, dict) or data.get("tokenizer", ""):
        return
    m, d = model.get("vocab_size"), data.get("vocab_size")
    if m is not None and d is not None:
        if m != d:
            raise ConfigError(f"{source}: model.vocab_size {m!r} != data.vocab_size {d!r} (the tokenizer trained "
                              f"here has data.vocab_size tokens): set one of them, or both to the same value")
        return
    if d is not None:
        raw.setdefault("model", {})["vocab_size"] = d
    else:
        raw.setdefault("data", {})["vocab_size"] = preset.vocab_size if m is None else m


def config_from_dict(raw: dict[str, Any], source: str = "<dict>") -> TrainConfig:
    """Build a TrainConfig from nested plain data; unknown keys raise ConfigError naming them.

    A key of the older layout is an error naming its new name (:func:`reject_renamed_keys`). When the tokenizer is trained
    here (``data.tokenizer`` empty), the two vocabulary sizes are made to agree: a value set in the
    data wins over the preset's; only ``data.vocab_size`` set -> ``model.vocab_size`` follows it, only
    ``model.vocab_size`` set -> ``data.vocab_size`` follows it, neither -> both are the preset's
    ``model.vocab_size`` (``tiny``: 8192, ``150M``: 32000); both set and different -> ConfigError
    naming both (:func:`_derive_vocab`)."""
    reject_renamed_keys(raw, source)
    raw = copy.deepcopy(raw)
    preset = raw.pop("preset", "tiny")
    if preset not in MODEL_PRESETS:
        raise ConfigError(f"{source}: unknown preset {preset!r} (known: {', '.join(MODEL_PRESETS)})")
    for key in raw:
        if key not in _SECTIONS:
            raise ConfigError(f"{source}: unknown key {key!r} (known: preset, {', '.join(_SECTIONS)})")
    _derive_vocab(raw, MODEL_PRESETS[preset], source)
    parts = {}
    for name, cls in _SECTIONS.items():
        base = MODEL_PRESETS[preset] if name == "model" else None
        parts[name] = _section(cls, raw.get(name, {}), f"{source} [{name}]", base)
    return TrainConfig(**parts)


def read_toml(path: Path, what: str) -> dict[str, Any]:
    """Parse a TOML file; a missing file or bad syntax is a ConfigError naming the file."""
    try:
        return tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{what} file not found: {path}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: invalid TOML: {exc}") from None


def _merge(into: dict[str, Any], over: dict[str, Any], where: str) -> None:
    for key, value in over.items():
        if isinstance(value, dict):
            node = into.setdefault(key, {})
            if not isinstance(node, dict):
                raise ConfigError(f"{where}: {key} must be a table")
            _merge(node, value, where)
        else:
            into[key] = value


def load_config(path: str | Path, overrides: dict[str, Any] | None = None) -> TrainConfig:
    """Load a TOML config strictly; ``overrides`` is a nested dict merged over the file (a renamed
    key in either is an error naming its new name)."""
    path = Path(path)
    raw = read_toml(path, "config")
    reject_renamed_keys(raw, str(path))
    reject_renamed_keys(overrides or {}, "--set")
    _merge(raw, overrides or {}, str(path))
    return config_from_dict(raw, str(path))


def _plain(obj: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for f in fields(obj):
        if "derived_from" in f.metadata:
            continue
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value):
            value = _plain(value)
        elif isinstance(value, tuple):
            value = list(value)
        out[f.name] = value
    return out


def config_to_dict(cfg: TrainConfig) -> dict[str, Any]:
    """Plain nested dict (JSON/TOML friendly) of a config; :func:`config_from_dict` reads it back."""
    return _plain(cfg)


def digest_layout(d: dict[str, Any]) -> dict[str, Any]:
    """A copy of a :func:`config_to_dict` dict in the layout config digests are taken in (the older
    one: every :data:`LEGACY_KEYS` key at its old place), so fingerprints and sweep hashes stay
    what they were when first made. Only for digests: configs themselves never load this layout."""
    d = copy.deepcopy(d)
    for old, new in LEGACY_KEYS.items():
        table, present = _lookup(d, new.split("."))
        if present:
            node = d
            for part in old.split(".")[:-1]:
                node = node.setdefault(part, {})
            node[old.split(".")[-1]] = table.pop(new.split(".")[-1])
    for name, value in list(d.items()):
        if isinstance(value, dict):
            for key in [k for k, v in value.items() if v == {}]:
                del value[key]
            if not value:
                del d[name]
    return d


_HOST_LOCAL = ("compression.vq.max_distance_mib", "compression.vq.compile")
"""The VQ encoder's host-local performance knobs: hosts with different memory or compilers must
still join the same run, so they are in neither the fingerprint nor the summary."""


def _fingerprint_payload(cfg: TrainConfig, tokenizer_hash: str, vocab_size: int) -> dict[str, Any]:
    """What :func:`model_fingerprint` digests (SPEC §9.8)."""
    compression = digest_layout({"compression": config_to_dict(cfg)["compression"]})["compression"]
    for local in _HOST_LOCAL:
        compression.pop(local.replace("compression.vq.", "vq_"), None)
    return {
        "model": dataclasses.asdict(cfg.model),
        "compression": compression,
        "seed": cfg.run.seed,
        "num_stages": cfg.pipeline.num_stages,
        "context_length": cfg.model.context_length,
        "tokenizer_hash": tokenizer_hash,
        "vocab_size": vocab_size,
    }


def model_fingerprint(cfg: TrainConfig, tokenizer_hash: str, vocab_size: int) -> str:
    """Hex digest that two peers must share: model, codec, seed, tokenizer hash and vocab size
    (the compression section in the older flat layout), without the host-local knobs."""
    blob = json.dumps(_fingerprint_payload(cfg, tokenizer_hash, vocab_size), sort_keys=True,
                      separators=(",", ":")).encode()
    return hashlib.sha256(blob).hexdigest()[:32]


def config_summary(cfg: TrainConfig, tokenizer_hash: str = "", vocab_size: int = 0) -> dict[str, Any]:
    """Every setting two peers must share, as ``{dotted name: scalar}``: the fingerprinted ones
    (``model.hidden_size``, ``compression.vq_rounds``, ``seed``...), the pipeline shape checked
    at the handshake (``pipeline.num_micro_batches``, ``pipeline.micro_batch_size``,
    ``eval.batches``, and ``net.max_in_flight`` from which every stage's 1F1B order follows, 0
    resolved to P), and the ``[replicas]`` settings, named as in the TOML. Sent in HELLO/WELCOME
    (SPEC §9.2, 1.6) so that a refusal names the settings that differ instead of two digests."""
    d = config_to_dict(cfg)
    flat: dict[str, Any] = {}

    def add(prefix: str, table: dict[str, Any]) -> None:
        for key, value in table.items():
            if isinstance(value, dict):
                add(f"{prefix}{key}.", value)
            elif f"{prefix}{key}" not in _HOST_LOCAL:
                flat[f"{prefix}{key}"] = value

    add("model.", d["model"])
    add("compression.", d["compression"])
    flat.update({"run.seed": cfg.run.seed, "pipeline.num_stages": cfg.pipeline.num_stages,
                 "pipeline.num_micro_batches": cfg.pipeline.num_micro_batches,
                 "pipeline.micro_batch_size": cfg.pipeline.micro_batch_size, "eval.batches": cfg.eval.batches,
                 "net.max_in_flight": cfg.net.max_in_flight or cfg.pipeline.num_stages,
                 "tokenizer_hash": tokenizer_hash, "vocab_size": vocab_size})
    replicas = {**d["replicas"], "initial": ",".join(map(str, cfg.replicas.initial))}  # a scalar on the wire
    add("replicas.", replicas)  # replicas of a stage route and average alike (SPEC §9.10)
    return flat
