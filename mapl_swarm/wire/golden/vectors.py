"""Golden vector tool: regenerate or check ``protocol/vectors/v2``.

    python -m mapl_swarm.wire.golden --out protocol/vectors/v2     # (re)write the vectors
    python -m mapl_swarm.wire.golden --check protocol/vectors/v2   # verify them, exit 1 on failure

Each vector is one ``.mwv`` file: a msgpack array whose items are the message's frames as bin.
``manifest.json`` lists every file with its expectation (``valid`` / ``accept`` / ``invalid`` /
``codebook`` / ``content``), the error code of invalid ones, the valid vector an accept-only one
re-encodes to, the receiver state and outcome of codebook ones (SPEC §5.1), the run, window and
outcome of content ones (SPEC §6.1), and a JSON summary of what the decodable vectors decode to.
``--check`` verifies every expectation against the decoder and that the generator reproduces the
stored files byte for byte.
"""

from __future__ import annotations

import argparse
import hashlib
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgpack

from mapl_swarm.wire.codebook import CODEBOOK_ERRORS_BY_CODE, CodebookError, CodebookLayout, receiver_outcome
from mapl_swarm.wire.content import (ContentError, RunShapes, Window, check_content, check_declared, check_epoch,
                                     check_header, check_sender)
from mapl_swarm.wire.errors import ERRORS_BY_CODE, WireError
from mapl_swarm.wire.frames import decode, decode_header, decode_tensors, encode
from mapl_swarm.wire.message import Message
from mapl_swarm.wire.spec import PROTOCOL_VERSION

from .cases import Case, build_cases

__all__ = [
    "SUFFIX",
    "KINDS",
    "pack_container",
    "unpack_container",
    "summarize",
    "json_value",
    "build_manifest",
    "write_vectors",
    "check_entry",
    "codebook_outcome",
    "content_outcome",
    "check_vectors",
    "main",
]

SUFFIX = ".mwv"
KINDS = ("valid", "accept", "invalid", "codebook", "content")
MANIFEST = "manifest.json"
COMMAND = "mapl_swarm.wire.golden"
"""The module to run with ``python -m`` (named in the manifest)."""
FOLDER = f"protocol/vectors/v{PROTOCOL_VERSION[0]}"
"""Where the vectors of this major live, from the repository root (named in the manifest)."""


def pack_container(frames: list[bytes]) -> bytes:
    """Vector file bytes for ``frames``."""
    return msgpack.packb([bytes(f) for f in frames], use_bin_type=True)


def unpack_container(data: bytes) -> list[bytes]:
    """Frames stored in a vector file."""
    frames = msgpack.unpackb(data, raw=False)
    if not isinstance(frames, list) or not all(isinstance(f, bytes) for f in frames):
        raise ValueError("vector file is not a msgpack array of bin")
    return frames


