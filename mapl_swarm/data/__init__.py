"""Training data: corpus -> tokenizer -> cached token shards -> micro-batches.

* :mod:`.corpus` reads documents (stdlib sources, local files, Hugging Face datasets).
* :mod:`.tokenizer` trains or loads the tokenizer.
* :mod:`.shards` writes and reuses the flat token arrays (:func:`prepare_data`).
* :mod:`.batches` samples (B, T+1) int64 micro-batches from them.

Everything except :mod:`.batches` is numpy-only; the batch names are imported on first use so
that ``import mapl_swarm.data`` does not import torch.
"""

from __future__ import annotations

from typing import Any

from mapl_swarm.data.corpus import Corpus, Document, load_corpus, split_validation, stdlib_root
from mapl_swarm.data.shards import PreparedData, load_prepared, prepare_data
from mapl_swarm.data.tokenizer import EOS_TOKEN, TextTokenizer, load_tokenizer, train_bpe

__all__ = [
    "Corpus",
    "Document",
    "load_corpus",
    "split_validation",
    "stdlib_root",
    "EOS_TOKEN",
    "TextTokenizer",
    "load_tokenizer",
    "train_bpe",
    "PreparedData",
    "prepare_data",
    "load_prepared",
    "BatchSampler",
    "validation_batches",
]

_LAZY = {"BatchSampler", "validation_batches"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        from mapl_swarm.data import batches

        return getattr(batches, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
