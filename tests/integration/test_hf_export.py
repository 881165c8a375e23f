"""The trained model leaves the swarm: export, load with transformers, evaluate, generate (issue 21).

Every codec's export, loaded by ``AutoModelForCausalLM.from_pretrained``, gives the logits of the
in-process pipeline built from the same checkpoint (fp32, CPU); so does a 3-stage swarm whose
stages wrote separate folders. ``codec = "none"`` loads as a plain Llama in an interpreter that
never imported mapl_swarm. Greedy generation equals the argmax continuation computed without a
cache; ``eval --config`` reproduces the run's last val_loss; ``eval --tasks`` runs lm-eval on a
local multiple-choice task; bad input gives one line and exit 2, and leaves nothing at OUT.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mapl_swarm.cli import main
from mapl_swarm.config import config_from_dict
from mapl_swarm.data import prepare_data, validation_batches
from mapl_swarm.pipeline import checkpoint
from mapl_swarm.pipeline.inprocess import InProcessPipeline
from mapl_swarm.pipeline.trainer import train

from swarm_helpers import Watched, cli, start_dht

CODECS = ["none", "none_offsets", "mapl", "fixed", "naive", "ssn", "mapl_vq"]
STEPS = 3


def run_config(cache: Path, out: Path, codec: str, **compression):
    return config_from_dict({
        "model": {"vocab_size": 512, "hidden_size": 32, "num_layers": 3, "num_heads": 2,
                  "ffn_hidden_size": 64, "context_length": 16},
        "compression": {"codec": codec, "rank": 8, "anchor_rank": 8, **compression},
        "optim": {"warmup_steps": 2},
        "data": {"source": "stdlib", "vocab_size": 512, "max_corpus_bytes": 200_000, "val_fraction": 0.2,
                 "cache_dir": str(cache)},
        "run": {"steps": STEPS, "out_dir": str(out)},
        "pipeline": {"num_stages": 3, "micro_batch_size": 2, "num_micro_batches": 2},
        "eval": {"interval_steps": STEPS, "batches": 2},
        "checkpoint": {"interval_steps": STEPS},
    }, "test_hf_export")


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("cache")
    prepare_data(run_config(path, path, "mapl").data, progress=False)
    return path


def _train(cache: Path, root: Path, codec: str, **compression):
    cfg = run_config(cache, root / "run", codec, **compression)
    train(cfg, progress=False)
    return cfg


def _export(run: Path, out: Path, *extra: str) -> None:
    assert main(["export", str(run), str(out), *extra]) == 0


def reference_logits(cfg, dirs: dict[int, Path], step: int, ids: torch.Tensor) -> torch.Tensor:
    """The in-process pipeline with every stage's checkpoint of ``step`` loaded, each receiver holding
    its sender's projector (as a swarm's PROJ gives it before the next decode), as a run evaluates."""
    torch.manual_seed(0)
    pipe = InProcessPipeline(cfg)
    for stage in pipe.stages:
        stage.load_state_dict(checkpoint.load_stage(dirs[stage.stage], step, stage.stage))
    pipe.sync_projectors()
    return pipe.logits(ids)


def val_batch(cfg) -> torch.Tensor:
    data = prepare_data(cfg.data, progress=False)
    return validation_batches(data.val, cfg.pipeline.micro_batch_size, cfg.model.context_length, 1)[0]


def hf_logits(path: Path, ids: torch.Tensor) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path).eval()
    with torch.no_grad():
        return model(input_ids=ids[:, :-1], use_cache=False).logits.float()


@pytest.mark.parametrize("codec", CODECS)
def test_export_of_every_codec_computes_what_the_pipeline_computes(codec, cache, tmp_path):
    # codec none exports a plain Llama, which has no boundary rounding: exact on an fp32 wire
    cfg = _train(cache, tmp_path, codec, **({"wire_dtype": "fp32"} if codec == "none" else {}))
    out = tmp_path / "hf"
    _export(tmp_path / "run", out)
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == ("llama" if codec == "none" else "mapl_llama")
    assert {"model.safetensors", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
            "README.md"} <= {p.name for p in out.iterdir()}
    ids = val_batch(cfg)
    expected = reference_logits(cfg, {s: tmp_path / "run" for s in range(3)}, STEPS, ids)
    assert torch.allclose(hf_logits(out, ids), expected, atol=1e-5, rtol=0)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(out)
    assert tok.decode(tok("def main():")["input_ids"]) == "def main():"
    assert tok.eos_token == "<|endoftext|>"
    card = (out / "README.md").read_text()
    assert f"step {STEPS} of {STEPS}" in card and codec in card and "final train loss" in card


def test_none_on_a_bf16_wire_is_a_plain_llama_that_skips_the_boundary_rounding(cache, tmp_path):
    cfg = _train(cache, tmp_path, "none")
    out = tmp_path / "hf"
    _export(tmp_path / "run", out)
    ids = val_batch(cfg)
    diff = (hf_logits(out, ids) - reference_logits(cfg, {s: tmp_path / "run" for s in range(3)}, STEPS, ids)).abs()
    assert 0 < float(diff.max()) < 5e-2  # bf16 rounding of the hidden state at 2 boundaries, nothing more
    assert "does not, hence the logit difference" in (out / "README.md").read_text()


def test_plain_llama_loads_without_mapl_swarm(cache, tmp_path):
    cfg = _train(cache, tmp_path, "none", wire_dtype="fp32")
    out = tmp_path / "hf"
    _export(tmp_path / "run", out)
    ids = val_batch(cfg)
    script = (
        "import sys, torch\n"
        "from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM\n"
        f"m = AutoModelForCausalLM.from_pretrained({str(out)!r}).eval()\n"
        "assert type(m) is LlamaForCausalLM, type(m)\n"
        f"AutoTokenizer.from_pretrained({str(out)!r})\n"
        f"ids = torch.tensor({ids[:, :-1].tolist()})\n"
        "with torch.no_grad(): logits = m(input_ids=ids).logits\n"
        f"torch.save(logits, {str(tmp_path / 'logits.pt')!r})\n"
        "assert not any(name.startswith('mapl_swarm') for name in sys.modules)\n"
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                          cwd=tmp_path)  # not the repository root: nothing of mapl_swarm on sys.path
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert torch.allclose(torch.load(tmp_path / "logits.pt"), hf_logits(out, ids), atol=1e-6, rtol=0)


def test_swarm_run_with_a_folder_per_stage(cache, tmp_path):
    """A 3-stage MAPL+VQ swarm whose stages wrote separate folders (one per host): exported with
    --stage-dir, equal to the in-process pipeline built from those folders."""
    cfg = run_config(cache, tmp_path / "host0", "mapl_vq")
    path = tmp_path / "swarm.toml"
    path.write_text(_toml(cfg))
    dirs = {s: tmp_path / f"host{s}" for s in range(3)}
    dht, maddr = start_dht(path)
    peers = [Watched(cli("peer", "--config", str(path), "--stage", str(s), "--initial-peer", maddr, "--quiet",
                         "--set", f'run.out_dir="{dirs[s]}"')) for s in range(3)]
    try:
        for p in peers:
            assert p.wait(180) == 0, p.output[-4000:]
    finally:
        for p in peers:
            p.stop()
        dht.stop()
    assert all(checkpoint.stage_steps(dirs[s], s) == [STEPS] for s in range(3))
    assert not (dirs[0] / "checkpoints" / f"step_{STEPS:08d}" / "stage_1.pt").exists()
    out = tmp_path / "hf"
    assert main(["export", str(dirs[0]), str(out), "--stage-dir", f"1={dirs[1]}", "--stage-dir", f"2={dirs[2]}"]) == 0
    ids = val_batch(cfg)
    assert torch.allclose(hf_logits(out, ids), reference_logits(cfg, dirs, STEPS, ids), atol=1e-5, rtol=0)
    assert "3 stages (swarm)" in (out / "README.md").read_text()


def _toml(cfg) -> str:
    from mapl_swarm.config import config_to_dict

    def value(v):
        return json.dumps(list(v) if isinstance(v, tuple) else v)
    lines = []
    for section, fields in config_to_dict(cfg).items():
        if not isinstance(fields, dict):
            lines.insert(0, f"{section} = {value(fields)}")
            continue
        lines.append(f"[{section}]")
        nested = {k: v for k, v in fields.items() if isinstance(v, dict)}
        lines += [f"{k} = {value(v)}" for k, v in fields.items() if k not in nested and v is not None]
        for name, sub in nested.items():
            lines.append(f"[{section}.{name}]")
            lines += [f"{k} = {value(v)}" for k, v in sub.items() if v is not None]
    return "\n".join(lines) + "\n"


@pytest.fixture(scope="module")
def mapl_export(cache, tmp_path_factory):
    root = tmp_path_factory.mktemp("mapl")
    cfg = _train(cache, root, "mapl")
    _export(root / "run", root / "hf")
    return cfg, root / "hf", root / "run"


def test_greedy_generation_is_the_argmax_continuation(mapl_export, capsys):
    from mapl_swarm.hf.generate import generate
    from mapl_swarm.hf.loading import load_model

    _, out, _ = mapl_export
    lm = load_model(out, device="cpu")
    cached = generate(lm, "def f(x):", max_new_tokens=8, temperature=0)
    uncached = generate(lm, "def f(x):", max_new_tokens=8, temperature=0, use_cache=False)
    ids = list(cached.prompt_ids)
    for _ in range(len(cached.new_ids)):
        with torch.no_grad():
            ids.append(int(lm.model(input_ids=torch.tensor([ids]), use_cache=False).logits[0, -1].argmax()))
    assert cached.new_ids == ids[len(cached.prompt_ids):] == uncached.new_ids
    assert main(["generate", str(out), "--prompt", "def f(x):", "--max-new-tokens", "8", "--temperature", "0"]) == 0
    assert capsys.readouterr().out == "def f(x):" + cached.text + "\n"
    sampled = [generate(lm, "def f(x):", max_new_tokens=8, temperature=1.0, seed=s).new_ids for s in (1, 1, 2)]
    assert sampled[0] == sampled[1]  # seeded


def test_eval_config_reproduces_the_runs_last_val_loss(mapl_export, tmp_path, capsys):
    cfg, out, run = mapl_export
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    val = [r["val_loss"] for r in records if "val_loss" in r and r["step"] == STEPS][-1]
    config = tmp_path / "run.toml"
    config.write_text(_toml(cfg))
    assert main(["eval", str(out), "--config", str(config), "--quiet"]) == 0
    loss = float(re.search(r"loss (\S+),", capsys.readouterr().out).group(1))
    assert loss == pytest.approx(val, abs=1e-4)


def test_eval_text_reports_tokens_loss_and_perplexity(mapl_export, tmp_path, capsys):
    _, out, _ = mapl_export
    text = tmp_path / "notes.txt"
    text.write_text("def add(a, b):\n    return a + b\n" * 20)
    assert main(["eval", str(out), "--text", str(text), "--quiet"]) == 0
    m = re.fullmatch(r"\S+ on \S+: (\d+) tokens, loss (\S+), perplexity (\S+)\n", capsys.readouterr().out)
    assert m and int(m.group(1)) > 50 and float(m.group(3)) == pytest.approx(2.718281828 ** float(m.group(2)), rel=1e-3)


TASK = """task: tiny_choice
dataset_path: json
dataset_kwargs:
  data_files:
    test: {items}
