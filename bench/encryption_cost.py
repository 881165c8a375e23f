"""What encryption costs: the throughput benchmark's swarm between certified peers (CURVE, links
pinned to each peer's certified key) and with ``--insecure``, on a link-bound and an unshaped swarm.

    python bench/encryption_cost.py [--bandwidth-mbps 0.1] [--steps 4] [--repeats 1]

The swarm of ``bench/throughput.py`` (4 peer processes with 1 torch thread each and a DHT bootstrap
on this machine, tiny preset, T=128, 8 micro-batches of 2 per step, ``mapl`` rank 64), started
peer by peer (``mapl-swarm peer`` / ``mapl-swarm dht``), either certified (identities from
``issue_local``: each peer with its own ``--peer-key`` and ``--cert``, the DHT node with stage 0's
``--cert``) or each with ``--insecure`` (``launch`` always certifies its peers), once with every
outbound link shaped to ``--bandwidth-mbps`` and once unshaped, certified and insecure runs
alternating (certified first in even repeats, insecure first in odd ones). Measures steady-state
tokens/s (steps 2..N, from when stage 0 received each REPORT) and wire bytes per token (what the
peers handed ZeroMQ, not CURVE's own framing). Then one DEALER -> ROUTER link of the peers'
transport alone, certified (pinned) and insecure, over loopback.

Writes bench/results/encryption_cost.json and .md (never throughput.json / throughput.md).
"""

from __future__ import annotations

import argparse
import json
import platform
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))

from throughput import CONFIG, M, P  # noqa: E402 - the same swarm as the throughput table

from mapl_swarm.launch import summarize  # noqa: E402
from mapl_swarm.metrics import run_manifest  # noqa: E402
from mapl_swarm.net.identity import issue_local, load_identity  # noqa: E402

CODEC, RANK = "mapl", 64
RUN_ID = f"tp-{CODEC}-{RANK}"
"""The run id of ``throughput.CONFIG`` for this codec (the certificates name it)."""
CURVE_FRAME_OVERHEAD = 33
"""Bytes libzmq's CURVE adds to every frame on the wire (the MESSAGE command), not counted in the
wire bytes above; the app-level link emulator shapes the bytes handed to ZeroMQ, so a shaped run
does not pay for them either."""


def wait_line(path: Path, pattern: str, timeout_s: float, proc: subprocess.Popen) -> re.Match:
    deadline = time.monotonic() + timeout_s
    rx = re.compile(pattern)
    while time.monotonic() < deadline:
        if path.exists():
            m = rx.search(path.read_text())
            if m:
                return m
        if proc.poll() is not None:
            break
        time.sleep(0.2)  # polling a log file with a deadline
    raise RuntimeError(f"{pattern!r} not in {path} within {timeout_s} s:\n{path.read_text()[-3000:]}")


