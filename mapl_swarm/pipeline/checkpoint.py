"""Per-stage checkpoint files at common step numbers: written atomically, verified before use, the
pruning rule, and one stage's store of them (:class:`StageCheckpoints`: fresh start, save, verified
steps, load, complete steps, pruning), with the resume step of a run whose stages share a folder.

Layout under ``<out_dir>``::

    checkpoints/step_<08d>/stage_<s>.pt              one stage's state (torch.save)
    checkpoints/step_<08d>/stage_<s>.manifest.json   written last: every file of the stage's step
                                                     with its size and SHA-256; who wrote it (driver,
                                                     config fingerprint), step, stage
    checkpoints/complete_stage<s>.json               the steps stage s knows every stage has (agreed)
    checkpoints.previous/...                         an earlier run's checkpoints, moved by a fresh run

Every file is written to a temporary name beside it, fsynced and renamed, then the folder is
fsynced (:mod:`mapl_swarm.files`), so a crash never leaves a half file under the final name; the
manifest comes last, so a step without one is incomplete. A stage's step is *usable* only when its
manifest lists files that are all there with their recorded sizes and hashes (:func:`verify_stage`);
:func:`load_stage` checks the same before ``torch.load``. A save that fails (a full disk) leaves no
file of that stage's step behind and says, in one line, where and how many bytes it needed
(:class:`CheckpointSaveError`).

Steps written before manifests existed (``stage_<s>.meta.json`` beside the ``.pt``, no manifest) are
still loaded, with a warning that they cannot be verified, so an upgrade does not strand a run.

A fresh run (no ``--resume``) moves an earlier run's checkpoints of its stages to
``checkpoints.previous/`` (:func:`start_fresh`), so the older, higher-numbered steps can never
outrank (and prune) its own. A resume refuses checkpoints written by the other driver or another
config, and ones at or beyond ``run.steps``.

Each stage only ever touches its own files, so stages sharing one folder (one host) and stages on
separate hosts behave the same. Files are local; nothing here crosses the network (which steps are
complete swarm-wide is agreed by the peers, :mod:`mapl_swarm.peer.checkpoints`).
"""

from __future__ import annotations

import errno
import json
import logging
import os
import re
import shutil
from pathlib import Path
from typing import Any, Iterable

import torch

from mapl_swarm.errors import CheckpointError, MissingCheckpoints
from mapl_swarm.files import atomic_write_text, atomic_writer, fsync_dir, sha256_file, temp_name_glob

log = logging.getLogger(__name__)

__all__ = ["save_stage", "load_stage", "verify_stage", "read_meta", "stage_steps", "complete_steps",
           "latest_complete_step", "read_complete", "write_complete", "prune_plan", "delete_stage_steps",
           "prune", "retire_stages", "set_aside", "missing_files", "rolled_back_note", "remove_temp_files", "state_nbytes", "UnusableCheckpoint",
           "CheckpointSaveError", "CHECKPOINTS", "PREVIOUS", "ROLLED_BACK", "MANIFEST_FORMAT", "DRIVERS", "start_fresh",
           "StageCheckpoints", "save_step", "choose_resume_step", "check_resume_step"]

CHECKPOINTS = "checkpoints"
PREVIOUS = "checkpoints.previous"
ROLLED_BACK = "checkpoints.rolled_back"
"""Where a resume keeps a stage's checkpoint steps newer than the step it resumes from."""
MANIFEST_FORMAT = 1
"""Version of ``stage_<s>.manifest.json``."""
_STEP_RE = re.compile(r"^step_(\d{8})$")
_PERMANENT = {errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOTDIR, errno.EISDIR, errno.ENAMETOOLONG}
"""Errors a later save would meet again: the run stops instead of training on without checkpoints."""


class UnusableCheckpoint(CheckpointError):
    """A stage's step that must not be loaded: incomplete or corrupt (the message names the file)."""


class CheckpointSaveError(CheckpointError):
    """A stage's step could not be saved; nothing of it is left on disk. ``permanent``: no later save
    can succeed there either (read-only folder, no permission, a state larger than the filesystem)."""

    def __init__(self, message: str, *, permanent: bool) -> None:
        super().__init__(message)
        self.permanent = permanent


def _step_dir(root: Path, step: int, folder: str = CHECKPOINTS) -> Path:
    return Path(root) / folder / f"step_{step:08d}"


