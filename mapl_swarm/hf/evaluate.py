"""``mapl-swarm eval MODEL``: loss and perplexity on text or on a run's validation split, and
lm-evaluation-harness tasks.

- :func:`eval_text`: the documents of a file or folder (read as a run reads a corpus), each
  tokenized and ended with the end-of-text token, cut into windows of ``context + 1`` tokens that
  share their boundary token, so every token but the first is predicted once; mean loss over them.
- :func:`eval_validation`: the very micro-batches a run's ``val_loss`` used
  (``eval.batches`` x ``pipeline.micro_batch_size`` windows of its validation shard), averaged as
  the run averages them (mean of the micro-batches' mean losses), so the figures compare.
- :func:`eval_tasks`: lm-eval's ``simple_evaluate`` through the registered model ``mapl``
  (:mod:`.lm_eval_model`), zero-shot by default; ``tasks_dir`` adds local task YAMLs.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from tqdm import tqdm

from mapl_swarm.config import DataConfig, TrainConfig
from mapl_swarm.errors import ConfigError, DataError
from mapl_swarm.hf.loading import LoadedModel

log = logging.getLogger(__name__)

__all__ = ["EvalResult", "eval_text", "eval_validation", "eval_tasks", "text_windows"]


@dataclass
class EvalResult:
    tokens: int
    """Tokens predicted."""
    loss: float
    """Mean cross-entropy per predicted token (nats)."""

    @property
    def perplexity(self) -> float:
        return math.exp(self.loss)


def text_windows(ids: list[int], context: int) -> list[list[int]]:
    """Windows of at most ``context + 1`` ids, consecutive ones sharing one id (each window predicts
    its ids after the first): every id but the first is predicted exactly once."""
    return [ids[i:i + context + 1] for i in range(0, max(len(ids) - 1, 0), context)]


@torch.no_grad()
def _window_losses(lm: LoadedModel, windows: list[list[int]], batch_size: int, progress: bool) -> EvalResult:
    total, count = 0.0, 0
    windows = sorted(windows, key=len, reverse=True)  # equal lengths batch together
    bar = tqdm(total=len(windows), unit="window", desc="eval", disable=not progress)
    i = 0
    while i < len(windows):
        n = len(windows[i])
        batch = [w for w in windows[i:i + batch_size] if len(w) == n]
        ids = torch.tensor(batch, device=lm.device)  # (b, n)
        logits = lm.model(input_ids=ids[:, :-1], use_cache=False).logits.float()  # (b, n-1, V)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1), reduction="sum")
        total += float(loss)
        count += ids[:, 1:].numel()
        i += len(batch)
        bar.update(len(batch))
        bar.set_postfix(loss=f"{total / count:.4f}")
    bar.close()
    if not count:
        raise DataError("nothing to evaluate: the text has fewer than 2 tokens")
    return EvalResult(tokens=count, loss=total / count)


def eval_text(lm: LoadedModel, path: str | Path, *, batch_size: int = 8, progress: bool = True) -> EvalResult:
    """Mean loss and perplexity of the model on the documents under ``path`` (file or folder)."""
    from mapl_swarm.data.corpus import load_corpus

    path = Path(path)
    if not path.exists():
        raise DataError(f"--text {path}: no such file or folder")
    corpus = load_corpus(DataConfig(source=str(path)))
    eos = lm.tokenizer.eos_token_id
    ids: list[int] = []
    for _, text in corpus.documents:
        ids += lm.tokenizer(text, add_special_tokens=False)["input_ids"]
        if eos is not None:
            ids.append(eos)
    return _window_losses(lm, text_windows(ids, lm.context_length), batch_size, progress)


@torch.no_grad()
def eval_validation(lm: LoadedModel, cfg: TrainConfig, *, progress: bool = True) -> EvalResult:
    """The run's validation loss: its ``val_loss`` batches, averaged as the run averages them."""
    from mapl_swarm.data import prepare_data, validation_batches
    from mapl_swarm.pipeline.stage import mean_loss

    if lm.context_length != cfg.model.context_length or lm.model.config.vocab_size != cfg.model.vocab_size:
        raise ConfigError(f"--config: the model (context {lm.context_length}, vocab {lm.model.config.vocab_size}) "
                          f"is not this run's (context {cfg.model.context_length}, vocab {cfg.model.vocab_size})")
    data = prepare_data(cfg.data, progress=False)
    batches = validation_batches(data.val, cfg.pipeline.micro_batch_size, cfg.model.context_length, cfg.eval.batches)
    losses = []
    for ids in tqdm(batches, unit="batch", desc="eval", disable=not progress):
        ids = ids.to(lm.device)  # (B, T+1)
        logits = lm.model(input_ids=ids[:, :-1], use_cache=False).logits.float()  # (B, T, V)
        losses.append(F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1)))
    return EvalResult(tokens=sum(b[:, 1:].numel() for b in batches), loss=mean_loss(losses))  # as the run averages


