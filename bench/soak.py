"""Soak benchmark: a local swarm for ``--minutes`` with every peer's memory, the swarm's progress and
the reject counters sampled throughout.

    python bench/soak.py [--minutes 30] [--interval-s 10] [--codec mapl_vq] [--set SECTION.KEY=VALUE ...]

Starts ``mapl-swarm launch`` (its own process group, a log file and ``run.out_dir`` under
``--run-dir``) on a small CPU config (tiny preset, T=128, 4 stages with one torch thread each,
``mapl_vq`` rank 64 so the wire, the codebook slices and the admission checks all run, periodic
validation every 50 steps and checkpoints every 100, ``run.steps`` far beyond the duration;
``--set`` overrides any of it). The clock starts at the swarm's first step (stage 0's first metrics
record); after ``--minutes`` the launcher gets one SIGINT, which drains the swarm, and the script
waits for it to exit.

Every ``--interval-s``, from ``/proc`` (no psutil): per stage peer process (a child of the launcher
whose command is ``mapl_swarm peer ... --stage K``) its RSS, peak RSS (``VmHWM``), threads and open
files, and the same summed over its helpers (descendants: its DHT process); the launcher with its
DHT bootstrap; the steps done and tokens from stage 0's ``metrics_stage0.jsonl``; the codebook-slice
reject counters of every stage's metrics (``vq_*_rx_rejected``); rejected messages as the peers log
them (``dropped a message ... (code, N so far)``: every one of the first 20 of a code, then powers
of two, so a lower bound while running: the peers expose no live counter). The exact reject counts
(``rejects``, ``bad_frames``), codebook rejects and ``peak_rss_mb`` come from the peers' result files
at the end.

Memory growth after warm-up, per process: median RSS over the window just after the warm-up
(``min(20% of the run, 5 min)``) against the median over the run's final window (10% of the run);
growth % = (final - warm) / warm * 100, to stay under ``--max-growth-pct`` (5) for every stage.

Writes every sample and the summary to ``--out`` (default ``bench/results/soak.json``) and prints
the table. Exit status: 0, 1 when the swarm failed or did not drain, 3 when a stage grew too much.
Ctrl-C (or SIGTERM) ends the soak early and drains the swarm the same way (a second one stops the
peers at once, a third kills the launcher); a launcher that does not exit in time is stopped, then
killed, and any process of the swarm still running after it is killed and named (``orphans_killed``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]

__all__ = ["parse_status", "parse_stat", "peer_stage", "codebook_rejects", "parse_reject", "LineTail",
           "soak_windows", "growth", "rate", "summarize", "summary_table", "snapshot", "stop_swarm", "run_soak"]

CONFIG = """
preset = "tiny"
[model]
context_length = 128
[compression]
codec = "{codec}"
rank = 64
anchor_rank = 64
[data]
cache_dir = "{cache}"
[run]
steps = 10000000
out_dir = "{out}"
run_id = "soak"
[pipeline]
num_stages = {stages}
micro_batch_size = 2
num_micro_batches = 4
[eval]
interval_steps = 50
batches = 2
[checkpoint]
interval_steps = 100
[metrics]
log_interval_steps = 1
[runtime]
threads = 1
"""

_MIB = 1024.0
_STATUS_KB = {"VmRSS": "rss_mb", "VmHWM": "hwm_mb", "RssAnon": "anon_mb"}
_REJECT = re.compile(r"\b(stage\d+): dropped a message from .*\((\w+), (\d+) so far\)\s*$")


# ---------------------------------------------------------------- /proc and log parsing (pure)
def parse_status(text: str) -> dict[str, float]:
    """``/proc/<pid>/status`` -> ``rss_mb``, ``hwm_mb``, ``anon_mb`` (MiB) and ``threads``; fields
    missing from the text are left out."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key in _STATUS_KB:
            out[_STATUS_KB[key]] = int(value.split()[0]) / _MIB  # kB
        elif key == "Threads":
            out["threads"] = int(value)
    return out


