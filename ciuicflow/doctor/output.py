"""The diagnosis as text, the way ``ciuicflow doctor`` prints it."""
from __future__ import annotations

from ciuicflow.doctor.findings import Diagnosis
from ciuicflow.doctor.nccl import NCCL_VARIABLES

# shown even when unset: the variables that most often decide which transport NCCL takes
_ALWAYS_SHOWN = NCCL_VARIABLES[:7] + ("NCCL_DEBUG",)


def format_diagnosis(d: Diagnosis) -> str:
    sw = d.software
    lines = ["ciuicflow doctor", "", "software"]
    if sw.get("torch"):
        lines.append(f"  torch {sw['torch']} (CUDA {sw.get('torch_cuda') or 'none'}; "
                     f"{sw.get('cuda_devices', 0)} GPU(s) visible), NCCL "
                     f"{sw.get('nccl') or 'not available'}, gloo {'yes' if sw.get('gloo') else 'no'}")
        kernels = "CPU + CUDA kernels" if sw.get("cuda_kernels") else "CPU kernels only"
        lines.append(f"  ciuicflow {sw.get('ciuicflow')}, extension: "
                     f"{kernels if sw.get('extension') else 'not built'}")
    lines += ["", f"GPUs and interconnect ({d.topology_source or 'not available'})"]
    ic = d.interconnect
    if ic is not None:
        lines.append(f"  {ic.describe()}")
        if len(ic.nvlink_islands) > 1 and len(ic.nvlink_islands) < ic.gpus:
            lines.append(f"  NVLink islands: {ic.nvlink_islands}")
        numa = {}
        for gpu, node in sorted(ic.numa_of_gpu.items()):
            numa.setdefault(node, []).append(gpu)
        if len(numa) > 1:
            lines.append("  NUMA: " + "; ".join(f"GPUs {g} on NUMA {n}" for n, g in numa.items()))
        for gpu, nic in sorted(ic.nearest_nic.items()):
            lines.append(f"  GPU{gpu}: nearest NIC {', '.join(nic['nics'])} ({nic['link']})")
    lines += ["", "network"]
    for port in d.rdma_ports:
        lines.append(f"  {port['device']} port {port['port']}: {port['link_layer']}, "
                     f"{port['state']}, {port['rate'] or 'rate unknown'}")
    for iface in d.interfaces:
        if not iface["virtual"]:
            speed = f"{iface['mbit']} Mbit/s" if iface["mbit"] else "speed unknown"
            lines.append(f"  {iface['name']}: {iface['state']}, {speed}")
    lines.append(f"  GPUDirect RDMA module: {'loaded' if d.peermem else 'not loaded'}")
    lines += ["", "settings"]
    for name in _ALWAYS_SHOWN:
        lines.append(f"  {name}={d.environment[name]}" if name in d.environment
                     else f"  {name} unset")
    for name, value in d.environment.items():
        if name not in _ALWAYS_SHOWN:
            lines.append(f"  {name}={value}")
    lines += ["", "findings"]
    for f in d.findings:
        lines.append(f"  [{f.level}] {f.message}")
    lines += ["", "recommendations"]
    for number, r in enumerate(d.recommendations, 1):
        verb = f"use {r.hook}" if r.hook else \
            ("no ciuicflow hook" if r.title.startswith("hook") else "")
        lines.append(f"  {number}. {r.title}" + (f": {verb}" if verb else ""))
        lines.append(f"     {r.why}")
        for name, value in r.env.items():
            lines.append(f"     unset {name}" if value == "(unset)" else f"     export {name}={value}")
        if r.command:
            lines.append(f"     {r.command}")
        if r.hook:
            options = "".join(f", {k}={v!r}" for k, v in r.options.items())
            lines.append(f"     state = ciuicflow.register(ddp_model, \"{r.hook}\"{options})")
    return "\n".join(lines)