def run_case(certified: bool, bw: float, steps: int, cache: Path, tmp: Path, index: int) -> dict:
    name = f"{'certified' if certified else 'insecure'}-{bw:g}-{index}"
    out = tmp / name
    out.mkdir(parents=True)
    path = tmp / f"{name}.toml"
    path.write_text(CONFIG.format(codec=CODEC, rank=RANK, cache=cache, P=P, M=M, steps=steps, out=out, bw=bw, lat=0.0))
    local = issue_local(out / "identities", run_id=RUN_ID, num_stages=P) if certified else None

    def membership(stage: int | None) -> list[str]:
        """A peer's identity (``stage``) or the DHT node's certificate (None), or ``--insecure``."""
        if local is None:
            return ["--insecure"]
        return local.args(stage) if stage is not None else ["--cert", str(local.cert_file(0))]

    py = [sys.executable, "-m", "mapl_swarm"]
    procs: list[subprocess.Popen] = []
    logs = []
    try:
        dht_log = out / "dht.log"
        dht = subprocess.Popen([*py, "dht", "--host", "127.0.0.1", *membership(None)], stdout=dht_log.open("w"),
                               stderr=subprocess.STDOUT)
        procs.append(dht)
        maddr = wait_line(dht_log, r"--initial-peer (\S+)", 120, dht).group(1)
        t0 = time.perf_counter()
        for s in range(P):
            log = out / f"peer{s}.log"
            logs.append(log)
            procs.append(subprocess.Popen([*py, "peer", "--config", str(path), "--stage", str(s), "--initial-peer",
                                           maddr, "--quiet", *membership(s)], stdout=log.open("w"),
                                          stderr=subprocess.STDOUT))
        for s, proc in enumerate(procs[1:]):
            code = proc.wait(3600)
            if code != 0:
                raise RuntimeError(f"{name}: stage {s} exited {code}:\n{logs[s].read_text()[-3000:]}")
        wall = time.perf_counter() - t0
    finally:
        for proc in procs[1:]:
            if proc.poll() is None:
                proc.kill()
        if procs:
            procs[0].send_signal(signal.SIGINT)
            try:
                procs[0].wait(30)
            except subprocess.TimeoutExpired:
                procs[0].kill()
    s = summarize(out, P)
    tokens_per_step = s.tokens / len(s.train_losses)
    times = s.report_times_s
    wire = sum(link["forward_wire"] + link["backward_wire"] for link in s.links)
    messages = [json.loads((out / f"peer_stage{k}.json").read_text()) for k in range(P)]
    return {"certified": certified, "bandwidth_mbps": bw, "steps": steps, "repeat": index,
            "tokens_per_s": tokens_per_step * (len(times) - 1) / (times[-1] - times[0]),
            "wire_bytes_per_token": wire, "tokens_per_step": tokens_per_step, "swarm_wall_s": s.wall_s,
            "launch_wall_s": wall, "final_loss": s.train_losses[-1],
            "peak_rss_mb": [m["peak_rss_mb"] for m in messages]}


def transport_rate(certified: bool, size: int, count: int) -> float:
    """Messages per second one DEALER -> ROUTER link of the peers' transport carries over loopback
    (``count`` messages of ``size`` bytes, sent and received in one event loop); certified: stage 0's
    CURVE keys dialing stage 1's contact (pinned to its key)."""
    import asyncio

    from mapl_swarm.net.transport import Transport, TransportConfig, run

    curves = [None, None]
    if certified:
        with tempfile.TemporaryDirectory(prefix="mapl-enc-ids-") as tmp:
            local = issue_local(tmp, run_id=RUN_ID, num_stages=2)
            curves = [load_identity(local.key_file(s), local.cert_file(s), run_id=RUN_ID, stage=s).curve
                      for s in range(2)]
    payload = bytes(size)

    async def main() -> float:
        server, client = (TransportConfig(bind_host="127.0.0.1", curve=c) for c in (curves[1], curves[0]))
        async with Transport("stage1", server) as rx, Transport("stage0", client) as tx:
            tx.connect("stage1", rx.endpoint)
            await tx.send("stage1", [b"warm-up"])
            await rx.recv(30)
            t0 = time.perf_counter()

            async def send() -> None:
                for _ in range(count):
                    await tx.send("stage1", [payload])

            sender = asyncio.create_task(send())
            for _ in range(count):
                await rx.recv(60)
            await sender
            return count / (time.perf_counter() - t0)

    return run(main())


def transport_rows(repeats: int) -> list[dict]:
    """Best of ``repeats`` alternating runs per (size, certified): the machine is shared, the best
    run is the least disturbed."""
    rows = []
    for size, count in ((33_280, 3000), (200, 30_000)):  # an ACT of the swarm above; a control message
        best = {True: 0.0, False: 0.0}
        for _ in range(repeats):
            for certified in (True, False):
                best[certified] = max(best[certified], transport_rate(certified, size, count))
        for certified in (True, False):
            rows.append({"size": size, "count": count, "certified": certified, "messages_per_s": best[certified],
                         "mb_per_s": best[certified] * size / 1e6})
    return rows


