"""``mapl-swarm export RUN_DIR OUT``: a run's newest complete checkpoint as a Hugging Face model folder.

Which step: the newest one that every stage holds *verified* (its manifest's sizes and SHA-256s
match, written by this run's config fingerprint), each stage read from its own folder (``train``
and a one-host swarm: RUN_DIR; a multi-host swarm: ``--stage-dir K=PATH`` for the folders copied
from the other hosts). Steps left out are named with the reason.

What is written, into a temporary folder beside OUT that is renamed to OUT only when complete:
``config.json`` + ``model.safetensors`` + ``generation_config.json`` (:mod:`.convert`), the
tokenizer (``tokenizer.json``, ``tokenizer_config.json``; ``AutoTokenizer`` loads it) and a
``README.md`` model card. Before writing, the exported model's logits on one validation
micro-batch are compared with the in-process pipeline's (the swarm's computation): the largest
difference is reported and goes into the card.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from mapl_swarm.config import TrainConfig, config_from_dict, model_fingerprint
from mapl_swarm.errors import CheckpointError, ConfigError, DataError, MaplError
from mapl_swarm.pipeline import checkpoint
from mapl_swarm.pipeline.run_records import manifest_path, metrics_path

log = logging.getLogger(__name__)

__all__ = ["ExportResult", "export_run", "parse_stage_dirs", "choose_step"]


@dataclass
class ExportResult:
    out: Path
    step: int
    model_type: str
    max_logit_diff: float
    """Largest |logit difference| of the export against the in-process pipeline on one micro-batch."""
    skipped: dict[int, str] = field(default_factory=dict)
    """Newer steps left out -> why."""
    seconds: float = 0.0


def parse_stage_dirs(items: list[str], num_stages: int) -> dict[int, Path]:
    """``["1=/copies/host1", ...]`` -> {1: Path(...)} (ConfigError naming a bad item)."""
    out: dict[int, Path] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip().isdigit() or not value:
            raise ConfigError(f"--stage-dir expects K=PATH, got {item!r}")
        stage = int(key)
        if not 0 <= stage < num_stages:
            raise ConfigError(f"--stage-dir {item!r}: the run has stages 0..{num_stages - 1}")
        out[stage] = Path(value)
    return out


def _read_json(path: Path, what: str) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{path} not found: {what}") from None
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{path} is unreadable ({exc}): {what}") from None


def _run_config(run_dir: Path) -> tuple[TrainConfig, dict[str, Any]]:
    manifest = _read_json(manifest_path(run_dir), f"{run_dir} is not a run folder (train, or a swarm's stage 0)")
    try:
        return config_from_dict(manifest["config"], str(manifest_path(run_dir))), manifest
    except (KeyError, TypeError):
        raise CheckpointError(f"{manifest_path(run_dir)} holds no run config") from None


def _verified_steps(root: Path, stage: int, fingerprint: str, why: dict[tuple[int, int], str]) -> set[int]:
    """Stage ``stage``'s steps under ``root`` that verify and carry ``fingerprint``; each other step
    gets its reason in ``why[(step, stage)]``."""
    steps = checkpoint.stage_steps(root, stage)
    if not steps:
        raise CheckpointError(f"stage {stage} has no checkpoint under {root / checkpoint.CHECKPOINTS} (copy that "
                              f"host's run folder here, or name it with --stage-dir {stage}=PATH)")
    good = set()
    for step in steps:
        try:
            meta = checkpoint.verify_stage(root, step, stage)
        except checkpoint.UnusableCheckpoint as exc:
            why[(step, stage)] = str(exc)
            continue
        theirs = meta.get("config_fingerprint")
        if theirs not in (None, fingerprint):
            why[(step, stage)] = (f"written by another run or config (fingerprint {str(theirs)[:12]}... vs "
                                  f"{fingerprint[:12]}...)")
            continue
        good.add(step)
    return good


def choose_step(stage_dirs: dict[int, Path], fingerprint: str) -> tuple[int, dict[int, str]]:
    """The newest step every stage holds verified, and why each newer step was left out."""
    why: dict[tuple[int, int], str] = {}
    verified = {s: _verified_steps(d, s, fingerprint, why) for s, d in sorted(stage_dirs.items())}
    common = set.intersection(*verified.values())
    if not common:
        def listing(s: int) -> str:
            bad = "; ".join(f"step {n}: {r}" for (n, k), r in sorted(why.items()) if k == s)
            return f"stage {s}: {sorted(verified[s]) or 'none verified'}" + (f" ({bad})" if bad else "")
        have = "; ".join(listing(s) for s in verified)
        raise CheckpointError(f"no checkpoint step that every stage holds verified ({have})")
    step = max(common)
    newer = sorted({n for v in verified.values() for n in v} | {n for n, _ in why})
    skipped = {n: "; ".join(f"stage {s}: {why.get((n, s), 'no copy')}" for s in verified if n not in verified[s])
               for n in newer if n > step}
    return step, skipped


def _stage_fingerprints(stage_dirs: dict[int, Path], expected: str) -> None:
    """The run manifest found in each stage's folder (a swarm stage's manifest_stage{S}.json, else a
    manifest.json) must carry the run's config fingerprint: another run's folder is named, not mixed in."""
    for stage, root in stage_dirs.items():
        path = next((p for p in (manifest_path(root, stage), manifest_path(root)) if p.exists()), None)
        if path is None:
            continue
        theirs = _read_json(path, f"the run manifest of stage {stage}").get("config_fingerprint")
        if theirs not in (None, expected):
            raise CheckpointError(f"stage {stage}'s folder {root} belongs to another run or config: {path.name} has "
                                  f"fingerprint {str(theirs)[:12]}..., stage 0's manifest {expected[:12]}...")


def _losses(run_dir: Path, cfg: TrainConfig, driver: str, step: int) -> dict[str, float]:
    """Final train loss and last validation loss up to ``step`` from stage 0's metrics (empty when absent)."""
    path = metrics_path(run_dir, 0 if driver == "swarm" else None)
    out: dict[str, float] = {}
    if not path.exists():
        return out
    for line in path.read_text().splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if rec.get("step", 0) > step:
            continue
        for key in ("loss", "val_loss"):
            if isinstance(rec.get(key), (int, float)):
                out[key] = float(rec[key])
    return out


