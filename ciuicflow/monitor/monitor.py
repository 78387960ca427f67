"""``Monitor``: per-step communication records, Prometheus export, straggler and hang alerts.

    state = ciuicflow.register(ddp_model, "hierarchical_1bit")
    with ciuicflow.monitor.Monitor(run_dir="runs/exp1", states=[state],
                                   prometheus_port=9400, straggler_every=50) as mon:
        for batch in loader:
            with mon.step():
                with mon.phase("data"):
                    x, y = next(batches)
                loss = loss_fn(ddp_model(x), y)
                loss.backward()
                optimizer.step()
                mon.add_metrics(loss=loss.item())

Constructing a ``Monitor`` is collective when torch.distributed is initialised (every rank of the
group constructs one, in the same order as its other collectives): it builds a gloo group of its
own, agrees on a run id and, without an explicit ``topology``, detects the node layout. Every
rank must run the same number of steps (a straggler check is a collective every
``straggler_every`` steps).

Each step record (one JSON line per step in ``RUN_DIR/rankNNNNN.jsonl``) holds: ``step``,
``time`` (Unix time at the step's end), ``step_s`` (wall time), ``comm_s`` (time in the sources'
compression and communication, from their ``time_s``), ``compute_s`` (``step_s - comm_s``, at
least 0), ``comm_fraction``, bytes sent per link class and what exact all-reduces would have
sent (``intra_node_bytes``, ``inter_node_bytes``, ``exact_*``), ``compression_ratio`` (exact /
actual, all links) and ``inter_node_compression_ratio``, ``error_feedback_norm`` (every
``error_norm_every`` steps, default 50, else null), ``relative_error`` (the accuracy guard's
measure of the compressing hook states: ||error-feedback memory|| / ||gradient||, worst bucket;
null without one), ``beyond_target_reductions`` (tensors sent with more than their method's own
codec: a 1-bit method's steps that were not all 1 bit), ``wire`` (per source, the tensors whose
plan, ``ciuicflow.explain``'s ``WirePlan`` with its reasons, first appeared or changed at this
step; absent otherwise), ``phases`` (seconds per ``phase``) and ``metrics`` (``add_metrics``). With overlapping hooks (``overlap=True``) communication runs beside the
backward pass, so ``comm_fraction`` bounds the exposed share from above.
"""
from __future__ import annotations

import contextlib
import logging
import os
import threading
import time

from ciuicflow.monitor.layout import detect_layout, hang_detection
from ciuicflow.monitor.recorder import RunRecorder
from ciuicflow.monitor.sources import StatsSource
from ciuicflow.monitor.step_record import step_record
from ciuicflow.monitor.stragglers import (BETWEEN_STEPS, StragglerDetector, describe_hang,
                                          describe_straggler)
from ciuicflow.monitor.traffic import TRAFFIC_MODELS

log = logging.getLogger("ciuicflow.monitor")


