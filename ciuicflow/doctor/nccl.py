"""The NCCL (and neighbouring) environment variables the doctor watches, and their syntax."""
from __future__ import annotations

GDR_LEVELS = ("LOC", "PIX", "PXB", "PHB", "SYS")  # NCCL_NET_GDR_LEVEL, as names (0..4)
# where a GPU-to-NIC path sits on that scale (NCCL does not tell NODE from PHB)
GDR_DISTANCE = {"PIX": 1, "PXB": 2, "PHB": 3, "NODE": 3, "SYS": 4}
NCCL_DEFAULT_GDR_LEVEL = "PXB"
NCCL_VARIABLES = (
    "NCCL_IB_DISABLE", "NCCL_SOCKET_IFNAME", "NCCL_IB_HCA", "NCCL_P2P_DISABLE", "NCCL_P2P_LEVEL",
    "NCCL_SHM_DISABLE", "NCCL_NET_GDR_LEVEL", "NCCL_NET_GDR_READ", "NCCL_IB_GID_INDEX",
    "NCCL_CROSS_NIC", "NCCL_ALGO", "NCCL_PROTO", "NCCL_DEBUG", "NCCL_DEBUG_SUBSYS", "NCCL_NET",
    "NCCL_NET_PLUGIN", "NCCL_TOPO_FILE", "NCCL_NVLS_ENABLE", "NCCL_COLLNET_ENABLE",
    "NCCL_BUFFSIZE", "NCCL_NSOCKS_PERTHREAD", "NCCL_SOCKET_NTHREADS")
OTHER_VARIABLES = ("GLOO_SOCKET_IFNAME", "CIUICFLOW_LOCAL_WORLD_SIZE", "CUDA_VISIBLE_DEVICES",
                   "TORCH_NCCL_ASYNC_ERROR_HANDLING", "TORCH_NCCL_BLOCKING_WAIT", "WORLD_SIZE",
                   "LOCAL_WORLD_SIZE", "MASTER_ADDR")


def _spec(value: str) -> tuple[bool, bool, list[str]]:
    """NCCL's list syntax: ``^`` excludes, ``=`` matches exactly; else prefixes."""
    exclude = value.startswith("^")
    value = value[1:] if exclude else value
    exact = value.startswith("=")
    value = value[1:] if exact else value
    return exclude, exact, [v.strip() for v in value.split(",") if v.strip()]


def socket_ifname_matches(value: str, names: list[str]) -> list[str]:
    """Interfaces NCCL_SOCKET_IFNAME=value selects among ``names``."""
    exclude, exact, items = _spec(value)

    def hit(name):
        return any(name == item if exact else name.startswith(item) for item in items)

    return [n for n in names if hit(n) != exclude]


def ib_hca_matches(value: str, devices: list[str]) -> tuple[list[str], list[str]]:
    """(devices NCCL_IB_HCA=value selects, names in it that match no device)."""
    exclude, exact, items = _spec(value)
    names = [item.split(":")[0] for item in items]

    def hit(device, name):
        return device == name if exact else device.startswith(name)

    unknown = [n for n in names if not any(hit(d, n) for d in devices)]
    selected = [d for d in devices if any(hit(d, n) for n in names) != exclude]
    return selected, unknown


def gdr_level_index(value: str) -> int | None:
    """NCCL_NET_GDR_LEVEL as a number on GDR_LEVELS' scale (None: not a valid value)."""
    value = value.strip().upper()
    if value.isdigit():
        return min(int(value), len(GDR_LEVELS) - 1)
    if value == "NODE":
        return GDR_DISTANCE["NODE"]
    return GDR_LEVELS.index(value) if value in GDR_LEVELS else None



def switched_on(environ: dict, name: str) -> bool:
    """Whether a 0/1 NCCL switch such as ``NCCL_IB_DISABLE`` is on (unset, empty and 0 are off)."""
    return environ.get(name, "0") not in ("0", "")
