"""The metrics a process exports besides its JSONL file: a Prometheus endpoint and TensorBoard
event files, both under one schema (:data:`SCALARS`, :func:`scalar_name`).

Every record :class:`~mapl_swarm.pipeline.run_records.MetricsLog` writes (``train``'s, or a swarm
stage's or replica's) also goes to the exporters the ``[metrics]`` section turns on; each is off by
default:

- :class:`PrometheusExporter` (``metrics.prometheus_port``): an HTTP endpoint on
  ``metrics.prometheus_host`` (127.0.0.1 unless told otherwise) serving, in Prometheus' text
  format, the last record's figures as gauges and, for a swarm peer, its live counters read at
  scrape time (:class:`LiveFigures`): bytes per link, direction and kind (averaging included),
  rejected messages by code, the replicas of its stage, the steps redone. Every series carries
  the labels ``run``, ``stage`` and ``peer_id`` (a replica's averaging peer id; empty for a chain
  stage and ``train``), so one Prometheus scrapes a whole swarm.
- :class:`TensorBoardExporter` (``metrics.tensorboard``): one event file per process under
  ``<out_dir>/tensorboard/<who>/``, each record's figures as scalars at its step, tagged with the
  same names (labels appended: ``mapl_energy_captured/boundary=0``).

Names (README "Monitoring" lists them): a record key in :data:`SCALARS` maps to its gauge; a
``health/b{B}/{name}`` key maps to ``mapl_{name}{boundary="B"}`` (``orth_error`` is
``mapl_projector_orthonormality``); ``link_tx_bytes/{link}`` (a peer's payload bytes sent so far on
a link) maps to ``mapl_link_payload_sent_bytes{peer="link"}``; any other numeric key ``k`` is
``mapl_k`` with non-alphanumerics as ``_``.
"""

from __future__ import annotations

import contextlib
import logging
import re
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

__all__ = ["SCALARS", "scalar_name", "LiveFigures", "Exporter", "PrometheusExporter", "TensorBoardExporter",
           "exporters_for", "opened_exporters"]

log = logging.getLogger(__name__)

SCALARS: dict[str, tuple[str, str]] = {
    "step": ("mapl_step", "The last step this process recorded."),
    "loss": ("mapl_train_loss", "Train loss of the last recorded step (the swarm's, at stage 0)."),
    "val_loss": ("mapl_val_loss", "Validation loss of the last validation step."),
    "tokens_per_s": ("mapl_tokens_per_second", "Tokens trained per second over the last step."),
    "tokens": ("mapl_step_tokens", "Tokens of the last recorded step."),
    "step_s": ("mapl_step_seconds", "Wall seconds of the last recorded step."),
    "lr_mult": ("mapl_lr_multiplier", "Learning-rate schedule multiplier of the last step."),
    "grad_norm": ("mapl_grad_norm", "Gradient norm before clipping, last step."),
    "averaging_sent_bytes": ("mapl_averaging_sent_bytes", "Tensor bytes the last averaging round sent."),
    "averaging_received_bytes": ("mapl_averaging_received_bytes",
                                 "Tensor bytes the last averaging round received."),
    "averaging_error_norm": ("mapl_averaging_error_norm",
                             "Norm of this replica's error feedback after the last round."),
}
"""Record key -> (metric name, help) for the figures every process may record."""

_HELP = dict(SCALARS.values())
"""Metric name -> help."""
_HEALTH = re.compile(r"^health/b(\d+)/(.+)$")
_RENAMED = {"orth_error": "projector_orthonormality"}


def scalar_name(key: str) -> tuple[str, dict[str, str]] | None:
    """The metric name and labels a record key is exported under (None: not a metric, e.g. ``time``)."""
    if key in ("time", "stage"):
        return None
    if key in SCALARS:
        return SCALARS[key][0], {}
    if key.startswith("link_tx_bytes/"):
        return "mapl_link_payload_sent_bytes", {"peer": key.split("/", 1)[1]}
    m = _HEALTH.match(key)
    if m:
        name = _RENAMED.get(m.group(2), m.group(2))
        return "mapl_" + re.sub(r"[^a-zA-Z0-9_]", "_", name), {"boundary": m.group(1)}
    return "mapl_" + re.sub(r"[^a-zA-Z0-9_]", "_", key), {}


def _figures(record: dict[str, Any]) -> Iterator[tuple[str, dict[str, str], float]]:
    for key, value in record.items():
        named = scalar_name(key)
        if named is not None and isinstance(value, (int, float)) and not isinstance(value, bool):
            yield named[0], named[1], float(value)


@dataclass
class LiveFigures:
    """A swarm peer's running counters, read when Prometheus scrapes (on the server's thread: each
    callable reads attributes only and returns plain values)."""

    link_bytes: Callable[[], list[tuple[str, str, str, int]]] = lambda: []
    """(peer or link, direction ``tx``/``rx``, kind, bytes so far) rows."""
    rejected: Callable[[], dict[str, int]] = lambda: {}
    """Received messages dropped so far, by code (SPEC §6)."""
    replicas: Callable[[], int | None] = lambda: None
    """Live replicas of this peer's stage, as it knows them (None: the run has no replicas)."""
    redos: Callable[[], int] = lambda: 0
    """Steps this peer redid."""


