"""Prometheus export of the per-step figures (prometheus-client).

Each rank owns a registry whose series carry ``rank`` and ``node`` labels, exported either

- on an HTTP endpoint of its own (``port``: the monitor passes ``base_port + local rank``, so the
  ranks of a node use consecutive ports and every node the same ones; ``port=0`` lets the OS
  pick), or
- by pushes to a Pushgateway (``push_gateway="host:9091"``), grouped by ``rank``, from a
  background thread so that a slow gateway never stalls a training step; or both.

Series (all prefixed ``ciuicflow_``): ``steps_total``, ``step_seconds`` (histogram),
``last_step_seconds``, ``comm_seconds_total``, ``compute_seconds_total``, ``comm_fraction``,
``bytes_sent_total{link}``, ``exact_bytes_total{link}``, ``compression_ratio``,
``error_feedback_norm``, ``alerts_total{kind}`` (on the rank that detects), ``last_step_timestamp_seconds``.
"""
from __future__ import annotations

import logging
import math
import threading

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, push_to_gateway
from prometheus_client.exposition import start_http_server

log = logging.getLogger("ciuicflow.monitor")

STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
                30.0, 60.0)
LINKS = ("intra_node", "inter_node")


class PrometheusExporter:
    def __init__(self, rank: int, node: int, *, port: int | None = None,
                 addr: str = "127.0.0.1", push_gateway: str | None = None, push_every: int = 10,
                 job: str = "ciuicflow"):
        if port is None and push_gateway is None:
            raise ValueError("PrometheusExporter needs a port, a push_gateway, or both")
        if push_every < 1:
            raise ValueError(f"push_every must be >= 1, got {push_every}")
        self.registry = CollectorRegistry()
        labels = {"rank": str(rank), "node": str(node)}
        names = list(labels)

        def metric(kind, name, doc, extra=(), **kw):
            return kind(f"ciuicflow_{name}", doc, names + list(extra), registry=self.registry, **kw)

        self._steps = metric(Counter, "steps", "training steps recorded").labels(**labels)
        self._step_seconds = metric(Histogram, "step_seconds", "wall time of a training step",
                                    buckets=STEP_BUCKETS).labels(**labels)
        self._last_step = metric(Gauge, "last_step_seconds", "wall time of the last step").labels(**labels)
        self._comm = metric(Counter, "comm_seconds", "time in hooks' compression and "
                            "communication").labels(**labels)
        self._compute = metric(Counter, "compute_seconds", "step time outside communication").labels(**labels)
        self._fraction = metric(Gauge, "comm_fraction", "communication share of the last step").labels(**labels)
        sent = metric(Counter, "bytes_sent", "bytes this rank sent (modelled)", ["link"])
        exact = metric(Counter, "exact_bytes", "bytes exact all-reduces would have sent", ["link"])
        self._sent = {link: sent.labels(link=link, **labels) for link in LINKS}
        self._exact = {link: exact.labels(link=link, **labels) for link in LINKS}
        self._ratio = metric(Gauge, "compression_ratio", "exact / actual bytes of the last step, "
                             "all links").labels(**labels)
        self._ef_norm = metric(Gauge, "error_feedback_norm", "L2 norm of the error-feedback "
                               "memory").labels(**labels)
        self._alerts = metric(Counter, "alerts", "straggler and hang alerts raised", ["kind"])
        self._last_time = metric(Gauge, "last_step_timestamp_seconds", "when the last step "
                                 "ended (Unix time)").labels(**labels)
        self._labels = labels
        for value in (self._ratio, self._ef_norm):
            value.set(math.nan)  # unknown until reported

        self._server = self._server_thread = None
        self.port = None
        if port is not None:
            try:
                self._server, self._server_thread = start_http_server(port, addr=addr,
                                                                      registry=self.registry)
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
        step_s = record["step_s"]
        self._steps.inc()
        self._step_seconds.observe(step_s)
        self._last_step.set(step_s)
        self._comm.inc(record["comm_s"])
        self._compute.inc(record["compute_s"])
        self._fraction.set(record["comm_fraction"])
        for link in LINKS:
            self._sent[link].inc(record[f"{link}_bytes"])
            self._exact[link].inc(record[f"exact_{link}_bytes"])
        if record.get("compression_ratio") is not None:
            self._ratio.set(record["compression_ratio"])
        if record.get("error_feedback_norm") is not None:
            self._ef_norm.set(record["error_feedback_norm"])
        self._last_time.set(record["time"])
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
