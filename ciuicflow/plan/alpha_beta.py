"""Alpha-beta times of the collectives: k members, D bytes, per-member bandwidth b, latency a."""


def _ring_allreduce(k, nbytes, bw, lat):
    return 0.0 if k <= 1 else 2 * (k - 1) * lat + 2 * (k - 1) / k * nbytes / bw


def _scatter_or_gather(k, nbytes, bw, lat):
    return 0.0 if k <= 1 else (k - 1) * lat + (k - 1) / k * nbytes / bw
