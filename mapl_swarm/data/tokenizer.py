"""Tokenizers: train a byte-level BPE on the corpus, or load an existing one, behind one wrapper.

:class:`TextTokenizer` gives the rest of the package one small interface (``encode_batch``,
``decode``, ``vocab_size``, ``eos_id``, ``file_hash``) whether the backend is a
``tokenizers.Tokenizer`` (trained here, or any ``tokenizer.json``) or a ``transformers``
tokenizer (any other name or path; imported lazily). Encoding never adds special tokens: the
shard writer places the end-of-text token between documents itself.

``file_hash`` identifies the exact vocabulary and merges: the sha256 of the ``tokenizer.json``
bytes, or of a stable serialisation for ``transformers`` tokenizers. Peers compare it (through
the model fingerprint) before they exchange activations.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from mapl_swarm.errors import DataError

__all__ = ["EOS_TOKEN", "TOKENIZER_FILE", "TextTokenizer", "train_bpe", "load_tokenizer"]

logger = logging.getLogger(__name__)

EOS_TOKEN = "<|endoftext|>"
"""End-of-text special token of trained tokenizers; separates documents in the shards."""

TOKENIZER_FILE = "tokenizer.json"
"""File name of a saved ``tokenizers`` tokenizer."""

_EOS_CANDIDATES = (EOS_TOKEN, "<|end_of_text|>", "</s>", "<eos>", "<|eos|>", "<|im_end|>")


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


class TextTokenizer:
    """A tokenizer with the handful of operations training needs.

    Build one with :func:`train_bpe`, :func:`load_tokenizer` or :meth:`from_file`.
    """

    def __init__(self, backend: Any, *, name: str, file_hash: str, path: Path | None = None,
                 is_transformers: bool = False) -> None:
        self._backend = backend
        self._is_transformers = is_transformers
        self.name = name
        """Where it came from: a path or a transformers name."""
        self.path = path
        """The tokenizer.json it was read from; None for transformers tokenizers."""
        self.file_hash = file_hash
        """sha256 hex digest of the tokenizer file (or a stable serialisation of it)."""
        self.vocab_size = len(backend) if is_transformers else backend.get_vocab_size(with_added_tokens=True)
        """Number of token ids, special tokens included."""
        self.eos_id = self._find_eos()
        """Id of the end-of-text token placed between documents."""

    def _find_eos(self) -> int:
        if self._is_transformers and self._backend.eos_token_id is not None:
            return int(self._backend.eos_token_id)
        for token in _EOS_CANDIDATES:
            token_id = (self._backend.convert_tokens_to_ids(token) if self._is_transformers
                        else self._backend.token_to_id(token))
            if token_id is not None and (not self._is_transformers or token_id != self._backend.unk_token_id):
                return int(token_id)
        raise DataError(f"tokenizer {self.name} has no end-of-text token "
                        f"(looked for {', '.join(_EOS_CANDIDATES)})")

    @classmethod
    def from_file(cls, path: str | Path) -> TextTokenizer:
        """Load a ``tokenizer.json`` written by the ``tokenizers`` library."""
        from tokenizers import Tokenizer

        path = Path(path)
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            raise DataError(f"tokenizer file not found: {path}") from None
        try:
            backend = Tokenizer.from_str(data.decode("utf-8"))
        except Exception as exc:  # noqa: BLE001 - tokenizers raises a bare Exception
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise DataError(f"cannot read tokenizer {path}: {first}") from None
        return cls(backend, name=str(path), file_hash=_sha256(data), path=path)

    def encode(self, text: str) -> list[int]:
        """Token ids of one text, no special tokens added."""
        return self.encode_batch([text])[0]

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """Token ids of each text (in parallel where the backend can), no special tokens added."""
        texts = list(texts)
        if not texts:
            return []
        if self._is_transformers:
            return list(self._backend(texts, add_special_tokens=False, verbose=False)["input_ids"])
        return [enc.ids for enc in self._backend.encode_batch_fast(texts, add_special_tokens=False)]

    def decode(self, ids: Iterable[int]) -> str:
        """Text of token ids; special tokens are kept."""
        ids = [int(i) for i in ids]
        if self._is_transformers:
            return self._backend.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
        return self._backend.decode(ids, skip_special_tokens=False)

    def save_pretrained(self, folder: str | Path, *, model_max_length: int) -> None:
        """Write it as a transformers tokenizer folder (``tokenizer.json``, ``tokenizer_config.json``,
        special tokens) that ``AutoTokenizer.from_pretrained(folder)`` loads; the end-of-text token
        is its EOS and padding token."""
        if self._is_transformers:
            self._backend.save_pretrained(folder)
            return
        from transformers import PreTrainedTokenizerFast

        eos = self._backend.id_to_token(self.eos_id)
        PreTrainedTokenizerFast(tokenizer_object=self._backend, eos_token=eos, pad_token=eos,
                                model_max_length=model_max_length).save_pretrained(folder)

    def __repr__(self) -> str:
        return (f"TextTokenizer(name={self.name!r}, vocab_size={self.vocab_size}, eos_id={self.eos_id}, "
                f"file_hash={self.file_hash[:12]}...)")


def train_bpe(texts: Sequence[str], vocab_size: int, path: str | Path) -> TextTokenizer:
    """Train a byte-level BPE with an ``<|endoftext|>`` special token and save it at ``path``.

    Training is deterministic for a given text list and vocab size. The file is written
    atomically (temporary file, then rename). The vocabulary may come out smaller than
    ``vocab_size`` when the texts are too small to learn that many merges.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    path = Path(path)
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    logger.info("training byte-level BPE (vocab %d) on %d documents", vocab_size, len(texts))
    backend.train_from_iterator(texts, trainer, length=len(texts))
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    backend.save(str(tmp))
    os.replace(tmp, path)
    tok = TextTokenizer.from_file(path)
    if tok.vocab_size < vocab_size:
        logger.warning("trained tokenizer has %d tokens, fewer than the %d asked for (small corpus)",
                       tok.vocab_size, vocab_size)
    return tok


def _transformers_hash(tok: Any) -> str:
    if getattr(tok, "is_fast", False):
        return _sha256(tok.backend_tokenizer.to_str().encode("utf-8"))
    payload = {
        "class": type(tok).__name__,
        "vocab": sorted(tok.get_vocab().items()),
        "special": {k: str(v) for k, v in sorted(tok.special_tokens_map.items())},
    }
    return _sha256(json.dumps(payload, sort_keys=True, separators=(",", ":")).encode("utf-8"))


def load_tokenizer(spec: str) -> TextTokenizer:
    """Load ``spec``: a ``tokenizer.json`` path, else a ``transformers`` tokenizer name or path."""
    if not spec:
        raise DataError("empty tokenizer setting: train one with train_bpe instead")
    path = Path(spec).expanduser()
    if path.suffix == ".json" or path.is_file():
        if not path.is_file():
            raise DataError(f"tokenizer file not found: {path}")
        return TextTokenizer.from_file(path)
    try:
        from transformers import AutoTokenizer  # lazy: heavy import
    except ImportError:
        raise DataError(f"tokenizer {spec!r} needs the `transformers` package") from None
    try:
        tok = AutoTokenizer.from_pretrained(spec)
    except Exception as exc:  # noqa: BLE001 - many failure types; report one line
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise DataError(f"cannot load tokenizer {spec!r}: {first}") from None
    return TextTokenizer(tok, name=spec, file_hash=_transformers_hash(tok), is_transformers=True)