_LM_EVAL_DTYPES = {"fp32": "float32", "bf16": "bfloat16"}
_HUB_ERRORS = ("Connection", "Offline", "LocalEntryNotFound", "DatasetNotFound", "HfHubHTTP", "Timeout",
               "NameResolution", "MaxRetry", "HTTPError")


def _is_hub_error(exc: BaseException) -> bool:
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if any(word in type(exc).__name__ for word in _HUB_ERRORS) or "huggingface.co" in str(exc):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


_PACKAGED_BUILDERS = {"json", "csv", "parquet", "text", "arrow", "pandas", "sql", "webdataset"}
"""``dataset_path`` values that name one of datasets' own readers of local files, not a hub dataset."""


def _hub_problem() -> str | None:
    """Why the Hugging Face hub cannot be reached from here (one quick connection), or None."""
    import os
    import socket

    if os.environ.get("HF_HUB_OFFLINE") or os.environ.get("HF_DATASETS_OFFLINE"):
        return None  # the user reads the hub's datasets from the local cache on purpose
    try:
        socket.create_connection(("huggingface.co", 443), timeout=5).close()
    except OSError as exc:
        return str(exc) or type(exc).__name__
    return None


def _dataset_of(task_manager: Any, task: str) -> str:
    import yaml

    entry = task_manager.task_index.get(task)
    cfg = getattr(entry, "cfg", None) or {}
    if not cfg and getattr(entry, "yaml_path", None):
        try:  # lm-eval's own tags (!function) are not plain YAML; only dataset_path is read
            cfg = yaml.safe_load(Path(entry.yaml_path).read_text().replace("!function", "")) or {}
        except (OSError, ValueError, yaml.YAMLError):
            cfg = {}
    return str(cfg.get("dataset_path") or "its dataset")


def eval_tasks(model_path: str | Path, tasks: list[str], *, tasks_dir: str | None = None, num_fewshot: int = 0,
               batch_size: int = 8, device: str = "cpu", dtype: str = "fp32", limit: int | None = None) -> str:
    """lm-eval's results table for ``tasks`` on the exported model at ``model_path``."""
    try:
        import lm_eval
        from lm_eval.tasks import TaskManager
        from lm_eval.utils import make_table
    except ImportError:
        raise ConfigError("--tasks needs lm-evaluation-harness: pip install 'mapl_swarm[eval]'") from None
    import mapl_swarm.hf.lm_eval_model  # noqa: F401 - registers the lm-eval model "mapl"

    if tasks_dir and not Path(tasks_dir).is_dir():
        raise DataError(f"--tasks-dir {tasks_dir}: no such folder")
    manager = None
    if tasks_dir:  # lm-eval's own index (~15k tasks) takes seconds to build: skip it when the folder has every task
        local = TaskManager(include_path=tasks_dir, include_defaults=False)
        manager = local if all(t in local.all_tasks for t in tasks) else TaskManager(include_path=tasks_dir)
    manager = manager or TaskManager()
    unknown = [t for t in tasks if t not in manager.all_tasks]
    if unknown:
        raise ConfigError(f"--tasks: unknown lm-eval task(s) {', '.join(unknown)}"
                          + ("" if tasks_dir else " (local task YAMLs: --tasks-dir DIR)"))
    hub = [(t, d) for t in tasks if (d := _dataset_of(manager, t)) not in _PACKAGED_BUILDERS and not Path(d).exists()]
    if hub and (why := _hub_problem()) is not None:
        which = ", ".join(f"{t} ({d})" for t, d in hub)
        raise DataError(f"the datasets of {which} are on the Hugging Face hub, which is unreachable from here ({why}): "
                        f"download them where the hub is reachable and point a task YAML's dataset_path at the local "
                        f"copy (--tasks-dir DIR)")
    try:
        results = lm_eval.simple_evaluate(
            model="mapl", model_args={"pretrained": str(model_path), "dtype": _LM_EVAL_DTYPES[dtype], "device": device},
            tasks=tasks, num_fewshot=num_fewshot, batch_size=batch_size, task_manager=manager, limit=limit)
    except Exception as exc:  # noqa: BLE001 - only the hub's errors are named; others propagate
        if not _is_hub_error(exc):
            raise
        which = ", ".join(f"{t} ({_dataset_of(manager, t)})" for t in tasks)
        raise DataError(f"the datasets of {which} cannot be read from the Hugging Face hub here (unreachable): "
                        f"download them where the hub is reachable and point a task YAML's dataset_path at the "
                        f"local copy (--tasks-dir DIR)") from None
    return make_table(results)
