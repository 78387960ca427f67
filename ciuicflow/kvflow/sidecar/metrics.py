"""Prometheus metrics of one sidecar (its own registry, served on ``--metrics-port`` by metrics_http.py)."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from .metrics_http import MetricsServer

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


def _memoize_labels(metric) -> None:
    """``metric.labels(...)`` validates its values and takes a lock, and runs several times per chunk. The
    child of a label set never changes (nothing here removes one), so remember it."""
    cache = {}
    find = metric.labels

    def labels(*values):
        child = cache.get(values)
        if child is None:
            child = cache[values] = find(*values)
        return child

    metric.labels = labels


class Metrics:
    def __init__(self, registry: CollectorRegistry | None = None):
        r = self.registry = registry or CollectorRegistry()
        p = self.prefix = "ciuicflow_kvflow_"
        self.bytes = Counter(p + "bytes", "Payload bytes moved, per peer, class and direction",
                             ["peer", "priority", "direction"], registry=r)
        self.chunks = Counter(p + "chunks", "Chunks moved, per peer, class and direction",
                              ["peer", "priority", "direction"], registry=r)
        self.transfers = Counter(p + "transfers", "Finished transfers by outcome (gRPC status name)",
                                 ["peer", "priority", "direction", "status"], registry=r)
        self.latency = Histogram(p + "transfer_seconds", "Time from send to delivery, per class and direction",
                                 ["priority", "direction"], buckets=_LATENCY_BUCKETS, registry=r)
        self.queue_depth = Gauge(p + "queue_depth", "Outgoing transfers with a chunk waiting, per peer and class",
                                 ["peer", "priority"], registry=r)
        self.pacing_rate = Gauge(p + "pacing_rate_bytes_per_second", "Pacing rate per peer", ["peer"], registry=r)
        self.btl_bw = Gauge(p + "bottleneck_bandwidth_bytes_per_second", "Estimated delivery rate per peer",
                            ["peer"], registry=r)
        self.rtt = Gauge(p + "min_rtt_seconds", "Minimum chunk RTT per peer", ["peer"], registry=r)
        self.cwnd = Gauge(p + "cwnd_bytes", "Cap on bytes in flight per peer", ["peer"], registry=r)
        self.inflight = Gauge(p + "inflight_bytes", "Bytes sent and not yet acknowledged per peer", ["peer"],
                              registry=r)
        self.rtt_hist = Histogram(p + "chunk_rtt_seconds", "Chunk RTT samples per peer", ["peer"],
                                  buckets=_LATENCY_BUCKETS, registry=r)
        self.retransmits = Counter(p + "retransmits", "Chunks sent again, per peer and reason",
                                   ["peer", "reason"], registry=r)
        self.rejected = Counter(p + "rejected_requests", "Requests refused, by gRPC status name",
                                ["code"], registry=r)
        self.buffered = Gauge(p + "buffered_bytes", "Bytes buffered (outgoing + incoming) per peer", ["peer"],
                              registry=r)
        self.buffered_total = Gauge(p + "memory_used_bytes", "Bytes buffered in total (outgoing + incoming)", registry=r)
        self.leases_expired = Counter(p + "leases_expired", "Received transfers dropped uncollected", registry=r)
        self.link_up = Gauge(p + "peer_link_up", "1 while the link to the peer is connected", ["peer"], registry=r)
        self.insecure = Gauge(p + "insecure", "1: started with --insecure (peers unauthenticated on a network "
                                              "address)", registry=r)

        for metric in vars(self).values():
            if getattr(metric, "_labelnames", None):
                _memoize_labels(metric)

    def export_load(self, load) -> None:
        """The load a router reads (``load()``: discovery.entry.Load, also in Stats and the registry entry),
        computed when scraped: on the event loop, which serves the metrics port too."""
        p, r = self.prefix, self.registry
        for field, doc in (("transfers", "Transfers in flight, sending and receiving"),
                           ("queued_bytes", "Bytes buffered, outgoing and received not yet collected"),
                           ("link_bps", "Bandwidth estimate of the fastest connected link, bytes/s")):
            Gauge(p + "load_" + field, doc + " (the load routers read)", registry=r).set_function(
                lambda field=field: getattr(load(), field))

    def sender_state(self, peer: str, cc, queue_depth) -> None:
        """The gauges of one peer's sender: its congestion controller ``cc`` and ready transfers per class."""
        self.pacing_rate.labels(peer).set(cc.pacing_rate)
        self.btl_bw.labels(peer).set(cc.btl_bw)
        if cc.min_rtt != float("inf"):
            self.rtt.labels(peer).set(cc.min_rtt)
        self.cwnd.labels(peer).set(cc.cwnd)
        self.inflight.labels(peer).set(cc.inflight)
        for prio, n in queue_depth.items():
            self.queue_depth.labels(peer, prio).set(n)

    def serve(self, port: int, host: str = "127.0.0.1", *, max_connections: int = 16,
              header_timeout_s: float = 5.0, idle_timeout_s: float = 30.0) -> MetricsServer:
        """Serve the registry on ``host:port`` (needs the running event loop); limits: metrics_http.py."""
        server = MetricsServer(self.registry, max_connections, header_timeout_s, idle_timeout_s)
        server.start(host, port)
        return server