def _pt(d: Path, stage: int) -> Path:
    return d / f"stage_{stage}.pt"


def _manifest(d: Path, stage: int) -> Path:
    return d / f"stage_{stage}.manifest.json"


def _legacy_meta(d: Path, stage: int) -> Path:
    return d / f"stage_{stage}.meta.json"


def _stage_files(d: Path, stage: int) -> list[Path]:
    """The stage's files of a step folder, the manifest first (removing it first makes the step
    unusable before its data goes), then the data, the legacy metadata, any temporary files."""
    named = [_manifest(d, stage), _pt(d, stage), _legacy_meta(d, stage)]
    temps = [t for f in named for t in sorted(d.glob(temp_name_glob(f.name)))] if d.is_dir() else []
    return [*named, *temps]


# ---------------------------------------------------------------- save
def _storages(state: Any) -> dict[tuple[str, int], int]:
    """Distinct tensor storages in ``state`` (nested dicts, lists, tuples) -> their bytes."""
    seen: dict[tuple[str, int], int] = {}

    def walk(x: Any) -> None:
        if isinstance(x, torch.Tensor):
            st = x.untyped_storage()
            seen[(str(x.device), st.data_ptr())] = st.nbytes()
        elif isinstance(x, dict):
            for v in x.values():
                walk(v)
        elif isinstance(x, (list, tuple)):
            for v in x:
                walk(v)

    walk(state)
    return seen


def state_nbytes(state: Any) -> int:
    """Bytes of the distinct tensor storages in ``state``: a lower bound of its ``torch.save`` size."""
    return sum(_storages(state).values())


def _estimate(state: Any) -> tuple[int, int]:
    """(lower bound, estimate) of a state's file size: its tensors, plus about 300 bytes of zip
    record and pickle per storage (measured: 270-280) and a few kB of fixed overhead."""
    storages = _storages(state)
    low = sum(storages.values())
    return low, low + 320 * len(storages) + 4096


def _human(n: int) -> str:
    for unit, size in (("GB", 1 << 30), ("MB", 1 << 20), ("kB", 1 << 10)):
        if n >= size:
            return f"{n} bytes ({n / size:.1f} {unit})"
    return f"{n} bytes"


def save_stage(root: str | Path, step: int, stage: int, state: dict[str, Any],
               meta: dict[str, Any] | None = None) -> Path:
    """Write one stage's state for ``step`` atomically, then its manifest (sizes, SHA-256 and
    ``meta``: driver, config fingerprint...). A failure (full disk, I/O error) removes whatever of
    this stage's step was written and raises :class:`CheckpointSaveError` naming the path and the
    bytes needed."""
    d = _step_dir(Path(root), step)
    final = _pt(d, stage)
    low, need = _estimate(state)
    where = f"checkpoint step {step} of stage {stage} not saved"
    try:
        _make_step_dir(d)
        _manifest(d, stage).unlink(missing_ok=True)  # a re-save: the old manifest must not outlive its data
        free = shutil.disk_usage(d).free
        if free < low:  # cannot fit: fail before filling the disk
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(final))
        with atomic_writer(final) as f:
            torch.save(state, f)
        manifest = {**(meta or {}), "format": MANIFEST_FORMAT, "step": step, "stage": stage,
                    "files": {final.name: {"bytes": f.nbytes, "sha256": f.hexdigest()}}}
        atomic_write_text(_manifest(d, stage), json.dumps(manifest, indent=1, sort_keys=True))
    except (OSError, RuntimeError) as exc:
        cause = _os_error(exc)
        if cause is None and not _is_write_failure(exc):
            _discard(d, stage)
            raise  # not an I/O problem (a bug): keep its traceback
        _discard(d, stage)
        raise _save_error(cause, exc, where, final, low, need) from None
    return final


def _make_step_dir(d: Path) -> None:
    if d.is_dir():
        return
    d.parent.mkdir(parents=True, exist_ok=True)
    d.mkdir(exist_ok=True)
    fsync_dir(d.parent)