def json_value(v: Any) -> Any:
    """JSON form of a decoded msgpack value: bytes as ``{"bin": hex}`` (every vector manifest's)."""
    if isinstance(v, bytes):
        return {"bin": v.hex()}
    if isinstance(v, dict):
        return {k: json_value(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [json_value(x) for x in v]
    return v


def summarize(msg: Message) -> dict[str, Any]:
    """JSON summary of a decoded message (bin values as ``{"bin": hex}``, tensors by SHA-256;
    ``epoch`` only when not 0)."""
    return {
        "version": list(msg.version),
        "type": msg.type.name,
        "run": msg.run_id,
        "src": msg.src,
        "dst": msg.dst,
        "step": msg.step,
        "micro": msg.micro,
        "seq": msg.seq,
        "pver": msg.pver,
        "cver": msg.cver,
        **({"epoch": msg.epoch} if msg.epoch else {}),  # absent means 0, as on the wire
        "meta": json_value(msg.meta),
        "tensors": [
            {
                "name": name,
                "dtype": t.dtype,
                "shape": list(t.shape),
                "sha256": hashlib.sha256(t.wire_array().tobytes()).hexdigest(),
            }
            for name, t in msg.tensors.items()
        ],
    }


def _file(c: Case) -> str:
    return f"{c.kind}/{c.name}{SUFFIX}"


def content_outcome(frames: list[bytes], run: dict[str, Any], window: dict[str, Any], epoch: int = 0) -> str:
    """``accept`` or the content error code a receiver of ``run`` with ``window`` at run epoch ``epoch``
    gives (SPEC §6.1 order: the sender, the epoch, the header's other rules and declared sizes,
    decoding with the run's limits, then the tensors). A wire error propagates: content vectors are
    valid frames."""
    shapes, win = RunShapes.from_dict(run), Window.from_dict(window)
    header, _ = decode_header(frames)
    try:
        check_sender(header, shapes)
        check_epoch(header, epoch)
        check_header(header, shapes, win)
        check_declared(header, shapes)
        msg = decode_tensors(header, frames, shapes.decode_limits())
        check_content(msg, shapes, win)
    except ContentError as e:
        return e.code
    return "accept"


def build_manifest(cases: list[Case]) -> dict[str, Any]:
    """Manifest describing ``cases``."""
    by_name = {c.name: c for c in cases if c.kind == "valid"}
    entries = []
    for c in cases:
        e: dict[str, Any] = {"file": _file(c), "expect": c.kind}
        if c.kind == "invalid":
            e["error"] = c.error
            e["error_class"] = ERRORS_BY_CODE[c.error].__name__
        elif c.kind == "codebook":
            e["receiver"] = c.extra["receiver"]
            e["outcome"] = c.extra["outcome"]
            if c.extra["outcome"] in CODEBOOK_ERRORS_BY_CODE:
                e["error_class"] = CODEBOOK_ERRORS_BY_CODE[c.extra["outcome"]].__name__
            e["message"] = summarize(decode(c.frames))
        elif c.kind == "content":
            e["run"] = c.extra["run"]
            e["window"] = c.extra["window"]
            if "epoch" in c.extra:
                e["epoch"] = c.extra["epoch"]
            e["outcome"] = c.extra["outcome"]
            e["message"] = summarize(decode(c.frames))
        else:
            if c.kind == "accept":
                e["equivalent"] = _file(by_name[c.equivalent])
            e["message"] = summarize(decode(c.frames))
        e["description"] = c.description
        entries.append(e)
    return {
        "protocol": f"{PROTOCOL_VERSION[0]}.{PROTOCOL_VERSION[1]}",
        "regenerate": f"python -m {COMMAND} --out {FOLDER}",
        "check": f"python -m {COMMAND} --check {FOLDER}",
        "container": f"each {SUFFIX} file is a msgpack array of bin: the message's frames in order",
        "vectors": entries,
    }


def _manifest_text(manifest: dict[str, Any]) -> str:
    return json.dumps(manifest, indent=1, ensure_ascii=False) + "\n"


def write_vectors(out: Path) -> int:
    """Write every vector and the manifest under ``out``; remove stale vector files. Returns count."""
    cases = build_cases()
    manifest = build_manifest(cases)
    keep = {out / _file(c) for c in cases}
    for kind in KINDS:
        (out / kind).mkdir(parents=True, exist_ok=True)
        for p in (out / kind).glob(f"*{SUFFIX}"):
            if p not in keep:
                p.unlink()
    for c in cases:
        (out / _file(c)).write_bytes(pack_container(c.frames))
    (out / MANIFEST).write_text(_manifest_text(manifest), encoding="utf-8")
    return len(cases)


def _codecs(frames: list[bytes]) -> dict[str, str]:
    return {d["name"]: d["codec"] for d in msgpack.unpackb(frames[0], raw=False)["tensors"]}


def _same(a: list[Any], b: list[Any]) -> bool:
    return len(a) == len(b) and all(bytes(x) == bytes(y) for x, y in zip(a, b))


def codebook_outcome(msg: Message, receiver: dict[str, Any]) -> str:
    """``apply``, ``ignore`` or the error code a codebook receiver in state ``receiver`` gives."""
    layout = CodebookLayout(rounds=receiver["rounds"], groups=receiver["groups"],
                            codebook_size=receiver["codebook_size"], group_size=receiver["group_size"])
    try:
        return receiver_outcome(msg, stream=receiver["stream"], layout=layout, have=receiver["version"],
                                awaiting_resync=receiver["awaiting_resync"],
                                holds_slice=receiver.get("holds_slice", False))
    except CodebookError as e:
        return e.code


def check_entry(root: Path, entry: dict[str, Any]) -> None:
    """Check one manifest entry against the decoder; raise AssertionError saying what differs."""
    frames = unpack_container((root / entry["file"]).read_bytes())
    kind = entry["expect"]
    name = entry["file"]
    if kind == "invalid":
        try:
            decode(frames)
        except WireError as e:
            if e.code != entry["error"]:
                raise AssertionError(f"{name}: expected {entry['error']}, got {e.code}: {e}") from e
            return
        except Exception as e:  # a decoder must never raise anything else
            raise AssertionError(f"{name}: raised {type(e).__name__}: {e}") from e
        raise AssertionError(f"{name}: accepted, expected {entry['error']}")
    try:
        msg = decode(frames)
    except WireError as e:
        raise AssertionError(f"{name}: rejected with {e.code}: {e}") from e
    got = json.loads(json.dumps(summarize(msg), ensure_ascii=False))
    if got != entry["message"]:
        raise AssertionError(f"{name}: decodes to {got}, manifest says {entry['message']}")
    if kind == "codebook":
        outcome = codebook_outcome(msg, entry["receiver"])
        if outcome != entry["outcome"]:
            raise AssertionError(f"{name}: codebook receiver says {outcome}, expected {entry['outcome']}")
    if kind == "content":
        try:
            outcome = content_outcome(frames, entry["run"], entry["window"], entry.get("epoch", 0))
        except WireError as e:
            raise AssertionError(f"{name}: rejected with {e.code} under the run's limits: {e}") from e
        if outcome != entry["outcome"]:
            raise AssertionError(f"{name}: content checks say {outcome}, expected {entry['outcome']}")
    if kind in ("valid", "codebook", "content"):
        target = frames
    elif kind == "accept":
        target = unpack_container((root / entry["equivalent"]).read_bytes())
        try:
            msg.version = decode(target).version
        except WireError as e:
            raise AssertionError(f"{name}: its equivalent {entry['equivalent']} is rejected: {e.code}") from e
    else:
        raise AssertionError(f"{name}: unknown expectation {kind!r}")
    again = encode(msg, compress=_codecs(target))
    if not _same(again, target):
        what = "itself" if kind == "valid" else entry["equivalent"]
        raise AssertionError(f"{name}: re-encoding does not reproduce {what} byte for byte")


def check_vectors(root: Path) -> list[str]:
    """Every problem found in the vectors under ``root`` (empty when all is well)."""
    problems: list[str] = []
    try:
        stored = json.loads((root / MANIFEST).read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        return [f"cannot read {root / MANIFEST}: {e}"]
    for entry in stored.get("vectors", []):
        try:
            check_entry(root, entry)
        except (AssertionError, OSError, ValueError) as e:
            problems.append(str(e))
    cases = build_cases()
    if (root / MANIFEST).read_text(encoding="utf-8") != _manifest_text(build_manifest(cases)):
        problems.append(f"{MANIFEST} differs from what the generator writes")
    expected = {_file(c): pack_container(c.frames) for c in cases}
    present = {str(p.relative_to(root)) for k in KINDS for p in (root / k).glob(f"*{SUFFIX}")}
    for f in sorted(present - expected.keys()):
        problems.append(f"{f}: stored but not generated (stale)")
    for f, data in expected.items():
        if f not in present:
            problems.append(f"{f}: generated but not stored")
        elif (root / f).read_bytes() != data:
            problems.append(f"{f}: stored bytes differ from the generator's")
    return problems


def vectors_main(argv: list[str] | None, *, command: str, description: str, write: Callable[[Path], str],
                 check: Callable[[Path], list[str]], checked: Callable[[Path], str]) -> int:
    """The command line of a vector generator (this one, the identities', the averaging's): ``--out
    DIR`` writes (``write`` says what it wrote), ``--check DIR`` prints each of ``check``'s problems
    and a summary line (``checked`` names what was checked). Returns the exit status."""
    p = argparse.ArgumentParser(prog=f"python -m {command}", description=description)
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("--out", type=Path, help="directory to (re)write the vectors into")
    g.add_argument("--check", type=Path, help="directory of stored vectors to verify")
    args = p.parse_args(argv)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        print(write(args.out))
        return 0
    problems = check(args.check)
    for line in problems:
        print(f"FAIL {line}")
    print(f"{checked(args.check)}: {'OK' if not problems else f'{len(problems)} problem(s)'}")
    return 0 if not problems else 1


def manifest_text(manifest: dict[str, Any]) -> str:
    """A one-file vector manifest as stored (JSON, one space of indent, keys in the given order)."""
    return json.dumps(manifest, indent=1) + "\n"


def check_manifest_file(root: Path, name: str, build: Callable[[], dict[str, Any]],
                        recheck: Callable[[dict[str, Any]], list[str]]) -> list[str]:
    """Every problem with the one-file manifest ``root/name``: ``recheck``'s (each entry re-checked
    by the reference from its stored inputs), then the whole file against ``build()``'s text."""
    try:
        text = (root / name).read_text(encoding="utf-8")
        stored = json.loads(text)
    except (OSError, ValueError) as exc:
        return [f"cannot read {root / name}: {exc}"]
    problems = recheck(stored)
    if text != manifest_text(build()):
        problems.append(f"{root / name} differs from what the generator writes (--out)")
    return problems


def manifest_main(argv: list[str] | None, *, command: str, description: str, build: Callable[[], dict[str, Any]],
                  check: Callable[[Path], list[str]], name: str = "manifest.json") -> int:
    """:func:`vectors_main` of a generator whose vectors are one manifest file (``name``), written
    from ``build()`` as :func:`manifest_text`."""
    def write(out: Path) -> str:
        (out / name).write_text(manifest_text(build()), encoding="utf-8")
        return f"wrote {out / name}"

    return vectors_main(argv, command=command, description=description, write=write, check=check,
                        checked=lambda root: str(root / name))


def main(argv: list[str] | None = None) -> int:
    """Command line entry point; returns the exit status."""
    def checked(root: Path) -> str:
        n = len(json.loads((root / MANIFEST).read_text(encoding="utf-8")).get("vectors", [])) if (
            root / MANIFEST).exists() else 0
        return f"{n} vectors checked in {root}"

    return vectors_main(argv, command=COMMAND, description=__doc__.split("\n")[0],
                        write=lambda out: f"wrote {write_vectors(out)} vectors and {MANIFEST} to {out}",
                        check=check_vectors, checked=checked)