def parse_stat(text: str) -> tuple[int, int]:
    """``/proc/<pid>/stat`` -> (parent pid, start time in clock ticks since boot). The command name
    in parentheses may hold spaces and parentheses itself: fields are counted after the last ')'."""
    fields = text[text.rindex(")") + 2:].split()
    return int(fields[1]), int(fields[19])  # fields 4 and 22 of proc(5)


def peer_stage(argv: list[str]) -> int | None:
    """The stage of a ``mapl_swarm peer ... --stage K`` command line (None for anything else)."""
    if "peer" not in argv or "--stage" not in argv:
        return None
    i = argv.index("--stage")
    return int(argv[i + 1]) if i + 1 < len(argv) and argv[i + 1].isdigit() else None


def codebook_rejects(record: dict[str, Any], into: dict[str, float]) -> None:
    """The cumulative codebook-slice reject counters of a stage's metrics record (``vq_*_rx_rejected``)
    into ``into``."""
    into.update({k: v for k, v in record.items() if k.endswith("_rx_rejected")})


def parse_reject(line: str) -> tuple[int, str, int] | None:
    """A peer's reject log line -> (stage, code, count so far); None for any other line."""
    m = _REJECT.search(line)
    return (int(m.group(1)[5:]), m.group(2), int(m.group(3))) if m else None


