"""What a message costs between certified peers, and what a certified handshake adds.

    python bench/message_cost.py [--iterations 20000] [--out bench/results/message_cost.json]

Per message kind of the demo swarm (tiny preset: T=128, B=2, ``mapl`` rank 64 ACT and GRAD, a
HEARTBEAT, a REPORT): bytes of its frames as handed to ZeroMQ, and CPU microseconds to encode it
and to decode its header (``wire.encode`` + ``wire.decode_header``, the work on a peer's event
loop; tensors are not inflated). Messages carry no tag: CURVE between certified peers covers
origin, integrity and replay. CPU is ``time.process_time`` over ``--iterations`` rounds, best of 3.

Handshake: the bytes a certificate adds to a HELLO, the CPU to verify it (``PeerIdentity.verify_peer``:
one Ed25519 check and the body), and the wall time from ``connect`` to the first message received
over loopback for a transport pinned to a certified peer's CURVE key (median of ``--handshakes``
fresh connections). Prints one line per figure and writes a JSON results file.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]

from mapl_swarm.net.identity import issue_local, load_identity  # noqa: E402
from mapl_swarm.net.transport import Transport, TransportConfig  # noqa: E402
from mapl_swarm.wire import Message, MessageType, PROTOCOL_VERSION, WireTensor, decode_header, encode  # noqa: E402

B, T, R = 2, 128, 64
MT = MessageType


def messages() -> dict[str, Message]:
    rng = np.random.default_rng(0)
    z = rng.integers(0, 1 << 16, (B, T, R), dtype=np.uint16)  # bf16 bit patterns
    ids = rng.integers(0, 4096, (B, T + 1), dtype=np.uint16)
    common = dict(run_id="demo", step=12, micro=3, seq=40, pver=12)
    return {
        "ACT (rank 64)": Message(type=MT.ACT, src=0, dst=1, meta={"mode": "train"},
                                 tensors={"z": WireTensor("bf16", z), "ids": ids}, **common),
        "GRAD (rank 64)": Message(type=MT.GRAD, src=1, dst=0, tensors={"dz": WireTensor("bf16", z)}, **common),
        "HEARTBEAT": Message(type=MT.HEARTBEAT, src=0, dst=1, run_id="demo", seq=41,
                             meta={"sent_ns": 1234567890123, "echo_ns": 1234567890000, "held_ns": 120}),
        "REPORT": Message(type=MT.REPORT, src=1, dst=0, run_id="demo", step=12, seq=42,
                          meta={"loss": 5.123, "tokens": 512, "mode": "train"}),
    }


def cpu_us(fn, iterations: int) -> float:
    best = float("inf")
    for _ in range(3):
        t0 = time.process_time()
        for _ in range(iterations):
            fn()
        best = min(best, time.process_time() - t0)
    return best / iterations * 1e6


def per_message(iterations: int) -> list[dict]:
    rows = []
    for name, msg in messages().items():
        frames = encode(msg, compress="raw")

        def round_trip(msg=msg) -> None:
            decode_header(encode(msg, compress="raw"))

        rows.append({"message": name, "bytes": sum(len(f) for f in frames), "header_bytes": len(frames[0]),
                     "cpu_us": round(cpu_us(round_trip, iterations), 2)})
    return rows


async def connect_time(server: TransportConfig, client: TransportConfig, runs: int) -> float:
    """Median milliseconds from ``connect`` (to the server's contact) to its first message received."""
    times = []
    async with Transport("stage1", server) as rx:
        for i in range(runs):
            async with Transport("stage0", client) as tx:
                t0 = time.perf_counter()
                tx.connect("stage1", rx.endpoint)
                await tx.send("stage1", [b"hello %d" % i])
                while True:
                    _, frames = await rx.recv(timeout_s=10)
                    if bytes(frames[0]) == b"hello %d" % i:
                        break
                times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def handshake(runs: int, iterations: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        local = issue_local(tmp, run_id="demo", num_stages=2)
        ids = [load_identity(local.key_file(s), local.cert_file(s), run_id="demo", stage=s) for s in range(2)]
    cert = ids[0].encoded_cert
    verify = cpu_us(lambda: ids[1].verify_peer(cert, stage=0, curve_key=ids[0].key.curve_public), iterations // 10)
    server, client = (TransportConfig(bind_host="127.0.0.1", curve=i.curve) for i in (ids[1], ids[0]))
    return {"cert_bytes_in_hello": len(cert), "verify_cpu_us": round(verify, 1),
            "connect_to_first_message_ms": round(asyncio.run(connect_time(server, client, runs)), 2),
            "handshakes": runs}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--iterations", type=int, default=20000)
    ap.add_argument("--handshakes", type=int, default=30)
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "message_cost.json")
    args = ap.parse_args()
    rows = per_message(args.iterations)
    hs = handshake(args.handshakes, args.iterations)
    version = ".".join(map(str, PROTOCOL_VERSION))
    print(f"protocol {version}, certified peers (no tag), {args.iterations} iterations, best of 3")
    for r in rows:
        print(f"{r['message']:<16} {r['bytes']:>7} B (header {r['header_bytes']:>3} B) "
              f"{r['cpu_us']:>8.2f} us encode + decode_header")
    print(f"certificate in a HELLO: {hs['cert_bytes_in_hello']} B; verifying it: {hs['verify_cpu_us']} us CPU")
    print(f"connect to first message (pinned to a certified key): {hs['connect_to_first_message_ms']} ms "
          f"(median of {args.handshakes})")
    result = {"command": " ".join(["python", "bench/message_cost.py", *sys.argv[1:]]),
              "machine": f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}",
              "date": time.strftime("%Y-%m-%d"), "protocol": version, "iterations": args.iterations,
              "messages": rows, "handshake": hs}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