class Exporter(Protocol):
    def record(self, record: dict[str, Any]) -> None: ...

    def close(self) -> None: ...


class PrometheusExporter:
    """The Prometheus endpoint of one process (``prometheus_client``'s own HTTP server, in a daemon
    thread); :attr:`port` is the bound port (``port=0`` picks a free one)."""

    def __init__(self, host: str, port: int, *, run: str, stage: int | None, peer_id: str = "",
                 live: LiveFigures | None = None) -> None:
        from prometheus_client import CollectorRegistry, start_http_server

        self._place = {"run": run, "stage": "" if stage is None else str(stage), "peer_id": peer_id}
        """The labels of every series: where this process is."""
        self._live = live
        self._last: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
        self._lock = threading.Lock()
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(self)
        try:
            self._server, self._thread = start_http_server(port, addr=host, registry=self.registry)
        except OSError as exc:
            from mapl_swarm.errors import ConfigError

            raise ConfigError(f"metrics.prometheus_port: cannot serve metrics on {host}:{port}: "
                              f"{exc.strerror or exc}") from None
        self.host, self.port = host, int(self._server.server_port)
        self.url = f"http://{host}:{self.port}/metrics"
        """Where it serves (also in the run manifest, ``metrics_endpoints``)."""
        log.info("Prometheus metrics on %s", self.url)

    def record(self, record: dict[str, Any]) -> None:
        with self._lock:
            for name, labels, value in _figures(record):
                self._last[(name, tuple(sorted(labels.items())))] = value

    def collect(self):  # prometheus_client's Collector protocol
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        place = self._place
        with self._lock:
            last = dict(self._last)
        families: dict[str, GaugeMetricFamily] = {}
        for (name, labels), value in sorted(last.items()):
            extra = dict(labels)
            fam = families.get(name)
            if fam is None:
                fam = families[name] = GaugeMetricFamily(name, _HELP.get(name, f"{name} (last record)"),
                                                         labels=[*place, *extra])
            fam.add_metric([*place.values(), *extra.values()], value)
        yield from families.values()
        live = self._live
        if live is None:
            return
        links = CounterMetricFamily("mapl_link_bytes", "Bytes this peer sent (tx) or received (rx), per "
                                    "neighbour or link and kind (ACT, GRAD, averaging...).",
                                    labels=[*place, "peer", "direction", "kind"])
        for peer, direction, kind, n in live.link_bytes():
            links.add_metric([*place.values(), peer, direction, kind], float(n))
        yield links
        rejected = CounterMetricFamily("mapl_rejected_messages", "Received messages dropped, by code (SPEC §6).",
                                       labels=[*place, "code"])
        for code, n in sorted(live.rejected().items()):
            rejected.add_metric([*place.values(), code], float(n))
        yield rejected
        count = live.replicas()
        if count is not None:
            replicas = GaugeMetricFamily("mapl_replicas", "Live replicas of this peer's stage, as it knows them.",
                                         labels=list(place))
            replicas.add_metric(list(place.values()), float(count))
            yield replicas
        redos = CounterMetricFamily("mapl_redos", "Steps this peer redid.", labels=list(place))
        redos.add_metric(list(place.values()), float(live.redos()))
        yield redos

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


class TensorBoardExporter:
    """TensorBoard event files of one process (``torch.utils.tensorboard``), every figure of a
    record as a scalar at the record's step, tagged ``name`` or ``name/label=value``."""

    def __init__(self, log_dir: str | Path) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.log_dir = Path(log_dir)
        self._writer = SummaryWriter(log_dir=str(self.log_dir))

    def record(self, record: dict[str, Any]) -> None:
        step = record.get("step")
        if not isinstance(step, int):
            return
        for name, labels, value in _figures(record):
            if name == "mapl_step":
                continue
            tag = name + "".join(f"/{k}={v}" for k, v in labels.items())
            self._writer.add_scalar(tag, value, global_step=step, walltime=record.get("time"))
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


@contextlib.contextmanager
def opened_exporters(cfg: Any, *, stage: int | None, peer_id: str = "",
                     live: LiveFigures | None = None) -> Iterator[list[Exporter]]:
    """:func:`exporters_for`, closed when the block ends."""
    with contextlib.ExitStack() as closing:
        exporters = exporters_for(cfg, stage=stage, peer_id=peer_id, live=live)
        for exporter in exporters:
            closing.callback(exporter.close)
        yield exporters


def exporters_for(cfg: Any, *, stage: int | None, peer_id: str = "",
                  live: LiveFigures | None = None) -> list[Exporter]:
    """The exporters ``cfg.metrics`` turns on for a process (``train``: ``stage=None``; a replica:
    its averager's ``peer_id``), TensorBoard's under ``<out_dir>/tensorboard/{train,stage<S>}``
    (each replica has an out_dir of its own)."""
    m = cfg.metrics
    out: list[Exporter] = []
    try:
        if m.prometheus_port is not None:
            out.append(PrometheusExporter(m.prometheus_host, m.prometheus_port, run=cfg.run.run_id, stage=stage,
                                          peer_id=peer_id, live=live))
        if m.tensorboard:
            out.append(TensorBoardExporter(Path(cfg.run.out_dir) / "tensorboard" /
                                           ("train" if stage is None else f"stage{stage}")))
    except BaseException:
        for exporter in out:
            exporter.close()
        raise
    return out
