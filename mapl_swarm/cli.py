"""``mapl-swarm`` command line: argument parsing and logging set-up only.

User mistakes (bad config, missing files, refused handshakes...) raise :class:`MaplError`; they are
printed on one line (``mapl-swarm: error: ...``) with exit status 2 (3 for a NaN/Inf in the
process's own compute, :class:`~mapl_swarm.errors.NonFiniteError`), never as a traceback.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import signal
import sys
import tomllib
from pathlib import Path
from typing import Any

from mapl_swarm.errors import ConfigError, MaplError
from mapl_swarm.procs import raise_open_file_limit

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
    """The run config of this invocation. Called before anything imports torch, so that a config
    mistake is answered at once."""
    from mapl_swarm.config import config_from_dict, load_config

    overrides = parse_overrides(args.set or [])
    if args.preset:
        overrides["preset"] = args.preset
    if args.config:
        return load_config(args.config, overrides)
    return config_from_dict(overrides, "--set")


def _config_args(args: argparse.Namespace) -> list[str]:
    """The config and logging options of this invocation, to hand to child peer processes (the log
    level only when it is not the default, INFO, which the children have anyway)."""
    out = (["--config", args.config] if args.config else []) + (["--preset", args.preset] if args.preset else [])
    for item in args.set or []:
        out += ["--set", item]
    return out + (["--log-level", args.log_level] if args.log_level != "INFO" else [])


def _cmd_prepare(args: argparse.Namespace) -> int:
    cfg = _load(args)
    from mapl_swarm.data import prepare_data

    data = prepare_data(cfg.data, progress=not args.quiet)
    m = data.meta
    print(f"prepared {data.path}: {m.get('train_tokens')} train / {m.get('val_tokens')} val tokens, "
          f"vocab {data.tokenizer.vocab_size}, corpus {m.get('corpus_fingerprint', '')[:16]}")
    return 0


def _cmd_train(args: argparse.Namespace) -> int:
    cfg = _load(args)
    from mapl_swarm.pipeline.trainer import train

    s = train(cfg, resume=args.resume, progress=not args.quiet)
    init = f"{s.initial_val_loss:.4f} -> " if s.initial_val_loss is not None else ""
    print(f"codec {cfg.compression.codec} P={cfg.pipeline.num_stages}: val loss {init}{s.final_val_loss:.4f}, "
          f"train loss {s.final_train_loss:.4f}, {s.tokens_per_s:.0f} tokens/s")
    print("  bytes/token per boundary, payload (tensor bytes that would cross it; in-process, no wire):")
    for b, bpt in enumerate(s.bytes_per_token):
        print(f"  boundary {b}->{b + 1}: payload {bpt['forward']:.1f} B/token forward, "
              f"{bpt['backward']:.1f} B/token backward")
    print(f"metrics: {cfg.run.out_dir}/metrics.jsonl; checkpoints: {cfg.run.out_dir}/checkpoints")
    return 0


def _membership(args: argparse.Namespace, cfg: Any, stage: int | None = None, *, peer: bool = False):
    """What makes this process a member of run ``cfg``, read and checked before any other work: the
    certified identity of ``--cert`` (with ``--peer-key``; for a peer of stage ``stage``, any of its
    certificate's with None; for a bootstrap node only the run and authority it names), or None
    with ``--insecure``."""
    if args.key_file:
        raise ConfigError(f"--key-file {args.key_file}: peers no longer share a run key; give each peer its own "
                          f"identity: --peer-key FILE --cert FILE (`mapl-swarm keys local` issues one per stage, "
                          f"`keys peer` / `keys request` / `keys issue` one per host)")
    if getattr(args, "peer_key", None) and not args.cert:
        raise ConfigError("--peer-key goes with --cert (a certified peer)")
    if args.insecure:
        return None
    from mapl_swarm.net.identity import load_identity

    if stage is None and not peer:  # a bootstrap node: it trusts the authority of the certificate it is given
        return _trusted_authority(args.cert)
    if not args.peer_key:
        raise ConfigError("--cert needs --peer-key FILE (this host's peer key, from `mapl-swarm keys peer`)")
    return load_identity(args.peer_key, args.cert, run_id=cfg.run.run_id, stage=stage, revocations=args.revocations)


def _trusted_authority(cert_path: str):
    """The run and authority a certificate names (its signature checked, not expired): what a
    bootstrap node, or a reader of certified records without a usable key, trusts."""
    from mapl_swarm.net.discovery import TrustedAuthority
    from mapl_swarm.net.identity import CertificateBody, CertificateError, read_signed, verify_certificate

    cert = read_signed(cert_path, "certificate")
    try:
        body = CertificateBody.decode(cert.body)
        verify_certificate(cert, authority=body.authority, run_id=body.run)  # its signature, not expired
    except CertificateError as exc:
        raise ConfigError(f"certificate {cert_path}: {exc} ({exc.code})") from None
    return TrustedAuthority(body.run, body.authority)


def _cmd_keys(args: argparse.Namespace) -> int:
    raise ConfigError("keys: a subcommand (authority, peer, request, issue, revoke, local, show); peers no longer "
                      "share a run key: every peer gets its own key and a certificate")


def _cmd_keys_authority(args: argparse.Namespace) -> int:
    from mapl_swarm.net.identity import create_authority

    authority = create_authority(args.out, force=args.force)
    print(f"wrote run authority key {args.out} (key id {authority.key_id}, mode 0600); keep it with the operator: "
          f"it issues every peer's certificate (`mapl-swarm keys issue`)")
    return 0


def _cmd_keys_local(args: argparse.Namespace) -> int:
    from mapl_swarm.net.identity import issue_local

    cfg = _load(args)
    counts = [cfg.replicas_of(s) for s in range(cfg.pipeline.num_stages)]
    local = issue_local(args.out, run_id=cfg.run.run_id, num_stages=cfg.pipeline.num_stages,
                        authority_file=args.authority, replicas=counts)
    replicas = "" if max(counts) == 1 else f", and stage<k>r<r>.key|cert for replica r > 0 ({counts} per stage)"
    print(f"identities of run {cfg.run.run_id!r} in {local.folder}: stage<k>.key and stage<k>.cert for "
          f"k = 0..{cfg.pipeline.num_stages - 1}{replicas} (authority {local.authority.key_id} at "
          f"{args.authority or local.folder / 'authority.key'}); existing ones that still fit are kept")
    return 0


def _cmd_keys_peer(args: argparse.Namespace) -> int:
    from mapl_swarm.net.identity import create_peer_key

    key = create_peer_key(args.out, force=args.force)
    print(f"wrote peer key {args.out} (key id {key.key_id}, mode 0600); it never leaves this host: send the "
          f"operator a request (`mapl-swarm keys request`)")
    return 0


def _stage_list(text: str) -> list[int]:
    """``--stages 1`` or ``--stages 0,2``."""
    try:
        stages = [int(s) for s in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected stage numbers separated by commas, got {text!r}") from None
    if any(s < 0 for s in stages):
        raise argparse.ArgumentTypeError(f"stages are 0-based, got {text!r}")
    return stages


def _cmd_keys_request(args: argparse.Namespace) -> int:
    from mapl_swarm.net.identity import load_peer_key, make_request, write_signed

    key = load_peer_key(args.key)
    write_signed(args.out, make_request(key, args.name, args.stages), force=args.force)
    print(f"wrote certificate request {args.out} for {args.name!r}, stage(s) {sorted(set(args.stages))} (peer key "
          f"{key.key_id}); it holds public keys only: send it to the run's operator")
    return 0


def _cmd_keys_issue(args: argparse.Namespace) -> int:
    from mapl_swarm.net.identity import CertificateBody, issue, load_authority, read_signed, write_signed

    authority = load_authority(args.authority)
    cert = issue(authority, read_signed(args.request, "request"), run_id=args.run_id, stages=args.stages,
                 roles=args.role or [], valid_s=round(args.days * 86400))
    write_signed(args.out, cert, force=args.force)
    body = CertificateBody.decode(cert.body)
    print(f"wrote certificate {args.out}: {body.name!r} may serve stage(s) {list(body.stages)} of run {body.run!r}"
          f"{' and ' + ', '.join(body.roles) if body.roles else ''} for {args.days:g} day(s) (authority "
          f"{authority.key_id}, serial {body.serial})")
    return 0


def _cmd_keys_revoke(args: argparse.Namespace) -> int:
    from mapl_swarm.net.identity import RevocationsBody, load_authority, read_signed, revoke, write_signed

    authority = load_authority(args.authority)
    previous = read_signed(args.out, "revocations") if Path(args.out).exists() else None
    signed = revoke(authority, args.serial, run_id=args.run_id, previous=previous)
    write_signed(args.out, signed, force=True)
    body = RevocationsBody.decode(signed.body)
    print(f"wrote revocation list {args.out} of run {body.run!r}: serial(s) {list(body.serials)} revoked")
    return 0


def _cmd_keys_show(args: argparse.Namespace) -> int:
    from mapl_swarm.net.identity import (
        CERTIFICATE_HEADER,
        REVOCATIONS_HEADER,
        CertificateBody,
        RequestBody,
        RevocationsBody,
        key_id,
        read_signed,
    )
    from mapl_swarm.when import iso_time

    try:
        head = Path(args.file).read_text(encoding="ascii", errors="replace").split("\n", 1)[0]
    except OSError as exc:
        raise ConfigError(f"{args.file}: cannot read it: {exc.strerror}") from None
    kind = {CERTIFICATE_HEADER: "certificate", REVOCATIONS_HEADER: "revocations"}.get(head, "request")
    signed = read_signed(args.file, kind)  # type: ignore[arg-type]
    if kind == "revocations":
        rev = RevocationsBody.decode(signed.body)
        print(f"revocation list of run {rev.run!r}: serial(s) {list(rev.serials)}, issued {iso_time(rev.issued)}, "
              f"authority {key_id(rev.authority)}")
        return 0
    if kind == "request":
        req = RequestBody.decode(signed.body)
        print(f"certificate request of {req.name!r}: stage(s) {list(req.stages)}, peer key {key_id(req.sign_key)}")
        return 0
    body = CertificateBody.decode(signed.body)

    print(f"certificate of {body.name!r}: run {body.run!r}, stage(s) {list(body.stages)}, roles {list(body.roles)}, "
          f"valid {iso_time(body.not_before)} to {iso_time(body.not_after)}, serial {body.serial}, peer key "
          f"{key_id(body.sign_key)}, authority {key_id(body.authority)} (signature not checked: a peer checks it "
          f"against its run's authority)")
    return 0


def _auto_resume(cfg: Any, stage: int) -> bool | None:
    """``peer --auto-resume``: whether stage ``stage`` resumes (its folder holds a checkpoint of it),
    or None when its newest checkpoint is already at ``run.steps`` (the run is over: nothing to do)."""
    from mapl_swarm.pipeline.checkpoint import stage_steps

    steps = stage_steps(cfg.run.out_dir, stage)
    if steps and steps[-1] >= cfg.run.steps:
        print(f"mapl-swarm: stage {stage}: the run is over (checkpoint of step {steps[-1]}, run.steps "
              f"{cfg.run.steps}); nothing to do")
        return None
    log.info("stage %d: %s", stage, f"resuming (checkpoint steps {steps} under {cfg.run.out_dir})" if steps
             else f"starting fresh (no checkpoint of this stage under {cfg.run.out_dir})")
    return bool(steps)


def _initial_peers(args: argparse.Namespace, wait_s: float) -> list[str]:
    """The DHT multiaddrs of ``--initial-peer`` and ``--initial-peers-file`` (waited for up to ``wait_s``)."""
    from mapl_swarm.peer.main import read_peers_file

    peers = list(args.initial_peer or [])
    if args.initial_peers_file:
        peers += read_peers_file(args.initial_peers_file, wait_s)
    return peers


def _initial_peers_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--initial-peer", action="append", metavar="MADDR",
                   help="multiaddr of a running DHT node, as printed by `mapl-swarm dht` (repeatable)")
    p.add_argument("--initial-peers-file", metavar="PATH",
                   help="file of DHT multiaddrs written by `mapl-swarm dht --maddr-file` (waited for)")


def _cmd_peer(args: argparse.Namespace) -> int:
    raise_open_file_limit()
    if args.launched:  # launch gives each peer a process group of its own: a background group may
        signal.signal(signal.SIGTTOU, signal.SIG_IGN)  # still write to the terminal (with `stty tostop`)
    cfg = _load(args)
    if args.stage is None and not args.join:
        raise ConfigError("peer: --stage K is required (or --join, to join a running swarm at the stage it needs most)")
    if args.stage is not None:  # before the certificate is read (its refusal would not name the range)
        cfg.check_stage(args.stage)
    membership = _membership(args, cfg, args.stage, peer=True)
    from mapl_swarm.net.dht_node import precheck_initial_peers
    from mapl_swarm.peer.main import run_peer

    resume = args.resume
    if args.auto_resume:
        resume = _auto_resume(cfg, args.stage)
        if resume is None:
            return 0
    peers = _initial_peers(args, cfg.net.timeout_s)
    precheck_initial_peers(peers or cfg.net.initial_peers)  # a mistyped address, before torch loads
    if args.join and not cfg.replicas.enabled:
        raise ConfigError("--join takes a replica into a running swarm with replicas: set replicas.enabled = true "
                          "(the swarm's configuration)")
    result = run_peer(cfg, args.stage, membership=membership, initial_peers=peers, resume=resume,
                      progress=not args.quiet, joining=args.join)
    if result.end != "finished":  # drained or stopped: one line (under launch, the launcher's line)
        if args.launched:
            log.info("%s", result.end_note)
        else:
            print(f"mapl-swarm: {result.end_note}")
        return 0
    if result.stage == 0 and result.train_losses:
        print(f"stage 0 done: {len(result.train_losses)} steps, last loss {result.train_losses[-1]:.4f}, "
              f"{result.tokens / max(result.wall_s, 1e-9):.0f} tokens/s, {result.bad_frames} bad frames dropped")
    elif result.stage > 0:
        sent = sum(sum(kinds.values()) for kinds in result.wire_tx.values())
        rejoined = f", {len(result.rejoins)} rejoin(s)" if result.rejoins else ""
        print(f"stage {result.stage} done: steps {result.start_step}..{cfg.run.steps} in {result.wall_s:.1f} s, "
              f"{sent / 1e6:.1f} MB sent, {result.bad_frames} bad frames dropped{rejoined}")
    return 0


def _cmd_dht(args: argparse.Namespace) -> int:
    raise_open_file_limit()
    membership = _membership(args, None)
    from mapl_swarm.net.discovery import run_bootstrap_node

    if membership is None:
        log.warning("INSECURE: DHT bootstrap node without a certificate (--insecure): it accepts unsigned records, "
                    "so anyone can announce a stage")

    if args.maddr_file:  # never hand out an earlier node's addresses while this one starts
        Path(args.maddr_file).unlink(missing_ok=True)

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

    try:
        run_bootstrap_node(args.host, args.port, announce_host=args.announce_host, identity_path=args.identity,
                           ready=ready, membership=membership)
    except (KeyboardInterrupt, _Terminated) as stop:  # a bootstrap node's normal end (docker stop, Ctrl-C)
        log.info("DHT bootstrap node stopped (%s)", "SIGTERM" if isinstance(stop, _Terminated) else "SIGINT")
    return 0


RELAY_PEERS_WAIT_S = 60.0
"""How long ``relay --initial-peers-file`` waits for the file."""


def _cmd_relay(args: argparse.Namespace) -> int:
    if args.insecure:
        raise ConfigError("a relay serves the certified members of one run: give --cert (any certificate of the run)")
    trust = _membership(args, None)
    from mapl_swarm.net.identity import load_identity, peer_key_at
    from mapl_swarm.net.relay import run_relay

    peers = _initial_peers(args, RELAY_PEERS_WAIT_S)
    host = args.announce_host or args.host
    if peers and host in ("0.0.0.0", "::", ""):
        raise ConfigError(f"--initial-peer: a relay announced in the DHT needs the address members dial: give "
                          f"--announce-host (it listens on {args.host!r})")
    key = peer_key_at(args.relay_key)
    discovery = None
    if peers:  # announced under the run's relay key, signed by the member whose key the relay's is
        try:
            identity = load_identity(args.relay_key, args.cert, run_id=trust.run_id)
        except ConfigError as exc:
            raise ConfigError(f"--initial-peer: a relay announces itself in the DHT as the member whose key it "
                              f"holds, so --relay-key must be the peer key --cert was issued to (a member host's "
                              f"--peer-key): {exc}") from None
        from mapl_swarm.net.discovery import Discovery, DiscoveryConfig

        discovery = Discovery(trust.run_id, DiscoveryConfig(initial_peers=tuple(peers), client_mode=True),
                              membership=identity)
        discovery.start()  # forks the DHT process: before the relay's event loop

    def ready(port: int, public: bytes) -> None:
        address = f"{host}:{port}#{public.hex()}"
        print(f"relay of run {trust.run_id!r} on {args.host}:{port}; on each dial-out peer set "
              f"net.relay = \"{address}\"" + (" (or nothing: it is announced in the DHT)" if discovery else ""),
              flush=True)
        if discovery is not None:
            discovery.announce_relay(address)

    try:
        run_relay(trust, key, args.host, args.port, ready=ready, revocations=args.revocations)
    except (KeyboardInterrupt, _Terminated) as stop:  # its normal end
        log.info("relay stopped (%s)", "SIGTERM" if isinstance(stop, _Terminated) else "SIGINT")
    finally:
        if discovery is not None:
            discovery.withdraw_relay()
            discovery.close()
    return 0


def _cmd_status(args: argparse.Namespace) -> int:
    cfg = _load(args)
    membership = _membership(args, None)  # any certificate of the run: records are checked against its authority
    from mapl_swarm.net.dht_node import precheck_initial_peers

    peers = _initial_peers(args, cfg.net.timeout_s) or list(cfg.net.initial_peers)
    if not peers:
        raise ConfigError("status reads a running swarm's DHT: give --initial-peer MADDR (as `mapl-swarm dht` "
                          "printed it) or --initial-peers-file PATH")
    precheck_initial_peers(peers)
    from dataclasses import asdict

    from mapl_swarm.net.discovery import Discovery, DiscoveryConfig

    P = cfg.pipeline.num_stages
    dht = DiscoveryConfig(initial_peers=tuple(peers), client_mode=True)
    with Discovery(cfg.run.run_id, dht, membership=membership) as discovery:
        if args.watch:
            from mapl_swarm.metrics.watch import watch

            if args.json:
                raise ConfigError("status: --watch draws a table; --json prints one snapshot (give one of them)")
            if not args.every > 0 or (args.count is not None and args.count < 1):
                raise ConfigError(f"status --watch: --every must be > 0 and --count >= 1, got {args.every} and "
                                  f"{args.count}")
            try:
                watch(lambda: [discovery.stage_peers(k) for k in range(P)], run_id=cfg.run.run_id,
                      status_s=dht.status_s, every_s=args.every, count=args.count)
            except KeyboardInterrupt:
                pass
            return 0
        stages = [discovery.stage_peers(k) for k in range(P)]
    serving = [sum(1 for p in ps if p.contact and not p.silent(dht.status_s)) for ps in stages]
    if args.json:
        print(json.dumps({"run": cfg.run.run_id, "stages": [[{**asdict(p), "silent": p.silent(dht.status_s)} for p in ps]
                                                            for ps in stages]}, indent=1))
    else:
        print(f"run {cfg.run.run_id!r}: {P} stages, {sum(serving)} peers serving")
        for k, ps in enumerate(stages):
            print(f"stage {k}: {serving[k]} serving" + ("" if ps else ", no record"))
            for p in ps:
                print(f"  {p.peer_id[:8]}…{p.peer_id[-6:]}  {_status_line(p, dht.status_s)}")
    if not all(serving):
        missing = ", ".join(str(k) for k, n in enumerate(serving) if not n)
        print(f"mapl-swarm: no peer serves stage(s) {missing}", file=sys.stderr)
        return 1
    return 0


def _status_line(p: Any, status_s: float) -> str:
    """One peer of ``status``: its state, step, rate and queue, where it serves, and how old that is
    (a killed peer goes silent within three status periods; its records lapse later)."""
    st = p.status
    figures = (f"{st.get('state', '?'):<11} step {st['step']:<6} {st['tokens_per_s']:>9,.0f} tok/s  queue "
               f"{st['queue']:<3}" if {"step", "tokens_per_s", "queue"} <= st.keys() else "no status record".ljust(46))
    if "averaging" in st:  # a replica: its scheme and the bytes its last averaging round sent
        figures += f"  averaging {st['averaging']} {st.get('averaging_bytes', 0) / 1e6:.2f} MB/step"
    if "relayed_bytes" in st:  # a dial-out peer linked to another through a relay
        figures += f"  relayed {st['relayed_bytes'] / 1e6:.2f} MB"
    where = p.contact.partition("#")[0] or "(withdrawn)"
    if p.silent(status_s):
        heard = f"SILENT for {p.heard_s:.0f} s: not serving (stopped or lost)"
    else:  # a peer stores its record every status_s: its step is that old (a fast run is steps ahead)
        heard = f"as of {p.heard_s:.1f} s ago" if p.heard_s is not None else "never heard"
    return f"{figures}  {where}  {heard}; its records lapse in {p.expires_in_s:.0f} s"


def _local_revocations_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--revocations", metavar="FILE",
                   help="the revocation list of this swarm's authority (RUN_DIR/identities/authority.key; "
                        "`mapl-swarm keys revoke`), given to every peer, which re-reads it when it changes: replace "
                        "the file to cut a peer off while the swarm runs")


def _replicas_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--replicas", metavar="N",
                   help="peers per stage (SPEC §9.10: each micro-batch routed to one replica of the next stage, "
                        "the replicas of a stage average their gradients every step), e.g. --replicas 2, or one "
                        "count per stage, --replicas 1,2,2 (sets replicas.enabled and replicas.initial)")


def _replica_sets(value: str, num_stages: int) -> list[str]:
    """``launch --replicas N`` (every stage), or one count per stage (``1,2,2``), as the ``--set``
    items every peer gets."""
    try:
        counts = [int(x) for x in value.split(",")]
    except ValueError:
        raise ConfigError(f"--replicas {value!r}: expected a count, or one count per stage (e.g. 1,2,2)") from None
    if any(n < 1 for n in counts):
        raise ConfigError(f"--replicas {value!r}: every count must be at least 1")
    counts = counts * num_stages if len(counts) == 1 else counts
    return ["replicas.enabled=true", f"replicas.initial={counts!r}"]


def _cmd_launch(args: argparse.Namespace) -> int:
    if args.replicas is not None:
        args.set = [*(args.set or []), *_replica_sets(args.replicas, _load(args).pipeline.num_stages)]
    cfg = _load(args)
    from mapl_swarm.launch import launch, parse_gpus

    gpus = parse_gpus(args.gpus) if args.gpus else None
    s = launch(cfg, _config_args(args) + (["--resume"] if args.resume else []), progress=not args.quiet, gpus=gpus,
               max_restarts=args.max_restarts, revocations=args.revocations)
    if s.end_note:  # drained (SIGINT/SIGTERM): one line
        print(f"mapl-swarm: {s.end_note}")
        return 0
    val = f", val loss {s.val_history[-1][1]:.4f}" if s.val_history else ""
    last = f"{s.train_losses[-1]:.4f}" if s.train_losses else "n/a"
    print(f"swarm {cfg.compression.codec} P={cfg.pipeline.num_stages}: {len(s.train_losses)} steps, train loss "
          f"{last}{val}, {s.tokens / max(s.wall_s, 1e-9):.0f} tokens/s")
    _print_links(s)
    out = Path(cfg.run.out_dir)
    print(f"metrics: {out}/metrics_stage{{0..{cfg.pipeline.num_stages - 1}}}.jsonl; checkpoints: {out}/checkpoints; "
          f"manifest: {out}/manifest.json")
    _print_restarts(s)
    return 0


def _print_links(s: Any) -> None:
    """The bytes/token lines of a ``launch`` / ``lab`` :class:`~mapl_swarm.launch.SwarmSummary`."""
    print("  bytes/token per link, forward / backward: payload = tensor bytes; "
          "on the wire = ZeroMQ frames with headers")
    for b, link in enumerate(s.links):
        print(f"  link {b}->{b + 1}: payload {link['forward_payload']:.1f} / {link['backward_payload']:.1f} B/token, "
              f"on the wire {link['forward_wire']:.1f} / {link['backward_wire']:.1f} B/token")
    if s.averaging:
        print(f"  replicas' averaging: {s.averaging['bytes_per_step'] / 1e6:.2f} MB a step (every stage's replicas "
              f"together), {100 * s.averaging['share']:.1f}% of all bytes sent")


def _print_restarts(s: Any) -> None:
    """The restarts line of a ``launch`` / ``lab`` :class:`~mapl_swarm.launch.SwarmSummary`."""
    if s.restarts:
        print("restarted peers: " + ", ".join(f"stage {st} x{n}" for st, n in s.restarts.items()))


def _cmd_sweep(args: argparse.Namespace) -> int:
    from mapl_swarm.experiments.grid import load_grid

    grid = load_grid(args.grid)
    from mapl_swarm.experiments.publish import publish
    from mapl_swarm.experiments.sweep import run_sweep

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
    if rep.failed:  # loud: a table missing a codec's rows must not look like a result
        print(f"mapl-swarm: error: {len(rep.failed)} sweep run(s) failed (above); their rows are missing"
              + (f", so nothing was published to {args.publish}" if args.publish else ""), file=sys.stderr)
        return 1
    if args.publish:
        for p in publish(rep.summary_path, rep.plots, args.publish, benchmarks=args.benchmarks, name=grid.name):
            print(f"published: {p}")
    return 0


def _cmd_lab(args: argparse.Namespace) -> int:
    if args.replicas is not None:
        args.set = [*(args.set or []), *_replica_sets(args.replicas, _load(args).pipeline.num_stages)]
    cfg = _load(args)
    from mapl_swarm.lab.swarm import run_lab_swarm

    s = run_lab_swarm(cfg, _config_args(args) + (["--resume"] if args.resume else []), rate_mbit=args.rate_mbit,
                      subnet=args.subnet, max_restarts=args.max_restarts, revocations=args.revocations,
                      nat=[host for host in (args.nat or "").split(",") if host], relay=args.relay)
    if s.end_note:  # drained (SIGINT/SIGTERM): one line
        print(f"mapl-swarm: {s.end_note}")
        return 0
    print(f"lab swarm {cfg.compression.codec} P={cfg.pipeline.num_stages} over {args.rate_mbit:g} Mbit/s tbf links: "
          f"{len(s.train_losses)} steps, train loss {s.train_losses[-1]:.4f}, "
          f"{s.tokens / max(s.wall_s, 1e-9):.0f} tokens/s")
    _print_links(s)
    _print_restarts(s)
    return 0


def _cmd_doctor(args: argparse.Namespace) -> int:
    cfg = _load(args)
    if args.stage is not None:
        cfg.check_stage(args.stage)
    from mapl_swarm.doctor import local_checks, swarm_checks
    from mapl_swarm.net.dht_node import precheck_initial_peers

    peers = list(args.initial_peer or []) or list(cfg.net.initial_peers)
    precheck_initial_peers(peers)
    checks = local_checks(cfg, peer_key=args.peer_key, cert=args.cert, stage=args.stage,
                          revocations=args.revocations, initial_peers=peers)
    for check in checks:
        print(check.line(), flush=True)
    membership = None
    if args.cert:  # the certified records are read as a member reads them, or as its bootstrap node does
        from mapl_swarm.net.identity import load_identity

        if next(c for c in checks if c.name == "certificate").ok:
            membership = load_identity(args.peer_key, args.cert, run_id=cfg.run.run_id, stage=args.stage,
                                       revocations=args.revocations)
        else:
            try:
                membership = _trusted_authority(args.cert)
            except ConfigError:
                membership = None  # an unreadable certificate: failed above; the records are read unchecked
    if peers:
        from mapl_swarm.peer.main import peer_assets

        def settings() -> tuple[str, dict]:  # what this host's peer would send (prepares the data)
            assets = peer_assets(cfg)
            return assets.fingerprint, assets.config

        for check in swarm_checks(cfg, initial_peers=peers, membership=membership, settings=settings,
                                  stage=args.stage):
            checks.append(check)
            print(check.line(), flush=True)
    failed = [c for c in checks if c.ok is False]
    if failed:
        print(f"mapl-swarm doctor: {len(failed)} check(s) failed: {', '.join(c.name for c in failed)}",
              file=sys.stderr)
        return 1
    return 0


def _cmd_plot(args: argparse.Namespace) -> int:
    from mapl_swarm.metrics.plot import plot_runs

    written = plot_runs(args.runs, args.out)
    for path in written:
        print(path)
    if not written:
        print("mapl-swarm: nothing to plot in " + ", ".join(args.runs), file=sys.stderr)
        return 1
    return 0


def _cmd_export(args: argparse.Namespace) -> int:
    from mapl_swarm.hf.export import export_run

    r = export_run(args.run_dir, args.out, stage_dirs=args.stage_dir or [], tokenizer_path=args.tokenizer,
                   force=args.force)
    for step, why in r.skipped.items():
        print(f"skipped step {step}: {why}")
    print(f"exported step {r.step} of {args.run_dir} to {r.out} ({r.model_type}) in {r.seconds:.1f} s; max |logit "
          f"difference| vs the in-process pipeline {r.max_logit_diff:.2e}")
    return 0


def _cmd_eval(args: argparse.Namespace) -> int:
    if sum(bool(x) for x in (args.text, args.config, args.tasks)) != 1:
        raise ConfigError("eval needs exactly one of --text PATH, --config FILE or --tasks NAMES")
    if args.tasks:
        from mapl_swarm.hf.evaluate import eval_tasks
        from mapl_swarm.hf.loading import check_model_folder, resolve_device

        check_model_folder(args.model)  # before lm-eval starts
        tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
        print(eval_tasks(args.model, tasks, tasks_dir=args.tasks_dir, num_fewshot=args.num_fewshot,
                         batch_size=args.batch_size, device=str(resolve_device(args.device)), dtype=args.dtype,
                         limit=args.limit))
        return 0
    run_cfg = None
    if args.config:
        from mapl_swarm.config import load_config

        run_cfg = load_config(args.config, parse_overrides(args.set or []))
    from mapl_swarm.hf.evaluate import eval_text, eval_validation
    from mapl_swarm.hf.loading import load_model

    lm = load_model(args.model, device=args.device, dtype=args.dtype)
    if run_cfg is not None:
        r = eval_validation(lm, run_cfg, progress=not args.quiet)
        print(f"{args.model} on the validation split of {args.config}: {r.tokens} tokens, loss {r.loss:.4f}, "
              f"perplexity {r.perplexity:.2f}")
        return 0
    r = eval_text(lm, args.text, batch_size=args.batch_size, progress=not args.quiet)
    print(f"{args.model} on {args.text}: {r.tokens} tokens, loss {r.loss:.4f}, perplexity {r.perplexity:.2f}")
    return 0


def _cmd_generate(args: argparse.Namespace) -> int:
    if bool(args.prompt) == bool(args.prompt_file):
        raise ConfigError("generate needs one of --prompt TEXT or --prompt-file PATH")
    if args.prompt_file:
        try:
            prompt = Path(args.prompt_file).read_text()
        except OSError as exc:
            raise ConfigError(f"--prompt-file {args.prompt_file}: {exc.strerror or exc}") from None
    else:
        prompt = args.prompt
    from mapl_swarm.hf.generate import generate
    from mapl_swarm.hf.loading import load_model

    lm = load_model(args.model, device=args.device, dtype=args.dtype)

    def write(text: str) -> None:
        sys.stdout.write(text)
        sys.stdout.flush()

    write(prompt)
    g = generate(lm, prompt, max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                 seed=args.seed, use_cache=not args.no_cache, write=write)
    write("\n")
    log.info("%d new tokens in %.2f s (%.1f tokens/s%s)", len(g.new_ids), g.seconds, g.tokens_per_s,
             ", no KV cache" if args.no_cache else "")
    return 0


_LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")


def _log_level(value: str) -> str:
    level = value.upper()
    if level not in _LOG_LEVELS:
        raise argparse.ArgumentTypeError(f"must be one of {', '.join(_LOG_LEVELS)}, got {value!r}")
    return level


def _add_common_args(p: argparse.ArgumentParser, *, quiet: bool = True) -> None:
    """Options every subcommand takes: the log level (also accepted before the subcommand) and,
    where there is a progress bar, --quiet."""
    p.add_argument("--log-level", type=_log_level, default=argparse.SUPPRESS, metavar="LEVEL",
                   help="log messages of this level and above: DEBUG, INFO, WARNING or ERROR (default: INFO); "
                        "passed on to the peers that launch and lab start")
    if quiet:
        p.add_argument("--quiet", action="store_true", help="no progress bars")


def _add_config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", metavar="FILE",
                   help="TOML run config, e.g. peers/demo.toml (default: none, the built-in defaults)")
    p.add_argument("--preset", metavar="NAME", help="model preset: tiny, 150M, 500M or 1B (default: tiny, "
                                                    "or the config file's preset)")
    p.add_argument("--set", action="append", metavar="SECTION.KEY=VALUE",
                   help="override one config value, as TOML (repeatable), e.g. --set run.steps=20 "
                        "--set compression.codec=none")
    _add_common_args(p)


def _key_args(p: argparse.ArgumentParser, what: str, *, peer: bool = True) -> None:
    """``--cert FILE`` (with ``--peer-key FILE``) or ``--insecure``, one of them required; ``--key-file`` (a
    1.x run key) is refused with what to use instead."""
    group = p.add_mutually_exclusive_group(required=True)
    if peer:
        group.add_argument("--cert", metavar="FILE",
                           help="this peer's certificate (from `mapl-swarm keys issue`), with --peer-key: links to "
                                "named peers of the run's authority, DHT records signed with the peer's own key")
        p.add_argument("--peer-key", metavar="FILE", help="with --cert: this host's peer key (mode 0600)")
        p.add_argument("--revocations", metavar="FILE",
                       help="with --cert: the authority's revocation list (`mapl-swarm keys revoke`)")
    else:
        group.add_argument("--cert", metavar="FILE",
                           help="any certificate of the run: the node keeps only records certified by its "
                                "authority for its run")
    group.add_argument("--key-file", help=argparse.SUPPRESS)  # protocol 1.x's run key: refused with a hint
    group.add_argument("--insecure", action="store_true",
                       help=f"run without a certificate: plain TCP, unsigned records, anyone may read and join "
                            f"(logged as a warning); {what}")


def _max_restarts_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-restarts", type=int, default=3, metavar="N",
                   help="per stage: how many times a peer that dies (non-zero status or a signal, not after "
                        "Ctrl-C) is started again with --resume while the others wait; one more death stops the "
                        "swarm; 0: any death stops it (default: 3). With replicas only a stage's last replica is "
                        "restarted (the others' stage goes on without them), and a replica the swarm took for gone "
                        "(exit status 4) is started again with --join, as many times per stage")


def _resume_arg(p: argparse.ArgumentParser, who: str, more: str = "") -> None:
    p.add_argument("--resume", action="store_true",
                   help=f"{who} from the newest checkpoint under run.out_dir (default: start at step 0){more}")


_EPILOG = """\
examples:
  mapl-swarm train --config peers/demo.toml --set run.steps=20
  mapl-swarm launch --config peers/demo.toml --log-level WARNING
  mapl-swarm keys local --config peers/150M-mapl.toml --out ids
  mapl-swarm peer --config peers/150M-mapl.toml --stage 0 --peer-key ids/stage0.key --cert ids/stage0.cert \
      --initial-peer /ip4/10.0.0.1/tcp/31337/p2p/...
  mapl-swarm sweep --grid bench/grids/micro.toml

Every subcommand has its own --help."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mapl-swarm", epilog=_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Pipeline-parallel LLM training across hosts with compressed stage boundaries (MAPL).")
    parser.add_argument("--log-level", type=_log_level, default="INFO", metavar="LEVEL",
                        help="DEBUG, INFO, WARNING or ERROR (default: INFO); also accepted after the subcommand")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def add(name: str, summary: str, description: str) -> argparse.ArgumentParser:
        return sub.add_parser(name, help=summary, description=description)

    p = add("prepare", "build the tokenizer and token shards",
            "Read the corpus, train the tokenizer (or load data.tokenizer) and write the token shards "
            "under data.cache_dir; train, peer and launch reuse them.")
    _add_config_args(p)
    p.set_defaults(func=_cmd_prepare)

    p = add("train", "train every stage in this process",
            "Train the whole pipeline in this one process (no network): the reference a swarm reproduces. "
            "Writes metrics.jsonl, checkpoints and a manifest under run.out_dir.")
    _add_config_args(p)
    _resume_arg(p, "continue")
    p.set_defaults(func=_cmd_train)

    p = add("peer", "run one pipeline stage as a network peer",
            "Run one stage of the pipeline as a network peer; it finds its neighbours through the DHT "
            "and trains with them. Start one per stage, on any hosts, in any order.")
    _add_config_args(p)
    p.add_argument("--stage", type=int, metavar="K",
                   help="the stage this peer runs, 0 .. pipeline.num_stages-1 (required but with --join, where the "
                        "peer picks the stage of least capacity its certificate allows)")
    _initial_peers_args(p)
    how = p.add_mutually_exclusive_group()
    _resume_arg(how, "continue", "; also how a departed peer of this stage is replaced in a running swarm, which "
                                 "then rolls back to the newest step every stage saved; with replicas every "
                                 "replica of the run starts with it and all resume from the newest step each of "
                                 "them saved")
    how.add_argument("--auto-resume", action="store_true",
                     help="--resume when run.out_dir holds a checkpoint of this stage, else start fresh; exit 0 at "
                          "once when that checkpoint is already at run.steps (for restart policies: compose, "
                          "systemd)")
    how.add_argument("--join", action="store_true",
                     help="with replicas (replicas.enabled): join the running swarm as one more replica of the "
                          "stage, with the state downloaded from a live replica of it (a stage of several replicas; "
                          "how a dead replica is replaced while its stage keeps another)")
    _key_args(p, "with --cert, links are encrypted and pinned to certified peers, DHT records signed")
    p.add_argument("--launched", action="store_true", help=argparse.SUPPRESS)  # started by `launch`
    p.set_defaults(func=_cmd_peer)

    p = add("dht", "run a DHT bootstrap node and print its multiaddrs",
            "Run a DHT node that peers join first (any running node will do); prints the multiaddrs "
            "to pass to `mapl-swarm peer --initial-peer`.")
    p.add_argument("--host", default="0.0.0.0", help="interface to listen on (default: 0.0.0.0, every one)")
    p.add_argument("--port", type=int, default=0, help="TCP port (default: 0, a free one)")
    p.add_argument("--announce-host", default=None, metavar="HOST",
                   help="address other hosts dial, in the printed multiaddrs (needs --port; default: the "
                        "listening addresses)")
    p.add_argument("--maddr-file", metavar="PATH",
                   help="also write the multiaddrs to this file, atomically once the node is up; an earlier "
                        "file there is removed at start (default: none)")
    p.add_argument("--identity", metavar="PATH",
                   help="private-key file that keeps this node's peer id, hence its multiaddrs, the same across "
                        "restarts (created when missing; default: a new peer id each start)")
    _key_args(p, "with --cert, the node keeps only records its run's authority certified", peer=False)
    _add_common_args(p, quiet=False)
    p.set_defaults(func=_cmd_dht)

    p = add("relay", "join dial-out peers behind NAT to each other (run on a reachable host)",
            "Splice pairs of connections from dial-out peers (net.reachable = \"no\") that are neighbours, so "
            "that the CURVE-encrypted link runs end to end through this host: it serves certified members of "
            "the run only, and sees ciphertext, sizes and timing. Give each dial-out peer the net.relay it prints, "
            "or, with --initial-peer, it announces itself in the run's DHT (its --relay-key then being the peer key "
            "--cert was issued to), where dial-out peers without net.relay find it.")
    p.add_argument("--host", default="0.0.0.0", help="interface to listen on (default: 0.0.0.0, every one)")
    p.add_argument("--port", type=int, default=0, help="TCP port (default: 0, a free one)")
    p.add_argument("--announce-host", default=None, metavar="HOST", help="the address peers dial (printed)")
    p.add_argument("--relay-key", required=True, metavar="FILE",
                   help="the relay's own key (created when missing, mode 0600): members seal their requests to "
                        "it, so the run id and certificates never cross in clear; its CURVE key is printed")
    _key_args(p, "refused: a relay serves certified members only", peer=False)
    p.add_argument("--revocations", metavar="FILE",
                   help="the authority's revocation list (`mapl-swarm keys revoke`), read again when it changes: "
                        "revoked members are refused and their relayed connections cut")
    _initial_peers_args(p)
    _add_common_args(p, quiet=False)
    p.set_defaults(func=_cmd_relay)

    p = add("status", "show a running swarm's peers (every replica of every stage) from its DHT",
            "Read a running swarm's DHT and print each stage's peers (its replicas) with their state, step, "
            "tokens/s and queue, from the status records every peer renews every few seconds. Exit status 1 "
            "when a stage has no peer.")
    _add_config_args(p)
    _initial_peers_args(p)
    p.add_argument("--json", action="store_true", help="print the peers as JSON, one list per stage")
    p.add_argument("--watch", action="store_true",
                   help="a live table, redrawn every --every seconds until Ctrl-C: per peer its state, step, "
                        "tokens/s, queue, per link bytes/s each way against the link's rate, round trip and last "
                        "heartbeat, rejects by code, and the age of its record")
    p.add_argument("--every", type=float, default=2.0, metavar="S", help="--watch: seconds between redraws (default 2)")
    p.add_argument("--count", type=int, default=None, metavar="N", help="--watch: stop after N redraws")
    _key_args(p, "records are then unsigned hints", peer=False)
    p.set_defaults(func=_cmd_status)

    p = add("keys", "create a run authority, peer keys and certificates (subcommands)",
            "Per-peer identities under a run authority: the operator's authority key signs each peer's "
            "certificate; each host's peer key never leaves it (`keys peer`, `keys request`, `keys issue`). "
            "Key files are written with mode 0600 and never printed. `launch`, `lab` and compose issue "
            "identities themselves (as `keys local` does).")
    _add_common_args(p, quiet=False)
    p.set_defaults(func=_cmd_keys)
    identities = p.add_subparsers(title="per-peer identities under a run authority", metavar="SUBCOMMAND")

    def key_command(name: str, summary: str, func, out_help: str) -> argparse.ArgumentParser:
        q = identities.add_parser(name, help=summary, description=summary)
        q.add_argument("--out", required=True, metavar="FILE", help=f"{out_help} (required)")
        q.add_argument("--force", action="store_true", help="replace an existing file")
        _add_common_args(q, quiet=False)
        q.set_defaults(func=func)
        return q

    key_command("authority", "create a run authority key (mode 0600; it signs every peer's certificate)",
                _cmd_keys_authority, "where to write the authority key")
    key_command("peer", "create this host's peer key (mode 0600; it never leaves the host)", _cmd_keys_peer,
                "where to write the peer key")
    q = identities.add_parser("local", help="issue an authority and one identity per stage of a config, in one "
                                            "folder (a local swarm or a demo; launch and lab do it themselves)",
                              description="Create (or keep, while they fit) a run authority and, per stage of the "
                                          "config, a peer key and a certificate for that stage: stage<k>.key and "
                                          "stage<k>.cert in --out, for peer --peer-key/--cert and dht --cert.")
    q.add_argument("--out", required=True, metavar="DIR", help="folder of the identities (required)")
    q.add_argument("--authority", metavar="FILE",
                   help="the authority key, kept or created (default: DIR/authority.key)")
    _add_config_args(q)
    q.set_defaults(func=_cmd_keys_local)
    q = key_command("request", "write a certificate request (public keys only) for the operator", _cmd_keys_request,
                    "where to write the request")
    q.add_argument("--key", required=True, metavar="FILE", help="this host's peer key (required)")
    q.add_argument("--name", required=True, help="this peer's name in logs and certificates, e.g. the host name "
                                                 "(required)")
    q.add_argument("--stages", required=True, type=_stage_list, metavar="K[,K...]",
                   help="the stage(s) it asks to serve (required)")
    q = key_command("issue", "sign a certificate for a request with the run authority key", _cmd_keys_issue,
                    "where to write the certificate")
    q.add_argument("--authority", required=True, metavar="FILE", help="the run authority key (required)")
    q.add_argument("--request", required=True, metavar="FILE", help="the host's request (required)")
    q.add_argument("--run-id", required=True, help="the run it is valid for: run.run_id (required)")
    q.add_argument("--stages", type=_stage_list, metavar="K[,K...]",
                   help="the stages it allows, of those requested (default: all requested)")
    q.add_argument("--role", action="append", choices=["drain"],
                   help="also allow this: drain (ask the whole swarm to drain); repeatable (default: none)")
    q.add_argument("--days", type=float, default=30.0, help="how long it is valid (default: 30)")
    q = key_command("revoke", "add certificate serials to the run's revocation list (signed by the authority)",
                    _cmd_keys_revoke, "the revocation list: updated when it exists, else created")
    q.add_argument("--authority", required=True, metavar="FILE", help="the run authority key (required)")
    q.add_argument("--run-id", required=True, help="the run: run.run_id (required)")
    q.add_argument("--serial", required=True, type=int, action="append",
                   help="a certificate's serial (`keys show CERT`); repeatable (required)")
    q = identities.add_parser("show", help="print what a request, certificate or revocation list says",
                              description="Print what a request, certificate or revocation list file says "
                                          "(no secret is read).")
    q.add_argument("file", metavar="FILE")
    _add_common_args(q, quiet=False)
    q.set_defaults(func=_cmd_keys_show)

    p = add("sweep", "run an experiment grid in-process; tables and plots",
            "Run every run of a grid file in this process at an equal token budget (finished runs are "
            "skipped), then write one JSON per run, a summary with tables, and plots.")
    p.add_argument("--grid", required=True, metavar="FILE", help="grid TOML file, e.g. bench/grids/micro.toml "
                                                                 "(required)")
    p.add_argument("--out", metavar="DIR", help="output folder (default: the grid's out_dir)")
    p.add_argument("--only", metavar="TEXT", help="run only the runs whose id contains TEXT (default: all)")
    p.add_argument("--report-only", action="store_true", help="write tables and plots from finished runs only")
    p.add_argument("--publish", metavar="DIR",
                   help="copy summary.md and plots into DIR, e.g. bench/results/sweep-cpu (default: no copy)")
    p.add_argument("--benchmarks", metavar="FILE",
                   help="with --publish: replace the <!-- sweep:NAME:begin/end --> section of FILE (BENCHMARKS.md)")
    _add_common_args(p)
    p.set_defaults(func=_cmd_sweep)

    p = add("lab", "run a swarm in network namespaces with shaped links (root)",
            "Run the DHT and every stage in its own Linux network namespace, joined by tbf-shaped veth "
            "links (needs root): the compose topology on one machine. Each peer gets its own key and a "
            "certificate for its stage under RUN_DIR/identities (run.out_dir), issued when missing.")
    _add_config_args(p)
    p.add_argument("--rate-mbit", type=float, default=20.0, metavar="MBIT",
                   help="tbf rate of every link in Mbit/s; 0 leaves links unshaped (default: 20)")
    p.add_argument("--subnet", type=int, default=77, metavar="N", help="lab addresses are 10.N.0.x (default: 77)")
    p.add_argument("--nat", metavar="HOST[,HOST]",
                   help="put these peers' hosts behind NAT (stage1, stage2r1: a replica's): they accept no inbound "
                        "connection and run with net.reachable = \"no\" (needs iptables)")
    p.add_argument("--relay", action="store_true",
                   help="run a relay (mapl-swarm relay) on the DHT's host for the peers behind NAT")
    _resume_arg(p, "every peer continues")
    _max_restarts_arg(p)
    _replicas_arg(p)
    _local_revocations_arg(p)
    p.set_defaults(func=_cmd_lab)

    p = add("launch", "start a DHT and every stage peer on this machine",
            "Start a DHT node and one peer process per stage on this machine, wait for them and print "
            "the swarm's loss, tokens/s and bytes/token per link; Ctrl-C stops them all. Each peer gets its "
            "own key and a certificate for its stage under RUN_DIR/identities (run.out_dir), issued when missing.")
    _add_config_args(p)
    _resume_arg(p, "every peer continues")
    p.add_argument("--gpus", metavar="LIST",
                   help="GPUs to give the peers, round-robin, one per peer through its CUDA_VISIBLE_DEVICES, "
                        "e.g. --gpus 0,1,2,3 (a repeated id shares a GPU; needs runtime.device auto or cuda) "
                        "(default: the visible GPUs, round-robin; none: the peers' environment is unchanged)")
    _max_restarts_arg(p)
    _replicas_arg(p)
    _local_revocations_arg(p)
    p.set_defaults(func=_cmd_launch)

    p = add("doctor", "check why this host's peer would not meet its swarm, one line per check with its fix",
            "Check this host before it serves: the peer key file, the certificate (run, stage, key, "
            "revocation, expiry), the ports the peer will listen on, the address it will advertise; and, "
            "with --initial-peer, the swarm: each bootstrap node answers, the DHT joins, the live peers' "
            "protocol version and config fingerprint equal this host's (naming each differing setting), "
            "this host's clock agrees with theirs, and (with --peer-key and --cert) a live peer can dial "
            "the contact this host's peer would advertise. Exit status 1 when a check fails.")
    _add_config_args(p)
    p.add_argument("--stage", type=int, metavar="K", help="the stage this host will serve (its certificate is "
                                                          "checked for it)")
    p.add_argument("--initial-peer", action="append", metavar="MADDR",
                   help="multiaddr of the swarm's DHT bootstrap node (repeatable; default: net.initial_peers)")
    p.add_argument("--peer-key", metavar="FILE", help="this host's peer key file")
    p.add_argument("--cert", metavar="FILE", help="this host's certificate file")
    _local_revocations_arg(p)
    p.set_defaults(func=_cmd_doctor)

    p = add("plot", "draw one or more runs' metrics as PNGs (loss, tokens/s, bandwidth, health)",
            "Read the metrics files of each run folder (a `train` run's metrics.jsonl, or a swarm's "
            "metrics_stage<S>.jsonl of every stage and replica) and write loss.png, throughput.png, "
            "bandwidth.png and health.png, the runs overlaid (e.g. one per codec).")
    p.add_argument("runs", nargs="+", metavar="RUN_DIR", help="run folders (run.out_dir)")
    p.add_argument("--out", default="plots", metavar="DIR", help="folder for the PNGs (default: plots)")
    _add_common_args(p, quiet=False)
    p.set_defaults(func=_cmd_plot)

    p = add("export", "write a run's trained model as a Hugging Face model folder",
            "Write the newest checkpoint step that every stage holds verified as a Hugging Face model folder "
            "(config.json, model.safetensors, tokenizer, model card): codec none as a plain Llama, every other "
            "codec as mapl_llama (its stage boundaries included). The folder is written aside and renamed when "
            "complete.")
    p.add_argument("run_dir", metavar="RUN_DIR", help="the run folder (run.out_dir; a swarm: stage 0's)")
    p.add_argument("out", metavar="OUT", help="the model folder to write")
    p.add_argument("--stage-dir", action="append", metavar="K=PATH",
                   help="stage K's run folder, when it is not RUN_DIR (a multi-host swarm: the folder copied "
                        "from that host); repeatable")
    p.add_argument("--tokenizer", metavar="FILE",
                   help="the run's tokenizer.json (default: from the run's prepared data, prepared again when "
                        "this host lacks it)")
    p.add_argument("--force", action="store_true", help="replace OUT if it exists")
    _add_common_args(p, quiet=False)
    p.set_defaults(func=_cmd_export)

    def model_args(p: argparse.ArgumentParser) -> None:
        p.add_argument("model", metavar="MODEL", help="a model folder written by `mapl-swarm export`")
        p.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N (default: auto)")
        p.add_argument("--dtype", default="fp32", choices=("fp32", "bf16"), help="weights' dtype (default: fp32)")

    p = add("eval", "loss and perplexity of an exported model; lm-eval tasks",
            "Evaluate an exported model: on text (--text), on a run's validation split (--config, the batches "
            "its val_loss used), or on lm-evaluation-harness tasks (--tasks; needs the `eval` extra).")
    model_args(p)
    p.add_argument("--text", metavar="PATH", help="a text file or a folder of them (.py, .txt, .md, .rst)")
    p.add_argument("--config", metavar="FILE", help="the run's config: evaluate its validation split")
    p.add_argument("--set", action="append", metavar="SECTION.KEY=VALUE", help="with --config: override a value")
    p.add_argument("--tasks", metavar="NAMES", help="comma-separated lm-eval tasks, e.g. hellaswag,piqa,arc_easy")
    p.add_argument("--tasks-dir", metavar="DIR", help="with --tasks: a folder of local lm-eval task YAMLs")
    p.add_argument("--num-fewshot", type=int, default=0, metavar="N", help="with --tasks: shots (default: 0)")
    p.add_argument("--limit", type=int, default=None, metavar="N", help="with --tasks: at most N items per task")
    p.add_argument("--batch-size", type=int, default=8, metavar="N", help="sequences per forward (default: 8)")
    _add_common_args(p)
    p.set_defaults(func=_cmd_eval)

    p = add("generate", "sample text from an exported model",
            "Continue a prompt with an exported model, streaming the text as it comes. Temperature 0 is greedy.")
    model_args(p)
    p.add_argument("--prompt", metavar="TEXT", help="the prompt")
    p.add_argument("--prompt-file", metavar="PATH", help="read the prompt from a file")
    p.add_argument("--max-new-tokens", type=int, default=64, metavar="N", help="tokens to add (default: 64)")
    p.add_argument("--temperature", type=float, default=0.8, metavar="T", help="0: greedy (default: 0.8)")
    p.add_argument("--top-p", type=float, default=0.95, metavar="P", help="nucleus sampling mass (default: 0.95)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (default: 0)")
    p.add_argument("--no-cache", action="store_true", help="recompute the whole sequence every step (no KV cache)")
    _add_common_args(p, quiet=False)
    p.set_defaults(func=_cmd_generate)
    return parser


class _SharedFactsAtDebug(logging.Filter):
    """For a peer started by ``launch``: facts about inputs it shares with the launcher and the
    other peers (corpus, token shards, DHT membership), which the launcher logs once at INFO, are
    logged at DEBUG here."""

    SHARED = ("mapl_swarm.data", "mapl_swarm.net.discovery")

    def __init__(self, level: int) -> None:
        super().__init__()
        self.level = level

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno == logging.INFO and record.name.startswith(self.SHARED):
            record.levelno, record.levelname = logging.DEBUG, "DEBUG"
            return self.level <= logging.DEBUG
        return True


def _setup_logging(args: argparse.Namespace) -> None:
    level = getattr(logging, args.log_level)
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    if getattr(args, "launched", False):
        for handler in logging.getLogger().handlers:
            handler.addFilter(_SharedFactsAtDebug(level))
    logging.getLogger("hivemind").setLevel(max(level, logging.getLogger("hivemind").level))


class _Terminated(BaseException):
    """SIGTERM outside a serving peer (while it starts, in other commands)."""


def _terminate(signum: int, frame: object) -> None:
    """SIGTERM unwinds like Ctrl-C, so DHT children and sockets are closed by finally blocks. (A
    serving peer and ``launch`` handle SIGINT/SIGTERM themselves: a graceful drain.)"""
    raise _Terminated()


def main(argv: list[str] | None = None) -> int:
    signal.signal(signal.SIGTERM, _terminate)
    parser = build_parser()
    args = parser.parse_args(argv)
    _setup_logging(args)
    try:
        return int(args.func(args) or 0)
    except MaplError as exc:
        print(f"mapl-swarm: {exc.label}: {exc}", file=sys.stderr)
        # 2; 3 for a NaN/Inf in this process's own compute (NonFiniteError); 4 a replica the swarm took
        # for gone (TakenForGone); 130 stopped
        return exc.exit_code
    except KeyboardInterrupt:
        print("mapl-swarm: interrupted", file=sys.stderr)
        return 130
    except _Terminated:
        print("mapl-swarm: stopped by SIGTERM", file=sys.stderr)
        return 128 + signal.SIGTERM
    finally:
        if argv is None:  # the program's own run, whose work is closed: skip the collection of torch's
            gc.freeze()  # and hivemind's objects at interpreter exit (seconds on a busy machine)


if __name__ == "__main__":
    sys.exit(main())