class LineTail:
    """The complete lines appended to a file since the last :meth:`read` (a line still being written
    waits for its newline; a missing file has no lines yet)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._offset = 0
        self._partial = b""

    def read(self) -> list[str]:
        try:
            with self.path.open("rb") as fh:
                fh.seek(self._offset)
                data = fh.read()
        except FileNotFoundError:
            return []
        self._offset += len(data)
        *lines, self._partial = (self._partial + data).split(b"\n")
        return [line.decode("utf-8", "replace") for line in lines]


# ---------------------------------------------------------------- analysis (pure)
def soak_windows(duration_s: float) -> tuple[float, float]:
    """(warm-up, window) in seconds: warm-up the first 20% of the run or 5 minutes, whichever is
    smaller; each window 10% of the run."""
    return min(0.2 * duration_s, 300.0), 0.1 * duration_s


def _median_in(series: list[tuple[float, float]], lo: float, hi: float) -> float | None:
    vals = [v for t, v in series if lo <= t <= hi]
    return statistics.median(vals) if vals else None


def growth(series: list[tuple[float, float]], warmup_s: float, window_s: float) -> dict[str, Any]:
    """Memory growth of one process from its ``(t_s, rss_mb)`` samples (t from the first step):
    median over ``[warmup, warmup + window]`` vs median over the last ``window`` before the final
    sample; growth % None when either window has no sample or the two overlap (too short a soak)."""
    if not series:
        return {"warm_mb": None, "final_mb": None, "growth_pct": None, "peak_mb": None}
    end = max(t for t, _ in series)
    warm = _median_in(series, warmup_s, warmup_s + window_s)
    final = _median_in(series, end - window_s, end)
    apart = end - window_s > warmup_s + window_s
    pct = (final - warm) / warm * 100.0 if apart and warm and final is not None else None
    return {"warm_mb": warm, "final_mb": final, "growth_pct": pct, "peak_mb": max(v for _, v in series)}


def rate(points: list[tuple[float, float]], lo: float, hi: float) -> float | None:
    """Average rate of a cumulative counter (``(t_s, count)`` points) between the first and last point
    inside ``[lo, hi]``; None with fewer than two points there."""
    inside = [(t, c) for t, c in points if lo <= t <= hi]
    if len(inside) < 2 or inside[-1][0] <= inside[0][0]:
        return None
    return (inside[-1][1] - inside[0][1]) / (inside[-1][0] - inside[0][0])


def summarize(samples: list[dict], duration_s: float, results: dict[str, dict], max_growth_pct: float) -> dict:
    """Per process role: growth (:func:`growth`), threads and open files first/last; the swarm's
    tokens/s after warm-up and in each window; rejects per stage (result files, else the logged
    lower bound); ``ok`` when every stage peer grew less than ``max_growth_pct``."""
    warmup_s, window_s = soak_windows(duration_s)
    timed = [s for s in samples if s["t_s"] is not None and s["t_s"] >= 0]
    roles = sorted({r for s in timed for r in s["procs"]}, key=_role_order)
    procs = {}
    for role in roles:
        mine = [(s["t_s"], s["procs"][role]) for s in timed if role in s["procs"]]
        g = growth([(t, p["rss_mb"]) for t, p in mine], warmup_s, window_s)
        g["hwm_mb"] = max(p.get("hwm_mb", 0.0) for _, p in mine)
        for key in ("threads", "fds"):
            g[key] = [mine[0][1].get(key), mine[-1][1].get(key)]
        procs[role] = g
    progress = [(s["t_s"], s["tokens"]) for s in timed]
    end = timed[-1]["t_s"] if timed else 0.0
    last = timed[-1] if timed else {}
    logged, live = last.get("logged_rejects", {}), last.get("codebook_rejects", {})
    rejects = {}
    for key in sorted({*results, *logged, *live}, key=_role_order):
        res = results.get(key)
        if res:
            rejects[key] = {"total": res.get("bad_frames") or 0, "by_code": res.get("rejects") or {},
                            "codebook_slices": sum((res.get("codebooks_rejected") or {}).values()), "source": "result"}
        else:
            rejects[key] = {"total": sum(logged.get(key, {}).values()), "by_code": logged.get(key, {}),
                            "codebook_slices": sum(live.get(key, {}).values()), "source": "log and metrics"}
    stages = [g["growth_pct"] for role, g in procs.items() if role.startswith("stage") and "/" not in role]
    return {
        "warmup_s": warmup_s, "window_s": window_s, "soaked_s": end, "procs": procs,
        "steps": timed[-1]["steps"] if timed else 0, "tokens": timed[-1]["tokens"] if timed else 0,
        "tokens_per_s_after_warmup": rate(progress, warmup_s, end),
        "tokens_per_s_warm_window": rate(progress, warmup_s, warmup_s + window_s),
        "tokens_per_s_final_window": rate(progress, end - window_s, end),
        "rejects": rejects, "max_growth_pct": max_growth_pct,
        "ok": bool(stages) and all(p is not None and p < max_growth_pct for p in stages),
    }


def _role_order(role: str) -> tuple[int, str]:
    m = re.match(r"stage(\d+)", role)
    return (int(m.group(1)) if m else 1 << 30, role)


def _f(v: float | None, fmt: str) -> str:
    return "-" if v is None else format(v, fmt)


def summary_table(summary: dict) -> str:
    """The soak's printed table (Markdown): one row per process, then throughput, rejects, the verdict."""
    lines = ["| process | warm RSS MiB | final RSS MiB | growth % | peak RSS MiB (sampled / VmHWM) | threads | fds |",
             "|---|---|---|---|---|---|---|"]
    for role, g in summary["procs"].items():
        lines.append(f"| {role} | {_f(g['warm_mb'], '.1f')} | {_f(g['final_mb'], '.1f')} | "
                     f"{_f(g['growth_pct'], '+.2f')} | {_f(g['peak_mb'], '.1f')} / {_f(g['hwm_mb'], '.1f')} | "
                     f"{g['threads'][0]} -> {g['threads'][1]} | {g['fds'][0]} -> {g['fds'][1]} |")
    s = summary
    lines += ["", f"soaked {s['soaked_s'] / 60:.1f} min after the first step (warm-up {s['warmup_s']:.0f} s, "
                  f"windows {s['window_s']:.0f} s): {s['steps']} steps, {s['tokens']:,} tokens; tokens/s after "
                  f"warm-up {_f(s['tokens_per_s_after_warmup'], '.1f')} (warm window "
                  f"{_f(s['tokens_per_s_warm_window'], '.1f')}, final window {_f(s['tokens_per_s_final_window'], '.1f')})"]
    rejects = ", ".join(f"{k} {v['total']}" + (f" {v['by_code']}" if v["by_code"] else "")
                        + f" + {v['codebook_slices']:g} codebook slices ({v['source']})" for k, v in s["rejects"].items())
    lines.append(f"rejected messages per stage: {rejects or 'none recorded'}")
    limit = f"{s['max_growth_pct']:g}%"
    lines.append(f"PASS: every stage peer's RSS growth after warm-up < {limit}" if s["ok"]
                 else f"FAIL: a stage peer's RSS grew >= {limit} after warm-up (or was not measured)")
    return "\n".join(lines)