def _os_error(exc: BaseException) -> OSError | None:
    """The OSError behind ``exc``: itself, or one in its chain (``torch.save`` into a Python file
    turns the file's ENOSPC into a RuntimeError ``[enforce fail at inline_container.cc] unexpected pos``)."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, OSError) and exc.errno is not None:
            return exc
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return None


def _is_write_failure(exc: BaseException) -> bool:
    text = str(exc)
    return "inline_container" in text or "file write failed" in text or "PytorchStreamWriter" in text


def _save_error(cause: OSError | None, exc: BaseException, where: str, path: Path, low: int,
                need: int) -> CheckpointSaveError:
    try:
        usage = shutil.disk_usage(path.parent if path.parent.exists() else path.parent.parent)
    except OSError:
        usage = None
    code = cause.errno if cause is not None else None
    full = code in (errno.ENOSPC, errno.EDQUOT) or (code is None and usage is not None and usage.free < need)
    if full:
        space = "" if usage is None else f", {_human(usage.free)} free of {_human(usage.total)}"
        never = usage is not None and low > usage.total
        return CheckpointSaveError(f"{where}: no space left on device for {path} (needs about {_human(need)}"
                                   f"{space}{'; the filesystem is smaller than that' if never else ''})",
                                   permanent=never)
    reason = (cause.strerror or str(cause)) if cause is not None else str(exc).splitlines()[0]
    return CheckpointSaveError(f"{where}: cannot write {path}: {reason} (needs about {_human(need)})",
                               permanent=code in _PERMANENT)


def _discard(d: Path, stage: int) -> None:
    """Remove this stage's files of one step folder (and the folder when it is left empty); best
    effort: what cannot even be listed (no file descriptor left) stays, an unusable step without
    its manifest or with a stale one, which a load refuses."""
    try:
        files = _stage_files(d, stage)
    except OSError as exc:
        log.warning("cannot clean up %s: %s", d, exc.strerror or exc)
        return
    for f in files:
        try:
            f.unlink(missing_ok=True)
        except OSError as exc:
            log.warning("cannot remove %s: %s", f, exc.strerror)
    try:
        d.rmdir()
    except OSError:
        pass  # other stages' files remain (or it is gone already)


# ---------------------------------------------------------------- verify, load
def verify_stage(root: str | Path, step: int, stage: int) -> dict[str, Any]:
    """The manifest of stage ``stage``'s ``step`` once every file it lists has its recorded size and
    SHA-256; :class:`UnusableCheckpoint` naming the file and why otherwise (missing manifest,
    unreadable manifest, missing file, truncated, size or hash mismatch). A step written before
    manifests existed returns its ``meta.json`` with ``"files": None`` (nothing to verify against)."""
    d = _step_dir(Path(root), step)
    path = _manifest(d, stage)
    try:
        manifest = json.loads(path.read_text())
        files = manifest["files"]
        if manifest.get("format") != MANIFEST_FORMAT or not isinstance(files, dict) or not files:
            raise ValueError(f"no file list of format {MANIFEST_FORMAT}")
        sizes = {name: (int(want["bytes"]), str(want["sha256"])) for name, want in files.items()}
        if any(Path(name).name != name or name.startswith(".") for name in sizes):
            raise ValueError("a listed file is not a plain name in the step folder")
    except FileNotFoundError:
        if _legacy_meta(d, stage).exists() and _pt(d, stage).exists():
            return {**(read_meta(root, step, stage) or {}), "files": None}
        raise UnusableCheckpoint(f"{_pt(d, stage)}: missing manifest {path.name} (an unfinished save)") from None
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise UnusableCheckpoint(f"{path}: unreadable manifest ({exc})") from None
    for name, (nbytes, sha256) in sorted(sizes.items()):
        f = d / name
        try:
            size = f.stat().st_size
        except FileNotFoundError:
            raise UnusableCheckpoint(f"{f}: missing (listed in {path.name})") from None
        if size < nbytes:
            raise UnusableCheckpoint(f"{f}: truncated ({size} of {nbytes} bytes)")
        if size > nbytes:
            raise UnusableCheckpoint(f"{f}: size mismatch ({size} bytes, the manifest says {nbytes})")
        _, digest = sha256_file(f)
        if digest != sha256:
            raise UnusableCheckpoint(f"{f}: hash mismatch (sha256 {digest[:16]}..., the manifest says "
                                     f"{sha256[:16]}...)")
    return manifest


def load_stage(root: str | Path, step: int, stage: int) -> dict[str, Any]:
    """One stage's state of ``step``, verified against its manifest first (:func:`verify_stage`)."""
    d = _step_dir(Path(root), step)
    path = _pt(d, stage)
    if not path.exists() and not _manifest(d, stage).exists():
        raise CheckpointError(f"checkpoint missing: {path}")
    try:
        manifest = verify_stage(root, step, stage)
    except UnusableCheckpoint as exc:
        raise CheckpointError(f"cannot read checkpoint {exc}") from None
    if manifest["files"] is None:
        log.warning("checkpoint %s has no manifest (written before checkpoints had checksums): loaded "
                    "unverified", path)
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # unreadable although it verified (or legacy): name it, never a traceback
        raise CheckpointError(f"cannot read checkpoint {path}: {exc}") from None


