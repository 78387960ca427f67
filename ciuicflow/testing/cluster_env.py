"""What the simulated cluster and the processes it launches share: the variables it exports to
them, the name of a node's inter-node interface, rates in bits/s, and that interface's byte
counters as a rank reads them. Light on purpose: the ranks import it."""
from __future__ import annotations

import os
import re

NODE_IFACE = "veth0"  # name of each node's inter-node interface, inside its namespace

# environment variables the cluster passes to every process it launches on a node
ENV_NETNS = "CIUICFLOW_SIM_NETNS"  # "1" inside a namespace node, "0" in the loopback fallback
ENV_SHAPED = "CIUICFLOW_SIM_SHAPED"  # "1" when the inter-node link is rate limited
ENV_IFACE = "CIUICFLOW_SIM_IFACE"  # the node's inter-node interface ("" in the fallback)
ENV_NODE = "CIUICFLOW_SIM_NODE"  # the node's index
ENV_RATE = "CIUICFLOW_SIM_RATE_BPS"  # inter-node rate in bits/s ("" when unshaped)

_RATE_UNITS = {"": 1, "bit": 1, "bps": 1, "k": 1e3, "kbit": 1e3, "kbps": 1e3, "m": 1e6, "mbit": 1e6,
               "mbps": 1e6, "g": 1e9, "gbit": 1e9, "gbps": 1e9, "t": 1e12, "tbit": 1e12, "tbps": 1e12}


def parse_rate(value) -> float:
    """Bits per second from a number or a string such as "1gbit", "200Gbit", "100mbit", "5e8"."""
    if isinstance(value, (int, float)):
        rate = float(value)
    else:
        match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z/]*)\s*", str(value))
        unit = match.group(2).lower().replace("/s", "") if match else None
        if match is None or unit not in _RATE_UNITS:
            raise ValueError(f"cannot parse rate {value!r}: use e.g. 1gbit, 100mbit, 200Gbit or bits/s")
        rate = float(match.group(1)) * _RATE_UNITS[unit]
    if not rate > 0:
        raise ValueError(f"rate must be positive, got {value!r}")
    return rate


def format_rate(bits_per_second: float) -> str:
    for unit, scale in (("Tbit", 1e12), ("Gbit", 1e9), ("Mbit", 1e6), ("kbit", 1e3)):
        if bits_per_second >= scale:
            return f"{bits_per_second / scale:g} {unit}/s"
    return f"{bits_per_second:g} bit/s"


def read_node_link_bytes():
    """(tx_bytes, rx_bytes) of this node's inter-node interface, read from inside a rank.

    Reads /proc/self/net/dev, which shows the caller's own network namespace. Returns None outside a
    namespace node (loopback fallback or not launched by SimCluster): there is no inter-node link to count.
    """
    iface = os.environ.get(ENV_IFACE, "")
    if os.environ.get(ENV_NETNS) != "1" or not iface:
        return None
    with open("/proc/self/net/dev") as f:
        for line in f:
            name, sep, rest = line.partition(":")
            if sep and name.strip() == iface:
                fields = rest.split()
                return int(fields[0]), int(fields[8])
    raise RuntimeError(f"interface {iface} not found in /proc/self/net/dev")

