"""The simulated multi-node cluster, under its first name: it lives in ``ciuicflow.testing.cluster``
(with ``cluster_env`` and ``cluster_netns``); benchmarks, tests and docs import it from here."""
from ciuicflow.testing.cluster import MASTER_PORT, ClusterRun, SimCluster
from ciuicflow.testing.cluster_env import (ENV_IFACE, ENV_NETNS, ENV_NODE, ENV_RATE, ENV_SHAPED, NODE_IFACE,
                                           format_rate, parse_rate, read_node_link_bytes)
from ciuicflow.testing.cluster_netns import NETNS_ETC, NETNS_PREFIX, cleanup_stale, netns_available

__all__ = ["SimCluster", "ClusterRun", "MASTER_PORT", "NODE_IFACE", "NETNS_PREFIX", "NETNS_ETC", "ENV_NETNS",
           "ENV_SHAPED", "ENV_IFACE", "ENV_NODE", "ENV_RATE", "parse_rate", "format_rate", "read_node_link_bytes",
           "cleanup_stale", "netns_available"]