def read_meta(root: str | Path, step: int, stage: int) -> dict[str, Any] | None:
    """Who wrote a stage's step (driver, config fingerprint, step, stage): from its manifest, or the
    ``meta.json`` of a step written before manifests; None when it has neither."""
    d = _step_dir(Path(root), step)
    for path in (_manifest(d, stage), _legacy_meta(d, stage)):
        try:
            meta = json.loads(path.read_text())
        except FileNotFoundError:
            continue
        except (OSError, ValueError) as exc:
            raise CheckpointError(f"cannot read checkpoint metadata {path}: {exc}") from None
        return {k: v for k, v in meta.items() if k not in ("files", "format")}
    return None


# ---------------------------------------------------------------- which steps are there
def _steps(base: Path) -> list[tuple[int, Path]]:
    if not base.is_dir():
        return []
    return sorted((int(m.group(1)), d) for d in base.iterdir() if (m := _STEP_RE.match(d.name)))


def _has_any(d: Path, stage: int) -> bool:
    return any(f.exists() for f in (_pt(d, stage), _manifest(d, stage), _legacy_meta(d, stage)))


def _written(d: Path, stage: int) -> bool:
    """The stage's save of this step finished (its manifest is there; or a pre-manifest step)."""
    return _manifest(d, stage).exists() or (_pt(d, stage).exists() and _legacy_meta(d, stage).exists())


def stage_steps(root: str | Path, stage: int) -> list[int]:
    """Steps (ascending) for which stage ``stage`` has files under ``root`` (finished or not)."""
    return [s for s, d in _steps(Path(root) / CHECKPOINTS) if _has_any(d, stage)]


def complete_steps(root: str | Path, num_stages: int) -> list[int]:
    """Steps (ascending) for which all ``num_stages`` stages finished their save under this one
    ``root`` (manifests present; :func:`verify_stage` checks the contents)."""
    return [s for s, d in _steps(Path(root) / CHECKPOINTS) if all(_written(d, k) for k in range(num_stages))]


def latest_complete_step(root: str | Path, num_stages: int) -> int | None:
    steps = complete_steps(root, num_stages)
    return steps[-1] if steps else None


def read_complete(root: str | Path, stage: int) -> list[int]:
    """Steps stage ``stage`` recorded as complete across the swarm (``complete_stage<s>.json``)."""
    path = Path(root) / CHECKPOINTS / f"complete_stage{stage}.json"
    try:
        return sorted(int(s) for s in json.loads(path.read_text())["steps"])
    except FileNotFoundError:
        return []
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(f"cannot read {path}: {exc}") from None


def write_complete(root: str | Path, stage: int, steps: Iterable[int]) -> None:
    base = Path(root) / CHECKPOINTS
    base.mkdir(parents=True, exist_ok=True)
    atomic_write_text(base / f"complete_stage{stage}.json", json.dumps({"steps": sorted(set(steps))}))


# ---------------------------------------------------------------- pruning, retiring, cleaning
def prune_plan(local: Iterable[int], complete: Iterable[int], keep: int) -> list[int]:
    """Which of a stage's ``local`` steps to delete: all but the newest ``keep`` complete steps,
    never the newest complete step, never a step newer than it; nothing while none is complete."""
    complete = sorted(set(complete))
    if not complete:
        return []
    kept = set(complete[-max(keep, 1):])
    newest = complete[-1]
    return sorted(s for s in set(local) if s < newest and s not in kept)


