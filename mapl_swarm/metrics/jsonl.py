"""Append-only JSONL metrics and the run manifest (what produced a result)."""

from __future__ import annotations

import json
import logging
import platform
import subprocess
import time
from importlib import metadata
from pathlib import Path
from typing import Any

from mapl_swarm.when import iso_time

__all__ = ["JsonlWriter", "run_manifest"]

log = logging.getLogger(__name__)


class JsonlWriter:
    """One JSON object per line, flushed per record so a crash loses nothing written.

    A record that cannot be written (a full disk, an I/O error) is dropped with one warning naming
    the file and the error, and training goes on (its state is in the checkpoints); the next
    record that gets written says how many were lost (``dropped``)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fh = self.path.open("a", encoding="utf-8")
        self.dropped = 0
        """Records lost to write errors so far."""
        self._failing = False

    def write(self, record: dict[str, Any]) -> None:
        record = {"time": round(time.time(), 3), **record}
        line = json.dumps(record, sort_keys=False) + "\n"
        try:
            if self._failing:  # start over on a clean line: a failed write may have left part of one
                self._fh = self.path.open("a", encoding="utf-8")
                self._fh.write("\n")
            self._fh.write(line)
            self._fh.flush()
        except OSError as exc:
            self.dropped += 1
            if not self._failing:
                log.warning("metrics record not written to %s (%s); training goes on, records are dropped until "
                            "it can be written again", self.path, exc.strerror or exc)
            self._failing = True
            try:
                self._fh.close()  # what the buffer still holds is part of the lost record(s)
            except OSError:
                pass
            return
        if self._failing:
            log.warning("metrics written to %s again (%d record(s) lost)", self.path, self.dropped)
            self._failing = False

    def close(self) -> None:
        try:
            self._fh.close()
        except OSError as exc:
            log.warning("metrics file %s not closed cleanly: %s", self.path, exc.strerror or exc)

    def __enter__(self) -> "JsonlWriter":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _git_commit() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5,
                             cwd=Path(__file__).resolve().parent)
        return out.stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def _git_dirty() -> bool | None:
    try:
        out = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                             text=True, timeout=5, cwd=Path(__file__).resolve().parent)
        return bool(out.stdout.strip()) if out.returncode == 0 else None
    except (OSError, subprocess.SubprocessError):
        return None


def run_manifest(config: dict[str, Any], **extra: Any) -> dict[str, Any]:
    """Commit, package versions, machine and config of a run."""
    versions = {}
    for pkg in ("torch", "transformers", "tokenizers", "numpy", "mapl_swarm"):
        try:
            versions[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            versions[pkg] = "not installed"
    return {
        "commit": _git_commit(),
        "commit_dirty": _git_dirty(),
        "versions": versions,
        "python": platform.python_version(),
        "machine": f"{platform.machine()} {platform.system()} {platform.release()}",
        "created": iso_time(time.time()),
        "config": config,
        **extra,
    }
