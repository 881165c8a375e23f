"""Checkpoints that verify (issue 13, item 1): atomic writes, per-step manifests checked before a
load, corrupt or unfinished steps skipped with one warning, failed saves that leave nothing behind."""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import re
from pathlib import Path

import pytest
import torch

from mapl_swarm.errors import CheckpointError
from mapl_swarm.files import atomic_write_bytes, atomic_write_text, atomic_writer
from mapl_swarm.pipeline import checkpoint
from mapl_swarm.pipeline.checkpoint import StageCheckpoints, choose_resume_step, save_step

from checkpoint_damage import flip_tensor_byte, truncate

FP = "f" * 32


def _store(root: Path, stage: int, keep: int = 5) -> StageCheckpoints:
    return StageCheckpoints(root, stage, driver="train", fingerprint=FP, keep=keep)


def _state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(64, 32, generator=g), "opt": {"m": torch.randn(64, generator=g)}, "step": seed}


def _pt(root: Path, step: int, stage: int) -> Path:
    return root / "checkpoints" / f"step_{step:08d}" / f"stage_{stage}.pt"


def _leftovers(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*tmp*"))


# ---------------------------------------------------------------- atomic writes
def test_atomic_write_measures_replaces_and_leaves_no_temp_file(tmp_path):
    path = tmp_path / "a.bin"
    written = atomic_write_bytes(path, b"hello")
    assert path.read_bytes() == b"hello" and written.nbytes == 5
    assert written.sha256 == hashlib.sha256(b"hello").hexdigest()
    atomic_write_text(path, "new")
    assert path.read_text() == "new" and _leftovers(tmp_path) == []


@pytest.mark.parametrize("where", ["write", "fsync"])
def test_atomic_write_failure_removes_the_temp_file_and_keeps_the_old_file(tmp_path, monkeypatch, where):
    path = tmp_path / "a.bin"
    path.write_bytes(b"old")
    if where == "fsync":
        monkeypatch.setattr("mapl_swarm.files.os.fsync", _raise_enospc)
    with pytest.raises(OSError, match="No space left"):
        with atomic_writer(path) as f:
            f.write(b"x" * 10_000)
            if where == "write":
                _raise_enospc()
    assert path.read_bytes() == b"old" and _leftovers(tmp_path) == []


def _raise_enospc(*_):
    raise OSError(errno.ENOSPC, "No space left on device")


def test_torch_save_streams_through_the_atomic_writer(tmp_path):
    path = tmp_path / "s.pt"
    with atomic_writer(path) as f:
        torch.save(_state(1), f)
    assert f.nbytes == path.stat().st_size and f.hexdigest() == hashlib.sha256(path.read_bytes()).hexdigest()
    torch.testing.assert_close(torch.load(path, weights_only=True)["w"], _state(1)["w"])


# ---------------------------------------------------------------- manifests, verification, fallback
def test_manifest_lists_each_file_with_size_and_hash(tmp_path):
    _store(tmp_path, 0).save(2, _state(2))
    d = tmp_path / "checkpoints" / "step_00000002"
    assert sorted(p.name for p in d.iterdir()) == ["stage_0.manifest.json", "stage_0.pt"]
    manifest = json.loads((d / "stage_0.manifest.json").read_text())
    raw = (d / "stage_0.pt").read_bytes()
    assert manifest["files"] == {"stage_0.pt": {"bytes": len(raw), "sha256": hashlib.sha256(raw).hexdigest()}}
    assert {k: manifest[k] for k in ("driver", "config_fingerprint", "step", "stage")} == {
        "driver": "train", "config_fingerprint": FP, "step": 2, "stage": 0}
    assert checkpoint.read_meta(tmp_path, 2, 0) == {"driver": "train", "config_fingerprint": FP, "step": 2, "stage": 0}


def _flip(root, step, stage):
    flip_tensor_byte(_pt(root, step, stage))


def _truncate(root, step, stage):
    truncate(_pt(root, step, stage))


def _no_manifest(root, step, stage):
    (_pt(root, step, stage).parent / f"stage_{stage}.manifest.json").unlink()


def _bad_manifest(root, step, stage):
    (_pt(root, step, stage).parent / f"stage_{stage}.manifest.json").write_text("{\"files\": ")


@pytest.mark.parametrize("damage, why", [
    (_flip, r"stage_1.pt: hash mismatch \(sha256 [0-9a-f]{16}\.\.\., the manifest says [0-9a-f]{16}\.\.\.\)"),
    (_truncate, r"stage_1.pt: truncated \(\d+ of \d+ bytes\)"),
    (_no_manifest, r"stage_1.pt: missing manifest stage_1.manifest.json \(an unfinished save\)"),
    (_bad_manifest, r"stage_1.manifest.json: unreadable manifest"),
])
def test_a_damaged_newest_step_is_skipped_with_one_warning_and_the_previous_one_used(tmp_path, caplog, damage, why):
    stores = [_store(tmp_path, s) for s in range(2)]
    for step in (2, 4):
        assert save_step(stores, step, [_state(step * 10 + s) for s in range(2)])
    damage(tmp_path, 4, 1)
    if damage is _flip:  # without the manifest, torch would load it: a silently different weight
        assert not torch.equal(torch.load(_pt(tmp_path, 4, 1), weights_only=True)["w"], _state(41)["w"])
    with caplog.at_level(logging.WARNING):
        have = {st.stage: st.usable_steps() for st in stores}
    assert have == {0: [2, 4], 1: [2]}
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1, warnings
    assert warnings[0].startswith("checkpoint step 4 of stage 1 is not usable, skipped: ")
    assert str(tmp_path / "checkpoints" / "step_00000004") in warnings[0]
    assert re.search(why, warnings[0]), warnings[0]
    assert choose_resume_step(have, 10, "x") == 2
    torch.testing.assert_close(stores[1].load(2)["w"], _state(21)["w"], rtol=0, atol=0)
    with pytest.raises(CheckpointError, match="cannot read checkpoint .*stage_1"):
        stores[1].load(4)


def test_load_refuses_a_flipped_byte_even_without_a_resume_listing(tmp_path):
    checkpoint.save_stage(tmp_path, 2, 0, _state(1))
    flip_tensor_byte(_pt(tmp_path, 2, 0))
    with pytest.raises(CheckpointError, match=r"cannot read checkpoint .*stage_0.pt: hash mismatch"):
        checkpoint.load_stage(tmp_path, 2, 0)


def test_a_step_written_before_manifests_is_loaded_with_a_warning(tmp_path, caplog):
    """An upgrade must not strand a run: pre-manifest steps (``.pt`` + ``meta.json``) stay usable,
    and loading one says that it could not be verified."""
    d = tmp_path / "checkpoints" / "step_00000006"
    d.mkdir(parents=True)
    torch.save(_state(6), d / "stage_0.pt")
    (d / "stage_0.meta.json").write_text(json.dumps({"driver": "train", "config_fingerprint": FP, "step": 6,
                                                      "stage": 0}))
    store = _store(tmp_path, 0)
    store.save(4, _state(4))
    assert store.usable_steps() == [4, 6]
    with caplog.at_level(logging.WARNING):
        state = store.load(6)
    torch.testing.assert_close(state["w"], _state(6)["w"])
    assert [r.getMessage() for r in caplog.records] == [
        f"checkpoint {d / 'stage_0.pt'} has no manifest (written before checkpoints had checksums): loaded unverified"]
    assert checkpoint.complete_steps(tmp_path, 1) == [4, 6]
    store.discard(6)
    assert not d.exists()


def test_temp_files_of_a_killed_save_are_removed_at_the_next_start(tmp_path):
    _store(tmp_path, 0).save(2, _state(2))
    d = tmp_path / "checkpoints" / "step_00000002"
    (d / ".stage_0.pt.123-abcd.tmp").write_bytes(b"half")
    (d / ".stage_1.pt.456-abcd.tmp").write_bytes(b"other stage")  # not stage 0's: untouched
    (tmp_path / "checkpoints" / "step_00000004").mkdir()
    (tmp_path / "checkpoints" / "step_00000004" / ".stage_0.pt.123-abcd.tmp").write_bytes(b"half")
    _store(tmp_path, 0)
    assert _leftovers(tmp_path) == ["checkpoints/step_00000002/.stage_1.pt.456-abcd.tmp"]
    assert not (tmp_path / "checkpoints" / "step_00000004").exists()


# ---------------------------------------------------------------- a resume from an older step
def test_a_resume_from_an_older_step_keeps_the_later_steps_aside(tmp_path):
    """A resume that rolls back (a laggard's step agreed, a re-form) never deletes a checkpoint: the
    stage's later steps move to ``checkpoints.rolled_back/`` (the caller's one warning names them and
    the way back), another stage's files stay, and a step moved back loads as it was saved."""
    store, other = _store(tmp_path, 0), _store(tmp_path, 1)
    for step in (2, 4, 6):
        assert store.save(step, _state(step)) and other.save(step, _state(10 + step))
        store.mark_complete(step)
    assert store.resumed(2) == [4, 6]
    assert store.local_steps() == [2] and store.complete == [2] and other.local_steps() == [2, 4, 6]
    aside = tmp_path / "checkpoints.rolled_back"
    assert sorted(p.name for p in aside.iterdir()) == ["step_00000004", "step_00000006"]
    note = checkpoint.rolled_back_note(tmp_path, 2, [6, 4], "stage 0")
    assert note.startswith("stage 0 resumes from step 2, older than its checkpoint steps 4, 6: those are kept in "
                           f"{aside}, not used") and str(tmp_path / "checkpoints") in note
    store.save(4, _state(99))  # the resumed run saves step 4 again: then a second roll-back keeps the newer
    store.resumed(2)
    assert torch.equal(torch.load(aside / "step_00000004" / "stage_0.pt")["w"], _state(99)["w"])
    assert (aside / "step_00000006" / "stage_0.pt").exists()  # the first roll-back's step is still kept
    (aside / "step_00000006" / "stage_0.pt").rename(_pt(tmp_path, 6, 0))
    (aside / "step_00000006" / "stage_0.manifest.json").rename(tmp_path / "checkpoints" / "step_00000006" /
                                                               "stage_0.manifest.json")
    assert store.usable_steps() == [2, 6] and torch.equal(store.load(6)["w"], _state(6)["w"])


# ---------------------------------------------------------------- failed saves
def _torch_enospc(obj, f):
    """What ``torch.save`` does on a full disk: the file's OSError becomes a RuntimeError."""
    f.write(b"x" * 5000)
    try:
        _raise_enospc()
    except OSError:
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 5000 vs 4900") from None


def test_a_full_disk_costs_one_warning_and_leaves_nothing_of_the_step(tmp_path, monkeypatch, caplog):
    stores = [_store(tmp_path, s) for s in range(2)]
    assert save_step(stores, 2, [_state(20), _state(21)])
    real_save = torch.save
    monkeypatch.setattr(checkpoint.torch, "save", lambda obj, f: (_torch_enospc if obj is bad else real_save)(obj, f))
    bad = _state(41)
    with caplog.at_level(logging.WARNING):
        assert not save_step(stores, 4, [_state(40), bad])  # stage 0 saved, stage 1 failed: both gone
    lines = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(lines) == 1 and "\n" not in lines[0], lines
    assert lines[0].startswith(f"checkpoint step 4 of stage 1 not saved: no space left on device for "
                               f"{_pt(tmp_path, 4, 1)} (needs about ")
    assert " free of " in lines[0] and lines[0].endswith("; training goes on, the next checkpoint is tried again")
    assert _leftovers(tmp_path) == [] and not (tmp_path / "checkpoints" / "step_00000004").exists()
    assert [st.usable_steps() for st in stores] == [[2], [2]]
    torch.testing.assert_close(stores[1].load(2)["w"], _state(21)["w"])
    monkeypatch.setattr(checkpoint.torch, "save", real_save)
    assert save_step(stores, 6, [_state(60), _state(61)])  # the next checkpoint is tried again


def test_a_failed_manifest_write_removes_the_data_file_too(tmp_path, monkeypatch):
    def failing_manifest(path, text):
        _raise_enospc()

    monkeypatch.setattr(checkpoint, "atomic_write_text", failing_manifest)
    assert not _store(tmp_path, 0).save(2, _state(2))
    assert not (tmp_path / "checkpoints" / "step_00000002").exists()


@pytest.mark.parametrize("code, permanent", [(errno.EIO, False), (errno.EROFS, True), (errno.EACCES, True)])
def test_errors_a_later_save_would_meet_again_stop_the_run_with_one_line(tmp_path, monkeypatch, code, permanent):
    def failing(obj, f):
        raise OSError(code, "boom")

    monkeypatch.setattr(checkpoint.torch, "save", failing)
    store = _store(tmp_path, 0)
    if not permanent:
        assert store.save(2, _state(2)) is False
        return
    with pytest.raises(checkpoint.CheckpointSaveError, match=r"^checkpoint step 2 of stage 0 not saved: cannot "
                                                             r"write .*stage_0.pt: boom \(needs about \d+ bytes"):
        store.save(2, _state(2))
    assert _leftovers(tmp_path) == [] and store.local_steps() == []


def test_a_state_that_cannot_fit_is_refused_before_anything_is_written(tmp_path, monkeypatch):
    from collections import namedtuple

    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(checkpoint.shutil, "disk_usage", lambda p: usage(5_000, 4_000, 1_000))
    written = []
    monkeypatch.setattr(checkpoint.torch, "save", lambda obj, f: written.append(obj))
    with pytest.raises(checkpoint.CheckpointSaveError,
                       match=r"no space left on device .* \(needs about \d+ bytes \(\d+\.\d kB\), 1000 bytes free of "
                             r"5000 bytes \(4.9 kB\); the filesystem is smaller than that\)"):
        _store(tmp_path, 0).save(2, _state(2))
    assert written == [] and _leftovers(tmp_path) == []


def test_state_nbytes_counts_shared_storage_once():
    w = torch.zeros(100)
    assert checkpoint.state_nbytes({"a": w, "b": w[10:20], "c": [torch.zeros(3, dtype=torch.float64)]}) == 424


def test_a_save_without_file_descriptors_left_is_a_failed_save_not_a_crash(tmp_path, monkeypatch):
    """EMFILE (a stranger held the peer's descriptors): the save fails as any I/O error does, even
    when the clean-up cannot list the step folder either (it leaves what it cannot see)."""
    def emfile(*_):
        raise OSError(errno.EMFILE, "Too many open files", str(tmp_path))

    monkeypatch.setattr(checkpoint, "atomic_write_text", emfile)
    monkeypatch.setattr(checkpoint, "_stage_files", emfile)
    with pytest.raises(checkpoint.CheckpointSaveError, match=r"checkpoint step 2 of stage 0 not saved: "):
        checkpoint.save_stage(tmp_path, 2, 0, _state(2))
