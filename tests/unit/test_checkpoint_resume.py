"""Issue 13, "Done when" for checkpoints that verify, with the in-process ``train``: a flipped byte
or a truncated file in the newest checkpoint falls back to the previous one with the losses of a
clean resume from it; a full disk (a small tmpfs) costs one line naming the path and the bytes
needed, leaves no partial file, keeps the earlier checkpoints loadable and the run's state."""

from __future__ import annotations

import contextlib
import json
import logging
import shutil
import subprocess
from pathlib import Path

import pytest

from mapl_swarm.errors import CheckpointError
from mapl_swarm.pipeline import checkpoint
from mapl_swarm.pipeline.checkpoint import StageCheckpoints
from mapl_swarm.pipeline.trainer import train

from checkpoint_damage import flip_tensor_byte, truncate
from conftest import stdlib_run_config

STEPS, EVERY = 4, 2  # checkpoints at 2 and 4; a resume from 2 trains steps 3 and 4


def _cfg(cache: Path, out: Path):
    return stdlib_run_config(cache, out, STEPS, interval_steps=EVERY, keep=2)


def _losses(out: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())
            if "loss" in r}


def _stores(out: Path) -> list[StageCheckpoints]:
    fp = checkpoint.read_meta(out, EVERY, 0)["config_fingerprint"]
    return [StageCheckpoints(out, s, driver="train", fingerprint=fp, keep=2) for s in range(2)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """A run with checkpoints at 2 and 4, and a clean resume from 2 (step 4 removed first)."""
    root = tmp_path_factory.mktemp("ckpt_resume")
    cache, base = root / "cache", root / "base"
    train(_cfg(cache, base), progress=False)
    assert checkpoint.complete_steps(base, 2) == [2, 4]
    clean = root / "clean"
    shutil.copytree(base, clean)
    checkpoint.delete_stage_steps(clean, 0, [4])
    checkpoint.delete_stage_steps(clean, 1, [4])
    train(_cfg(cache, clean), resume=True, progress=False)
    return cache, base, _losses(clean)


@pytest.mark.parametrize("damage", [flip_tensor_byte, truncate], ids=["flipped_byte", "truncated"])
def test_damaged_newest_checkpoint_falls_back_to_the_previous_one(runs, tmp_path, caplog, damage):
    cache, base, clean = runs
    out = tmp_path / "run"
    shutil.copytree(base, out)
    bad = out / "checkpoints" / "step_00000004" / "stage_1.pt"
    damage(bad)
    with caplog.at_level(logging.WARNING):
        train(_cfg(cache, out), resume=True, progress=False)
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 2 and str(bad) in warnings[0], warnings
    assert ("hash mismatch" if damage is flip_tensor_byte else "truncated") in warnings[0]
    assert warnings[1].startswith("the run resumes from step 2, older than its checkpoint steps 4: those are kept in")
    assert (out / "checkpoints.rolled_back" / "step_00000004" / "stage_1.pt").exists()  # the damaged file kept too
    assert json.loads((out / "manifest.json").read_text())["resumed_from"] == 2
    losses = _losses(out)
    assert sorted(losses) == [1, 2, 3, 4]  # the interrupted run's 3, 4 replaced by the resumed ones
    assert [losses[s] for s in (3, 4)] == pytest.approx([clean[s] for s in (3, 4)], abs=1e-6, rel=0)
    assert [st.usable_steps() for st in _stores(out)] == [[2, 4], [2, 4]]  # step 4 written anew, intact


@contextlib.contextmanager
def _tmpfs(path: Path, size_bytes: int):
    """A tmpfs of ``size_bytes`` at ``path``, unmounted afterwards; skips the test when it cannot be mounted."""
    path.mkdir()
    try:
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_bytes}", "tmpfs", str(path)],
                           capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError) as exc:
        pytest.skip(f"full-disk test needs a small tmpfs: cannot run mount ({exc})")
    if r.returncode:
        pytest.skip(f"full-disk test needs a small tmpfs (root or CAP_SYS_ADMIN): mount said "
                    f"{(r.stderr or r.stdout).strip()!r}")
    try:
        yield path
    finally:
        subprocess.run(["umount", str(path)], capture_output=True, timeout=30, check=True)


def _files(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())


def test_torch_save_on_a_full_tmpfs_names_the_path_and_bytes_and_leaves_nothing(tmp_path):
    import torch

    state = {f"p{i}": torch.zeros(1) for i in range(2000)}  # 8 kB of tensors, ~560 kB of file
    with _tmpfs(tmp_path / "small", 128 * 1024) as fs:
        with pytest.raises(checkpoint.CheckpointSaveError) as err:  # torch's own ENOSPC, mid-write
            checkpoint.save_stage(fs, 2, 0, state)
        assert not err.value.permanent
        path = fs / "checkpoints" / "step_00000002" / "stage_0.pt"
        assert str(err.value).startswith(f"checkpoint step 2 of stage 0 not saved: no space left on device for "
                                         f"{path} (needs about ")
        assert "\n" not in str(err.value) and "inline_container" not in str(err.value)
        assert _files(fs) == [] and shutil.disk_usage(fs).used == 0


def test_full_disk_during_train_keeps_the_run_and_its_earlier_checkpoint(runs, tmp_path, caplog):
    cache, base, _ = runs
    step_bytes = sum(p.stat().st_size for p in (base / "checkpoints" / "step_00000002").iterdir())
    with _tmpfs(tmp_path / "disk", int(1.5 * step_bytes) + 64 * 1024) as fs:  # room for one step, not two
        out = fs / "run"
        with caplog.at_level(logging.WARNING):
            summary = train(_cfg(cache, out), progress=False)  # no exception: the run goes on
        warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
        assert len(warnings) == 1, warnings
        assert warnings[0].startswith("checkpoint step 4 of stage ")
        assert f"not saved: no space left on device for {out / 'checkpoints' / 'step_00000004'}/stage_" in warnings[0]
        assert "(needs about " in warnings[0] and " free of " in warnings[0]
        assert summary.steps == STEPS
        assert _losses(out) == pytest.approx(_losses(base), abs=1e-6, rel=0)  # the run kept its state
        assert not [f for f in _files(fs) if "tmp" in f]
        assert checkpoint.stage_steps(out, 0) == checkpoint.stage_steps(out, 1) == [2]  # no partial step 4
        stores = _stores(out)
        assert [st.usable_steps() for st in stores] == [[2], [2]]
        for st in stores:
            st.load(2)
        with pytest.raises(CheckpointError):
            st.load(4)
