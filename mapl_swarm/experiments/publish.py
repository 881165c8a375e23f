"""Copy a sweep's summary and plots into the repository and into BENCHMARKS.md.

``publish(summary, plots, folder, benchmarks=..., name=...)`` copies ``summary.md`` and the PNGs
into ``folder`` (plot links rewritten to stay valid there) and, given a benchmarks file, replaces
its section between ``<!-- sweep:NAME:begin -->`` and ``<!-- sweep:NAME:end -->`` (appended at the
end when the markers are missing) with the summary and the plots shown inline. Text outside the
markers — e.g. the hand-written comparison with the paper — is never touched.
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

__all__ = ["publish", "markers"]


def markers(name: str) -> tuple[str, str]:
    return f"<!-- sweep:{name}:begin -->", f"<!-- sweep:{name}:end -->"


def publish(summary: Path, plots: list[Path], folder: str | Path, *, benchmarks: str | Path | None = None,
            name: str = "sweep") -> list[Path]:
    folder = Path(folder)
    (folder / "plots").mkdir(parents=True, exist_ok=True)
    written = []
    for p in plots:
        dst = folder / "plots" / p.name
        shutil.copyfile(p, dst)
        written.append(dst)
    text = Path(summary).read_text()
    dst = folder / "summary.md"
    dst.write_text(text)  # links are plots/<name>.png in both places
    written.append(dst)
    if benchmarks is not None:
        bench = Path(benchmarks)
        rel = Path(os.path.relpath(folder, bench.parent)).as_posix()
        body = re.sub(r"\]\(plots/", f"]({rel}/plots/", text)
        body = re.sub(r"^## ", "### ", body, flags=re.M)  # nest under the file's own section heading
        body = re.sub(r"^### Table", "#### Table", body, flags=re.M)
        body = body.replace("### All configurations", "#### All configurations")
        images = "\n".join(f"![{p.stem}]({rel}/plots/{p.name})" for p in plots)
        begin, end = markers(name)
        section = f"{begin}\n{body.rstrip()}\n\n{images}\n{end}"
        old = bench.read_text() if bench.exists() else ""
        if begin in old and end in old:
            new = re.sub(re.escape(begin) + ".*?" + re.escape(end), lambda _: section, old, flags=re.S)
        else:
            new = old.rstrip() + "\n\n" + section + "\n"
        bench.write_text(new)
        written.append(bench)
    return written
