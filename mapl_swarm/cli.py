"""``mapl-swarm`` command line: argument parsing and logging set-up only.

User mistakes (bad config, missing files, refused handshakes...) raise :class:`MaplError`; they are
printed on one line (``mapl-swarm: error: ...``) with exit status 2, never as a traceback.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import tomllib
from pathlib import Path
from typing import Any

from mapl_swarm.errors import ConfigError, MaplError

log = logging.getLogger("mapl_swarm")

__all__ = ["main", "build_parser", "parse_overrides"]


def parse_overrides(items: list[str]) -> dict[str, Any]:
    """``["run.steps=20", "compression.codec=\"none\""]`` -> nested dict; values parse as TOML
    (bare words fall back to strings)."""
    out: dict[str, Any] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"--set expects SECTION.KEY=VALUE, got {item!r}")
        try:
            value = tomllib.loads(f"v = {raw}")["v"]
        except tomllib.TOMLDecodeError:
            value = raw
        parts = key.split(".")
        node = out
        for p in parts[:-1]:
            node = node.setdefault(p, {})
            if not isinstance(node, dict):
                raise ConfigError(f"--set {key}: {p} is not a table")
        node[parts[-1]] = value
    return out


def _load(args: argparse.Namespace):
    from mapl_swarm.config import config_from_dict, load_config

    overrides = parse_overrides(args.set or [])
    if args.preset:
        overrides["preset"] = args.preset
    if args.config:
        return load_config(args.config, overrides)
    return config_from_dict(overrides, "--set")


def _config_args(args: argparse.Namespace) -> list[str]:
    """The config options of this invocation, to hand to child peer processes."""
    out = (["--config", args.config] if args.config else []) + (["--preset", args.preset] if args.preset else [])
    for item in args.set or []:
        out += ["--set", item]
    return out


def _cmd_prepare(args: argparse.Namespace) -> int:
    from mapl_swarm.data import prepare_data

    cfg = _load(args)
    data = prepare_data(cfg.data, progress=not args.quiet)
    m = data.meta
    print(f"prepared {data.path}: {m.get('train_tokens')} train / {m.get('val_tokens')} val tokens, "
          f"vocab {data.tokenizer.vocab_size}, corpus {m.get('corpus_fingerprint', '')[:16]}")
    return 0


def _cmd_train(args: argparse.Namespace) -> int:
    from mapl_swarm.pipeline.trainer import train

    cfg = _load(args)
    s = train(cfg, resume=args.resume, progress=not args.quiet)
    init = f"{s.initial_val_loss:.4f} -> " if s.initial_val_loss is not None else ""
    print(f"codec {cfg.compression.codec} P={cfg.run.num_stages}: val loss {init}{s.final_val_loss:.4f}, "
          f"train loss {s.final_train_loss:.4f}, {s.tokens_per_s:.0f} tokens/s")
    for b, bpt in enumerate(s.bytes_per_token):
        print(f"  boundary {b}->{b + 1}: {bpt['forward']:.1f} B/token forward, "
              f"{bpt['backward']:.1f} B/token backward (measured payload)")
    print(f"metrics: {cfg.run.out_dir}/metrics.jsonl; checkpoints: {cfg.run.out_dir}/checkpoints")
    return 0


def _cmd_peer(args: argparse.Namespace) -> int:
    from mapl_swarm.peer.main import run_peer

    cfg = _load(args)
    secret = args.secret_file and open(args.secret_file, "rb").read().strip()
    peers = list(args.initial_peer or [])
    if args.initial_peers_file:
        from mapl_swarm.peer.main import read_peers_file

        peers += read_peers_file(args.initial_peers_file, cfg.net.timeout_s)
    result = run_peer(cfg, args.stage, initial_peers=peers, resume=args.resume,
                      progress=not args.quiet, secret=secret or None)
    if args.stage == 0 and result.train_losses:
        print(f"stage 0 done: {len(result.train_losses)} steps, last loss {result.train_losses[-1]:.4f}, "
              f"{result.tokens / max(result.wall_s, 1e-9):.0f} tokens/s, {result.bad_frames} bad frames dropped")
    return 0


def _cmd_dht(args: argparse.Namespace) -> int:
    from mapl_swarm.net.discovery import run_bootstrap_node

    def ready(maddrs: list[str]) -> None:
        if args.maddr_file:
            Path(args.maddr_file).parent.mkdir(parents=True, exist_ok=True)
            tmp = Path(args.maddr_file + ".tmp")
            tmp.write_text("\n".join(maddrs) + "\n")
            tmp.replace(args.maddr_file)
        print("DHT bootstrap node running; start peers with one of:")
        for m in maddrs:
            print(f"  --initial-peer {m}")
        sys.stdout.flush()

    run_bootstrap_node(args.host, args.port, announce_host=args.announce_host, ready=ready)
    return 0


def _cmd_launch(args: argparse.Namespace) -> int:
    from mapl_swarm.peer.launch import launch

    cfg = _load(args)
    s = launch(cfg, _config_args(args) + (["--resume"] if args.resume else []), progress=not args.quiet)
    val = f", val loss {s.val_history[-1][1]:.4f}" if s.val_history else ""
    last = f"{s.train_losses[-1]:.4f}" if s.train_losses else "n/a"
    print(f"swarm {cfg.compression.codec} P={cfg.run.num_stages}: {len(s.train_losses)} steps, train loss "
          f"{last}{val}, {s.tokens / max(s.wall_s, 1e-9):.0f} tokens/s")
    for b, link in enumerate(s.links):
        print(f"  link {b}->{b + 1}: {link['forward_payload']:.1f} B/token forward, "
              f"{link['backward_payload']:.1f} B/token backward payload; "
              f"{link['forward_wire']:.1f} / {link['backward_wire']:.1f} B/token on the wire")
    out = Path(cfg.run.out_dir)
    print(f"metrics: {out}/metrics_stage{{0..{cfg.run.num_stages - 1}}}.jsonl; checkpoints: {out}/checkpoints; "
          f"manifest: {out}/manifest.json")
    return 0


def _cmd_sweep(args: argparse.Namespace) -> int:
    from mapl_swarm.experiments import load_grid, run_sweep
    from mapl_swarm.experiments.publish import publish

    grid = load_grid(args.grid)
    command = f"mapl-swarm sweep --grid {args.grid}" + (f" --out {args.out}" if args.out else "")
    rep = run_sweep(grid, args.out, progress=not args.quiet, only=args.only, command=command,
                    report_only=args.report_only)
    print(f"sweep {grid.name}: {len(rep.ran)} run, {len(rep.skipped_done)} already finished, "
          f"{len(rep.failed)} failed")
    for f in rep.failed:
        print(f"failed: {f}")
    print(f"summary: {rep.summary_path}")
    for p in rep.plots:
        print(f"plot: {p}")
    if args.publish:
        for p in publish(rep.summary_path, rep.plots, args.publish, benchmarks=args.benchmarks, name=grid.name):
            print(f"published: {p}")
    return 1 if rep.failed else 0


def _cmd_lab(args: argparse.Namespace) -> int:
    from mapl_swarm.lab.swarm import run_lab_swarm

    cfg = _load(args)
    s = run_lab_swarm(cfg, _config_args(args), rate_mbit=args.rate_mbit, subnet=args.subnet)
    print(f"lab swarm {cfg.compression.codec} P={cfg.run.num_stages} over {args.rate_mbit:g} Mbit/s tbf links: "
          f"{len(s.train_losses)} steps, train loss {s.train_losses[-1]:.4f}, "
          f"{s.tokens / max(s.wall_s, 1e-9):.0f} tokens/s")
    return 0


def _add_config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", help="TOML run config (see peers/)")
    p.add_argument("--preset", help="model preset: tiny, 150M, 500M, 1B")
    p.add_argument("--set", action="append", metavar="SECTION.KEY=VALUE",
                   help="override one config value (repeatable), e.g. --set run.steps=20")
    p.add_argument("--quiet", action="store_true", help="no progress bar")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mapl-swarm", description=__doc__.splitlines()[0])
    parser.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING, ERROR")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("prepare", help="build the tokenizer and token shards")
    _add_config_args(p)
    p.set_defaults(func=_cmd_prepare)

    p = sub.add_parser("train", help="train all stages in this process")
    _add_config_args(p)
    p.add_argument("--resume", action="store_true", help="resume from the newest complete checkpoint")
    p.set_defaults(func=_cmd_train)

    p = sub.add_parser("peer", help="run one pipeline stage as a network peer")
    _add_config_args(p)
    p.add_argument("--stage", type=int, required=True, help="stage index, 0 .. num_stages-1")
    p.add_argument("--initial-peer", action="append", metavar="MADDR", help="DHT bootstrap multiaddr")
    p.add_argument("--resume", action="store_true", help="resume from the newest complete checkpoint")
    p.add_argument("--initial-peers-file", metavar="PATH",
                   help="file of DHT multiaddrs written by `mapl-swarm dht --maddr-file` (waited for)")
    p.add_argument("--secret-file", help="file holding the run's shared secret (adds HMAC tags)")
    p.set_defaults(func=_cmd_peer)

    p = sub.add_parser("dht", help="run a DHT bootstrap node and print its multiaddrs")
    p.add_argument("--host", default="0.0.0.0")
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--announce-host", default=None, help="address other hosts dial (needs --port)")
    p.add_argument("--maddr-file", metavar="PATH", help="also write the multiaddrs to this file")
    p.set_defaults(func=_cmd_dht)

    p = sub.add_parser("sweep", help="run an experiment grid in-process; tables and plots")
    p.add_argument("--grid", required=True, help="grid TOML file (see bench/grids/)")
    p.add_argument("--out", help="output folder (default: the grid's out_dir)")
    p.add_argument("--only", metavar="TEXT", help="run only the runs whose id contains TEXT")
    p.add_argument("--report-only", action="store_true", help="write tables and plots from finished runs only")
    p.add_argument("--publish", metavar="DIR", help="copy summary.md and plots into DIR (e.g. bench/results/sweep-cpu)")
    p.add_argument("--benchmarks", metavar="FILE",
                   help="with --publish: replace the <!-- sweep:NAME:begin/end --> section of FILE (BENCHMARKS.md)")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    p.set_defaults(func=_cmd_sweep)

    p = sub.add_parser("lab", help="run the compose topology in network namespaces with tbf-shaped links (root)")
    _add_config_args(p)
    p.add_argument("--rate-mbit", type=float, default=20.0, help="tbf rate of every link, Mbit/s (0: unshaped)")
    p.add_argument("--subnet", type=int, default=77, help="lab addresses are 10.SUBNET.0.x")
    p.set_defaults(func=_cmd_lab)

    p = sub.add_parser("launch", help="start a DHT and every stage peer on this machine")
    _add_config_args(p)
    p.add_argument("--resume", action="store_true", help="every peer resumes from the newest complete checkpoint")
    p.set_defaults(func=_cmd_launch)
    return parser


def _terminate(signum: int, frame: object) -> None:
    """SIGTERM unwinds like Ctrl-C, so DHT children and sockets are closed by finally blocks."""
    raise SystemExit(128 + signum)


def main(argv: list[str] | None = None) -> int:
    signal.signal(signal.SIGTERM, _terminate)
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=getattr(logging, str(args.log_level).upper(), logging.INFO),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    try:
        return int(args.func(args) or 0)
    except MaplError as exc:
        print(f"mapl-swarm: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("mapl-swarm: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
