"""Unit tests for mapl_swarm.data: corpus sources, tokenizer, cached shards, batch sampling."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from mapl_swarm.config import DataConfig
from mapl_swarm.data import shards as shards_mod
from mapl_swarm.data.batches import BatchSampler, num_windows, validation_batches
from mapl_swarm.data.corpus import EXCLUDED_DIR_NAMES, corpus_fingerprint, load_corpus, split_validation
from mapl_swarm.data.shards import load_prepared, prepare_data
from mapl_swarm.data.tokenizer import EOS_TOKEN, TextTokenizer, load_tokenizer, train_bpe
from mapl_swarm.errors import DataError

SMALL = 300_000
CODE = 'def add(a, b):\n    """Sum."""\n    return a + b  # ok\n\n\nclass X:\n\tpass\n'


@pytest.fixture(scope="module")
def full_stdlib():
    return load_corpus(DataConfig())


@pytest.fixture(scope="module")
def small_cfg(tmp_path_factory):
    return DataConfig(cache_dir=str(tmp_path_factory.mktemp("cache")), max_corpus_bytes=SMALL, vocab_size=512)


@pytest.fixture(scope="module")
def prepared(small_cfg):
    return prepare_data(small_cfg, progress=False)


# --- corpus -------------------------------------------------------------------------------------


def test_stdlib_corpus_excludes_tests_and_site_packages_and_is_sorted(full_stdlib):
    names = [name for name, _ in full_stdlib.documents]
    assert len(names) > 300
    assert names == sorted(names)
    assert len(set(names)) == len(names)
    for name in names:
        assert name.endswith(".py")
        assert not set(name.split("/")[:-1]) & EXCLUDED_DIR_NAMES, name
    assert "os.py" in names and "json/__init__.py" in names
    assert 4_000_000 < full_stdlib.num_bytes < 60_000_000
    assert all(text for _, text in full_stdlib.documents)
    assert full_stdlib.fingerprint == corpus_fingerprint(full_stdlib.documents)


def test_max_corpus_bytes_keeps_whole_documents_and_stable_fingerprint(full_stdlib):
    small = load_corpus(DataConfig(max_corpus_bytes=SMALL))
    assert small.documents == full_stdlib.documents[: len(small.documents)]
    sizes = [len(text.encode()) for _, text in small.documents]
    assert sum(sizes) == small.num_bytes >= SMALL > sum(sizes[:-1])
    assert load_corpus(DataConfig(max_corpus_bytes=SMALL)).fingerprint == small.fingerprint
    assert small.fingerprint != full_stdlib.fingerprint


def test_folder_source_filters_extensions_and_sorts(tmp_path):
    (tmp_path / "b").mkdir()
    (tmp_path / ".hidden").mkdir()
    (tmp_path / "z.py").write_text("print(1)\n")
    (tmp_path / "b" / "a.txt").write_text("hello\n")
    (tmp_path / "b" / "skip.bin").write_text("nope")
    (tmp_path / ".hidden" / "x.py").write_text("nope")
    (tmp_path / "empty.md").write_text("")
    corpus = load_corpus(DataConfig(source=str(tmp_path)))
    assert corpus.documents == [("b/a.txt", "hello\n"), ("z.py", "print(1)\n")]
    only_py = load_corpus(DataConfig(source=str(tmp_path), text_extensions=(".py",)))
    assert [n for n, _ in only_py.documents] == ["z.py"]


def test_single_file_source_is_chunked_at_lines(tmp_path):
    text = "".join(f"line {i} of the file\n" for i in range(5000))
    path = tmp_path / "input.txt"
    path.write_text(text)
    corpus = load_corpus(DataConfig(source=str(path)))
    assert len(corpus.documents) > 10
    assert "".join(t for _, t in corpus.documents) == text
    assert all(t.endswith("\n") for _, t in corpus.documents)
    assert [n for n, _ in corpus.documents] == sorted(n for n, _ in corpus.documents)


def test_missing_path_raises_data_error_naming_it(tmp_path):
    missing = tmp_path / "no_such_corpus"
    with pytest.raises(DataError) as info:
        load_corpus(DataConfig(source=str(missing)))
    assert str(missing) in str(info.value) and "\n" not in str(info.value)
    with pytest.raises(DataError, match="no_such.json"):
        load_tokenizer(str(tmp_path / "no_such.json"))


def test_hf_saved_dataset_source(tmp_path):
    datasets = pytest.importorskip("datasets")
    rows = ["first row\n", "", "second row\n", "third row\n"]
    datasets.Dataset.from_dict({"text": rows, "n": [1, 2, 3, 4]}).save_to_disk(str(tmp_path / "ds"))
    corpus = load_corpus(DataConfig(source=f"hf:{tmp_path / 'ds'}"))
    assert [t for _, t in corpus.documents] == ["first row\n", "second row\n", "third row\n"]
    assert len({n for n, _ in corpus.documents}) == 3
    dd = datasets.DatasetDict({"train": datasets.Dataset.from_dict({"body": ["a b c"] * 3})})
    dd.save_to_disk(str(tmp_path / "dd"))
    corpus = load_corpus(DataConfig(source=f"hf:{tmp_path / 'dd'}", hf_text_field="body"))
    assert [t for _, t in corpus.documents] == ["a b c"] * 3
    with pytest.raises(DataError, match="no column 'text'"):
        load_corpus(DataConfig(source=f"hf:{tmp_path / 'dd'}"))
    with pytest.raises(DataError, match="no split 'validation'"):
        load_corpus(DataConfig(source=f"hf:{tmp_path / 'dd'}", hf_split="validation", hf_text_field="body"))


def test_validation_split_is_deterministic_disjoint_and_never_empty(full_stdlib):
    docs = full_stdlib.documents
    train, val = split_validation(docs, 0.05)
    assert (train, val) == split_validation(list(docs), 0.05)
    train_names, val_names = {n for n, _ in train}, {n for n, _ in val}
    assert not train_names & val_names
    assert train_names | val_names == {n for n, _ in docs}
    assert 0.01 < len(val) / len(docs) < 0.12
    tiny_train, tiny_val = split_validation(docs[:3], 1e-12)
    assert len(tiny_val) == 1 and len(tiny_train) == 2
    big_train, big_val = split_validation(docs[:3], 0.999999)
    assert len(big_train) == 1 and len(big_val) == 2
    with pytest.raises(DataError):
        split_validation(docs[:1], 0.5)


# --- tokenizer ----------------------------------------------------------------------------------


def test_tokenizer_train_save_load_round_trip(tmp_path, full_stdlib):
    texts = [t for _, t in full_stdlib.documents[:20]]
    tok = train_bpe(texts, 512, tmp_path / "tokenizer.json")
    assert tok.vocab_size == 512
    assert tok.encode(EOS_TOKEN) == [tok.eos_id]
    for sample in (CODE, texts[3][:2000], "  x = [1,2]  \n\n"):
        assert tok.decode(tok.encode(sample)) == sample
    assert tok.encode_batch([CODE, "x"]) == [tok.encode(CODE), tok.encode("x")]
    assert all(0 <= i < tok.vocab_size for i in tok.encode(CODE))
    loaded = load_tokenizer(str(tmp_path / "tokenizer.json"))
    assert loaded.file_hash == tok.file_hash == TextTokenizer.from_file(tmp_path / "tokenizer.json").file_hash
    assert loaded.encode(CODE) == tok.encode(CODE)
    again = train_bpe(texts, 512, tmp_path / "again" / "tokenizer.json")
    assert again.file_hash == tok.file_hash  # training is deterministic


# --- shards -------------------------------------------------------------------------------------


def test_prepare_writes_shards_meta_and_joins_with_eos(prepared, small_cfg):
    meta = prepared.meta
    assert prepared.path.parent == Path(small_cfg.cache_dir)
    assert (prepared.path / "tokenizer.json").is_file()
    assert meta["vocab_size"] == prepared.tokenizer.vocab_size == 512
    assert meta["dtype"] == "uint16" and prepared.train.dtype == np.uint16
    assert isinstance(prepared.train, np.memmap) and not prepared.train.flags.writeable
    assert len(prepared.train) == meta["train_tokens"] > 0 and len(prepared.val) == meta["val_tokens"] > 0
    assert meta["tokenizer_hash"] == prepared.tokenizer.file_hash
    corpus = load_corpus(small_cfg)
    assert meta["corpus_fingerprint"] == corpus.fingerprint and meta["corpus_bytes"] == corpus.num_bytes
    train_docs, val_docs = split_validation(corpus.documents, small_cfg.val_fraction)
    assert (meta["train_docs"], meta["val_docs"]) == (len(train_docs), len(val_docs))
    eos = prepared.tokenizer.eos_id
    assert int((np.asarray(prepared.train) == eos).sum()) == len(train_docs) - 1
    assert prepared.tokenizer.decode(prepared.val) == EOS_TOKEN.join(t for _, t in val_docs)
    assert prepared.tokenizer.decode(prepared.train[:5000]) == EOS_TOKEN.join(t for _, t in train_docs)[
        : len(prepared.tokenizer.decode(prepared.train[:5000]))]


def test_prepare_reuses_cache_without_retokenizing(prepared, small_cfg, monkeypatch):
    mtime = (prepared.path / "train.bin").stat().st_mtime_ns

    def boom(*args, **kwargs):
        raise AssertionError("retokenized")

    monkeypatch.setattr(shards_mod, "train_bpe", boom)
    monkeypatch.setattr(TextTokenizer, "encode_batch", boom)
    again = prepare_data(small_cfg, progress=False)
    assert again.path == prepared.path and again.meta == prepared.meta
    assert (prepared.path / "train.bin").stat().st_mtime_ns == mtime
    np.testing.assert_array_equal(again.train, prepared.train)
    reopened = load_prepared(prepared.path)
    np.testing.assert_array_equal(reopened.val, prepared.val)
    other = DataConfig(cache_dir=small_cfg.cache_dir, max_corpus_bytes=SMALL, vocab_size=512, val_fraction=0.3)
    with pytest.raises(AssertionError, match="retokenized"):
        prepare_data(other, progress=False)  # a different key must not reuse the folder


def test_interrupted_prepare_leaves_nothing_reusable(tmp_path, monkeypatch):
    cfg = DataConfig(cache_dir=str(tmp_path / "cache"), max_corpus_bytes=100_000, vocab_size=300)
    real = shards_mod._write_split
    calls = []

    def crash(handle, docs, tok, dtype, bar):
        calls.append(1)
        real(handle, docs, tok, dtype, bar)
        raise KeyboardInterrupt

    monkeypatch.setattr(shards_mod, "_write_split", crash)
    with pytest.raises(KeyboardInterrupt):
        prepare_data(cfg, progress=False)
    assert [p for p in (tmp_path / "cache").iterdir() if not p.name.endswith(".lock")] == []
    monkeypatch.setattr(shards_mod, "_write_split", real)
    done = prepare_data(cfg, progress=False)
    assert done.meta["train_tokens"] == len(done.train) > 0


def test_prepare_with_given_tokenizer_json(tmp_path, prepared):
    cfg = DataConfig(source=str(Path(__file__)), cache_dir=str(tmp_path / "cache"),
                     tokenizer=str(prepared.path / "tokenizer.json"))
    data = prepare_data(cfg, progress=False)
    assert data.tokenizer.file_hash == prepared.tokenizer.file_hash == data.meta["tokenizer_hash"]
    assert data.meta["vocab_size"] == 512
    assert load_prepared(data.path).tokenizer.file_hash == prepared.tokenizer.file_hash


def test_import_data_package_does_not_import_torch():
    code = "import sys, mapl_swarm.data, mapl_swarm.data.shards; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


# --- batches ------------------------------------------------------------------------------------


def _windows(batch: torch.Tensor) -> list[int]:
    return [int(row[0]) // 4 for row in batch]  # tokens are arange, seq_len 4


def test_batch_sampler_shapes_dtype_and_windows():
    tokens = np.arange(41, dtype=np.uint16)
    sampler = BatchSampler(tokens, micro_batch_size=3, seq_len=4, seed=0)
    assert sampler.num_windows == num_windows(41, 4) == 10
    batch = next(sampler)
    assert batch.shape == (3, 5) and batch.dtype == torch.int64
    for row in batch:
        start = int(row[0])
        assert start % 4 == 0 and row.tolist() == list(range(start, start + 5))


def test_batch_sampler_is_deterministic_and_rolls_over_epochs():
    tokens = np.arange(41, dtype=np.uint16)
    a = BatchSampler(tokens, 3, 4, seed=7)
    b = BatchSampler(tokens, 3, 4, seed=7)
    stream_a = [next(a) for _ in range(10)]
    assert all(torch.equal(x, next(b)) for x in stream_a)
    seen = [w for batch in stream_a for w in _windows(batch)]
    assert sorted(seen[:10]) == list(range(10)) and sorted(seen[10:20]) == list(range(10))
    assert seen[:10] != seen[10:20]  # a fresh permutation per epoch
    assert a.state_dict() == {"epoch": 3, "cursor": 0}
    epoch0 = {seed: _windows(next(BatchSampler(tokens, 10, 4, seed=seed))) for seed in (7, 8)}
    assert epoch0[7] == seen[:10] and epoch0[8] != epoch0[7]


def test_batch_sampler_state_round_trip_resumes_identical_stream():
    tokens = np.arange(41, dtype=np.uint16)
    sampler = BatchSampler(tokens, 4, 4, seed=3)
    for _ in range(4):  # 16 windows: into epoch 1
        next(sampler)
    state = sampler.state_dict()
    assert state == {"epoch": 1, "cursor": 6}
    expected = [next(sampler) for _ in range(7)]
    resumed = BatchSampler(tokens, 4, 4, seed=3)
    resumed.load_state_dict(dict(state))
    assert all(torch.equal(x, next(resumed)) for x in expected)
    with pytest.raises(DataError):
        resumed.load_state_dict({"epoch": 0, "cursor": 11})
    with pytest.raises(DataError):
        resumed.load_state_dict({"cursor": 1})


def test_validation_batches_are_fixed_and_in_order():
    tokens = np.arange(41, dtype=np.uint16)
    first = validation_batches(tokens, 2, 4, 3)
    assert len(first) == 3 and all(b.shape == (2, 5) and b.dtype == torch.int64 for b in first)
    assert [_windows(b) for b in first] == [[0, 1], [2, 3], [4, 5]]
    assert all(torch.equal(x, y) for x, y in zip(first, validation_batches(tokens, 2, 4, 3)))
    cyc = validation_batches(tokens, 4, 4, 3)  # 12 windows asked, 10 exist
    assert _windows(cyc[2]) == [8, 9, 0, 1]


def test_too_short_shard_raises():
    tokens = np.arange(4, dtype=np.uint16)
    with pytest.raises(DataError, match="too short"):
        BatchSampler(tokens, 1, 4, seed=0)
    with pytest.raises(DataError, match="too short"):
        validation_batches(tokens, 1, 4, 1)
    assert BatchSampler(np.arange(5, dtype=np.uint16), 2, 4, 0).next_batch().shape == (2, 5)


def test_sampler_on_prepared_shards(prepared):
    sampler = BatchSampler(prepared.train, 4, 64, seed=0)
    batch = next(sampler)
    assert batch.shape == (4, 65) and int(batch.max()) < prepared.meta["vocab_size"]
    val = validation_batches(prepared.val, 2, 8, 2)
    assert val[0][0].tolist() == prepared.val[:9].astype(np.int64).tolist()


def test_transformers_tokenizer_folder(tmp_path, prepared):
    transformers = pytest.importorskip("transformers")
    fast = transformers.PreTrainedTokenizerFast(tokenizer_file=str(prepared.path / "tokenizer.json"),
                                                eos_token=EOS_TOKEN)
    fast.save_pretrained(str(tmp_path / "hf_tok"))
    tok = load_tokenizer(str(tmp_path / "hf_tok"))
    assert tok.path is None and tok.vocab_size == 512 and tok.eos_id == prepared.tokenizer.eos_id
    assert tok.encode_batch([CODE]) == prepared.tokenizer.encode_batch([CODE])
    assert tok.decode(tok.encode(CODE)) == CODE
    assert tok.file_hash == load_tokenizer(str(tmp_path / "hf_tok")).file_hash