output_type: multiple_choice
test_split: test
doc_to_text: "{{{{question}}}}"
doc_to_target: "{{{{label}}}}"
doc_to_choice: "{{{{choices}}}}"
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
"""


def test_eval_tasks_runs_lm_eval_on_a_local_multiple_choice_task(mapl_export, tmp_path, capsys):
    pytest.importorskip("lm_eval")
    _, out, _ = mapl_export
    items = tmp_path / "items.jsonl"
    rows = [{"question": "def f(x):\n    return", "choices": [" x", " ))(("], "label": 0},
            {"question": "import", "choices": [" os", " ]]"], "label": 0},
            {"question": "for i in", "choices": [" range(3):", " ::::"], "label": 0},
            {"question": "class A", "choices": [":", " ]["], "label": 0}]
    items.write_text("".join(json.dumps(r) + "\n" for r in rows))
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    (tasks / "tiny_choice.yaml").write_text(TASK.format(items=items))
    assert main(["eval", str(out), "--tasks", "tiny_choice", "--tasks-dir", str(tasks), "--batch-size", "2"]) == 0
    table = capsys.readouterr().out
    m = re.search(r"\|tiny_choice\s*\|.*\|acc\s*\|[^|]*\|\s*([\d.]+)\|", table)
    assert m and 0.0 <= float(m.group(1)) <= 1.0, table


# ---------------------------------------------------------------- bad input
def _fails(capsys, argv: list[str], pattern: str) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert re.search(pattern, err), err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err


def test_export_refuses_bad_run_folders_and_leaves_nothing_at_out(cache, tmp_path, capsys):
    _train(cache, tmp_path / "a", "mapl")
    _train(cache, tmp_path / "b", "mapl", rank=4)  # another config
    run, out = tmp_path / "a" / "run", tmp_path / "hf"
    _fails(capsys, ["export", str(tmp_path), str(out)], r"not a run folder")
    _fails(capsys, ["export", str(run), str(out), "--stage-dir", f"1={tmp_path / 'b' / 'run'}"],
           r"stage 1's folder .* belongs to another run or config")
    empty = tmp_path / "empty"
    empty.mkdir()
    _fails(capsys, ["export", str(run), str(out), "--stage-dir", f"2={empty}"],
           r"stage 2 has no checkpoint under .*--stage-dir 2=PATH")
    _fails(capsys, ["export", str(run), str(out), "--stage-dir", "7=/x"], r"--stage-dir '7=/x': the run has stages 0..2")
    pt = run / "checkpoints" / f"step_{STEPS:08d}" / "stage_1.pt"
    pt.write_bytes(pt.read_bytes()[:100])  # the only step of stage 1, truncated
    _fails(capsys, ["export", str(run), str(out)],
           r"no checkpoint step that every stage holds verified \(stage 0: \[3\]; stage 1: none verified")
    assert not out.exists() and not list(tmp_path.glob(".hf.tmp-*"))
    _export(tmp_path / "b" / "run", out)
    _fails(capsys, ["export", str(tmp_path / "b" / "run"), str(out)], r"exists: choose another OUT or pass --force")


def test_eval_and_generate_refuse_bad_models_and_prompts(mapl_export, tmp_path, capsys):
    _, out, _ = mapl_export
    _fails(capsys, ["eval", str(tmp_path / "nothing"), "--text", str(out / "README.md")], r"no such folder")
    other = tmp_path / "other"
    other.mkdir()
    _fails(capsys, ["generate", str(other), "--prompt", "x"], r"not a Hugging Face model folder: no config\.json")
    (other / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    _fails(capsys, ["generate", str(other), "--prompt", "x"], r"is a gpt2 model; eval and generate take a mapl_llama or")
    broken = tmp_path / "broken"
    subprocess.run(["cp", "-r", str(out), str(broken)], check=True)
    weights = broken / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    _fails(capsys, ["eval", str(broken), "--text", str(out / "README.md")], r"cannot load its weights")
    _fails(capsys, ["generate", str(out), "--prompt", "x = 1\n" * 40], r"the prompt is \d+ tokens; the model's context "
                                                                       r"is 16 tokens")


def test_eval_tasks_names_the_hub_dataset_it_cannot_reach(mapl_export, capsys):
    pytest.importorskip("lm_eval")
    from mapl_swarm.hf.evaluate import _hub_problem

    if _hub_problem() is None:
        pytest.skip("the Hugging Face hub is reachable from here")
    _, out, _ = mapl_export
    _fails(capsys, ["eval", str(out), "--tasks", "arc_easy"],
           r"the datasets of arc_easy \(allenai/ai2_arc\) are on the Hugging Face hub, which is unreachable from here "
           r"\(.*\): download them .* \(--tasks-dir DIR\)")


def test_loads_in_bf16_with_fp32_boundaries(mapl_export):
    from transformers import AutoModelForCausalLM

    cfg, out, _ = mapl_export
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.bfloat16).eval()
    assert model.model.layers[0].mlp.down_proj.weight.dtype == torch.bfloat16
    assert {b.dtype for name, b in model.named_buffers() if "boundaries" in name} == {torch.float32}
    assert {p.dtype for name, p in model.named_parameters() if "anchors" in name} == {torch.float32}
    ids = val_batch(cfg)
    with torch.no_grad():
        got = model(input_ids=ids[:, :-1]).logits
    assert got.dtype == torch.float32 and torch.allclose(got, hf_logits(out, ids), atol=0.05, rtol=0)