def delete_stage_steps(root: str | Path, stage: int, steps: Iterable[int]) -> None:
    """Remove stage ``stage``'s files of ``steps`` (and a step folder left empty)."""
    for step in steps:
        _discard(_step_dir(Path(root), step), stage)
        log.debug("pruned stage %d of checkpoint step %d", stage, step)


def prune(root: str | Path, num_stages: int, keep: int) -> None:
    """Single-folder pruning: complete = every stage's save finished here (:func:`prune_plan`)."""
    complete = complete_steps(root, num_stages)
    for s in range(num_stages):
        delete_stage_steps(root, s, prune_plan(stage_steps(root, s), complete, keep))


def remove_temp_files(root: str | Path, stage: int) -> list[Path]:
    """Remove the temporary files a killed save of stage ``stage`` left under ``root`` (only that
    stage's process writes them); returns what was removed."""
    base = Path(root) / CHECKPOINTS
    gone = sorted(base.glob(temp_name_glob(f"complete_stage{stage}.json"))) if base.is_dir() else []
    for _, d in _steps(base):
        named = (_pt(d, stage), _manifest(d, stage))
        gone += [t for f in named for t in sorted(d.glob(temp_name_glob(f.name)))]
    for t in gone:
        t.unlink(missing_ok=True)
        try:
            t.parent.rmdir()
        except OSError:
            pass
    return gone


def _move_aside(root: Path, stages: list[int], steps: Iterable[int] | None, folder: str) -> list[int]:
    """Move ``stages``' files of ``steps`` (None: every step) from ``checkpoints/`` to ``folder``
    (a step already there for those stages is replaced); returns the steps moved."""
    wanted = None if steps is None else set(steps)
    moved = set()
    for step, d in _steps(root / CHECKPOINTS):
        if wanted is not None and step not in wanted:
            continue
        for s in stages:
            for f in _stage_files(d, s):
                if f.exists():
                    dest = _step_dir(root, step, folder)
                    dest.mkdir(parents=True, exist_ok=True)
                    os.replace(f, dest / f.name)
                    moved.add(step)
        try:
            d.rmdir()
        except OSError:
            pass
    return sorted(moved)


def retire_stages(root: str | Path, stages: Iterable[int]) -> list[int]:
    """Move ``stages``' checkpoint files of an earlier run to ``checkpoints.previous/`` (replacing
    what an older run left there for those stages); returns the steps moved."""
    root = Path(root)
    stages = list(stages)
    for step, d in _steps(root / PREVIOUS):
        _drop_stages_in(d, stages)
    for s in stages:
        (root / PREVIOUS / f"complete_stage{s}.json").unlink(missing_ok=True)
        remove_temp_files(root, s)
    moved = _move_aside(root, stages, None, PREVIOUS)
    for s in stages:
        done = root / CHECKPOINTS / f"complete_stage{s}.json"
        if done.exists():
            (root / PREVIOUS).mkdir(parents=True, exist_ok=True)
            os.replace(done, root / PREVIOUS / done.name)
    return moved


def set_aside(root: str | Path, stage: int, steps: Iterable[int]) -> list[int]:
    """Move stage ``stage``'s files of ``steps`` to ``checkpoints.rolled_back/`` (beside what earlier
    resumes kept there; a step of the same number is replaced): a resume from an older step keeps
    them, never deletes them; returns the steps moved."""
    return _move_aside(Path(root), [stage], steps, ROLLED_BACK)


def _drop_stages_in(d: Path, stages: Iterable[int]) -> None:
    for s in stages:
        for f in _stage_files(d, s):
            f.unlink(missing_ok=True)
    if d.is_dir() and not any(d.iterdir()):
        shutil.rmtree(d, ignore_errors=True)


DRIVERS = ("train", "swarm")
"""Who wrote a checkpoint: the in-process trainer or swarm peers."""


def start_fresh(out_dir: str | Path, stages: Iterable[int]) -> list[int]:
    """A run without ``--resume`` owns its folder: an earlier run's checkpoints of ``stages`` move to
    ``checkpoints.previous/`` (one log line says so); returns the steps moved."""
    stages = list(stages)
    moved = retire_stages(out_dir, stages)
    if moved:
        which = f"stage {stages[0]}" if len(stages) == 1 else f"stages {stages[0]}-{stages[-1]}"
        log.info("fresh run: moved an earlier run's checkpoints (%s, steps %s) to %s", which,
                 ", ".join(map(str, moved)), Path(out_dir) / PREVIOUS)
    return moved


