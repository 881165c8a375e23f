"""Corpus loading: the embedded stdlib corpus, local text files/folders, Hugging Face datasets.

A corpus is an ordered list of documents ``(name, text)`` plus a fingerprint: the sha256 over
every document's name and text (length-prefixed, UTF-8), so two peers that read the same
sources get the same fingerprint and the same token shards.

Sources (``DataConfig.source``):

* ``stdlib`` -- the running interpreter's own standard-library ``.py`` sources
  (``sysconfig.get_paths()["stdlib"]``), without ``site-packages``/``dist-packages`` and test
  directories, sorted by relative POSIX path. About 12 MB, always available offline.
* a local folder -- every file whose suffix is in ``DataConfig.text_extensions``, hidden
  entries skipped, sorted by relative POSIX path.
* a local file -- split at line boundaries into chunks named ``FILE:00000``, ``FILE:00001``...
  (about 256 chunks of 4 Ki to 1 Mi characters) so that the per-document validation split works on a
  single file too.
* ``hf:NAME`` -- a Hugging Face dataset, read with ``datasets.load_from_disk`` when NAME is a
  folder written by ``save_to_disk``, else ``datasets.load_dataset(NAME, split=...)``; rows
  keep their dataset order and are named ``NAME:SPLIT:00000000``...

``max_corpus_bytes`` keeps whole documents and stops once the total UTF-8 size reaches it.
Empty documents are dropped.
"""

from __future__ import annotations

import hashlib
import logging
import os
import sysconfig
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from mapl_swarm.config import DataConfig
from mapl_swarm.errors import DataError

__all__ = [
    "Document",
    "Corpus",
    "EXCLUDED_DIR_NAMES",
    "load_corpus",
    "stdlib_root",
    "corpus_fingerprint",
    "split_validation",
]

logger = logging.getLogger(__name__)

Document = tuple[str, str]
"""A document: (name, text). Names are unique within a corpus and drive the validation split."""

EXCLUDED_DIR_NAMES = frozenset(
    {"site-packages", "dist-packages", "test", "tests", "testing", "idle_test", "__pycache__"}
)
"""Directory names never entered when collecting the stdlib corpus."""

_CHUNK_TARGET = 256
_CHUNK_MIN_CHARS = 4 * 1024
_CHUNK_MAX_CHARS = 1024 * 1024


@dataclass(frozen=True)
class Corpus:
    """An ordered list of documents and what identifies them."""

    source: str
    """The ``DataConfig.source`` it was read from."""
    documents: list[Document]
    """Documents in corpus order."""
    fingerprint: str
    """sha256 hex digest over every (name, text)."""
    num_bytes: int
    """Total UTF-8 size of all texts."""


def stdlib_root() -> Path:
    """The running interpreter's standard-library folder."""
    return Path(sysconfig.get_paths()["stdlib"])


def corpus_fingerprint(documents: Iterable[Document]) -> str:
    """sha256 hex digest over length-prefixed UTF-8 names and texts, in order."""
    h = hashlib.sha256()
    for name, text in documents:
        for part in (name.encode("utf-8"), text.encode("utf-8")):
            h.update(len(part).to_bytes(8, "little"))
            h.update(part)
    return h.hexdigest()


def _read_text(path: Path) -> str:
    data = path.read_bytes()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        logger.debug("%s is not valid UTF-8; undecodable bytes replaced", path)
        return data.decode("utf-8", errors="replace")


def _walk_files(root: Path, suffixes: tuple[str, ...], excluded: frozenset[str]) -> list[tuple[str, Path]]:
    """(relative posix path, path) of files under root with one of the suffixes, sorted."""
    found: list[tuple[str, Path]] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in excluded and not d.startswith(".")]
        for name in filenames:
            if name.startswith(".") or not name.endswith(suffixes):
                continue
            path = Path(dirpath) / name
            if path.is_file():
                found.append((path.relative_to(root).as_posix(), path))
    found.sort(key=lambda item: item[0])
    return found


def _stdlib_documents() -> Iterator[Document]:
    root = stdlib_root()
    if not root.is_dir():
        raise DataError(f"standard library folder not found: {root}")
    for rel, path in _walk_files(root, (".py",), EXCLUDED_DIR_NAMES):
        yield rel, _read_text(path)


def _folder_documents(root: Path, suffixes: tuple[str, ...]) -> Iterator[Document]:
    files = _walk_files(root, suffixes, frozenset({"__pycache__"}))
    if not files:
        raise DataError(f"no files with suffixes {', '.join(suffixes)} under {root}")
    for rel, path in files:
        yield rel, _read_text(path)


