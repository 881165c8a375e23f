"""Several peers per stage (SPEC §9.10), as real processes: ``launch`` with two replicas of each of
three stages, for 5 steps. Stage 0's replicas split every step's micro-batches (2 and 1 of M = 3), each micro-batch
is routed to one replica of the next stage, the replicas of each stage average their gradients
through hivemind and take the same step; the swarm's losses are those of one in-process pipeline
over the whole batch (``train``), the projector's SPEL steps included (``mapl``), and with MAPL+VQ
(``compression.vq.update = step``) the replicas of a stage learn the same codebooks. ``none`` is
``slow`` (the issue's default-run budget; ``mapl`` runs the same path and more)."""

from __future__ import annotations

import json
import threading
import urllib.request
from pathlib import Path

import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from mapl_swarm.config import load_config
from mapl_swarm.hf.export import export_run
from mapl_swarm.launch import launch, replica_out_dir
from mapl_swarm.metrics.plot import load_run, plot_runs
from mapl_swarm.pipeline.checkpoint import load_stage, stage_steps
from mapl_swarm.pipeline.trainer import train

from swarm_helpers import train_losses, write_config

pytestmark = pytest.mark.timeout(300)

STEPS = 5
"""Steps of each run (the issue's equivalence is over 5 steps)."""


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("cache")


@pytest.mark.parametrize("codec", [pytest.param("none", marks=pytest.mark.slow), "mapl", "mapl_vq"])
def test_two_replicas_of_three_stages_train_as_one_pipeline(tmp_path, cache, codec):
    path = write_config(tmp_path / "replicas.toml", codec=codec, stages=3, steps=STEPS, cache=cache,
                        out=tmp_path / "swarm", run_id=f"replicas-{codec}")
    vq = '\n[compression.vq]\nupdate = "step"\ncodebook_size = 16\n' if codec == "mapl_vq" else ""
    path.write_text(path.read_text() + vq +
                    "\n[replicas]\nenabled = true\ninitial = [2, 2, 2]\nmatchmaking_s = 1.0\n")
    cfg = load_config(path)
    summary = launch(cfg, ["--config", str(path)], progress=False, timeout_s=240)
    ref = train(load_config(path, {"run": {"out_dir": str(tmp_path / "ref")}}), progress=False)
    assert summary.train_losses == pytest.approx(train_losses(tmp_path / "ref"), rel=1e-3)
    assert summary.val_history[-1][1] == pytest.approx(ref.final_val_loss, rel=1e-3)
    results = {(s, r): json.loads((replica_out_dir(tmp_path / "swarm", r) / f"peer_stage{s}.json").read_text())
               for s in range(3) for r in range(2)}
    for s in range(3):  # every replica links to both replicas of each neighbour stage and sent on them
        for r in range(2):
            links = results[s, r]["payload_tx"]
            assert sorted(name.split("@")[0] for name in links) == sorted(
                [f"stage{n}" for n in (s - 1, s + 1) if 0 <= n < 3 for _ in range(2)]), links
            assert results[s, r]["bad_frames"] == 0 and results[s, r]["end"] == "finished"
    # stage 0's replicas both fed the swarm (2 and 1 micro-batches a step) and recorded every loss
    assert all(sum(results[0, r]["payload_tx"][n].get("act", 0) for n in results[0, r]["payload_tx"]) > 0
               for r in range(2))
    assert results[0, 1]["train_losses"] == results[0, 0]["train_losses"]
    assert all(link["forward_payload"] > 0 and link["backward_payload"] > 0 for link in summary.links)
    if codec == "mapl":
        check_any_replica_exports(tmp_path)
    if codec == "mapl_vq":
        check_codebooks(results)


def check_codebooks(results: dict) -> None:
    """The replicas of a stage learned the same codebooks (version and digest of each stream they
    send), a receiver holds the bytes its senders hold at that version, and the links carried full
    slices before the payloads that needed them (no codes at another version, no slice refused; a
    receiver ignores the second upstream replica's copy of a version)."""
    def sent(s: int, stream: str) -> tuple[int, str]:
        book = results[s, 0]["codebooks"]
        return book["versions"][f"tx_{stream}"], book["digests"][f"tx_{stream}"]

    for s in range(3):
        books = [results[s, r]["codebooks"] for r in range(2)]
        for book in books:
            tx = [k for k in book["versions"] if k.startswith("tx_")]
            # a version per step from the first (the grad stream of stage 1 a step later: its
            # downstream decoded all-zero codes in the first step, so it had zero gradients)
            assert tx and all(STEPS - 1 <= book["versions"][k] <= STEPS for k in tx), book["versions"]
            assert {k: (book["versions"][k], book["digests"][k]) for k in tx} == {
                k: (books[0]["versions"][k], books[0]["digests"][k]) for k in tx}
            assert not book["rejected"] and book["resyncs_sent"] == 0 and book["applied"] >= 1, book
        assert sum(book["ignored"] for book in books) >= 1  # the other upstream replica's copy of a version
        for stream, up in (("act", s - 1), ("grad", s + 1)):
            if not 0 <= up < 3:
                continue
            version, digest = sent(up, stream)
            # a replica gets a version with the first payload that needs it: the grad stream's last
            # one would come with the next step's (there is none), the act stream's with the
            # validation's eval ACTs (to one replica); a replica routed no payload of a step may lag
            newest = version - 1 if stream == "grad" else version
            held = [book["versions"][f"rx_{stream}"] for book in books]
            assert max(held) == newest and all(v <= newest for v in held), (s, stream, held, version)
            for book in books:
                if book["versions"][f"rx_{stream}"] == version:
                    assert book["digests"][f"rx_{stream}"] == digest


