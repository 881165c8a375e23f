"""Open an exported model folder for ``eval`` and ``generate``: checks first, one-line errors.

A MODEL argument must be a Hugging Face model folder of a ``mapl_llama`` or ``llama`` model with
its tokenizer (what ``mapl-swarm export`` writes); anything else is a :class:`DataError` naming
what is wrong (no folder, no config.json, another model type, unreadable weights or tokenizer).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from mapl_swarm.errors import ConfigError, DataError

log = logging.getLogger(__name__)

__all__ = ["LoadedModel", "check_model_folder", "load_model", "resolve_device", "MODEL_TYPES", "DTYPES"]

MODEL_TYPES = ("mapl_llama", "llama")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


@dataclass
class LoadedModel:
    model: Any
    tokenizer: Any
    path: Path
    context_length: int
    device: torch.device


def resolve_device(name: str) -> torch.device:
    """``auto`` (CUDA when available, else CPU), ``cpu``, ``cuda`` or ``cuda:N``."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ConfigError(f"--device {name!r}: expected auto, cpu, cuda or cuda:N") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"--device {name}: no CUDA device here")
    return device


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def check_model_folder(path: str | Path) -> str:
    """The model type of an exported folder, or a DataError saying why it is not one (no folder, no
    or an unreadable config.json, another model type); reads config.json only."""
    path = Path(path)
    if not path.is_dir():
        raise DataError(f"MODEL {path}: no such folder (a folder written by `mapl-swarm export`)")
    try:
        config = json.loads((path / "config.json").read_text())
    except FileNotFoundError:
        raise DataError(f"MODEL {path} is not a Hugging Face model folder: no config.json") from None
    except (OSError, ValueError) as exc:
        raise DataError(f"MODEL {path}: config.json is unreadable ({exc})") from None
    model_type = config.get("model_type") if isinstance(config, dict) else None
    if model_type not in MODEL_TYPES:
        raise DataError(f"MODEL {path} is a {model_type or 'untyped'} model; eval and generate take a "
                        f"{' or '.join(MODEL_TYPES)} model (written by `mapl-swarm export`)")
    return model_type


def load_model(path: str | Path, *, device: str = "auto", dtype: str = "fp32") -> LoadedModel:
    """The model (eval mode, on ``device`` in ``dtype``) and tokenizer of an exported folder."""
    path = Path(path)
    check_model_folder(path)
    if dtype not in DTYPES:
        raise ConfigError(f"--dtype {dtype!r}: expected one of {', '.join(DTYPES)}")
    dev = resolve_device(device)
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    from mapl_swarm.hf.registration import register

    register()
    hf_logging.disable_progress_bar()
    try:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=DTYPES[dtype])
    except Exception as exc:  # noqa: BLE001 - safetensors/transformers raise many types for bad files
        raise DataError(f"MODEL {path}: cannot load its weights: {_first_line(exc)}") from None
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
    except Exception as exc:  # noqa: BLE001
        raise DataError(f"MODEL {path}: cannot load its tokenizer: {_first_line(exc)}") from None
    model.to(dev).eval()
    return LoadedModel(model=model, tokenizer=tokenizer, path=path,
                       context_length=int(model.config.max_position_embeddings), device=dev)