def _model_card(cfg: TrainConfig, *, step: int, driver: str, model_type: str, losses: dict[str, float],
                diff: float, tokens: int, manifest: dict[str, Any]) -> str:
    m, c = cfg.model, cfg.compression
    rows = [("model", f"{m.num_layers} layers, d={m.hidden_size}, {m.num_heads} heads, ffn {m.ffn_hidden_size}, "
                      f"context {m.context_length}, vocab {m.vocab_size}"),
            ("pipeline", f"{cfg.pipeline.num_stages} stages ({driver}), "
                         f"{cfg.pipeline.micro_batch_size} x {cfg.pipeline.num_micro_batches} sequences per step"),
            ("codec", f"{c.codec} (rank {c.rank}, anchor {c.anchor}, wire {c.wire_dtype})"),
            ("checkpoint", f"step {step} of {cfg.run.steps} ({tokens:,} training tokens)"),
            ("run", f"{cfg.run.run_id}, seed {cfg.run.seed}, data {cfg.data.source}, "
                    f"commit {str(manifest.get('commit', 'unknown'))[:12]}")]
    if "loss" in losses:
        rows.append(("final train loss", f"{losses['loss']:.4f}"))
    if "val_loss" in losses:
        rows.append(("last validation loss", f"{losses['val_loss']:.4f}"))
    rows.append(("export check", f"largest logit difference from the in-process pipeline: {diff:.2e} (one "
                                 f"validation micro-batch)"))
    table = "\n".join(f"| {k} | {v} |" for k, v in rows)
    how = ("`AutoModelForCausalLM.from_pretrained(PATH)` (plain Llama: no mapl_swarm needed)" if model_type == "llama"
           else "`import mapl_swarm` then `AutoModelForCausalLM.from_pretrained(PATH)` (model type mapl_llama)")
    note = ""
    if model_type == "llama" and c.wire_dtype != "fp32":
        note = (f"\nThe run's stage boundaries rounded activations to {c.wire_dtype}; this plain Llama does not, "
                "hence the logit difference above.\n")
    return (f"---\nlibrary_name: transformers\ntags: [mapl_swarm, pipeline-parallel, {c.codec}]\n---\n\n"
            f"# {cfg.run.run_id} (mapl_swarm, step {step})\n\nTrained with mapl_swarm: a LLaMA-style model split into "
            f"pipeline stages, trained across peers with compressed stage boundaries (MAPL).\n\n"
            f"| | |\n|---|---|\n{table}\n{note}\nLoad: {how}; `AutoTokenizer.from_pretrained(PATH)`.\n"
            f"Evaluate: `mapl-swarm eval PATH --text FILE`; sample: `mapl-swarm generate PATH --prompt TEXT`.\n")


def _prepare_out(out: Path, force: bool) -> Path:
    if out.exists() and not force:
        raise ConfigError(f"{out} exists: choose another OUT or pass --force to replace it")
    if out.exists() and not out.is_dir():
        raise ConfigError(f"{out} exists and is not a folder")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    return tmp


