"""The descriptor budget: how many descriptors each surface of a sidecar may make it hold, shared out of
its descriptor limit (RLIMIT_NOFILE) so that, together, they never exhaust it (``descriptor_caps``)."""
from __future__ import annotations

import resource
from dataclasses import dataclass

RESERVE_MIN = 64            # descriptors kept for the work itself, at least (an idle sidecar holds ~20)
RESERVE_PER_PEER = 4        # per configured peer: its gRPC channel, data plane connection and theirs to us
METRICS_MAX = 16            # metrics connections: a scraper or two needs no more
HANDLES_MAX = 4096          # ring handles in all, however high the descriptor limit
HANDLES_PER_CLIENT_MAX = 256
SHARES = {"api": 3, "peer": 3, "data": 2, "metrics": 1, "handoff": 1, "handles": 6}    # sixteenths


@dataclass(frozen=True)
class DescriptorCaps:
    """How many descriptors each surface may hold (see ``descriptor_caps``)."""
    nofile: int
    reserve: int
    api: int                    # local API connections (gRPC)
    peer: int                   # peer port connections (gRPC, --listen)
    data: int                   # data plane connections
    metrics: int                # metrics HTTP connections
    handoff: int                # descriptor socket connections
    handles: int                # ring handles held, in all
    handles_per_client: int     # ... per client process (peer pid on the descriptor socket)

    def describe(self) -> str:
        return (f"descriptor limit {self.nofile}: connections api {self.api}, peer {self.peer}, data plane "
                f"{self.data}, metrics {self.metrics}, descriptor socket {self.handoff}; ring handles "
                f"{self.handles} ({self.handles_per_client} per client); {self.reserve} kept for the work")


def descriptor_caps(nofile: int, max_connections: int, peers: int = 0) -> DescriptorCaps:
    """The caps of every surface that makes the sidecar hold descriptors, from its descriptor limit
    ``nofile`` (RLIMIT_NOFILE), so that together they can never exhaust it (the accept loops would then
    fail with EMFILE, and the work itself with them).

    The split: first a reserve for the work itself (spool files, shared-memory rings of transfers in
    progress, sockets to peers, the process's own files): a quarter of the limit, at least RESERVE_MIN,
    plus RESERVE_PER_PEER per configured peer. The rest is shared out in sixteenths (SHARES): 3 to the
    local API, 3 to the peer gRPC port, 2 to the data plane, 1 to metrics (at most METRICS_MAX), 1 to
    the descriptor socket's connections and 6 to ring handles (at most HANDLES_MAX), of which one client
    may hold a quarter (at most HANDLES_PER_CLIENT_MAX), so one client cannot take them all. Each port's
    cap is also at most ``max_connections`` (--max-connections: the operator may set it lower). Every cap
    is at least 1, so a sidecar under a tiny limit still serves (and its caps say it is tight)."""
    reserve = max(RESERVE_MIN, nofile // 4) + RESERVE_PER_PEER * max(peers, 0)
    free = max(nofile - reserve, 0)

    def share(name: str, ceiling: int) -> int:
        return max(1, min(ceiling, free * SHARES[name] // 16))

    handles = share("handles", HANDLES_MAX)
    return DescriptorCaps(
        nofile=nofile, reserve=reserve, api=share("api", max_connections), peer=share("peer", max_connections),
        data=share("data", max_connections), metrics=share("metrics", min(METRICS_MAX, max_connections)),
        handoff=share("handoff", max_connections), handles=handles,
        handles_per_client=max(1, min(HANDLES_PER_CLIENT_MAX, handles // 4)))


def descriptor_limit() -> int:
    """This process's RLIMIT_NOFILE (its soft limit: the one open() and accept() meet)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return soft if soft != resource.RLIM_INFINITY else 1 << 20
