"""Helpers of ``bench/gpu_check.sh`` (torch-free): a short grid slice, part results, the summary.

    python bench/gpu_check.py grid-slice --grid bench/grids/gpu-small.toml --steps 8 --out FILE [--set K=V]...
    python bench/gpu_check.py swarm-result --run-dir DIR --stages P --out FILE
    python bench/gpu_check.py sweep-result --sweep-dir DIR --out FILE
    python bench/gpu_check.py finish --part NAME --json FILE --rc RC ... (status ok / failed / skipped)
    python bench/gpu_check.py summary --dir DIR --label TEXT ... (DIR/summary.md and DIR/gpu_check.json)

Every part's JSON carries ``part``, ``title``, ``status`` (ok | failed | skipped), ``reason`` (when
not ok; a failed part adds its log's ``log_tail``), ``label`` (what its figures are: a measurement,
or "smoke (CPU, not a measurement)"), ``limit_s``, ``wall_s`` and its ``commands`` (each with its
wall time and exit status); a failed part keeps whatever figures its command wrote before it stopped.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from mapl_swarm.cli import parse_overrides  # noqa: E402  (torch-free)
from mapl_swarm.config.catalog import uncompressed_codec  # noqa: E402

PARTS = (  # (part, file, title) in the order the script runs them
    ("vq_speed", "vq_speed.json", "VQ encoder speed (eager, compiled) and share of a middle stage"),
    ("boundary_overhead", "boundary_overhead.json", "Boundary overhead per codec vs none (middle stage fwd+bwd)"),
    ("swarm", "swarm.json", "Local swarm (launch, one process per stage, ZeroMQ + DHT)"),
    ("sweep", "sweep.json", "Grid slice (mapl-swarm sweep --only)"),
)


# ---------------------------------------------------------------- grid slice
def _toml_value(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v)  # a JSON string is a valid TOML basic string
    if isinstance(v, list):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    raise TypeError(f"cannot write {v!r} as a TOML value")


def _toml_table(d: dict, prefix: str, out: list[str]) -> None:
    scalars = {k: v for k, v in d.items() if not isinstance(v, dict) and not _is_table_array(v)}
    if prefix and scalars:
        out.append(f"\n[{prefix}]")
    out += [f"{k} = {_toml_value(v)}" for k, v in scalars.items()]
    for k, v in d.items():
        if isinstance(v, dict):
            _toml_table(v, f"{prefix}.{k}" if prefix else k, out)
    for k, v in d.items():
        if _is_table_array(v):
            for item in v:
                out.append(f"\n[[{f'{prefix}.{k}' if prefix else k}]]")
                out += [f"{ik} = {_toml_value(iv)}" for ik, iv in item.items()]


def _is_table_array(v) -> bool:
    return isinstance(v, list) and bool(v) and all(isinstance(x, dict) for x in v)


def to_toml(d: dict) -> str:
    """A grid dict as TOML (scalars, lists, nested tables, arrays of flat tables: what grids use)."""
    out: list[str] = []
    _toml_table(d, "", out)
    return "\n".join(out).lstrip("\n") + "\n"


def _merge(into: dict, over: dict) -> None:
    for k, v in over.items():
        if isinstance(v, dict) and isinstance(into.get(k), dict):
            _merge(into[k], v)
        else:
            into[k] = v


def cmd_grid_slice(args: argparse.Namespace) -> None:
    from mapl_swarm.config import config_from_dict
    from mapl_swarm.experiments.grid import grid_from_dict

    raw = tomllib.loads(args.grid.read_text())
    _merge(raw.setdefault("base", {}), parse_overrides(args.set))
    per_step = config_from_dict(json.loads(json.dumps(raw["base"])), f"{args.grid} [base]").tokens_per_step
    raw["tokens_per_run"] = args.steps * per_step
    raw["name"] = f"{raw['name']}-slice"
    raw["description"] = (f"{args.steps}-step slice of {args.grid} (gpu_check.sh; base overrides: "
                          f"{' '.join(args.set) or 'none'}). " + raw.get("description", ""))
    if args.out_dir:
        raw["out_dir"] = str(args.out_dir)
    text = to_toml(raw)
    grid_from_dict(tomllib.loads(text), str(args.out))  # the slice must load as strictly as the original
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    print(f"wrote {args.out}: {args.steps} steps x {per_step} tokens per run")


# ---------------------------------------------------------------- part results
def _write(path: Path, obj: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2) + "\n")
    tmp.replace(path)


def _steady(tokens: int, report_times_s: list[float]) -> float | None:
    """Tokens/s over the steps after the first (None with fewer than 2 steps)."""
    n = len(report_times_s)
    if n < 2 or report_times_s[-1] <= report_times_s[0]:
        return None
    return tokens / n * (n - 1) / (report_times_s[-1] - report_times_s[0])


def cmd_swarm_result(args: argparse.Namespace) -> None:
    from mapl_swarm.launch import summarize

    s = summarize(args.run_dir, args.stages)
    wall = max(s.wall_s, 1e-9)
    links = [{k: v for k, v in link.items() if not k.startswith("shaper")} for link in s.links]
    mean = lambda key: sum(link[key] for link in links) / len(links)  # noqa: E731
    _write(args.out, {
        "benchmark": "swarm", "command": args.command, "stages": args.stages, "train_steps": len(s.train_losses),
        "tokens": s.tokens, "swarm_wall_s": s.wall_s, "tokens_per_s": s.tokens / wall,
        "tokens_per_s_note": "stage 0's tokens over its wall time from the handshake to the end (warm-up, "
                             "k-means init and the final validation included); steady_tokens_per_s: the steps "
                             "after the first, from the times their losses reached stage 0",
        "steady_tokens_per_s": _steady(s.tokens, s.report_times_s),
        "train_losses": s.train_losses, "val_history": s.val_history,
        "bytes_per_token": {k: mean(k) for k in ("forward_payload", "backward_payload", "forward_wire",
                                                 "backward_wire")},
        "links": links,
    })
    print(f"swarm: {len(s.train_losses)} steps, {s.tokens / wall:.0f} tokens/s, "
          f"{mean('forward_wire'):.1f} / {mean('backward_wire'):.1f} B/token on the wire fwd/bwd (mean over links)")


def cmd_sweep_result(args: argparse.Namespace) -> None:
    runs = []
    for p in sorted((args.sweep_dir / "runs").glob("*.json")):
        r = json.loads(p.read_text())
        runs.append({k: r.get(k) for k in ("run_id", "codec", "rank", "stages", "steps", "tokens", "val_loss",
                                           "initial_val_loss", "train_loss", "act_bytes_per_token", "wall_s",
                                           "tokens_per_s", "device")})
    ref = uncompressed_codec()
    base = next((r["val_loss"] for r in runs if r["codec"] == ref and r["val_loss"]), None)  # one seed
    for r in runs:
        if base and r["val_loss"] is not None:
            r["delta_pct_vs_none"] = 100 * (r["val_loss"] / base - 1)
    summary = args.sweep_dir / "summary.md"
    _write(args.out, {"benchmark": "sweep", "command": args.command, "grid": str(args.grid or ""),
                      "only": args.only, "runs": runs,
                      "sweep_summary": str(summary) if summary.exists() else None})
    print(f"sweep: {len(runs)} finished runs: " + ", ".join(
        f"{r['run_id']} val {r['val_loss']:.3f}" for r in runs if r["val_loss"] is not None))


def _steps(path: Path | None) -> list[dict]:
    if path is None or not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _tail(path: Path | None, lines: int) -> str:
    if path is None or not path.exists():
        return ""
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


def cmd_finish(args: argparse.Namespace) -> None:
    """Stamp a part's JSON with its status: ok (exit 0 and a parseable JSON), skipped (with the
    reason) or failed (why: time box, exit status, or no JSON; with the log's last lines)."""
    title = dict((p, t) for p, _, t in PARTS).get(args.part, args.part)
    data: dict = {}
    problem = ""
    if args.json.exists():
        try:
            data = json.loads(args.json.read_text())
        except json.JSONDecodeError as exc:
            problem = f"{args.json.name} is not valid JSON ({exc})"
    commands = _steps(args.steps_file)
    failed = next((s for s in commands if s["rc"] != 0), None)
    if args.skip_reason:
        status, reason = "skipped", args.skip_reason
    elif args.rc == 0 and data and not problem:
        status, reason = "ok", ""
    else:
        status = "failed"
        if failed and failed["rc"] in (124, 137):
            reason = (f"timed out: the part's {args.limit_s:g} s time box ran out in `{failed['command']}`"
                      f" after {failed['wall_s']:.0f} s")
        elif failed:
            reason = f"exit status {failed['rc']} from `{failed['command']}`"
        else:
            reason = problem or f"exit status {args.rc} and no result file {args.json.name}"
        data["log_tail"] = _tail(args.log, 20)
    data.update({"part": args.part, "title": title, "status": status, "label": args.label,
                 "limit_s": args.limit_s, "wall_s": sum(s["wall_s"] for s in commands), "commands": commands})
    if reason:
        data["reason"] = reason
    _write(args.json, data)
    print(f"part {args.part}: {status}" + (f" ({reason})" if reason else ""))


# ---------------------------------------------------------------- summary
def _pct(x: float) -> str:
    return f"{100 * x:+.1f}%"


def _figures(part: str, d: dict) -> str:
    """One table cell of headline figures of a finished part."""
    if part == "vq_speed":
        return "; ".join(
            f"{r['preset']} {r['encoder']}: encode+learn {r['encode_learn_us_per_token']:.3g} us/token, "
            f"VQ = {100 * r['vq_share_of_stage_compute']:.0f}% of stage fwd+bwd "
            f"({1e3 * r['stage_fwd_bwd_s']:.3g} ms/{r['tokens_per_micro_batch']} tokens)"
            + (f", compile {r['compile_s']:.1f} s" if "compile_s" in r else "")
            for r in d.get("results", []))
    if part == "boundary_overhead":
        return ", ".join(f"{r['codec']} {_pct(r['overhead_vs_none'])}" for r in d.get("results", [])[1:]) \
            + f" vs {d['results'][0]['codec']}"  # results[0]: the uncompressed reference
    if part == "swarm":
        b = d.get("bytes_per_token", {})
        steady = d.get("steady_tokens_per_s")
        return (f"{d.get('stages')} peers, {d.get('train_steps')} steps: {d.get('tokens_per_s', math.nan):.0f} tokens/s"
                + (f" ({steady:.0f} after the first step)" if steady else "") + "; "
                f"{b.get('forward_payload', math.nan):.1f} / {b.get('backward_payload', math.nan):.1f} B/token payload, "
                f"{b.get('forward_wire', math.nan):.1f} / {b.get('backward_wire', math.nan):.1f} on the wire "
                f"(fwd / bwd, mean over links)")
    if part == "sweep":
        return f"{len(d.get('runs', []))} runs: " + ", ".join(
            f"{r['codec']} val {r['val_loss']:.3f} ({r['act_bytes_per_token']:.0f} B/token)"
            for r in d.get("runs", []) if r.get("val_loss") is not None)
    return ""


def _details(part: str, d: dict, label: str) -> list[str]:
    """A detail table per finished part (its figures labelled)."""
    out: list[str] = []
    if part == "boundary_overhead" and d.get("results"):
        sh = d.get("shape", {})
        out += [f"### Boundary overhead ({label})", "",
                f"Middle stage (stage 1 of {sh.get('stages')}) forward+backward, preset {sh.get('preset')}, "
                f"rank {sh.get('rank')}, micro-batch {sh.get('batch')} x {sh.get('seq')}, autocast "
                f"{sh.get('autocast')}, {d.get('machine', {}).get('device')}.", "",
                "| codec | fwd+bwd ms | tokens/s | vs none | payload B/token fwd / bwd |", "|---|---|---|---|---|"]
        out += [f"| {r['codec']} | {1e3 * r['fwd_bwd_s']:.3g} | {r['tokens_per_s']:.3g} | {_pct(r['overhead_vs_none'])} "
                f"| {r['fwd_payload_bytes_per_token']:.0f} / {r['bwd_payload_bytes_per_token']:.0f} |"
                for r in d["results"]]
        out.append("")
    if part == "vq_speed" and d.get("results"):
        out += [f"### VQ encoder speed ({label})", "",
                "| preset | encoder | tokens | stage fwd+bwd ms | encode+learn us/token | encode us/token | "
                "decode us/token | VQ share | compile s |", "|---|---|---|---|---|---|---|---|---|"]
        out += [f"| {r['preset']} | {r['encoder']} | {r['tokens_per_micro_batch']} | {1e3 * r['stage_fwd_bwd_s']:.3g} | "
                f"{r['encode_learn_us_per_token']:.3g} | {r['encode_only_us_per_token']:.3g} | "
                f"{r['decode_us_per_token']:.3g} | {100 * r['vq_share_of_stage_compute']:.0f}% | "
                f"{r.get('compile_s', 0):.1f} |" for r in d["results"]]
        out.append("")
    if part == "sweep" and d.get("runs"):
        out += [f"### Grid slice ({label})", "", "| run | steps | val loss | Δ% vs none | act B/token | tokens/s |",
                "|---|---|---|---|---|---|"]
        out += [f"| {r['run_id']} | {r['steps']} | {r['val_loss']:.4f} | "
                f"{r.get('delta_pct_vs_none', math.nan):+.2f} | {r['act_bytes_per_token']:.1f} | {r['tokens_per_s']:.0f} |"
                for r in d["runs"] if r.get("val_loss") is not None]
        out.append("")
    return out


def cmd_summary(args: argparse.Namespace) -> None:
    rows, details, statuses = [], [], {}
    for n, (part, file, title) in enumerate(PARTS, 1):
        path = args.dir / file
        d = json.loads(path.read_text()) if path.exists() else {"status": "failed", "reason": "no result file"}
        status = d.get("status", "failed")
        statuses[part] = status
        try:
            figures = _figures(part, d)
        except (KeyError, TypeError, ValueError):  # a part stopped half-way: what it wrote may be incomplete
            figures = ""
        if status == "ok":
            cell = f"{args.label}: {figures}"
            details += _details(part, d, args.label)
        else:
            cell = d.get("reason", "").replace("\n", " ")
            if figures and d.get("results", d.get("runs")):
                cell += f"; partial, {args.label}: {figures}"
        wall = d.get("wall_s")
        rows.append(f"| {n} | {title} | {status} | {cell.replace('|', '/')} | "
                    f"{'' if wall is None else f'{wall:.1f}'} / {d.get('limit_s', '')} | `{file}` |")
    total = args.total_s
    md = [f"# GPU check: {args.label}", "",
          f"`{args.command}` on {args.device}, {time.strftime('%Y-%m-%d %H:%M:%S %Z')}, commit {args.commit}; "
          f"{total:.0f} s in all.", ""]
    if args.smoke:
        md += ["Smoke run: tiny shapes, 1-2 steps, every code path of the GPU check exercised; its figures "
               "are smoke (CPU, not a measurement). GPU figures: not measured.", ""]
    md += ["| # | part | status | figures | wall s / time box | file |", "|---|---|---|---|---|---|", *rows, ""]
    md += details
    (args.dir / "summary.md").write_text("\n".join(md))
    _write(args.dir / "gpu_check.json", {
        "benchmark": "gpu_check", "label": args.label, "smoke": args.smoke, "device": args.device,
        "command": args.command, "commit": args.commit, "total_s": total, "parts": statuses,
        "files": [f for _, f, _ in PARTS] + ["summary.md"]})
    print("\n".join(md))
    failed = [p for p, st in statuses.items() if st == "failed"]
    if failed:
        print(f"gpu_check: failed parts: {', '.join(failed)}", file=sys.stderr)
        sys.exit(1)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)

    s = sub.add_parser("grid-slice", help="write a few-step copy of a grid, with base overrides")
    s.add_argument("--grid", type=Path, required=True)
    s.add_argument("--steps", type=int, required=True, help="optimizer steps per run")
    s.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE", help="base override (TOML)")
    s.add_argument("--out-dir", type=Path, help="the slice's out_dir")
    s.add_argument("--out", type=Path, required=True, help="the slice grid file to write")
    s.set_defaults(func=cmd_grid_slice)

    s = sub.add_parser("swarm-result", help="the swarm part's JSON from launch's peer result files")
    s.add_argument("--run-dir", type=Path, required=True)
    s.add_argument("--stages", type=int, required=True)
    s.add_argument("--command", default="")
    s.add_argument("--out", type=Path, required=True)
    s.set_defaults(func=cmd_swarm_result)

    s = sub.add_parser("sweep-result", help="the sweep part's JSON from the sweep's run files")
    s.add_argument("--sweep-dir", type=Path, required=True)
    s.add_argument("--grid", type=Path)
    s.add_argument("--only", default="")
    s.add_argument("--command", default="")
    s.add_argument("--out", type=Path, required=True)
    s.set_defaults(func=cmd_sweep_result)

    s = sub.add_parser("finish", help="stamp a part's JSON with its status (ok / failed / skipped)")
    s.add_argument("--part", required=True)
    s.add_argument("--json", type=Path, required=True)
    s.add_argument("--rc", type=int, required=True)
    s.add_argument("--limit-s", type=float, required=True)
    s.add_argument("--label", required=True)
    s.add_argument("--steps-file", type=Path, help="JSON lines: command, wall_s, rc of each step")
    s.add_argument("--log", type=Path, help="the part's log (a failure keeps its tail)")
    s.add_argument("--skip-reason", default="")
    s.set_defaults(func=cmd_finish)

    s = sub.add_parser("summary", help="DIR/summary.md (a row per part) and DIR/gpu_check.json; "
                                       "exit status 1 when a part failed")
    s.add_argument("--dir", type=Path, required=True)
    s.add_argument("--label", required=True)
    s.add_argument("--smoke", action="store_true")
    s.add_argument("--device", default="")
    s.add_argument("--command", default="")
    s.add_argument("--commit", default="")
    s.add_argument("--total-s", type=float, default=0.0)
    s.set_defaults(func=cmd_summary)

    args = p.parse_args()
    args.func(args)


if __name__ == "__main__":
    main()