def _install(tmp: Path, out: Path) -> None:
    """Replace ``out`` by the finished ``tmp`` (an old OUT is moved aside first, removed last)."""
    old = None
    if out.exists():
        old = out.parent / f".{out.name}.old-{os.getpid()}"
        out.rename(old)
    tmp.rename(out)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def export_run(run_dir: str | Path, out: str | Path, *, stage_dirs: list[str] = (),
               tokenizer_path: str | None = None, force: bool = False) -> ExportResult:
    """Export ``run_dir``'s newest complete verified step to the Hugging Face folder ``out``;
    ``stage_dirs``: ``K=PATH`` items for stages whose folder is not ``run_dir``."""
    t0 = time.perf_counter()
    run_dir, out = Path(run_dir), Path(out)
    cfg, manifest = _run_config(run_dir)
    driver = str(manifest.get("driver", "train"))
    P = cfg.pipeline.num_stages
    dirs = {s: run_dir for s in range(P)} | parse_stage_dirs(list(stage_dirs), P)
    expected = manifest.get("config_fingerprint")
    tok_hash = manifest.get("tokenizer_hash")
    if not expected or not tok_hash:
        raise CheckpointError(f"{manifest_path(run_dir)} has no config fingerprint or tokenizer hash (a run "
                              f"written by an older mapl_swarm?)")
    _stage_fingerprints(dirs, expected)
    step, skipped = choose_step(dirs, expected)
    for newer, why in skipped.items():
        log.info("export: step %d skipped: %s", newer, why)
    log.info("export: step %d, the newest that every stage holds verified", step)

    tmp = _prepare_out(out, force)
    try:
        tokenizer, val = _tokenizer_and_batch(cfg, tokenizer_path)
        if tokenizer.file_hash != tok_hash or model_fingerprint(cfg, tokenizer.file_hash, tokenizer.vocab_size) != expected:
            raise DataError(f"the tokenizer {tokenizer.name} is not the run's (sha256 {tokenizer.file_hash[:12]}..., the "
                            f"run manifest says {str(tok_hash)[:12]}...): point --tokenizer at the run's tokenizer.json")
        from transformers.utils import logging as hf_logging

        from mapl_swarm.hf.convert import to_hf_model
        from mapl_swarm.pipeline.inprocess import InProcessPipeline

        torch.manual_seed(0)
        pipe = InProcessPipeline(cfg)
        for stage in pipe.stages:
            stage.load_state_dict(checkpoint.load_stage(dirs[stage.stage], step, stage.stage))
        pipe.sync_projectors()  # a swarm stage may have saved before its sender's last PROJ came
        model = to_hf_model(cfg, pipe, eos_token_id=tokenizer.eos_id)
        with torch.no_grad():
            expected_logits = pipe.logits(val)
            got = model(input_ids=val[:, :-1], use_cache=False).logits
        diff = float((got - expected_logits).abs().max())
        del pipe
        model.generation_config.eos_token_id = tokenizer.eos_id
        model.generation_config.pad_token_id = tokenizer.eos_id
        hf_logging.disable_progress_bar()
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp, model_max_length=cfg.model.context_length)
        tokens = step * cfg.tokens_per_step
        model_type = model.config.model_type
        (tmp / "README.md").write_text(_model_card(cfg, step=step, driver=driver, model_type=model_type,
                                                   losses=_losses(run_dir, cfg, driver, step), diff=diff,
                                                   tokens=tokens, manifest=manifest))
        _install(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return ExportResult(out=out, step=step, model_type=model_type, max_logit_diff=diff,
                        skipped=skipped, seconds=time.perf_counter() - t0)


def _tokenizer_and_batch(cfg: TrainConfig, tokenizer_path: str | None):
    """The run's tokenizer (``tokenizer_path``, else the run's prepared data) and one validation
    micro-batch (B, T+1) for the export check (random ids when only a tokenizer file is given)."""
    from mapl_swarm.data import prepare_data, validation_batches
    from mapl_swarm.data.tokenizer import TextTokenizer

    B, T = cfg.pipeline.micro_batch_size, cfg.model.context_length
    if tokenizer_path:
        if not Path(tokenizer_path).is_file():
            raise DataError(f"--tokenizer {tokenizer_path}: no such file")
        tokenizer = TextTokenizer.from_file(tokenizer_path)
        gen = torch.Generator().manual_seed(0)
        return tokenizer, torch.randint(0, cfg.model.vocab_size, (B, T + 1), generator=gen)
    try:
        data = prepare_data(cfg.data, progress=False)
    except MaplError as exc:
        raise DataError(f"the run's tokenizer comes from its data ({exc}); on a host without the corpus, pass "
                        f"--tokenizer PATH/tokenizer.json") from None
    return data.tokenizer, validation_batches(data.val, B, T, 1)[0]