@pytest.mark.parametrize("scheme", ["powersgd", pytest.param("topk", marks=pytest.mark.slow),
                                    pytest.param("topk/updates", marks=pytest.mark.slow)])
def test_with_compressed_averaging_the_replicas_of_each_stage_stay_bitwise_equal(tmp_path, cache, scheme):
    """``replicas.averaging`` ``powersgd`` and ``topk`` (SPEC §9.10 item 16) in a launched swarm:
    every replica of a stage saves the same parameters, optimizer state (and PowerSGD's warm-start
    factors; with ``averaged = "updates"`` the optimizer state is each replica's own); each keeps its
    own error feedback; the first step's loss (before any update) is ``train``'s; an averaging round
    sends a small fraction of the stage's fp32 gradient bytes."""
    scheme, _, carried = scheme.partition("/")
    path = write_config(tmp_path / f"{scheme}.toml", codec="mapl", stages=3, steps=STEPS, cache=cache,
                        out=tmp_path / "swarm", run_id=f"replicas-{scheme}-{carried or 'gradients'}")
    path.write_text(path.read_text() + "\n[replicas]\nenabled = true\ninitial = [2, 2, 2]\nmatchmaking_s = 1.0\n"
                    f'averaging = "{scheme}"\naveraging_rank = 2\ntopk_fraction = 0.02\n'
                    f'averaged = "{carried or "gradients"}"\n'
                    "[metrics]\nprometheus_port = 0\ntensorboard = true\n")
    folders = [replica_out_dir(tmp_path / "swarm", r) for r in range(2)]
    with Scrapes(folders, stages=3) as scrapes:
        summary = launch(load_config(path), ["--config", str(path)], progress=False, timeout_s=240)
    train(load_config(path, {"run": {"out_dir": str(tmp_path / "ref")}}), progress=False)
    ref = train_losses(tmp_path / "ref")
    assert summary.train_losses[0] == pytest.approx(ref[0], rel=1e-3)
    assert len(summary.train_losses) == STEPS and summary.train_losses[-1] < summary.train_losses[0]
    check_exported(scrapes, folders)
    run = load_run(tmp_path / "swarm")  # `plot` reads every stage's and replica's records
    assert sorted(run.peers) == [(s, r) for s in range(3) for r in range(2)]
    assert all(any(k.startswith("link_tx_bytes/") for k in recs[-1]) for recs in run.peers.values())
    assert sorted(p.name for p in plot_runs([tmp_path / "swarm"], tmp_path / "plots")) == [
        "bandwidth.png", "loss.png", "throughput.png"]
    for s in range(3):
        states = [load_stage(folder, STEPS, s) for folder in folders]
        own = ("/rng", "/averaging/errors") + (("/optimizers",) if carried else ())
        flat = [{k: v for k, v in _tensors(st).items() if not k.startswith(own)} for st in states]
        assert flat[0].keys() == flat[1].keys() and any(k.startswith("/modules") for k in flat[0])
        if carried:  # the compressed matrices' optimizer state: each replica's own, from its own gradients
            moments = [{k: v for k, v in _tensors(st).items() if k.startswith("/optimizers")} for st in states]
            assert moments[0].keys() == moments[1].keys()
            assert any(not torch.equal(moments[0][k], moments[1][k]) for k in moments[0])
        assert any(k.startswith("/averaging/factors") for k in flat[0]) == (scheme == "powersgd")
        assert all(torch.equal(flat[0][k], flat[1][k]) for k in flat[0]), s
        # each replica's own error feedback (zero only for one that computed no micro-batch yet)
        assert all(st["averaging"]["scheme"] == scheme and st["averaging"]["errors"] for st in states)
        assert all(st["averaging"]["averaged"] == (carried or "gradients") for st in states)
        assert any(float(e.norm()) > 0 for st in states for e in st["averaging"]["errors"])
        dense = 4 * sum(v.numel() for k, v in _tensors(states[0]["modules"]).items())
        records = [json.loads(line) for folder in folders
                   for line in (folder / f"metrics_stage{s}.jsonl").read_text().splitlines()]
        sent = [r["averaging_sent_bytes"] for r in records if "averaging_sent_bytes" in r]
        assert sent and max(sent) < 0.25 * dense, (s, sent, dense)
        assert any(r.get("averaging_error_norm", 0) > 0 for r in records)


