"""Prometheus export of the per-step figures (prometheus-client).

Each rank owns a registry whose series carry ``rank`` and ``node`` labels, exported either

- on an HTTP endpoint of its own (``port``: the monitor passes ``base_port + local rank``, so the
  ranks of a node use consecutive ports and every node the same ones; ``port=0`` lets the OS
  pick), or
- by pushes to a Pushgateway (``push_gateway="host:9091"``), grouped by ``rank``, from a
  background thread so that a slow gateway never stalls a training step; or both.

A training step only adds a few floats under a lock; the series are built when scraped or
pushed (a custom collector), so the step does not pay for formatting them.

Series (all prefixed ``ciuicflow_``): ``steps_total``, ``step_seconds`` (histogram),
``last_step_seconds``, ``comm_seconds_total``, ``compute_seconds_total``, ``comm_fraction``,
``bytes_sent_total{link}``, ``exact_bytes_total{link}``, ``compression_ratio``,
``error_feedback_norm``, ``last_step_timestamp_seconds``, and ``alerts_total{kind}`` (on the
rank that detects).
"""
from __future__ import annotations

import bisect
import logging
import math
import threading

from prometheus_client import CollectorRegistry, Counter, push_to_gateway
from prometheus_client.exposition import start_http_server
from prometheus_client.metrics_core import (CounterMetricFamily, GaugeMetricFamily,
                                            HistogramMetricFamily)
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

log = logging.getLogger("ciuicflow.monitor")

STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
                30.0, 60.0)
LINKS = ("intra_node", "inter_node")
_COUNTERS = {  # name -> (help, record key)
    "steps": ("training steps recorded", None),
    "comm_seconds": ("time in the sources' compression and communication", "comm_s"),
    "compute_seconds": ("step time outside communication", "compute_s"),
}
_GAUGES = {
    "last_step_seconds": ("wall time of the last step", "step_s"),
    "comm_fraction": ("communication share of the last step", "comm_fraction"),
    "compression_ratio": ("exact / actual bytes of the last step with traffic, all links",
                          "compression_ratio"),
    "error_feedback_norm": ("L2 norm of the error-feedback memory, last computed",
                            "error_feedback_norm"),
    "compression_relative_error": ("the accuracy guard's measure: ||error-feedback memory|| / "
                                   "||gradient||, worst bucket, last step", "relative_error"),
    "last_step_timestamp_seconds": ("when the last step ended (Unix time)", "time"),
}


class _StepCollector(Collector):
    """Holds running totals; builds the metric families when the registry is collected."""

    def __init__(self, labels: dict):
        self._names, self._values = list(labels), list(labels.values())
        self._lock = threading.Lock()
        self._counters = dict.fromkeys(_COUNTERS, 0.0)
        self._gauges = dict.fromkeys(_GAUGES, math.nan)  # unknown until reported
        self._sent = dict.fromkeys(LINKS, 0.0)
        self._exact = dict.fromkeys(LINKS, 0.0)
        self._buckets = [0] * (len(STEP_BUCKETS) + 1)  # last: above every bound
        self._step_sum = 0.0

    def observe(self, record: dict) -> None:
        with self._lock:
            self._counters["steps"] += 1
            self._counters["comm_seconds"] += record["comm_s"]
            self._counters["compute_seconds"] += record["compute_s"]
            for name, (_, key) in _GAUGES.items():
                value = record.get(key)
                if value is not None:
                    self._gauges[name] = value
            for link in LINKS:
                self._sent[link] += record[f"{link}_bytes"]
                self._exact[link] += record[f"exact_{link}_bytes"]
            self._buckets[bisect.bisect_left(STEP_BUCKETS, record["step_s"])] += 1
            self._step_sum += record["step_s"]

    def collect(self):
        with self._lock:
            counters, gauges = dict(self._counters), dict(self._gauges)
            sent, exact = dict(self._sent), dict(self._exact)
            buckets, step_sum = list(self._buckets), self._step_sum
        for name, (doc, _) in _COUNTERS.items():
            family = CounterMetricFamily(f"ciuicflow_{name}", doc, labels=self._names)
            family.add_metric(self._values, counters[name])
            yield family
        for name, (doc, _) in _GAUGES.items():
            family = GaugeMetricFamily(f"ciuicflow_{name}", doc, labels=self._names)
            family.add_metric(self._values, gauges[name])
            yield family
        for name, doc, values in (("bytes_sent", "bytes this rank sent (modelled)", sent),
                                  ("exact_bytes", "bytes exact all-reduces would have sent",
                                   exact)):
            family = CounterMetricFamily(f"ciuicflow_{name}", doc,
                                         labels=["link"] + self._names)
            for link in LINKS:
                family.add_metric([link] + self._values, values[link])
            yield family
        cumulative, running = [], 0
        for bound, count in zip(STEP_BUCKETS + (math.inf,), buckets):
            running += count
            cumulative.append((floatToGoString(bound), running))
        family = HistogramMetricFamily("ciuicflow_step_seconds", "wall time of a training step",
                                       labels=self._names)
        family.add_metric(self._values, cumulative, sum_value=step_sum)
        yield family


