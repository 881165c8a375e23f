"""The metrics exporters (``mapl_swarm.metrics.export``): a Prometheus endpoint actually bound and
scraped over HTTP, and TensorBoard event files read back, each holding the figures of the JSONL
records; and ``train`` with both on."""

from __future__ import annotations

import json
import logging
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from mapl_swarm.cli import main
from mapl_swarm.config import config_from_dict
from mapl_swarm.errors import ConfigError
from mapl_swarm.metrics.export import LiveFigures, PrometheusExporter, TensorBoardExporter, scalar_name
from mapl_swarm.pipeline.run_records import MetricsLog
from mapl_swarm.pipeline.trainer import train

from conftest import stdlib_run_config

RECORD = {"step": 7, "stage": 0, "loss": 4.25, "tokens": 512, "step_s": 0.5, "tokens_per_s": 1024.0,
          "lr_mult": 0.75, "health/b1/energy_captured": 0.875, "health/b1/orth_error": 1.5e-7,
          "averaging_sent_bytes": 123456.0}


def scrape(url: str) -> dict[tuple[str, tuple], float]:
    """Every sample the endpoint serves: (name, sorted labels) -> value."""
    with urllib.request.urlopen(url, timeout=10) as resp:
        text = resp.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def test_record_keys_map_to_one_schema_of_names():
    assert scalar_name("loss") == ("mapl_train_loss", {})
    assert scalar_name("val_loss") == ("mapl_val_loss", {})
    assert scalar_name("tokens_per_s") == ("mapl_tokens_per_second", {})
    assert scalar_name("health/b2/orth_error") == ("mapl_projector_orthonormality", {"boundary": "2"})
    assert scalar_name("health/b0/energy_captured") == ("mapl_energy_captured", {"boundary": "0"})
    assert scalar_name("health/b3/vq_act_cos") == ("mapl_vq_act_cos", {"boundary": "3"})
    assert scalar_name("time") is None and scalar_name("stage") is None


def test_the_prometheus_endpoint_serves_the_last_record_and_the_live_counters(tmp_path):
    live = LiveFigures(link_bytes=lambda: [("stage1@a", "tx", "act", 4096), ("averaging", "rx", "averaging", 77)],
                       rejected=lambda: {"replay": 3}, replicas=lambda: 2, redos=lambda: 1)
    exporter = PrometheusExporter("127.0.0.1", 0, run="r1", stage=0, peer_id="Qm1", live=live)
    try:
        assert exporter.port > 0 and exporter.url == f"http://127.0.0.1:{exporter.port}/metrics"
        with MetricsLog(tmp_path / "m.jsonl", resume_from=None, exporters=[exporter]) as log_:
            log_.write(RECORD)
            log_.write({**RECORD, "step": 8, "loss": 4.0})
        written = json.loads((tmp_path / "m.jsonl").read_text().splitlines()[-1])
        got = scrape(exporter.url)
        place = (("peer_id", "Qm1"), ("run", "r1"), ("stage", "0"))
        assert got[("mapl_step", place)] == written["step"] == 8
        assert got[("mapl_train_loss", place)] == written["loss"] == 4.0
        assert got[("mapl_tokens_per_second", place)] == written["tokens_per_s"]
        assert got[("mapl_averaging_sent_bytes", place)] == written["averaging_sent_bytes"]
        boundary = tuple(sorted((*place, ("boundary", "1"))))
        assert got[("mapl_energy_captured", boundary)] == written["health/b1/energy_captured"]
        assert got[("mapl_projector_orthonormality", boundary)] == written["health/b1/orth_error"]
        link = tuple(sorted((*place, ("peer", "stage1@a"), ("direction", "tx"), ("kind", "act"))))
        assert got[("mapl_link_bytes_total", link)] == 4096
        assert got[("mapl_rejected_messages_total", tuple(sorted((*place, ("code", "replay")))))] == 3
        assert got[("mapl_replicas", place)] == 2 and got[("mapl_redos_total", place)] == 1
    finally:
        exporter.close()


def test_a_taken_port_is_one_config_error(tmp_path):
    first = PrometheusExporter("127.0.0.1", 0, run="r1", stage=0)
    try:
        taken = rf"metrics.prometheus_port: cannot serve metrics on 127.0.0.1:{first.port}"
        with pytest.raises(ConfigError, match=taken):
            PrometheusExporter("127.0.0.1", first.port, run="r1", stage=1)
    finally:
        first.close()