class Scrapes:
    """Scrapes every peer's Prometheus endpoint (named in its manifest once it serves) over and
    over, on a thread, while the swarm runs: the samples of each scrape, per peer folder and stage."""

    def __init__(self, folders: list[Path], stages: int) -> None:
        self.manifests = [(folder, s, folder / ("manifest.json" if s == 0 else f"manifest_stage{s}.json"))
                          for folder in folders for s in range(stages)]
        self.got: dict[tuple[Path, int], list[dict]] = {(folder, s): [] for folder, s, _ in self.manifests}
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._done.wait(0.2):  # polling a live swarm's endpoints, not a synchronisation
            for folder, s, manifest in self.manifests:
                try:
                    url = json.loads(manifest.read_text())["metrics_endpoints"][0]
                    with urllib.request.urlopen(url, timeout=5) as resp:
                        text = resp.read().decode()
                except (OSError, ValueError, KeyError):
                    continue  # not serving yet, or gone
                self.got[folder, s].append({(x.name, tuple(sorted((k, v) for k, v in x.labels.items()
                                                                  if k not in ("run", "stage", "peer_id")))): x.value
                                            for fam in text_string_to_metric_families(text) for x in fam.samples})

    def __enter__(self) -> "Scrapes":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._done.set()
        self._thread.join()


def check_exported(scrapes: Scrapes, folders: list[Path]) -> None:
    """Every replica served its figures while it trained: at the step a scrape saw, the same figures
    as its JSONL record of that step (stage 0: the swarm's train loss), its live replicas, bytes
    sent on its links and by averaging; its TensorBoard files hold its JSONL's figures."""
    for (folder, s), samples in scrapes.got.items():
        records = {r["step"]: r for r in (json.loads(line) for line in
                                          (folder / f"metrics_stage{s}.jsonl").read_text().splitlines())}
        seen = [x for x in samples if x.get(("mapl_step", ())) in records]
        assert seen, (folder, s, len(samples))
        for x in seen:
            rec = records[x[("mapl_step", ())]]
            assert x[("mapl_step_seconds", ())] == rec["step_s"]
            assert x[("mapl_averaging_sent_bytes", ())] == rec["averaging_sent_bytes"]
            if s == 0:
                assert x[("mapl_train_loss", ())] == rec["loss"]
            assert x[("mapl_replicas", ())] == 2 and x[("mapl_redos_total", ())] == 0
            assert sum(v for (name, labels), v in x.items() if name == "mapl_link_bytes_total"
                       and ("direction", "tx") in labels and ("kind", "averaging") not in labels) > 0
        tb = EventAccumulator(str(folder / "tensorboard" / f"stage{s}"))
        tb.Reload()
        assert [(e.step, e.value) for e in tb.Scalars("mapl_averaging_sent_bytes")] == [
            (step, r["averaging_sent_bytes"]) for step, r in sorted(records.items()) if "averaging_sent_bytes" in r]


def check_any_replica_exports(tmp_path: Path) -> None:
    """Each replica saved its stage in its own folder, bit for bit the other replica's state
    (parameters, optimizer, projector); `export` takes any one replica per stage. The RNG states
    differ: each replica draws its own stream (nothing in training reads it with dropout 0)."""
    folders = [replica_out_dir(tmp_path / "swarm", r) for r in range(2)]
    for s in range(3):
        assert stage_steps(folders[0], s) == stage_steps(folders[1], s) == [STEPS]
        flat = [{k: v for k, v in _tensors(load_stage(folder, STEPS, s)).items() if not k.startswith("/rng")}
                for folder in folders]
        assert flat[0].keys() == flat[1].keys() and flat[0]
        assert all(torch.equal(flat[0][k], flat[1][k]) for k in flat[0]), s
    r = export_run(folders[0], tmp_path / "model", stage_dirs=[f"1={folders[1]}", f"2={folders[1]}"])
    assert r.step == STEPS and r.max_logit_diff < 1e-4


def _tensors(tree, prefix: str = "") -> dict:
    """Every tensor of a nested state (dicts and lists), by its path."""
    if isinstance(tree, torch.Tensor):
        return {prefix: tree}
    items = tree.items() if isinstance(tree, dict) else enumerate(tree) if isinstance(tree, (list, tuple)) else ()
    return {k: v for key, sub in items for k, v in _tensors(sub, f"{prefix}/{key}").items()}