def to_markdown(rows: list[dict], command: str, manifest: dict) -> str:
    lines = [
        f"Command: `{command}`  ",
        f"Machine: {platform.machine()}, 2 cores, no GPU, torch {manifest['versions'].get('torch', '?')}; shared with other "
        f"jobs (loaded); date {time.strftime('%Y-%m-%d')}; commit {manifest['commit'][:12]}  ",
        f"Setup: `bench/throughput.py`'s swarm ({P} peers, 1 torch thread each, tiny preset, T=128, {M} micro-batches of 2, "
        f"`{CODEC}` rank {RANK}), peers started one by one certified (`--peer-key` + `--cert`: CURVE, pinned) "
        "or with `--insecure`; "
        "tokens/s over steps 2..N; wire bytes per token summed over the 3 links and both directions.",
        "",
        "| links | membership | tokens/s | vs insecure | wire B/token | final loss |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        same = [b["tokens_per_s"] for b in rows if not b["certified"] and b["bandwidth_mbps"] == r["bandwidth_mbps"]]
        base = sum(same) / len(same) if same else float("nan")
        link = f"{r['bandwidth_mbps']:g} Mbit/s" if r["bandwidth_mbps"] else "unshaped (loopback)"
        membership = "certified (CURVE)" if r["certified"] else "--insecure"
        lines.append(f"| {link} | {membership} | {r['tokens_per_s']:.1f} | "
                     f"{r['tokens_per_s'] / base:.3f} | {r['wire_bytes_per_token']:.1f} | {r['final_loss']:.4f} |")
    transport = manifest.get("transport", [])
    if transport:
        lines += ["", "Transport alone (one DEALER -> ROUTER link of the peers' `Transport` over loopback, one event loop, "
                      "best of the alternating runs):", "",
                  "| message | membership | messages/s | MB/s | vs insecure |", "|---|---|---|---|---|"]
        for r in transport:
            base = next(b for b in transport if b["size"] == r["size"] and not b["certified"])["messages_per_s"]
            lines.append(f"| {r['size']:,} B | {'certified (CURVE)' if r['certified'] else '--insecure'} | "
                         f"{r['messages_per_s']:,.0f} | "
                         f"{r['mb_per_s']:.1f} | {r['messages_per_s'] / base:.2f} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bandwidth-mbps", type=float, default=0.1)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--profiles", default="unshaped,shaped", help="which swarms: unshaped, shaped, or none")
    ap.add_argument("--transport-repeats", type=int, default=3)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "encryption_cost.json"))
    args = ap.parse_args()
    command = (f"python bench/encryption_cost.py --bandwidth-mbps {args.bandwidth_mbps:g} --steps {args.steps} "
               f"--repeats {args.repeats} --profiles {args.profiles} --transport-repeats {args.transport_repeats}")
    rows = []
    with tempfile.TemporaryDirectory(prefix="mapl-enc-") as tmp:
        profiles = [p for p in args.profiles.split(",") if p in ("unshaped", "shaped")]
        for bw in [0.0 if p == "unshaped" else args.bandwidth_mbps for p in profiles]:
            for i in range(args.repeats):
                for certified in ((True, False) if i % 2 == 0 else (False, True)):  # either order first
                    row = run_case(certified, bw, args.steps, ROOT / ".mapl_cache", Path(tmp), i)
                    print(json.dumps({k: row[k] for k in ("certified", "bandwidth_mbps", "tokens_per_s",
                                                           "wire_bytes_per_token")}), flush=True)
                    rows.append(row)
    transport = transport_rows(args.transport_repeats) if args.transport_repeats else []
    manifest = run_manifest({"bandwidth_mbps": args.bandwidth_mbps, "steps": args.steps, "repeats": args.repeats,
                             "profiles": args.profiles})
    manifest["transport"] = transport
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"manifest": manifest, "command": command, "rows": rows, "transport": transport},
                              indent=2))
    md = to_markdown(rows, command, manifest)
    out.with_suffix(".md").write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
