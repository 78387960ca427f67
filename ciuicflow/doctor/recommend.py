"""Recommendations: which hook across and within nodes, which variables, what to plan."""
from __future__ import annotations

from ciuicflow.compression import registry
from ciuicflow.doctor.findings import Diagnosis, Recommendation
from ciuicflow.doctor.interconnect import Interconnect
from ciuicflow.doctor.nccl import ib_hca_matches, socket_ifname_matches, switched_on

# the hooks the doctor chooses among: every method of the compression registry
HOOKS = tuple(registry.METHODS)
_POWERSGD_RANK = registry.FAMILIES["powersgd"].cost.rank


def _inter_node_gbit(d: Diagnosis, environ: dict) -> tuple[float | None, str]:
    """Inter-node Gbit/s per node and direction, and what carries it."""
    ic = d.interconnect
    ib_off = switched_on(environ, "NCCL_IB_DISABLE")
    active = d.active_rdma
    if active and not ib_off:
        devices = sorted({p["device"] for p in active})
        near_gpus = {name for n in (ic.nearest_nic.values() if ic is not None else ())
                     for name in n["nics"]}
        if near_gpus & set(devices):
            # NICs nearest to no GPU (storage NICs) carry no gradient traffic to speak of
            devices = sorted(near_gpus & set(devices))
        hca = environ.get("NCCL_IB_HCA")
        if hca:
            devices, _ = ib_hca_matches(hca, devices)
        ports = [p for p in active if p["device"] in devices]
        if ports:
            return sum(p["gbit"] or 0 for p in ports), "RDMA (" + ", ".join(devices) + ")"
    candidates = d.network_candidates
    ifname = environ.get("NCCL_SOCKET_IFNAME")
    if ifname:
        chosen = set(socket_ifname_matches(ifname, [i["name"] for i in d.interfaces]))
        candidates = [i for i in d.interfaces if i["name"] in chosen and i["name"] != "lo"]
    speeds = [i for i in candidates if i["mbit"]]
    if not speeds:
        return None, "TCP sockets (speed unknown)"
    best = max(speeds, key=lambda i: i["mbit"])
    return best["mbit"] / 1000.0, f"TCP sockets ({best['name']})"


def add_recommendations(d: Diagnosis, environ: dict) -> None:
    """Append the hooks and settings to use, and the planner's command, to ``d.recommendations``."""
    ic = d.interconnect
    gpus = ic.gpus if ic is not None else None
    inter_gbit, carrier = _inter_node_gbit(d, environ)
    multi_node = d.nodes is None or d.nodes > 1
    if multi_node:
        d.recommendations.append(_multi_node_hook(ic, inter_gbit, carrier, d.nodes))
    if d.nodes in (None, 1) and ic is not None and ic.gpus > 1:
        d.recommendations.append(_single_node_hook(ic))
    env = {}
    if not d.active_rdma or switched_on(environ, "NCCL_IB_DISABLE"):
        candidates = [i for i in d.network_candidates if i["name"] != "lo"]
        if len(candidates) > 1 and not environ.get("NCCL_SOCKET_IFNAME"):
            best = max(candidates, key=lambda i: i["mbit"] or 0)
            env["NCCL_SOCKET_IFNAME"] = best["name"]
            env["GLOO_SOCKET_IFNAME"] = best["name"]
    if d.active_rdma and switched_on(environ, "NCCL_IB_DISABLE"):
        env["NCCL_IB_DISABLE"] = "(unset)"
    if ic is not None and switched_on(environ, "NCCL_P2P_DISABLE"):
        env["NCCL_P2P_DISABLE"] = "(unset)"
    if not environ.get("NCCL_DEBUG"):
        env["NCCL_DEBUG"] = "INFO"
        env["NCCL_DEBUG_SUBSYS"] = "INIT,NET"
    if env:
        d.recommendations.append(Recommendation(
            "environment", "variables to set (or unset) before launching; with NCCL_DEBUG=INFO "
            "for a first run the log says which transport NCCL chose ('NET/IB' or 'NET/Socket') "
            "and whether GPUDirect RDMA is on ('GDRDMA')", env=env))
    if gpus and inter_gbit and multi_node:
        nodes = d.nodes or 2
        d.recommendations.append(Recommendation(
            "predict", "the planner puts these link speeds and your model size into step times "
            "for every hook; replace 7B with your model",
            command=(f"ciuicflow plan --model 7B --nodes {nodes} --gpus-per-node {gpus} "
                     f"--intra-bw {ic.intra_node_gbps:.0f}GB/s --inter-bw {inter_gbit:.0f}Gbit/s")))


