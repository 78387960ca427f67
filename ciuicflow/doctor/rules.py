"""The checks: each turns facts of a diagnosis into findings (ok, info, warn, error)."""
from __future__ import annotations

from ciuicflow.doctor.findings import Diagnosis, Finding
from ciuicflow.doctor.nccl import (GDR_DISTANCE, GDR_LEVELS, NCCL_DEFAULT_GDR_LEVEL,
                                   gdr_level_index, ib_hca_matches, socket_ifname_matches,
                                   switched_on)


def run_checks(d: Diagnosis, environ: dict) -> None:
    """Append every check's findings to ``d.findings``."""
    _check_software(d)
    _check_gpus(d)
    _check_network(d)
    _check_nccl(d, environ)


def _add(d: Diagnosis, level: str, code: str, message: str) -> None:
    d.findings.append(Finding(level, code, message))


def _check_software(d: Diagnosis) -> None:
    sw = d.software
    if sw.get("torch") is None:
        _add(d, "error", "no-torch", "torch is not importable")
        return
    if not sw.get("extension"):
        _add(d, "error", "no-extension", "ciuicflow's native extension is not built: "
             + sw.get("extension_error", "") + " (pip install --no-build-isolation -e .)")
    gpus_here = sw.get("cuda_available") or (d.interconnect is not None
                                              and d.topology_source == "nvidia-smi topo -m")
    if sw.get("extension") and not sw.get("cuda_kernels"):
        if gpus_here:
            _add(d, "error", "no-cuda-kernels", "this machine has GPUs but ciuicflow's extension "
                 "has no CUDA kernels: the compressed hooks cannot run on GPU tensors. Rebuild "
                 "where nvcc is found (pip install --no-build-isolation -e .)")
        elif d.interconnect is not None:
            _add(d, "warn", "no-cuda-kernels", "ciuicflow's extension here has no CUDA kernels; "
                 "build it with nvcc on the GPU machines (pip install --no-build-isolation -e .)")
        else:
            _add(d, "info", "cpu-only", "ciuicflow's extension has CPU kernels only (no GPU here)")
    if d.interconnect is not None and sw.get("cuda_available") is False \
            and d.topology_source == "nvidia-smi topo -m":
        _add(d, "error", "torch-no-cuda", f"nvidia-smi shows {d.interconnect.gpus} GPU(s) but "
             f"torch {sw['torch']} has no CUDA: install a CUDA build of torch")
    if sw.get("cuda_available") and not sw.get("nccl"):
        _add(d, "warn", "no-nccl", "torch has CUDA but no NCCL: GPU training falls back to gloo")


def _check_gpus(d: Diagnosis) -> None:
    ic = d.interconnect
    if ic is None:
        _add(d, "info", "no-gpus", "no nvidia-smi (or no GPU): GPU interconnect not checked; "
             "pass --topo-file with a saved `nvidia-smi topo -m` to check another machine")
        return
    _add(d, "ok", "interconnect", ic.describe())
    far = sorted(g for g, n in ic.nearest_nic.items() if n["link"] in ("NODE", "SYS"))
    if far and len(far) < ic.gpus:
        _add(d, "info", "nic-distance", f"GPUs {far} have no NIC closer than NODE/SYS: their "
             "inter-node traffic crosses the host bridge or the socket link")


def _check_network(d: Diagnosis) -> None:
    for port in d.rdma_ports:
        if port["state"] != "ACTIVE":
            _add(d, "warn", "rdma-port-down", f"RDMA port {port['device']}:{port['port']} is "
                 f"{port['state']} ({port['link_layer']})")
    active = d.active_rdma
    if active:
        kinds = sorted({"RoCE" if p["link_layer"] == "Ethernet" else p["link_layer"] for p in active})
        total = sum(p["gbit"] or 0 for p in active)
        _add(d, "ok", "rdma", f"{len(active)} active RDMA port(s) ({', '.join(kinds)}), "
             f"{total:.0f} Gbit/s in all")
        if d.interconnect is not None and not d.peermem:
            _add(d, "warn", "no-peermem", "RDMA NICs and GPUs but no nvidia_peermem module: "
                 "NCCL cannot use GPUDirect RDMA (modprobe nvidia_peermem)")
    else:
        candidates = d.network_candidates
        names = ", ".join(f"{i['name']} ({i['mbit']} Mbit/s)" if i["mbit"] else i["name"]
                          for i in candidates) or "none"
        _add(d, "info", "no-rdma", f"no active InfiniBand/RoCE port: NCCL will use TCP sockets "
             f"between nodes (interfaces: {names})")