# ---------------------------------------------------------------- processes
def _read(path: str) -> str | None:
    try:
        with open(path, encoding="utf-8", errors="replace") as fh:
            return fh.read()
    except OSError:  # the process exited meanwhile (or is not ours to read)
        return None


def _process_table() -> dict[int, tuple[int, int]]:
    """pid -> (parent pid, start time) of every process now."""
    table = {}
    for name in os.listdir("/proc"):
        if name.isdigit() and (text := _read(f"/proc/{name}/stat")) is not None:
            table[int(name)] = parse_stat(text)
    return table


def _descendants(table: dict[int, tuple[int, int]], pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        parent = todo.pop()
        kids = [p for p, (ppid, _) in table.items() if ppid == parent]
        out += kids
        todo += kids
    return out


def _measure(pids: list[int]) -> dict[str, Any] | None:
    """Summed status figures and open files of ``pids`` (None when none could be read)."""
    total: dict[str, Any] = {"pids": []}
    for pid in pids:
        text = _read(f"/proc/{pid}/status")
        if text is None:
            continue
        for k, v in parse_status(text).items():
            total[k] = total.get(k, 0) + v
        try:
            total["fds"] = total.get("fds", 0) + len(os.listdir(f"/proc/{pid}/fd"))
        except OSError:
            pass
        total["pids"].append(pid)
    return total if total["pids"] else None


def snapshot(launcher: int, seen: dict[int, int]) -> dict[str, dict]:
    """Per role (``stageK``, ``stageK/helpers``, ``launcher``, ``launcher/helpers``) the figures of
    :func:`_measure`; every pid met is added to ``seen`` (pid -> start time) for the orphan check."""
    table = _process_table()
    if launcher not in table:
        return {}
    groups: dict[str, list[int]] = {"launcher": [launcher], "launcher/helpers": []}
    for kid in (p for p, (ppid, _) in table.items() if ppid == launcher):
        stage = peer_stage((_read(f"/proc/{kid}/cmdline") or "").split("\0"))
        if stage is None:
            groups["launcher/helpers"] += [kid, *_descendants(table, kid)]
        else:
            groups[f"stage{stage}"] = [kid]
            groups[f"stage{stage}/helpers"] = _descendants(table, kid)
    for pids in groups.values():
        seen.update({p: table[p][1] for p in pids if p in table})
    return {role: m for role, pids in groups.items() if (m := _measure(pids)) is not None}


def _alive(pid: int, start: int) -> bool:
    text = _read(f"/proc/{pid}/stat")
    return text is not None and parse_stat(text)[1] == start and text[text.rindex(")") + 2] != "Z"


def stop_swarm(proc: subprocess.Popen, seen: dict[int, int], drain_timeout_s: float) -> dict[str, Any]:
    """SIGINT (a drain) and wait; then a second SIGINT (peers stop at once) and 30 s; then SIGKILL to
    the launcher's process group. Afterwards any process of the swarm still running (same pid and
    start time as seen) is an orphan: killed and named. A Ctrl-C while waiting skips to the next stage."""
    how = "exited"
    for sig, wait_s, label in ((signal.SIGINT, drain_timeout_s, "drained"), (signal.SIGINT, 30.0, "stopped"),
                               (signal.SIGKILL, 10.0, "killed")):
        if proc.poll() is not None:
            break
        how = label
        try:
            os.killpg(proc.pid, sig) if sig == signal.SIGKILL else proc.send_signal(sig)
            proc.wait(wait_s)
        except (subprocess.TimeoutExpired, KeyboardInterrupt):
            continue
        except ProcessLookupError:
            break
    code = proc.wait()
    orphans = []
    deadline = time.monotonic() + 15.0  # peers' helpers close after the launcher returns
    while time.monotonic() < deadline and (orphans := [p for p, st in seen.items() if _alive(p, st)]):
        time.sleep(0.5)  # waiting for processes to exit, with a deadline
    for pid in orphans:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return {"launcher_status": code, "stop": how, "orphans_killed": orphans}


class Progress:
    """What the swarm's files say so far: steps done and tokens (stage 0's metrics), the codebook-slice
    reject counters (every stage's metrics) and the rejects the peers logged (the launcher's log)."""

    def __init__(self, out_dir: Path, log_path: Path, stages: int) -> None:
        self.metrics = [LineTail(out_dir / f"metrics_stage{k}.jsonl") for k in range(stages)]
        self.log = LineTail(log_path)
        self.steps = self.tokens = 0
        self.logged: dict[str, dict[str, int]] = {}
        self.codebook: dict[str, dict[str, float]] = {}

    def read(self) -> dict[str, Any]:
        for k, tail in enumerate(self.metrics):
            for rec in (json.loads(line) for line in tail.read() if line.strip()):
                if k == 0 and "tokens" in rec:
                    self.steps, self.tokens = int(rec["step"]), self.tokens + int(rec["tokens"])
                codebook_rejects(rec, self.codebook.setdefault(f"stage{k}", {}))
        for line in self.log.read():
            if (r := parse_reject(line)) is not None:
                self.logged.setdefault(f"stage{r[0]}", {})[r[1]] = r[2]
        return {"steps": self.steps, "tokens": self.tokens,
                "logged_rejects": {k: dict(v) for k, v in self.logged.items()},
                "codebook_rejects": {k: dict(v) for k, v in self.codebook.items()}}


def read_results(out_dir: Path, stages: int) -> dict[str, dict]:
    """What each peer's result file says (peers that wrote none are left out)."""
    results = {}
    for k in range(stages):
        path = out_dir / f"peer_stage{k}.json"
        if path.exists():
            res = json.loads(path.read_text())
            results[f"stage{k}"] = {key: res.get(key) for key in ("end", "drained_at", "end_note", "bad_frames",
                                                                  "rejects", "errors", "peak_rss_mb", "tokens")}
            results[f"stage{k}"]["codebooks_rejected"] = (res.get("codebooks") or {}).get("rejected")
    return results


def run_soak(args: argparse.Namespace, run_dir: Path) -> dict[str, Any]:
    """Start the swarm, sample it until ``--minutes`` after its first step (or Ctrl-C / SIGTERM, or the
    launcher's early exit), stop it (:func:`stop_swarm`) and collect the peers' result files."""
    from mapl_swarm.procs import die_with_parent  # standard library only

    out, log_path = run_dir / "out", run_dir / "launch.log"
    cfg_path = run_dir / "soak.toml"
    cfg_path.write_text(CONFIG.format(codec=args.codec, cache=Path(args.cache_dir).resolve(), out=out,
                                      stages=args.stages))
    cmd = [sys.executable, "-m", "mapl_swarm", "launch", "--config", str(cfg_path), "--quiet", "--log-level", "INFO"]
    for s in args.set or []:
        cmd += ["--set", s]
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    samples: list[dict] = []
    seen: dict[int, int] = {}
    progress = Progress(out, log_path, args.stages)
    t_launch, t_first = time.monotonic(), None
    interrupted = failed = False
    every = max(1, round(60 / args.interval_s))
    with log_path.open("wb") as log_fh:
        # a process group of its own: Ctrl-C reaches this script, which drains the swarm itself
        proc = subprocess.Popen(cmd, stdout=log_fh, stderr=subprocess.STDOUT, env=env, process_group=0,
                                preexec_fn=die_with_parent())
        previous = signal.signal(signal.SIGTERM, signal.default_int_handler)  # SIGTERM ends the soak like Ctrl-C
        try:
            while True:
                now = time.monotonic()
                procs = snapshot(proc.pid, seen)
                sample = progress.read()
                if t_first is None and sample["steps"]:
                    t_first = now
                t_s = None if t_first is None else round(now - t_first, 3)
                samples.append({"wall_s": round(now - t_launch, 3), "t_s": t_s, **sample, "procs": procs})
                if proc.poll() is not None:
                    failed = True
                    print(f"soak: the launcher exited early (status {proc.returncode}); see {log_path}")
                    break
                if t_first is None and now - t_launch > args.startup_timeout_s:
                    failed = True
                    print(f"soak: no step within {args.startup_timeout_s:g} s; see {log_path}")
                    break
                if t_s is not None and t_s >= args.minutes * 60:
                    break
                if t_s is not None and len(samples) % every == 0:
                    rss = ", ".join(f"{r} {p['rss_mb']:.0f} MiB" for r, p in procs.items() if "/" not in r)
                    print(f"soak: {t_s / 60:.1f} / {args.minutes:g} min, step {sample['steps']}, {rss}", flush=True)
                time.sleep(max(0.0, now + args.interval_s - time.monotonic()))  # the sampling period
        except KeyboardInterrupt:
            interrupted = True
            print("soak: interrupted; draining the swarm (again to stop it)", flush=True)
        finally:
            try:
                stop = stop_swarm(proc, seen, args.drain_timeout_s)
            finally:
                signal.signal(signal.SIGTERM, previous)
    results = read_results(out, args.stages)
    drained = len(results) == args.stages and all(r["end"] in ("drained", "finished") for r in results.values())
    return {"command_line": cmd, "run_dir": str(run_dir), "samples": samples, "results": results,
            "interrupted": interrupted, "failed": failed or not drained or stop["launcher_status"] != 0, **stop}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--minutes", type=float, default=30.0, help="soak length, from the swarm's first step")
    ap.add_argument("--interval-s", type=float, default=10.0, help="sampling period")
    ap.add_argument("--codec", default="mapl_vq")
    ap.add_argument("--stages", type=int, default=4)
    ap.add_argument("--set", action="append", metavar="SECTION.KEY=VALUE", help="passed on to mapl-swarm launch")
    ap.add_argument("--max-growth-pct", type=float, default=5.0)
    ap.add_argument("--run-dir", help="the swarm's log and run.out_dir (default: a new temporary folder, kept)")
    ap.add_argument("--cache-dir", default=str(ROOT / ".mapl_cache"), help="data.cache_dir")
    ap.add_argument("--startup-timeout-s", type=float, default=900.0)
    ap.add_argument("--drain-timeout-s", type=float, default=300.0)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "soak.json"))
    args = ap.parse_args()
    command = (f"python bench/soak.py --minutes {args.minutes:g} --interval-s {args.interval_s:g} "
               f"--codec {args.codec} --stages {args.stages}" + "".join(f" --set {s}" for s in args.set or []))
    run_dir = Path(args.run_dir) if args.run_dir else Path(tempfile.mkdtemp(prefix="mapl-soak-"))
    run_dir.mkdir(parents=True, exist_ok=True)
    print(f"soak: {command}; swarm log and out_dir under {run_dir}", flush=True)
    run = run_soak(args, run_dir)
    timed = [x["t_s"] for x in run["samples"] if x["t_s"] is not None]
    duration_s = min(args.minutes * 60, max(timed, default=0.0))  # a soak ended early: its windows shrink
    summary = summarize(run["samples"], duration_s, run["results"], args.max_growth_pct)
    from mapl_swarm.metrics import run_manifest

    manifest = run_manifest({"toml": (run_dir / "soak.toml").read_text(), "set": args.set or [],
                             "codec": args.codec, "stages": args.stages, "minutes": args.minutes,
                             "interval_s": args.interval_s},
                            cores=os.cpu_count(), platform=platform.platform(), date=time.strftime("%Y-%m-%d"),
                            omp_num_threads=os.environ.get("OMP_NUM_THREADS"))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"command": command, "manifest": manifest, "summary": summary, **run}, indent=1))
    print(summary_table(summary))
    print(f"swarm: {run['stop']}, launcher status {run['launcher_status']}, orphans killed "
          f"{run['orphans_killed'] or 'none'}" + (", interrupted" if run["interrupted"] else "") + f"; results in {out}")
    if run["failed"]:
        return 1
    return 0 if summary["ok"] else 3


if __name__ == "__main__":
    sys.exit(main())
