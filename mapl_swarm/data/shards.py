"""Token shards: tokenize the corpus once into flat binary arrays, cached and reused.

:func:`prepare_data` reads the corpus, splits validation documents off by name hash, trains or
loads the tokenizer and writes, into ``cache_dir/<slug>-<key>/``::

    tokenizer.json   the tokenizer (trained here, or a copy of the given tokenizer.json)
    train.bin        flat token ids, documents joined with the end-of-text id between them
    val.bin          same for the validation documents
    meta.json        fingerprints, counts, dtype; written last

The ids are ``uint16`` (``uint32`` when the vocabulary exceeds 65535). ``<key>`` hashes the
source, the corpus fingerprint, the tokenizer setting, vocab size, val_fraction and
max_corpus_bytes, so a second call with the same settings and the same corpus reuses the folder.
The folder is built under a temporary name and renamed into place, under a file lock, so an
interrupted or concurrent prepare never leaves a half-written folder that is later reused.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from hashlib import sha256
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
from tqdm import tqdm

from mapl_swarm.config import MIN_BPE_VOCAB, DataConfig
from mapl_swarm.data.corpus import Document, load_corpus, split_validation
from mapl_swarm.data.tokenizer import TOKENIZER_FILE, TextTokenizer, load_tokenizer, train_bpe
from mapl_swarm.errors import ConfigError, DataError

__all__ = ["SHARD_FORMAT_VERSION", "PreparedData", "prepare_data", "load_prepared", "shard_dtype"]

logger = logging.getLogger(__name__)

SHARD_FORMAT_VERSION = 1
"""Bumped whenever the folder layout or meta.json meaning changes."""

_META_FILE = "meta.json"
_BATCH_DOCS = 256
_BATCH_CHARS = 4 * 1024 * 1024


@dataclass(frozen=True)
class PreparedData:
    """Tokenized train/validation shards ready for sampling."""

    path: Path
    """The shard folder."""
    train: np.ndarray
    """Training token ids (read-only ``np.memmap``)."""
    val: np.ndarray
    """Validation token ids (read-only ``np.memmap``)."""
    tokenizer: TextTokenizer
    """The tokenizer that produced the ids."""
    meta: dict[str, Any]
    """Contents of meta.json."""


def shard_dtype(vocab_size: int) -> np.dtype:
    """uint16 for vocabularies up to 65535 tokens, else uint32."""
    return np.dtype(np.uint32 if vocab_size > 65535 else np.uint16)


def _cache_key(cfg: DataConfig, corpus_fingerprint: str, tokenizer_hash: str) -> str:
    payload = {
        "format": SHARD_FORMAT_VERSION,
        "source": cfg.source,
        "corpus_fingerprint": corpus_fingerprint,
        "tokenizer": cfg.tokenizer,
        "tokenizer_hash": tokenizer_hash,
        "vocab_size": cfg.vocab_size,
        "val_fraction": cfg.val_fraction,
        "max_corpus_bytes": cfg.max_corpus_bytes,
    }
    return sha256(json.dumps(payload, sort_keys=True).encode("utf-8")).hexdigest()


def _slug(source: str) -> str:
    name = "hf-" + source[3:].rstrip("/").rsplit("/", 1)[-1] if source.startswith("hf:") else (
        Path(source).name or "corpus")
    return re.sub(r"[^A-Za-z0-9._-]", "_", name)[:40] or "corpus"


@contextmanager
def _locked(lock_path: Path) -> Iterator[None]:
    """Exclusive advisory lock on lock_path (no-op where fcntl is missing)."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - non-POSIX
        yield
        return
    with open(lock_path, "a+b") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _read_meta(folder: Path) -> dict[str, Any] | None:
    try:
        return json.loads((folder / _META_FILE).read_text())
    except (FileNotFoundError, NotADirectoryError, json.JSONDecodeError):
        return None


def _is_complete(folder: Path, key: str) -> bool:
    meta = _read_meta(folder)
    if meta is None or meta.get("key") != key or meta.get("format_version") != SHARD_FORMAT_VERSION:
        return False
    itemsize = np.dtype(meta["dtype"]).itemsize
    for split in ("train", "val"):
        shard = folder / f"{split}.bin"
        if not shard.is_file() or shard.stat().st_size != meta[f"{split}_tokens"] * itemsize:
            return False
    return True


def _write_split(handle: BinaryIO, docs: list[Document], tok: TextTokenizer, dtype: np.dtype,
                 bar: tqdm) -> int:
    """Tokenize docs in batches and append their ids, EOS between documents; returns the count."""
    eos = np.array([tok.eos_id], dtype=dtype)
    count, start = 0, 0
    while start < len(docs):
        stop, chars = start, 0
        while stop < len(docs) and stop - start < _BATCH_DOCS and (chars < _BATCH_CHARS or stop == start):
            chars += len(docs[stop][1])
            stop += 1
        parts: list[np.ndarray] = []
        for ids in tok.encode_batch([text for _, text in docs[start:stop]]):
            if count or parts:
                parts.append(eos)
            parts.append(np.asarray(ids, dtype=dtype))
        block = np.concatenate(parts)
        handle.write(block.tobytes())
        count += block.size
        bar.update(stop - start)
        start = stop
    handle.flush()
    os.fsync(handle.fileno())
    return count