def _multi_node_hook(ic, inter_gbit, carrier, nodes) -> Recommendation:
    where = "across nodes" if nodes is None else f"on {nodes} nodes"
    if inter_gbit is None:
        return Recommendation(
            f"hook {where}", f"inter-node bandwidth unknown ({carrier}); start with "
            "hierarchical_1bit (exact inside nodes, 1-bit between them) and compare with "
            "hierarchical_allreduce using ciuicflow.monitor", hook="hierarchical_1bit")
    gpus = ic.gpus if ic is not None else 1
    per_gpu_gbps = inter_gbit / 8 / gpus  # GB/s per GPU per direction
    intra = ic.intra_node_gbps if ic is not None else None
    facts = (f"{inter_gbit:.0f} Gbit/s per node over {carrier} = {per_gpu_gbps:.1f} GB/s per GPU"
             + (f", vs ~{intra:.0f} GB/s inside the node" if intra else ""))
    if per_gpu_gbps >= 25:
        return Recommendation(
            f"hook {where}", facts + ": the network keeps up with exact reduction; compression "
            "rarely pays for its own work at this rate (check with `ciuicflow plan`)",
            hook="hierarchical_allreduce")
    if per_gpu_gbps >= 2.5:
        return Recommendation(
            f"hook {where}", facts + ": inter-node links are the bottleneck; reduce exactly "
            "inside nodes and send 1 bit per element (32x less, error feedback) between them. "
            "hierarchical_powersgd compresses further for models made of large matrices",
            hook="hierarchical_1bit")
    return Recommendation(
        f"hook {where}", facts + f": a slow network; low-rank compression (rank {_POWERSGD_RANK} by "
        f"default: {_POWERSGD_RANK}x+ less inter-node traffic for large matrices) between nodes, "
        "exact inside; "
        "hierarchical_1bit if the model is mostly small or non-matrix parameters",
        hook="hierarchical_powersgd")


def _single_node_hook(ic: Interconnect) -> Recommendation:
    if len(ic.nvlink_islands) == 1:
        return Recommendation(
            "hook within one node", f"all {ic.gpus} GPUs share NVLink (~{ic.intra_node_gbps:.0f} "
            "GB/s): PyTorch's default all-reduce over NCCL is the fastest; no compression "
            "(the hierarchical hooks are flat on one node)", hook=None)
    local = ic.suggested_local_world_size
    if local:
        inside = "NVLink" if len(ic.nvlink_islands) < ic.gpus else "the faster PCIe paths"
        return Recommendation(
            "hook within one node", f"GPUs form {len(ic.fast_domains)} groups of {local} joined by "
            f"{inside}, with {ic.worst_gpu_link} between groups: treat each group as a node so "
            "the reduction is exact inside a group and 1-bit between groups (launch ranks in "
            "GPU order)", hook="hierarchical_1bit",
            env={"CIUICFLOW_LOCAL_WORLD_SIZE": str(local)})
    if ic.worst_gpu_link == "SYS":
        return Recommendation(
            "hook within one node", f"PCIe only, with SYS (across sockets, ~"
            f"{ic.intra_node_gbps:.0f} GB/s) between some GPUs that do not form equal groups in "
            "GPU order: compress all traffic with powersgd (flat) when ciuicflow.monitor shows "
            "communication above ~30% of step time", hook="powersgd")
    return Recommendation(
        "hook within one node", f"PCIe only, all paths within one socket ({ic.worst_gpu_link} at "
        f"worst, ~{ic.intra_node_gbps:.0f} GB/s): PyTorch's default all-reduce; try powersgd "
        "(flat) only if ciuicflow.monitor shows communication above ~30% of step time", hook=None)

