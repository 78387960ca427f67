"""Communication observability for training loops: per-step records, Prometheus metrics,
straggler and hang detection, and the charts of ``ciuicflow report``.

    mon = ciuicflow.monitor.Monitor(run_dir="runs/exp1", states=[hook_state],
                                    prometheus_port=9400, straggler_every=50)
    for batch in loader:
        with mon.step():
            loss = model(batch).sum(); loss.backward(); optimizer.step()
    mon.close()

Modules, one job each:

- ``monitor``: ``Monitor``, the training-loop face that wires the others together;
- ``layout``: its collective setup (ranks, nodes, hosts, run id; heartbeats and watchdog);
- ``sources``: per-step figures from the cumulative ``stats()`` of hook states and optimizers;
- ``step_record``: one step's record, from the sources, phases and metrics;
- ``recorder``: the run directory (one JSON-lines file per rank) and its reader, ``load_run``;
- ``traffic``: the rank x rank traffic matrix derived from per-link-class bytes and the topology;
- ``prometheus``: the Prometheus export (an HTTP endpoint per rank, or pushes to a gateway);
- ``stragglers``: straggler detection (step times gathered over gloo) and the hang watchdog
  (heartbeats through the rendezvous store);
- ``report``: ``ciuicflow report RUN_DIR``.

Names are loaded on first use, so ``ciuicflow report`` does not import torch.distributed.
"""
from importlib import import_module

_EXPORTS = {
    "Monitor": "ciuicflow.monitor.monitor",
    "load_run": "ciuicflow.monitor.recorder",
    "Run": "ciuicflow.monitor.recorder",
    "traffic_matrix": "ciuicflow.monitor.traffic",
    "find_stragglers": "ciuicflow.monitor.stragglers",
    "find_hang_suspects": "ciuicflow.monitor.stragglers",
    "PrometheusExporter": "ciuicflow.monitor.prometheus",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name):
    module_name = _EXPORTS.get(name)
    if module_name is None:
        raise AttributeError(f"module 'ciuicflow.monitor' has no attribute {name!r}")
    value = getattr(import_module(module_name), name)
    globals()[name] = value
    return value


def __dir__():
    return __all__