@pytest.mark.parametrize("bad", [{"prometheus_port": -1}, {"prometheus_port": 70000}, {"tensorboard": "yes"},
                                 {"prometheus_host": ""}])
def test_bad_metrics_settings_are_config_errors(bad):
    with pytest.raises(ConfigError, match=rf"metrics\]?[.:] ?{next(iter(bad))}"):
        config_from_dict({"metrics": bad}, "test")


def tensorboard_scalars(folder) -> dict[str, list[tuple[int, float]]]:
    acc = EventAccumulator(str(folder))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_tensorboard_files_hold_each_records_figures_at_its_step(tmp_path):
    exporter = TensorBoardExporter(tmp_path / "tb")
    exporter.record(RECORD)
    exporter.close()
    got = tensorboard_scalars(tmp_path / "tb")
    assert got["mapl_train_loss"] == [(7, pytest.approx(4.25))]
    assert got["mapl_energy_captured/boundary=1"] == [(7, pytest.approx(0.875))]
    assert "mapl_step" not in got


def test_train_exports_the_jsonl_figures_to_tensorboard_and_names_its_endpoint(tmp_path, caplog):
    cfg = stdlib_run_config(tmp_path / "cache", tmp_path / "run", 4, interval_steps=0)
    cfg = config_from_dict({**json.loads(json.dumps(_as_dict(cfg))),
                            "metrics": {"tensorboard": True, "prometheus_port": 0, "health_interval_steps": 2},
                            "eval": {"interval_steps": 2, "batches": 1}}, "test")
    with caplog.at_level(logging.INFO, logger="mapl_swarm.metrics.export"):
        train(cfg, progress=False)
    manifest = json.loads((tmp_path / "run" / "manifest.json").read_text())
    assert len(manifest["metrics_endpoints"]) == 1 and manifest["metrics_endpoints"][0] in caplog.text
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    got = tensorboard_scalars(tmp_path / "run" / "tensorboard" / "train")
    losses = [(r["step"], r["loss"]) for r in records if "loss" in r]
    assert [(s, pytest.approx(v, rel=1e-6)) for s, v in losses] == got["mapl_train_loss"] and len(losses) == 4
    vals = [(r["step"], r["val_loss"]) for r in records if "val_loss" in r]
    assert [(s, pytest.approx(v, rel=1e-6)) for s, v in vals] == got["mapl_val_loss"]
    health = [(r["step"], r["health/b0/energy_captured"]) for r in records if "health/b0/energy_captured" in r]
    assert health and [(s, pytest.approx(v, rel=1e-6)) for s, v in health] == got["mapl_energy_captured/boundary=0"]
    # `plot` draws the run (and the same run twice, overlaid)
    assert main(["plot", str(tmp_path / "run"), str(tmp_path / "run"), "--out", str(tmp_path / "plots")]) == 0
    assert sorted(p.name for p in (tmp_path / "plots").iterdir()) == ["bandwidth.png", "health.png", "loss.png",
                                                                      "throughput.png"]
    assert all(p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for p in (tmp_path / "plots").iterdir())


def test_plot_names_a_folder_without_metrics_in_one_line(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    assert main(["plot", str(tmp_path / "empty"), "--out", str(tmp_path / "plots")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"no metrics in {tmp_path / 'empty'}" in err


def _as_dict(cfg):
    from mapl_swarm.config import config_to_dict

    return config_to_dict(cfg)


def test_where_figures_are_exported_is_not_part_of_a_runs_config_hash():
    """A sweep's finished runs still count: the tiny preset keeps the hash it had before the
    exporters' settings existed, whatever they are set to."""
    from mapl_swarm.experiments.grid import config_hash

    plain = config_from_dict({"preset": "tiny"}, "test")
    exported = config_from_dict({"preset": "tiny", "metrics": {"prometheus_port": 9100, "tensorboard": True,
                                                               "prometheus_host": "0.0.0.0"}}, "test")
    assert config_hash(plain) == config_hash(exported) == "047c0995e469428c"
    # a setting added since counts once it is set away from the default every earlier run had
    updates = config_from_dict({"preset": "tiny", "pipeline": {"num_stages": 2},
                                "replicas": {"averaging": "topk", "averaged": "updates"}}, "test")
    topk = config_from_dict({"preset": "tiny", "pipeline": {"num_stages": 2}, "replicas": {"averaging": "topk"}}, "test")
    assert config_hash(updates) != config_hash(topk)