class Monitor:
    """Records every step; exports, gathers and watches as configured.

    Args:
        run_dir: where to write ``rankNNNNN.jsonl`` (None: record nothing to disk).
        states: hook states (``stats()``) and/or callables returning cumulative stats dicts.
        group: the process group being trained on (default: the world).
        topology: a ``ciuicflow.Topology`` of ``group`` (default: a state's, else detected).
        prometheus_port: base port; rank's endpoint is ``base + local rank`` (0: OS-chosen).
        prometheus_addr: address the endpoints bind to (``"0.0.0.0"`` to be scraped remotely).
        prometheus_push: ``host:port`` of a Pushgateway to push to every ``push_every`` steps.
        straggler_every: gather step times every N steps (0: never); the gather is read a step
            later, so alerts come one step after the window.
        straggler_factor, straggler_min_excess_s: a straggler is busy > factor x median and
            > median + min_excess_s.
        hang_timeout_s: a rank whose position has not changed for this long is reported
            (None or 0: no watchdog).
        heartbeat_s: how often heartbeats are published and read (default: timeout / 10, <= 5 s).
        store: a torch.distributed Store shared by the ranks (default: the rendezvous store).
        watchdog_rank: the rank that logs alerts and runs the hang watchdog.
        error_norm_every: compute the error-feedback norm every N steps (0: only when reported);
            a pass over gradient-sized buffers, so not every step.
        traffic_model: ``"hierarchical"``, ``"flat"`` or ``"auto"`` (hierarchical when the
            topology is); pass ``"flat"`` with the flat hooks (``onebit``, ``powersgd``).
        flush_every: flush the record file every N steps.
        sync_cuda: ``torch.cuda.synchronize()`` at step boundaries for exact per-step times.
        on_alert: called with each alert dict raised on this rank.
    """

    def __init__(self, run_dir: str | None = None, states=(), *, group=None, topology=None,
                 prometheus_port: int | None = None, prometheus_addr: str = "127.0.0.1",
                 prometheus_push: str | None = None, push_every: int = 10,
                 straggler_every: int = 50, straggler_factor: float = 1.5,
                 straggler_min_excess_s: float = 0.005, hang_timeout_s: float | None = 300.0,
                 heartbeat_s: float | None = None, store=None, watchdog_rank: int = 0,
                 error_norm_every: int = 50, traffic_model: str = "auto", flush_every: int = 10,
                 sync_cuda: bool = False, on_alert=None):
        if traffic_model not in TRAFFIC_MODELS + ("auto",):
            raise ValueError(f"traffic_model must be auto, hierarchical or flat, got "
                             f"{traffic_model!r}")
        for name, value in (("straggler_every", straggler_every),
                            ("error_norm_every", error_norm_every)):
            if int(value) < 0:
                raise ValueError(f"{name} must be >= 0, got {value}")
        if prometheus_port is not None and not 0 <= int(prometheus_port) < 65536:
            raise ValueError(f"prometheus_port must be a port number, got {prometheus_port}")
        if isinstance(states, (str, bytes)) or not hasattr(states, "__iter__"):
            states = [states]
        states = list(states)
        self.sources = [StatsSource(s) for s in states]
        self.error_norm_every = int(error_norm_every)
        self.sync_cuda = bool(sync_cuda)
        self._on_alert_user = on_alert
        self.alerts: list[dict] = []
        self._alerts_lock = threading.Lock()
        self.last_windows: list[dict] | None = None

        layout = detect_layout(group, topology, states)
        self.host, self.rank, self.world_size = layout.host, layout.rank, layout.world_size
        self.node_of_rank, self.hosts, self.run_id = layout.node_of_rank, layout.hosts, layout.run_id
        self._group = layout.group
        self.watchdog_rank = int(watchdog_rank)
        if not 0 <= self.watchdog_rank < self.world_size:
            raise ValueError(f"watchdog_rank {watchdog_rank} is outside the group "
                             f"(size {self.world_size})")
        if traffic_model == "auto":
            traffic_model = "hierarchical" if layout.hierarchical else "flat"
        self.traffic_model = traffic_model

        self._stragglers = None
        if straggler_every and self.world_size > 1:
            self._stragglers = StragglerDetector(
                self._group, int(straggler_every), float(straggler_factor),
                float(straggler_min_excess_s), rank=self.rank, node_of_rank=self.node_of_rank,
                hosts=self.hosts)

        # collectives first (every rank reaches them), then what can fail locally, then threads
        self._heartbeat = self._watchdog = None
        if hang_timeout_s and self.world_size > 1:
            self._heartbeat, self._watchdog = hang_detection(
                layout, store, float(hang_timeout_s), heartbeat_s, self.watchdog_rank,
                self._raise_alert)

        self._prometheus = None
        if prometheus_port is not None or prometheus_push is not None:
            from ciuicflow.monitor.prometheus import PrometheusExporter

            port = None if prometheus_port is None else \
                (0 if int(prometheus_port) == 0 else int(prometheus_port) + self.local_rank)
            self._prometheus = PrometheusExporter(self.rank, self.node, port=port,
                                                  addr=prometheus_addr,
                                                  push_gateway=prometheus_push,
                                                  push_every=push_every)

        self.start_time = time.time()
        self.recorder = None
        if run_dir is not None:
            self.recorder = RunRecorder(run_dir, self.rank, self._meta(), flush_every)

        self.steps = 0             # completed steps; the next step's index
        self.overhead_s = 0.0      # time in the monitor's own bookkeeping (gathers excluded)
        self._in_step = False
        self._t_begin = 0.0
        self._phase_stack: list[tuple[str, float]] = []
        self._phase_times: dict[str, float] = {}
        self._ordinal = 0
        self._metrics: dict = {}
        self._closed = False
        if self._heartbeat is not None:
            self._heartbeat.start()
        if self._watchdog is not None:
            self._watchdog.start()

    # -- construction ----------------------------------------------------------------------

    def _meta(self) -> dict:
        import ciuicflow

        return {
            "run_id": self.run_id, "rank": self.rank, "world_size": self.world_size,
            "node": self.node, "local_rank": self.local_rank, "node_of_rank": self.node_of_rank,
            "host": self.host, "hosts": self.hosts, "traffic_model": self.traffic_model,
            "sources": [s.name for s in self.sources], "start_time": self.start_time,
            "pid": os.getpid(), "ciuicflow_version": ciuicflow.__version__,
            "straggler_every": self._stragglers.every if self._stragglers else 0,
            "prometheus_port": self.prometheus_port,
        }

    # -- layout ----------------------------------------------------------------------------

    @property
    def node(self) -> int:
        return self.node_of_rank[self.rank]

    @property
    def local_rank(self) -> int:
        return [r for r, n in enumerate(self.node_of_rank) if n == self.node].index(self.rank)

    @property
    def gather_s(self) -> float:
        """Time spent starting and reading the straggler gathers."""
        return self._stragglers.gather_s if self._stragglers is not None else 0.0

    @property
    def prometheus_port(self) -> int | None:
        """The port this rank's metrics endpoint listens on (None: no endpoint)."""
        return self._prometheus.port if getattr(self, "_prometheus", None) else None

    # -- the training loop's side ----------------------------------------------------------

    @contextlib.contextmanager
    def step(self):
        """``with mon.step(): ...`` — one training step. A step that raises is not recorded."""
        self.step_begin()
        try:
            yield self
        except BaseException:
            self._abandon_step()
            raise
        self.step_end()

    def step_begin(self) -> None:
        start = time.perf_counter()
        if self._closed:
            raise RuntimeError("this Monitor is closed")
        if self._in_step:
            raise RuntimeError("step_begin() called twice without step_end()")
        self._in_step = True
        self._phase_times = {}
        self._ordinal = 0
        if self._heartbeat is not None:
            self._heartbeat.move(self.steps, "step", 0)
        if self.sync_cuda:
            self._cuda_synchronize()
        now = time.perf_counter()
        self.overhead_s += now - start
        self._t_begin = now

    @contextlib.contextmanager
    def phase(self, name: str):
        """Time a named part of the step (``"data"``, ``"forward"``...); shown in alerts."""
        start = time.perf_counter()
        if not self._in_step:
            raise RuntimeError(f"phase {name!r} outside a step: call it inside mon.step()")
        self._phase_stack.append((name, start))
        self._moved(name)
        self.overhead_s += time.perf_counter() - start
        try:
            yield
        finally:
            end = time.perf_counter()
            self._phase_stack.pop()
            self._phase_times[name] = self._phase_times.get(name, 0.0) + (end - start)
            self._moved(self._phase_stack[-1][0] if self._phase_stack else "step")
            self.overhead_s += time.perf_counter() - end

    def _moved(self, phase: str) -> None:
        self._ordinal += 1
        if self._heartbeat is not None:
            self._heartbeat.move(self.steps, phase, self._ordinal)

    def add_metrics(self, **values) -> None:
        """Free-form numbers for the current step's record (loss, learning rate, ...)."""
        for name, value in values.items():
            self._metrics[name] = value.item() if hasattr(value, "item") else float(value)

    def step_end(self) -> dict:
        """End the step: record it, export it, and run a straggler check when one is due."""
        if self.sync_cuda:
            self._cuda_synchronize()
        end = time.perf_counter()
        if not self._in_step:
            raise RuntimeError("step_end() without step_begin()")
        step_s = end - self._t_begin
        record = step_record(self.steps, step_s, self.sources, self.error_norm_every,
                             self._phase_times, self._metrics)
        self._metrics = {}
        self._in_step = False
        self._phase_stack = []
        if self.recorder is not None:
            self.recorder.step(record)
        if self._prometheus is not None:
            self._prometheus.observe_step(record)
        self.steps += 1
        if self._heartbeat is not None:
            self._heartbeat.move(self.steps, BETWEEN_STEPS, -1)
        self.overhead_s += time.perf_counter() - end
        if self._stragglers is not None:
            if self._stragglers.in_flight:  # started a step ago: everyone has sent by now
                self._finish_straggler_check()
            if self._stragglers.add(record["step"], step_s, self._busy_s(record),
                                    record.get("phases")):
                self._stragglers.start()
        return record

    def _busy_s(self, record: dict) -> float:
        # with sources, waiting for peers shows up inside comm_s: busy time excludes it
        return record["compute_s"] if self.sources else record["step_s"]

    def _abandon_step(self) -> None:
        self._in_step = False
        self._phase_stack = []
        self._metrics = {}
        if self._heartbeat is not None:
            self._heartbeat.move(self.steps, BETWEEN_STEPS, -1)

    @staticmethod
    def _cuda_synchronize() -> None:
        import torch

        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()

    # -- alerts ----------------------------------------------------------------------------

    def _finish_straggler_check(self) -> None:
        if self._heartbeat is not None:
            self._heartbeat.move(self.steps, "straggler check", -1)
        windows, alerts = self._stragglers.finish()
        self.last_windows = windows
        if self._heartbeat is not None:
            self._heartbeat.move(self.steps, BETWEEN_STEPS, -1)
        if self.rank == self.watchdog_rank:  # one rank speaks for all
            for alert in alerts:
                self._raise_alert(dict(alert, time=time.time()))

    def _raise_alert(self, alert: dict) -> None:
        alert = dict(alert, detected_by=self.rank)
        describe = describe_hang if alert["kind"] == "hang" else describe_straggler
        log.warning("ciuicflow.monitor: %s", describe(alert))
        with self._alerts_lock:
            self.alerts.append(alert)
        if self.recorder is not None:
            self.recorder.alert(alert)
        if self._prometheus is not None:
            self._prometheus.count_alert(alert["kind"])
        if self._on_alert_user is not None:
            try:
                self._on_alert_user(alert)
            except Exception:  # a broken callback must not take training down
                log.exception("ciuicflow.monitor: on_alert callback failed")

    # -- shutdown --------------------------------------------------------------------------

    def close(self) -> None:
        """Stop the threads and the endpoint, write the end record. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._stragglers is not None and self._stragglers.in_flight:
            self._finish_straggler_check()  # every rank started it: it completes
        if self._watchdog is not None:
            self._watchdog.close()
        if self._heartbeat is not None:
            self._heartbeat.close()
        if self._prometheus is not None:
            self._prometheus.close()
        if self.recorder is not None:
            self.recorder.close({
                "steps": self.steps, "overhead_s": self.overhead_s,
                "gather_s": self.gather_s,
                "wall_s": time.time() - self.start_time, "time": time.time()})

    def __enter__(self) -> "Monitor":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