class PrometheusExporter:
    def __init__(self, rank: int, node: int, *, port: int | None = None,
                 addr: str = "127.0.0.1", push_gateway: str | None = None, push_every: int = 10,
                 job: str = "ciuicflow"):
        if port is None and push_gateway is None:
            raise ValueError("PrometheusExporter needs a port, a push_gateway, or both")
        if push_every < 1:
            raise ValueError(f"push_every must be >= 1, got {push_every}")
        self._labels = {"rank": str(rank), "node": str(node)}
        self.registry = CollectorRegistry()
        self._steps = _StepCollector(self._labels)
        self.registry.register(self._steps)
        self._alerts = Counter("ciuicflow_alerts", "straggler and hang alerts raised",
                               ["kind", "rank", "node"], registry=self.registry)

        self._server = None
        self.port = None
        if port is not None:
            try:
                self._server, _ = start_http_server(port, addr=addr, registry=self.registry)
            except OSError as exc:
                raise RuntimeError(f"ciuicflow.monitor: cannot serve Prometheus metrics on "
                                   f"{addr}:{port} (rank {rank}): {exc}") from exc
            self.port = self._server.server_port

        self._gateway, self._job, self._push_every = push_gateway, job, push_every
        self._push_wanted = threading.Event()
        self._closing = False
        self._push_error_logged = False
        self._pusher = None
        if push_gateway is not None:
            self._pusher = threading.Thread(target=self._push_loop, daemon=True,
                                            name="ciuicflow-prometheus-push")
            self._pusher.start()
        self._steps_seen = 0

    # -- updates (called from the training loop) -------------------------------------------

    def observe_step(self, record: dict) -> None:
        self._steps.observe(record)
        self._steps_seen += 1
        if self._pusher is not None and self._steps_seen % self._push_every == 0:
            self._push_wanted.set()

    def count_alert(self, kind: str) -> None:
        self._alerts.labels(kind=kind, **self._labels).inc()
        if self._pusher is not None:
            self._push_wanted.set()

    # -- pushing ---------------------------------------------------------------------------

    def push(self) -> bool:
        """Push now (blocking); False when the gateway could not be reached (logged once)."""
        try:
            push_to_gateway(self._gateway, job=self._job, registry=self.registry,
                            grouping_key={"rank": self._labels["rank"]}, timeout=5)
            return True
        except OSError as exc:
            if not self._push_error_logged:
                self._push_error_logged = True
                log.warning("ciuicflow.monitor: rank %s cannot push metrics to %s: %s",
                            self._labels["rank"], self._gateway, exc)
            return False

    def _push_loop(self) -> None:
        while True:
            self._push_wanted.wait()
            self._push_wanted.clear()
            if self._closing:
                return
            self.push()

    def close(self) -> None:
        """Final push (when pushing), then stop the endpoint."""
        if self._pusher is not None and not self._closing:
            self._closing = True
            self._push_wanted.set()
            self._pusher.join(timeout=10)
            self.push()
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
