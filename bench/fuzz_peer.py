"""Fuzz a live peer: an insider sends >= 100,000 generated messages to a real stage peer.

    python bench/fuzz_peer.py [--messages 100000] [--per-step 1000] [--seed 0]

The fuzzer is stage 0 of a certified 2-stage swarm (``issue_local``: one authority, a key and a
certificate per stage) whose stage 1 is a real ``mapl-swarm peer`` process (1 torch thread). It is
a member: it holds stage 0's identity, runs the DHT bootstrap and announces a certified record,
dials stage 1 as a CURVE client pinned to stage 1's key, shakes hands by SPEC §9.2 with its
certificate in its HELLO and its WELCOME (so it owns stage 1's upstream session) and drives
training itself: every ``--per-step`` fuzz messages it runs one valid step (PROJ and
M train ACTs of random finite activations) and requires stage 1's M GRADs and REPORT, all finite,
within 60 s — the peer must keep answering and training throughout.

Fuzz messages are mutations of valid messages (ACT, PROJ, HEARTBEAT, ERROR, CHECKPOINT, and types
stage 1 may not take from upstream: GRAD, PROJ_GRAD, REPORT, RESYNC) for the *next* step, so that
they pass the header checks and reach the content checks but never the model (a fuzz message that
stays valid is dropped by the schedule as ``out_of_window``). Messages carry no tag (CURVE covers
origin and integrity); all but the random-bytes ones take the session's next ``seq`` (so they reach
every check after the sequence). Mutations:
random bytes, bit flips in the header or a tensor frame, truncated/extended/extra/missing frames,
header fields (type, version, run, src/dst, step, micro, seq, pver), meta (missing/mistyped
fields, deep nesting, big strings), descriptors (name, dtype, shape, codec, nbytes, rawbytes — up
to 2^40 —, crc), tensor values (NaN, Inf, ids >= V), LZ4 blocks inflating past their declaration.
Never generated: a valid BYE (it ends the run by SPEC §9.5)
and ERROR ``retransmit_unavailable`` (it stops a peer that asked for a retransmission).

Reports crashes (stage 1 exited before the fuzzer's BYE, a traceback in its log, or a valid step
unanswered: must be 0), stage 1's drops by code (its result file's ``rejects``), its peak RSS
(``peak_rss_mb``) against its RSS after the handshake, and fuzz messages per second. Writes
bench/results/fuzz_peer.json and prints a markdown table.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import platform
import random
import subprocess
import sys
import tempfile
import threading
import time
import zlib
from collections import Counter
from pathlib import Path

import msgpack
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
RUN = "fuzz"
V, D, T, B, M, R, E = 512, 64, 32, 2, 3, 16, 2
CONFIG = f"""
preset = "tiny"
[model]
vocab_size = {V}
hidden_size = {D}
num_layers = 4
num_heads = 4
ffn_hidden_size = 128
context_length = {T}
[compression]
codec = "mapl"
rank = {R}
anchor_rank = 16
[data]
vocab_size = {V}
max_corpus_bytes = 400000
val_fraction = 0.2
cache_dir = "{{cache}}"
[run]
steps = 1000000
out_dir = "{{out}}"
run_id = "{RUN}"
[pipeline]
num_stages = 2
micro_batch_size = {B}
num_micro_batches = {M}
[eval]
interval_steps = 0
batches = {E}
[runtime]
threads = 1
[net]
timeout_s = 600
"""
DTYPES = ("bf16", "fp16", "fp32", "fp64", "uint8", "uint16", "uint32", "int32", "int64")


def status_rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


class Peer1:
    """The stage 1 peer process, its output collected by threads."""

    def __init__(self, cmd: list[str]) -> None:
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.lines: list[str] = []
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))


class Mutator:
    """Valid messages for the step after stage 1's current one, and mutations of them (see the module docstring)."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.np = np.random.default_rng(rng.getrandbits(32))
        self.ops: Counter[str] = Counter()

    # -- valid bases ---------------------------------------------------------------------------
    def base(self, step: int, pver: int):
        """A valid message for step ``step + 1`` (stage 1 is at ``step``, its link at projector ``pver``)."""
        from mapl_swarm.wire import Message, MessageType as MT, WireTensor

        kind = self.rng.choice(("ACT", "ACT", "ACT", "PROJ", "PROJ", "HEARTBEAT", "ERROR", "CHECKPOINT", "GRAD",
                                "PROJ_GRAD", "REPORT", "RESYNC"))
        common = dict(run_id=RUN, src=0, dst=1, step=step + 1)
        z = WireTensor("bf16", self._bf16((B, T, R)))
        if kind == "ACT":  # the link is at v, or at v + 1 after a fuzzed PROJ got in
            ids = self.np.integers(0, V, (B, T + 1), dtype=np.uint16)
            return Message(type=MT.ACT, micro=self.rng.randrange(M), pver=pver + self.rng.randrange(2),
                           meta={"mode": "train"},
                           tensors={"z": z, "ids": ids}, **common)
        if kind == "PROJ":
            return Message(type=MT.PROJ, pver=pver + 1, tensors={"proj": self.np.standard_normal((D, R), np.float32)},
                           **common)
        if kind == "HEARTBEAT":
            return Message(type=MT.HEARTBEAT, meta={"sent_ns": time.time_ns()}, **common)
        if kind == "ERROR":
            return Message(type=MT.ERROR, meta={"code": "internal", "message": "fuzz"}, **common)
        if kind == "CHECKPOINT":
            return Message(type=MT.CHECKPOINT, meta={"phase": "complete", "step": step + 1}, **common)
        if kind == "GRAD":
            return Message(type=MT.GRAD, micro=self.rng.randrange(M), pver=pver, tensors={"dz": z}, **common)
        if kind == "PROJ_GRAD":
            return Message(type=MT.PROJ_GRAD, pver=pver, meta={"micro_batches": M},
                           tensors={"grad": self.np.standard_normal((D, R), np.float32)}, **common)
        if kind == "REPORT":
            return Message(type=MT.REPORT, meta={"loss": 1.0, "tokens": B * T * M, "mode": "train"}, **common)
        return Message(type=MT.RESYNC, meta={"stream": "act", "have": 0}, **common)

    def _bf16(self, shape) -> np.ndarray:
        return (self.np.standard_normal(shape, np.float32).view(np.uint32) >> 16).astype(np.uint16)

    # -- mutations -----------------------------------------------------------------------------
    def mutate(self, msg, seq: int, step: int, pver: int) -> tuple[list[bytes], int]:
        """Frames of one fuzz message (``seq`` its session sequence number; stage 1 at ``step`` >= 1, its
        link at projector ``pver``) and the session's next ``seq``. Mutated fields never take a value
        stage 1's schedule would act on (``step``; ``pver`` v or v + 1)."""
        from mapl_swarm.wire import PROTOCOL_VERSION, MessageType as MT, WireError, encode

        rng, major = self.rng, PROTOCOL_VERSION[0]
        op = rng.choice(("bytes", "header_flips", "frame_flips", "frames", "field", "field", "field", "meta",
                         "descriptor", "descriptor", "tensors", "tensors", "values", "values", "lz4", "none"))
        self.ops[op] += 1
        if op == "tensors" and msg.tensors:
            msg = dataclasses.replace(msg, tensors=self._wrong_tensors(dict(msg.tensors)))
        try:
            frames = [bytes(f) for f in encode(msg)]
            header = msgpack.unpackb(frames[0], raw=False)
        except WireError:  # a type that may not carry these tensors: framed as an ACT, then retyped
            frames = [bytes(f) for f in encode(dataclasses.replace(msg, type=MT.ACT, meta={"mode": "train"}))]
            header = msgpack.unpackb(frames[0], raw=False)
            header.update(type=int(msg.type), meta=msg.meta)
        tensors = frames[1:]
        header["seq"] = seq
        next_seq = seq + 1
        if op == "bytes":
            return [rng.randbytes(rng.randrange(0, 300)) for _ in range(rng.randrange(1, 4))], seq
        if op == "header_flips":
            head = bytearray(self._pack(header, tensors)[0])
            for _ in range(rng.randrange(1, 9)):
                i = rng.randrange(len(head))
                head[i] ^= 1 << rng.randrange(8)
            return [bytes(head), *tensors], next_seq
        if op == "frame_flips" and tensors:
            i = rng.randrange(len(tensors))
            f = bytearray(tensors[i])
            for _ in range(rng.randrange(1, 9)):
                j = rng.randrange(len(f)) if f else 0
                if f:
                    f[j] ^= 1 << rng.randrange(8)
            tensors[i] = bytes(f)
            if rng.random() < 0.5:  # a consistent CRC: the flips reach decoding and the content rules
                header["tensors"][i]["crc"] = zlib.crc32(tensors[i])
        elif op == "frames":
            choice = rng.randrange(4)
            if choice == 0 and tensors:
                tensors.pop(rng.randrange(len(tensors)))
            elif choice == 1:
                tensors.append(rng.randbytes(rng.randrange(0, 2000)))
            elif choice == 2 and tensors:
                i = rng.randrange(len(tensors))
                tensors[i] = tensors[i][: rng.randrange(len(tensors[i]) + 1)]
            else:
                if tensors:
                    i = rng.randrange(len(tensors))
                    tensors[i] = tensors[i] + rng.randbytes(rng.randrange(1, 100))
        elif op == "field":
            name = rng.choice(("type", "v", "run", "src", "dst", "step", "micro", "seq", "pver", "cver"))
            value = {
                "type": lambda: rng.choice([t for t in range(0, 20) if t != 12] + [2 ** 16, -1]),
                "v": lambda: rng.choice(([major, 99], [major + 1, 0], [major - 1, 9], [major], [major, 0, 0],
                                         f"{major}.0", [-1, 0])),
                "run": lambda: rng.choice(("", "other", "x" * 200, RUN.upper(), 7)),
                "src": lambda: rng.choice((1, 2, 65535, -1, 2 ** 16)),
                "dst": lambda: rng.choice((0, 2, 65535, -1)),
                "step": lambda: rng.choice((step - 1, step + 2, step + 1000, 2 ** 64 - 1, 2.0 ** 64, -1, 1.5)),
                "micro": lambda: rng.choice((M, M + 1, 2 ** 32 - 1, 2 ** 32, -1, None)),
                "seq": lambda: rng.choice((0, max(0, seq - rng.randrange(1, 50)), seq + rng.randrange(1, 1000), -1)),
                "pver": lambda: rng.choice((pver + 2 + rng.randrange(100), 2 ** 64 - 1, 2.0 ** 64, -1, 1.0)),
                "cver": lambda: rng.choice((1, 99, -1)),
            }[name]()
            header[name] = value
            if name == "seq" and isinstance(value, int) and value >= seq:
                next_seq = value + 1  # a gap the receiver accepts: keep the session going above it
        elif op == "meta":
            meta = header["meta"]
            choice = rng.randrange(5)
            if choice == 0 and meta:
                meta.pop(rng.choice(list(meta)))
            elif choice == 1 and meta:
                meta[rng.choice(list(meta))] = rng.choice((None, True, -1, 2 ** 63, 1.5, "x", b"\x00", [1], {"a": 1}))
            elif choice == 2:
                deep: object = 1
                for _ in range(rng.randrange(6, 12)):
                    deep = [deep]
                meta["deep"] = deep
            elif choice == 3:
                meta["big"] = "x" * rng.choice((1000, 60_000, 70_000))
            else:
                header["meta"] = rng.choice((None, [], "meta", 5))
        elif op == "descriptor" and header["tensors"]:
            d = rng.choice(header["tensors"])
            name = rng.choice(("name", "dtype", "shape", "codec", "nbytes", "rawbytes", "crc", "drop", "extra_key",
                               "not_a_map"))
            if name == "name":
                d["name"] = rng.choice(("", "zz", "ids", "z", "proj", "x" * 100, 5))
            elif name == "dtype":
                d["dtype"] = rng.choice((*DTYPES, "bfloat16", "", 3))
            elif name == "shape":
                d["shape"] = rng.choice(([], [1], [B, T], [B, T, R + 1], [B, T + 2], [D, R + 1], [2 ** 20, 2 ** 20],
                                         [1] * 9, [-1, 4], [2.0, 3], "shape"))
            elif name == "codec":
                d["codec"] = rng.choice(("raw", "lz4", "zstd", ""))
            elif name == "nbytes":
                d["nbytes"] = rng.choice((0, d["nbytes"] + 1, 2 ** 28 + 1, 2 ** 40, -1))
            elif name == "rawbytes":
                d["rawbytes"] = rng.choice((0, d["rawbytes"] * 2, 2 ** 28, 2 ** 40, -1))
            elif name == "crc":
                d["crc"] = rng.choice((0, d["crc"] ^ 1, 2 ** 32, -1))
            elif name == "drop":
                d.pop(rng.choice(list(d)))
            elif name == "extra_key":
                d["future"] = 1  # ignored by the decoder (a newer minor version): the message stays valid
            else:
                header["tensors"][header["tensors"].index(d)] = rng.choice(([], "d", 1))
        elif op == "values" and tensors:
            i = rng.randrange(len(tensors))
            d = header["tensors"][i]
            arr = bytearray(np.frombuffer(tensors[i], np.uint8)) if d["codec"] == "raw" else None
            if arr is not None and arr:
                if d["dtype"] == "bf16":
                    pattern = rng.choice((0x7FC0, 0x7F80, 0xFF80, 0x7FFF)).to_bytes(2, "little")
                elif d["dtype"] == "fp32":
                    pattern = np.array([rng.choice((np.nan, np.inf, -np.inf))], np.float32).tobytes()
                else:  # ids
                    pattern = rng.choice((V, V + 1, 65535)).to_bytes(2, "little")
                j = rng.randrange(len(arr) // len(pattern)) * len(pattern)
                arr[j: j + len(pattern)] = pattern
                tensors[i] = bytes(arr)
                d["crc"] = zlib.crc32(tensors[i])
        elif op == "lz4" and tensors:
            i = rng.randrange(len(tensors))
            d = header["tensors"][i]
            block = lz4_zeros_block(rng.choice((d["rawbytes"] + 64, 1 << 16, 1 << 20)))
            tensors[i] = block
            d.update(codec="lz4", nbytes=len(block), crc=zlib.crc32(block))
        if header.get("type") == 12:  # never a BYE (it would end the run legitimately)
            header["type"] = 11
        meta = header.get("meta")
        if isinstance(meta, dict) and meta.get("code") == "retransmit_unavailable":
            meta["code"] = "internal"
        return self._pack(header, tensors), next_seq

    def _wrong_tensors(self, tensors: dict) -> dict:
        """Self-consistent tensors (frames match their descriptors) of a wrong name, shape or dtype."""
        from mapl_swarm.wire import WireTensor

        rng = self.rng
        name = rng.choice(list(tensors))
        t = tensors[name]
        shape = list(t.shape)
        choice = rng.randrange(6)
        if choice == 0 and shape:  # one dimension off by one
            i = rng.randrange(len(shape))
            shape[i] = max(0, shape[i] + rng.choice((-1, 1)))
            tensors[name] = WireTensor(t.dtype, np.resize(t.data, shape).astype(t.data.dtype))
        elif choice == 1:  # another rank
            tensors[name] = WireTensor(t.dtype, t.data.reshape(-1) if len(shape) > 1 else t.data.reshape(1, -1))
        elif choice == 2:  # another dtype, same shape
            tag = rng.choice([d for d in ("fp32", "fp16", "uint32", "int64", "uint8") if d != t.dtype])
            tensors[name] = WireTensor.from_array(np.zeros(shape, {"fp32": np.float32, "fp16": np.float16,
                                                                   "uint32": np.uint32, "int64": np.int64,
                                                                   "uint8": np.uint8}[tag]), tag)
        elif choice == 3:  # missing
            del tensors[name]
        elif choice == 4:  # renamed
            tensors[rng.choice(("x", "codes", "dz", "proj", "grad", "index"))] = tensors.pop(name)
        else:  # an extra one
            tensors[rng.choice(("extra", "codes", "index"))] = WireTensor.from_array(np.zeros((2, 3), np.float32))
        return tensors

    @staticmethod
    def _pack(header: dict, tensors: list[bytes]) -> list[bytes]:
        return [msgpack.packb(header, use_bin_type=True), *tensors]


def lz4_zeros_block(n: int) -> bytes:
    """An LZ4 block inflating to ``n`` >= 16 zero bytes (about n/255 bytes; tests/integration/attacker.py)."""
    ml = n - 10
    out = bytearray([0x10 | min(ml, 15), 0x00, 0x01, 0x00])
    if ml >= 15:
        out += b"\xff" * ((ml - 15) // 255) + bytes([(ml - 15) % 255])
    return bytes(out + bytes([0x50]) + bytes(5))


class Fuzzer:
    """Stage 0 of the swarm: handshakes, valid steps, fuzz (see the module docstring)."""

    def __init__(self, identity, fingerprint: str, peer: Peer1, discovery, args) -> None:
        self.identity, self.fingerprint, self.peer, self.discovery, self.args = (identity, fingerprint, peer,
                                                                                 discovery, args)
        self.rng = random.Random(args.seed)
        self.mut = Mutator(self.rng)
        self.grads: dict[int, set[int]] = {}
        self.reports: dict[int, float] = {}
        self.bad_answers: list[str] = []
        self.got = asyncio.Event()
        self.seq = 0
        self.welcomed = asyncio.Event()
        self.frames_sent = 0
        self.replies = 0

    def hello_meta(self) -> dict:
        """HELLO/WELCOME meta without the nonces, with stage 0's certificate."""
        return {"fingerprint": self.fingerprint, "num_stages": 2, "num_micro_batches": M, "micro_batch_size": B,
                "eval_batches": E, "capabilities": ["1f1b"], "peer": "fuzzer", "cert": self.identity.encoded_cert}

    async def run(self) -> dict:
        from mapl_swarm.net.transport import Transport, TransportConfig
        from mapl_swarm.wire import Message, MessageType as MT, decode, encode, new_nonce

        cfg = TransportConfig(bind_host="127.0.0.1", curve=self.identity.curve, max_message_bytes=1 << 20,
                              send_timeout_s=120)
        async with Transport("stage0", cfg) as t:
            self.t = t
            loop = asyncio.get_running_loop()
            await loop.run_in_executor(None, lambda: self.discovery.announce(0, t.endpoint, subkey=t.routing_id))
            endpoint = await self.discovery.lookup_async(1, 120)  # a contact: stage 1's endpoint#<its CURVE key>
            t.connect("stage1", endpoint)
            receiver = asyncio.create_task(self._receive())
            drain = None
            nonce = new_nonce()
            await t.send("stage1", encode(Message(type=MT.HELLO, run_id=RUN, src=0, dst=1, seq=0,
                                                  meta={**self.hello_meta(), "nonce": nonce})), kind="HELLO")
            _, frames = await t.recv_reply(120)
            msg = decode(frames)
            if msg.type != MT.WELCOME or msg.meta.get("hello_nonce") != nonce:
                raise RuntimeError(f"handshake refused: {msg.meta}")
            self.identity.verify_peer(msg.meta.get("cert"), stage=1, curve_key=t.server_key("stage1"))
            drain = asyncio.create_task(self._drain_replies())
            await asyncio.wait_for(self.welcomed.wait(), 120)  # stage 1's HELLO answered too
            rss_after_handshake = status_rss_mb(self.peer.proc.pid)
            proj = np.linalg.qr(np.random.default_rng(0).standard_normal((D, R)))[0].astype(np.float32)
            step, sent, t_fuzz, t0 = 0, 0, 0.0, time.perf_counter()
            unanswered = None
            while sent < self.args.messages:
                ok = await self._valid_step(step, proj)
                if not ok:
                    unanswered = step
                    break
                t1 = time.perf_counter()
                for _ in range(min(self.args.per_step, self.args.messages - sent)):
                    msg = self.mut.base(step + 1, step)  # stage 1 is at step + 1, its link at projector v = step
                    frames, next_seq = self.mut.mutate(msg, self.seq + 1, step + 1, step)
                    self.seq = next_seq - 1  # the last seq used
                    await t.send("stage1", frames, kind="FUZZ")
                    self.frames_sent += len(frames)
                    sent += 1
                    if self.peer.proc.poll() is not None:
                        break
                await t.flush(120)
                t_fuzz += time.perf_counter() - t1
                step += 1
                if self.peer.proc.poll() is not None:
                    break
                if step % 10 == 0:
                    print(f"  {sent} fuzz messages, step {step}, stage 1 RSS {status_rss_mb(self.peer.proc.pid):.0f} MB",
                          flush=True)
            final_ok = unanswered is None and self.peer.proc.poll() is None and await self._valid_step(step, proj)
            wall = time.perf_counter() - t0
            if self.peer.proc.poll() is None:
                await self._send(MT.BYE, meta={"reason": "fuzz finished"})
                await t.flush(60)
            receiver.cancel()
            drain.cancel()
            return {"messages": sent, "frames": self.frames_sent, "valid_steps": step + (1 if final_ok else 0),
                    "unanswered_step": unanswered if unanswered is not None else (None if final_ok else step),
                    "fuzz_s": t_fuzz, "wall_s": wall, "rss_after_handshake_mb": rss_after_handshake,
                    "bad_answers": self.bad_answers, "ops": dict(self.mut.ops), "replies_on_dealer": self.replies}

    async def _drain_replies(self) -> None:
        """REJECTs that fuzzed HELLOs or versions earn on this DEALER: counted, not read."""
        while True:
            await self.t.recv_reply(3600)
            self.replies += 1

    async def _send(self, mtype, **kw) -> None:
        from mapl_swarm.wire import Message, encode

        self.seq += 1
        await self.t.send("stage1", encode(Message(type=mtype, run_id=RUN, src=0, dst=1, seq=self.seq, **kw)),
                          kind=mtype.name)

    async def _valid_step(self, step: int, proj: np.ndarray) -> bool:
        """PROJ and M train ACTs of ``step``; True once its M GRADs and its REPORT came back (60 s)."""
        from mapl_swarm.wire import MessageType as MT, WireTensor

        await self._send(MT.PROJ, step=step, pver=step, tensors={"proj": proj})
        for micro in range(M):
            z = WireTensor("bf16", self.mut._bf16((B, T, R)))
            ids = self.mut.np.integers(0, V, (B, T + 1), dtype=np.uint16)
            await self._send(MT.ACT, step=step, micro=micro, pver=step, meta={"mode": "train"},
                             tensors={"z": z, "ids": ids})
        deadline = time.monotonic() + 60
        while not (self.grads.get(step, set()) >= set(range(M)) and step in self.reports):
            self.got.clear()
            try:
                await asyncio.wait_for(self.got.wait(), max(0.01, deadline - time.monotonic()))
            except asyncio.TimeoutError:
                return False
            if self.peer.proc.poll() is not None:
                return False
        return True

    async def _receive(self) -> None:
        """Stage 1's messages on this ROUTER: its HELLO (answered WELCOME), GRADs, REPORTs."""
        from mapl_swarm.wire import Message, MessageType as MT, decode, encode, new_nonce

        while True:
            sender, frames = await self.t.recv(3600)
            try:
                msg = decode(frames)
                if msg.type == MT.HELLO:  # its certificate names the key its connection proved
                    self.identity.verify_peer(msg.meta.get("cert"), stage=1, curve_key=self.t.peer_key(sender))
            except Exception as exc:  # noqa: BLE001 - a bad answer is a finding, not a fuzzer crash
                self.bad_answers.append(f"{type(exc).__name__}: {exc}")
                continue
            if msg.type == MT.HELLO:
                await self.t.reply(sender, encode(Message(
                    type=MT.WELCOME, run_id=RUN, src=0, dst=1, seq=0,
                    meta={**self.hello_meta(), "nonce": new_nonce(), "hello_nonce": msg.meta["nonce"]})),
                    kind="WELCOME")
                self.welcomed.set()
            elif msg.type == MT.GRAD:
                dz = msg.tensors["dz"].data.view(np.uint16)
                if ((dz & 0x7F80) == 0x7F80).any():
                    self.bad_answers.append(f"non-finite GRAD step {msg.step} micro {msg.micro}")
                self.grads.setdefault(msg.step, set()).add(msg.micro)
            elif msg.type == MT.REPORT and msg.meta.get("mode") == "train":
                if not np.isfinite(msg.meta["loss"]):
                    self.bad_answers.append(f"non-finite loss at step {msg.step}")
                self.reports[msg.step] = float(msg.meta["loss"])
            self.got.set()


def to_markdown(row: dict, command: str, manifest: dict) -> str:
    rejects = row["rejects"]
    lines = [
        f"Command: `{command}`  ",
        f"Machine: {platform.machine()}, 2 cores, no GPU, torch {manifest['versions'].get('torch', '?')}, shared with "
        f"other jobs (loaded); date {row['date']}; commit {manifest['commit'][:12]}  ",
        "Setup: a certified 2-stage swarm; stage 1 is a real `mapl-swarm peer` (1 torch thread, tiny test model "
        f"d={D}, 4 layers, T={T}, rank {R}, B={B}, M={M}); stage 0 is the fuzzer, a member (stage 0's certificate) "
        f"holding stage 1's upstream session, which sends {row['messages']:,} generated messages and a valid "
        f"training step every {row['per_step']} of them.",
        "",
        "| fuzz messages | ZeroMQ frames | crashes | valid steps answered | fuzz messages/s (end to end) | "
        "stage 1 RSS after handshake | stage 1 peak RSS | dropped (all codes) | wall |",
        "|---|---|---|---|---|---|---|---|---|",
        f"| {row['messages']:,} | {row['frames']:,} | {row['crashes']} | {row['valid_steps']} | "
        f"{row['messages'] / row['wall_s']:,.0f} | {row['rss_after_handshake_mb']:.0f} MB | {row['peak_rss_mb']:.0f} MB | "
        f"{sum(rejects.values()):,} | {row['wall_s']:.0f} s |",
        "",
        "| drop code (stage 1's `rejects`) | count |",
        "|---|---|",
        *(f"| `{code}` | {n:,} |" for code, n in sorted(rejects.items(), key=lambda kv: -kv[1])),
        "",
        "Mutations sent: " + ", ".join(f"{k} {v:,}" for k, v in sorted(row["ops"].items(), key=lambda kv: -kv[1])) + ".",
    ]
    if row.get("errors"):
        lines.append("ERROR messages stage 1 received (informational): "
                     + ", ".join(f"`{k}` {v:,}" for k, v in row["errors"].items()) + ".")
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--messages", type=int, default=100_000)
    ap.add_argument("--per-step", type=int, default=1000, help="fuzz messages between two valid steps")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "fuzz_peer.json"))
    args = ap.parse_args()
    import logging

    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    command = f"python bench/fuzz_peer.py --messages {args.messages} --per-step {args.per_step} --seed {args.seed}"

    from mapl_swarm.net.discovery import Discovery, DiscoveryConfig
    from mapl_swarm.net.identity import issue_local, load_identity

    with tempfile.TemporaryDirectory(prefix="mapl-fuzz-") as tmp:
        tmp_path = Path(tmp)
        local = issue_local(tmp_path / "identities", run_id=RUN, num_stages=2)
        identity = load_identity(local.key_file(0), local.cert_file(0), run_id=RUN, stage=0)
        discovery = Discovery(RUN, DiscoveryConfig(host="127.0.0.1"), membership=identity)
        discovery.start()  # forks the DHT: before ZeroMQ, threads and torch
        peer = None
        try:
            from mapl_swarm.config import load_config, model_fingerprint
            from mapl_swarm.data import prepare_data
            from mapl_swarm.metrics import run_manifest
            from mapl_swarm.net.transport import run

            config = tmp_path / "fuzz.toml"
            config.write_text(CONFIG.format(cache=ROOT / ".mapl_cache", out=tmp_path / "out"))
            cfg = load_config(config)
            data = prepare_data(cfg.data, progress=False)
            fingerprint = model_fingerprint(cfg, data.tokenizer.file_hash, data.tokenizer.vocab_size)
            peer = Peer1([sys.executable, "-m", "mapl_swarm", "peer", "--config", str(config), "--stage", "1",
                          "--initial-peer", discovery.visible_maddrs()[0], *local.args(1), "--quiet"])
            fuzzer = Fuzzer(identity, fingerprint, peer, discovery, args)
            row = run(fuzzer.run())
            code = peer.proc.wait(120)
        finally:
            if peer is not None and peer.proc.poll() is None:
                peer.proc.kill()
                peer.proc.wait()
            discovery.close()
        result_file = tmp_path / "out" / "peer_stage1.json"
        result = json.loads(result_file.read_text()) if result_file.exists() else {}
        log = "\n".join(peer.lines)
        crashed = code != 0 or "Traceback" in log or row["unanswered_step"] is not None or bool(row["bad_answers"])
        row.update(per_step=args.per_step, seed=args.seed, exit_code=code, crashes=int(crashed),
                   rejects=result.get("rejects", {}), errors=result.get("errors", {}),
                   peak_rss_mb=result.get("peak_rss_mb", 0.0), date=time.strftime("%Y-%m-%d"),
                   peer_log_tail=peer.lines[-40:] if crashed else [])
    manifest = run_manifest({"messages": args.messages, "per_step": args.per_step, "seed": args.seed})
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"manifest": manifest, "command": command, "result": row}, indent=2))
    md = to_markdown(row, command, manifest)
    out.with_suffix(".md").write_text(md)
    print(md)
    return 1 if crashed else 0


if __name__ == "__main__":
    sys.exit(main())
