"""A metrics record that cannot be written (a full disk) costs one warning, not the run."""

from __future__ import annotations

import errno
import json
import logging

from mapl_swarm.metrics.jsonl import JsonlWriter


class _FullDisk:
    """A file whose every write fails with ENOSPC (what a full disk gives on flush)."""

    def write(self, text: str) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")

    def flush(self) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    def close(self) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")


def test_records_are_dropped_with_one_warning_and_writing_resumes_when_space_returns(tmp_path, caplog,
                                                                                      monkeypatch):
    path = tmp_path / "metrics.jsonl"
    writer = JsonlWriter(path)
    writer.write({"step": 1, "loss": 5.0})
    writer._fh.close()
    writer._fh = _FullDisk()
    with caplog.at_level(logging.WARNING, logger="mapl_swarm.metrics.jsonl"):
        with monkeypatch.context() as full:
            full.setattr(type(path), "open", lambda self, *a, **k: _FullDisk())  # reopening finds no room either
            writer.write({"step": 2, "loss": 4.9})
            writer.write({"step": 3, "loss": 4.8})
        assert writer.dropped == 2
        assert [r.getMessage() for r in caplog.records] == [
            f"metrics record not written to {path} (No space left on device); training goes on, records are "
            f"dropped until it can be written again"]
        writer.write({"step": 4, "loss": 4.7})  # the disk has room again: the file is opened anew
        assert caplog.records[-1].getMessage() == f"metrics written to {path} again (2 record(s) lost)"
    writer.close()
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    assert [(r["step"], r["loss"]) for r in records] == [(1, 5.0), (4, 4.7)]