class StageCheckpoints:
    """One stage's checkpoint files under ``out_dir``: save with a manifest, list the verified
    (usable) steps, load, record complete steps and prune (:func:`prune_plan`). Create it
    after :func:`start_fresh` (it reads the complete steps recorded so far, and removes the
    temporary files a killed save of this stage left)."""

    def __init__(self, out_dir: str | Path, stage: int, *, driver: str, fingerprint: str, keep: int) -> None:
        if driver not in DRIVERS:
            raise ValueError(f"driver must be one of {DRIVERS}, got {driver!r}")
        self.root, self.stage = Path(out_dir), stage
        self.driver, self.fingerprint, self.keep = driver, fingerprint, keep
        self.complete: list[int] = read_complete(self.root, stage)
        """Steps known to be complete across the swarm (every stage has them)."""
        for t in remove_temp_files(self.root, stage):
            log.info("stage %d: removed %s, left by an interrupted checkpoint save", stage, t)

    def save(self, step: int, state: dict[str, Any]) -> bool:
        """Save ``step``; False (after one warning naming the path and the bytes needed) when it
        could not be saved, e.g. on a full disk: nothing of the step is left, earlier steps are
        untouched and training goes on (the next checkpoint is tried again). Raises
        :class:`CheckpointSaveError` when no checkpoint can ever be saved there."""
        try:
            save_stage(self.root, step, self.stage, state, meta={
                "driver": self.driver, "config_fingerprint": self.fingerprint, "step": step, "stage": self.stage})
        except CheckpointSaveError as exc:
            if exc.permanent:
                raise
            log.warning("%s; training goes on, the next checkpoint is tried again", exc)
            return False
        return True

    def discard(self, step: int) -> None:
        """Remove this stage's files of ``step`` (another stage could not save it)."""
        delete_stage_steps(self.root, self.stage, [step])

    def load(self, step: int) -> dict[str, Any]:
        """The state of ``step``, verified against its manifest before it is read."""
        return load_stage(self.root, step, self.stage)

    def local_steps(self) -> list[int]:
        return stage_steps(self.root, self.stage)

    def usable_steps(self) -> list[int]:
        """This stage's steps a resume may use: those whose files verify against their manifest
        (every file hashed, so call it at resume time). An incomplete or corrupt step is left out
        with one warning naming the file and why; a step of another driver or config raises
        :class:`CheckpointError` naming both. Steps written before manifests count (their load warns)."""
        usable = []
        for step in reversed(self.local_steps()):
            try:
                meta = verify_stage(self.root, step, self.stage)
            except UnusableCheckpoint as exc:
                log.warning("checkpoint step %d of stage %d is not usable, skipped: %s", step, self.stage, exc)
                continue
            where = f"checkpoint step {step} of stage {self.stage} under {self.root / CHECKPOINTS}"
            if meta.get("driver") != self.driver:
                raise CheckpointError(f"{where} was written by another driver: driver {meta.get('driver')} vs "
                                      f"{self.driver} (this run); run without --resume to start fresh")
            if meta.get("config_fingerprint") != self.fingerprint:
                raise CheckpointError(f"{where} was written with another config: fingerprint "
                                      f"{meta.get('config_fingerprint')} vs {self.fingerprint} (this run); model, "
                                      f"codec, seed, stages and tokenizer must match to resume")
            usable.append(step)
        return sorted(usable)

    def _record_complete(self) -> None:
        try:
            write_complete(self.root, self.stage, self.complete)
        except OSError as exc:  # a full disk: the record is only a hint for pruning after a restart
            log.warning("stage %d: cannot record the complete checkpoint steps under %s: %s", self.stage,
                        self.root / CHECKPOINTS, exc.strerror or exc)

    def mark_complete(self, step: int) -> list[int]:
        """Record ``step`` as complete and prune; returns the steps whose files were deleted."""
        local = self.local_steps()
        if step in self.complete or step not in local:
            return []
        self.complete = sorted({*(s for s in self.complete if s in local), step})
        self._record_complete()
        doomed = prune_plan(local, self.complete, self.keep)
        self.complete = [s for s in self.complete if s not in doomed]
        self._record_complete()
        delete_stage_steps(self.root, self.stage, doomed)
        return doomed

    def abandon(self, step: int) -> bool:
        """Delete this stage's files of ``step``, which will never be complete (stage 0 gave it up);
        a complete step is never deleted here. True when there were files."""
        if step in self.complete or step not in self.local_steps():
            return False
        self.discard(step)
        return True

    def resumed(self, step: int) -> list[int]:
        """Resuming from ``step``: it is complete; later steps of the interrupted run (every step when
        a swarm re-forming without a common checkpoint starts again from 0) are no longer this run's,
        but a resume never deletes a checkpoint: they move to ``checkpoints.rolled_back/``
        (:func:`set_aside`); returns them, for the caller's one warning (:func:`rolled_back_note`)."""
        later = set_aside(self.root, self.stage, [s for s in self.local_steps() if s > step])
        self.complete = sorted({*(s for s in self.complete if s < step), *((step,) if step > 0 else ())})
        self._record_complete()
        return later