def _build(tmp: Path, cfg: DataConfig, key: str, corpus_fp: str, corpus_bytes: int, train_docs: list[Document],
           val_docs: list[Document], external: TextTokenizer | None, progress: bool) -> None:
    started = time.perf_counter()
    tmp.mkdir(parents=True)
    if external is None:
        tok = train_bpe([text for _, text in train_docs], cfg.vocab_size, tmp / TOKENIZER_FILE)
    else:
        tok = external
        if external.path is not None:  # keep the folder self-contained
            shutil.copyfile(external.path, tmp / TOKENIZER_FILE)
    dtype = shard_dtype(tok.vocab_size)
    counts = {}
    with tqdm(total=len(train_docs) + len(val_docs), unit="doc", desc="tokenizing", disable=not progress) as bar:
        for split, docs in (("train", train_docs), ("val", val_docs)):
            with open(tmp / f"{split}.bin", "wb") as handle:
                counts[split] = _write_split(handle, docs, tok, dtype, bar)
    meta = {
        "format_version": SHARD_FORMAT_VERSION,
        "key": key,
        "source": cfg.source,
        "corpus_fingerprint": corpus_fp,
        "corpus_bytes": corpus_bytes,
        "max_corpus_bytes": cfg.max_corpus_bytes,
        "tokenizer": cfg.tokenizer,
        "tokenizer_hash": tok.file_hash,
        "vocab_size": tok.vocab_size,
        "requested_vocab_size": cfg.vocab_size,
        "eos_id": tok.eos_id,
        "dtype": dtype.name,
        "train_tokens": counts["train"],
        "val_tokens": counts["val"],
        "train_docs": len(train_docs),
        "val_docs": len(val_docs),
        "val_fraction": cfg.val_fraction,
        "prepare_seconds": round(time.perf_counter() - started, 3),
    }
    with open(tmp / _META_FILE, "w") as handle:
        json.dump(meta, handle, indent=2, sort_keys=True)
        handle.flush()
        os.fsync(handle.fileno())


def prepare_data(cfg: DataConfig, progress: bool = True) -> PreparedData:
    """Tokenize ``cfg``'s corpus into cached shards (or reuse them) and open them.

    Reading the corpus (to fingerprint it) happens on every call; training the tokenizer and
    tokenizing happen only when no complete folder for the same key exists.
    """
    if not cfg.tokenizer and cfg.vocab_size < MIN_BPE_VOCAB:
        raise ConfigError(f"data.vocab_size {cfg.vocab_size} is too small for the byte-level BPE trained here "
                          f"(at least {MIN_BPE_VOCAB}: 256 bytes, EOS and merges)")
    corpus = load_corpus(cfg)
    external = load_tokenizer(cfg.tokenizer) if cfg.tokenizer else None
    key = _cache_key(cfg, corpus.fingerprint, external.file_hash if external else "")
    cache_dir = Path(cfg.cache_dir).expanduser()
    folder = cache_dir / f"{_slug(cfg.source)}-{key[:16]}"
    if _is_complete(folder, key):
        logger.info("reusing token shards in %s", folder)
        return load_prepared(folder)
    cache_dir.mkdir(parents=True, exist_ok=True)
    with _locked(cache_dir / f".{folder.name}.lock"):
        if _is_complete(folder, key):  # another process finished it while we waited
            logger.info("reusing token shards in %s", folder)
            return load_prepared(folder)
        for stale in cache_dir.glob(f".tmp-{folder.name}-*"):  # left by an interrupted prepare
            shutil.rmtree(stale, ignore_errors=True)
        train_docs, val_docs = split_validation(corpus.documents, cfg.val_fraction)
        tmp = cache_dir / f".tmp-{folder.name}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        logger.info("preparing token shards in %s (%d train / %d val documents)", folder, len(train_docs),
                    len(val_docs))
        try:
            _build(tmp, cfg, key, corpus.fingerprint, corpus.num_bytes, train_docs, val_docs, external, progress)
            if folder.exists():  # incomplete or from an older format: replace it
                trash = cache_dir / f".tmp-{folder.name}-old-{uuid.uuid4().hex[:8]}"
                folder.rename(trash)
                shutil.rmtree(trash, ignore_errors=True)
            tmp.rename(folder)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
    prepared = load_prepared(folder)
    logger.info("prepared %d train / %d val tokens in %.1f s", prepared.meta["train_tokens"],
                prepared.meta["val_tokens"], prepared.meta["prepare_seconds"])
    return prepared


def _open_shard(path: Path, dtype: np.dtype, count: int) -> np.ndarray:
    if not path.is_file():
        raise DataError(f"token shard missing: {path}")
    if path.stat().st_size != count * dtype.itemsize:
        raise DataError(f"token shard {path} has {path.stat().st_size} bytes, meta.json expects "
                        f"{count * dtype.itemsize}")
    if count == 0:
        empty = np.zeros(0, dtype=dtype)
        empty.flags.writeable = False
        return empty
    return np.memmap(path, dtype=dtype, mode="r", shape=(count,))


def load_prepared(path: str | Path) -> PreparedData:
    """Open a shard folder written by :func:`prepare_data`; its tokenizer must match meta.json."""
    folder = Path(path)
    meta = _read_meta(folder)
    if meta is None:
        raise DataError(f"not a prepared data folder (no readable {_META_FILE}): {folder}")
    if meta.get("format_version") != SHARD_FORMAT_VERSION:
        raise DataError(f"{folder}: shard format {meta.get('format_version')} is not "
                        f"{SHARD_FORMAT_VERSION}; delete it and prepare again")
    tok_file = folder / TOKENIZER_FILE
    tok = TextTokenizer.from_file(tok_file) if tok_file.is_file() else load_tokenizer(meta["tokenizer"])
    if tok.file_hash != meta["tokenizer_hash"]:
        raise DataError(f"{folder}: tokenizer {tok.name} does not match the one the shards were made with")
    dtype = np.dtype(meta["dtype"])
    return PreparedData(
        path=folder,
        train=_open_shard(folder / "train.bin", dtype, meta["train_tokens"]),
        val=_open_shard(folder / "val.bin", dtype, meta["val_tokens"]),
        tokenizer=tok,
        meta=meta,
    )