def _file_documents(path: Path) -> Iterator[Document]:
    text = _read_text(path)
    chunk_chars = min(max(len(text) // _CHUNK_TARGET, _CHUNK_MIN_CHARS), _CHUNK_MAX_CHARS)
    index, parts, used = 0, [], 0
    for line in text.splitlines(keepends=True):
        parts.append(line)
        used += len(line)
        if used >= chunk_chars:
            yield f"{path.name}:{index:05d}", "".join(parts)
            index, parts, used = index + 1, [], 0
    if parts:
        yield f"{path.name}:{index:05d}", "".join(parts)


def _hf_documents(name: str, cfg: DataConfig) -> Iterator[Document]:
    try:
        import datasets  # lazy: optional dependency
    except ImportError:
        raise DataError(f"source hf:{name} needs the `datasets` package (pip install mapl_swarm[hf])") from None
    local = Path(name)
    try:
        if local.is_dir() and ((local / "dataset_dict.json").is_file() or (local / "state.json").is_file()):
            ds = datasets.load_from_disk(str(local))
            if isinstance(ds, datasets.DatasetDict):
                if cfg.hf_split not in ds:
                    raise DataError(f"hf:{name} has no split {cfg.hf_split!r} (has: {', '.join(ds)})")
                ds = ds[cfg.hf_split]
        else:
            ds = datasets.load_dataset(name, split=cfg.hf_split)
    except DataError:
        raise
    except Exception as exc:  # noqa: BLE001 - datasets raises many types; report one line
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise DataError(f"cannot load Hugging Face dataset {name!r}: {first}") from None
    field = cfg.hf_text_field
    if field not in ds.column_names:
        raise DataError(f"hf:{name} has no column {field!r} (columns: {', '.join(ds.column_names)})")
    index = 0
    for batch in ds.select_columns([field]).iter(batch_size=1024):
        for text in batch[field]:
            if not isinstance(text, str):
                raise DataError(f"hf:{name} column {field!r} holds {type(text).__name__}, not text")
            yield f"{name}:{cfg.hf_split}:{index:08d}", text
            index += 1


def _documents(cfg: DataConfig) -> Iterator[Document]:
    source = cfg.source
    if source == "stdlib":
        return _stdlib_documents()
    if source.startswith("hf:"):
        name = source[3:]
        if not name:
            raise DataError("data.source 'hf:' needs a dataset name, e.g. hf:roneneldan/TinyStories")
        return _hf_documents(name, cfg)
    path = Path(source).expanduser()
    if path.is_dir():
        return _folder_documents(path, tuple(cfg.text_extensions))
    if path.is_file():
        return _file_documents(path)
    raise DataError(f"corpus path not found: {path}")


def load_corpus(cfg: DataConfig) -> Corpus:
    """Read the documents of ``cfg.source`` (see the module docstring) and fingerprint them."""
    documents: list[Document] = []
    total = 0
    for name, text in _documents(cfg):
        if not text:
            continue
        documents.append((name, text))
        total += len(text.encode("utf-8"))
        if cfg.max_corpus_bytes and total >= cfg.max_corpus_bytes:
            break
    if not documents:
        raise DataError(f"corpus {cfg.source!r} holds no text")
    fingerprint = corpus_fingerprint(documents)
    logger.info("corpus %s: %d documents, %d bytes, fingerprint %s", cfg.source, len(documents), total,
                fingerprint[:16])
    return Corpus(source=cfg.source, documents=documents, fingerprint=fingerprint, num_bytes=total)


def _name_fraction(name: str) -> float:
    """Position of sha256(name) in [0, 1)."""
    return int.from_bytes(hashlib.sha256(name.encode("utf-8")).digest()[:8], "big") / 2.0**64


def split_validation(documents: list[Document], val_fraction: float) -> tuple[list[Document], list[Document]]:
    """Split documents into (train, val) by a hash of each name; both keep corpus order.

    A document goes to validation when sha256(name), read as a fraction of 2**64, is below
    ``val_fraction``. Validation is never empty (the document with the smallest hash is taken)
    and neither is train (the one with the largest hash is given back).
    """
    if len(documents) < 2:
        raise DataError(f"need at least 2 documents to split train/validation, corpus has {len(documents)}")
    fractions = [_name_fraction(name) for name, _ in documents]
    is_val = [f < val_fraction for f in fractions]
    if not any(is_val):
        is_val[min(range(len(documents)), key=fractions.__getitem__)] = True
    if all(is_val):
        is_val[max(range(len(documents)), key=fractions.__getitem__)] = False
    train = [doc for doc, v in zip(documents, is_val) if not v]
    val = [doc for doc, v in zip(documents, is_val) if v]
    return train, val