def missing_files(empty: list[int], step: int, *, why: str, source: str, target: str) -> MissingCheckpoints:
    """The refusal of a resume because ``empty`` stages hold no checkpoint of the run while the
    others share ``step`` (SPEC §5.2 "On resume"): ``why`` says so, then the files of ``step`` to copy
    from the run.out_dir of ``source`` (``{which}``: the stages) to that of ``target``."""
    files = " and ".join(f"{CHECKPOINTS}/{_step_dir(Path(), step).name}/{_pt(Path(), k).name}, "
                         f"{_manifest(Path(), k).name}" for k in empty)
    which = f"stage{'s' if len(empty) > 1 else ''} {', '.join(map(str, empty))}"
    return MissingCheckpoints(f"{which} {why}: copy {files} from the run.out_dir of {source.format(which=which)} to "
                              f"the run.out_dir of {target}, then start it again with --resume (a swarm re-forming "
                              f"after a departure waits for it; else start every peer again with --resume; no "
                              f"checkpoint was rolled back or deleted)", empty)


def rolled_back_note(root: str | Path, step: int, later: Iterable[int], who: str) -> str:
    """The one warning of a resume from ``step`` that set ``later`` steps of ``who`` aside."""
    root = Path(root)
    return (f"{who} resumes from step {step}, older than its checkpoint steps {', '.join(map(str, sorted(later)))}: "
            f"those are kept in {root / ROLLED_BACK}, not used (to train on from one of them instead, stop the run "
            f"and move that step's folder back into {root / CHECKPOINTS} on every host before --resume)")


def save_step(stores: list[StageCheckpoints], step: int, states: list[dict[str, Any]]) -> bool:
    """Every stage's state of ``step``, all in one process (``train``): all saved, or none (the
    stages already saved are removed again when one fails, so the step is never half there)."""
    try:
        for store, state in zip(stores, states, strict=True):
            if not store.save(step, state):
                break
        else:
            return True
    except BaseException:
        for store in stores:
            store.discard(step)
        raise
    for store in stores:
        store.discard(step)
    return False


def choose_resume_step(have: dict[int, list[int]], run_steps: int, where: str) -> int:
    """The newest step every stage of ``have`` (stage -> usable steps) holds, or a
    :class:`CheckpointError` saying why there is none (or why it leaves nothing to train)."""
    common = set.intersection(*(set(v) for v in have.values())) if have else set()
    if not common:
        listing = ", ".join(f"stage {s} has {sorted(v) if v else 'none'}" for s, v in sorted(have.items()))
        if not any(have.values()):
            raise CheckpointError(f"--resume: no checkpoint to resume from under {where} ({listing}); "
                                  f"run without --resume to start fresh")
        raise CheckpointError(f"--resume: no checkpoint step that every stage has ({listing})")
    step = max(common)
    check_resume_step(step, run_steps)
    newer = sorted({s for v in have.values() for s in v if s > step})
    if newer:
        log.info("resuming from step %d, the newest step every stage holds intact (step %s: not on every stage)",
                 step, ", ".join(map(str, newer)))
    return step


def check_resume_step(step: int, run_steps: int) -> None:
    if step >= run_steps:
        raise CheckpointError(f"checkpoint at step {step} >= run.steps {run_steps}: nothing to train; "
                              f"raise run.steps")