def _check_nccl(d: Diagnosis, environ: dict) -> None:
    ic = d.interconnect
    active = d.active_rdma
    if switched_on(environ, "NCCL_IB_DISABLE"):
        if active:
            _add(d, "warn", "ib-disabled", f"NCCL_IB_DISABLE={environ['NCCL_IB_DISABLE']} while "
                 f"{len(active)} RDMA port(s) are active: NCCL falls back to TCP sockets; unset it")
        else:
            _add(d, "info", "ib-disabled", "NCCL_IB_DISABLE is set (no active RDMA port anyway)")
    if switched_on(environ, "NCCL_P2P_DISABLE") and ic is not None:
        if len(ic.nvlink_islands) < ic.gpus:
            _add(d, "warn", "p2p-disabled", "NCCL_P2P_DISABLE is set: NVLink is not used, "
                 "GPU-to-GPU traffic goes through host memory; unset it")
        else:
            _add(d, "info", "p2p-disabled", "NCCL_P2P_DISABLE is set: PCIe peer-to-peer is off")
    if switched_on(environ, "NCCL_SHM_DISABLE") and ic is not None \
            and ic.worst_gpu_link == "SYS":
        _add(d, "warn", "shm-disabled", "NCCL_SHM_DISABLE is set and some GPUs are on different "
             "sockets: their traffic falls back to the network stack")
    names = [i["name"] for i in d.interfaces]
    ifname = environ.get("NCCL_SOCKET_IFNAME")
    if ifname:
        selected = socket_ifname_matches(ifname, names)
        if not selected:
            _add(d, "error", "socket-ifname", f"NCCL_SOCKET_IFNAME={ifname} matches no interface "
                 f"(interfaces: {', '.join(names) or 'none'})")
        elif all(n == "lo" for n in selected):
            _add(d, "warn", "socket-ifname", f"NCCL_SOCKET_IFNAME={ifname} selects only the "
                 "loopback interface: ranks on other nodes cannot connect")
        else:
            _add(d, "ok", "socket-ifname", f"NCCL_SOCKET_IFNAME={ifname} selects "
                 f"{', '.join(selected)}")
    hca = environ.get("NCCL_IB_HCA")
    devices = sorted({p["device"] for p in d.rdma_ports})
    if hca:
        selected, unknown = ib_hca_matches(hca, devices)
        if unknown:
            _add(d, "error", "ib-hca", f"NCCL_IB_HCA={hca} names {', '.join(unknown)}, which "
                 f"/sys/class/infiniband does not have (devices: {', '.join(devices) or 'none'})")
        elif not selected:
            _add(d, "warn", "ib-hca", f"NCCL_IB_HCA={hca} selects no RDMA device: NCCL uses "
                 "TCP sockets")
        else:
            _add(d, "ok", "ib-hca", f"NCCL_IB_HCA={hca} selects {', '.join(selected)}")
    level_text = environ.get("NCCL_NET_GDR_LEVEL")
    if ic is not None and active and ic.nearest_nic:
        level = gdr_level_index(level_text) if level_text else GDR_LEVELS.index(NCCL_DEFAULT_GDR_LEVEL)
        if level_text and level is None:
            _add(d, "error", "gdr-level", f"NCCL_NET_GDR_LEVEL={level_text} is not one of "
                 f"{', '.join(GDR_LEVELS)} (or 0-4)")
        else:
            beyond = sorted(g for g, n in ic.nearest_nic.items()
                            if GDR_DISTANCE[n["link"]] > level)
            if beyond and level_text:
                _add(d, "warn", "gdr-level", f"NCCL_NET_GDR_LEVEL={level_text} turns GPUDirect "
                     f"RDMA off for GPUs {beyond} (their nearest NIC is further); unset it to "
                     "keep NCCL's default")
            elif beyond:
                _add(d, "info", "gdr-level", f"GPUs {beyond} are further than "
                     f"{NCCL_DEFAULT_GDR_LEVEL} from any NIC, so NCCL's default keeps "
                     "GPUDirect RDMA off for them; NCCL_NET_GDR_LEVEL=PHB may help (measure)")
    if environ.get("NCCL_ALGO") or environ.get("NCCL_PROTO"):
        overrides = ", ".join(f"{v}={environ[v]}" for v in ("NCCL_ALGO", "NCCL_PROTO")
                              if environ.get(v))
        _add(d, "warn", "nccl-tuning", f"{overrides} overrides NCCL's own tuning; unset unless "
             "a measurement showed it helps")
    debug = environ.get("NCCL_DEBUG", "")
    if debug.upper() in ("INFO", "TRACE"):
        _add(d, "info", "nccl-debug", f"NCCL_DEBUG={debug}: verbose logs (unset for production)")
    if any(p["link_layer"] == "Ethernet" for p in active) and "NCCL_IB_GID_INDEX" not in environ:
        _add(d, "info", "roce-gid", "RoCE ports: if NCCL picks a RoCE v1 GID or fails to connect, "
             "set NCCL_IB_GID_INDEX to the RoCE v2 GID index (see show_gids)")

