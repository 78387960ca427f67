"""What the doctor reads from this machine: ``nvidia-smi``, ``/sys`` (RDMA ports, network
interfaces, kernel modules) and the installed software. ``sys_root`` stands in for ``/sys``."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys

VIRTUAL_INTERFACES = ("lo", "docker", "veth", "virbr", "br-", "ifb", "tun", "tap", "cali",
                      "flannel", "cni", "kube")


def run_nvidia_smi() -> str | None:
    """``nvidia-smi topo -m`` output, or None when there is no nvidia-smi (or it fails)."""
    if shutil.which("nvidia-smi") is None:
        return None
    try:
        done = subprocess.run(["nvidia-smi", "topo", "-m"], capture_output=True, text=True,
                              timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout if done.returncode == 0 else None


def _read(path: str) -> str | None:
    try:
        with open(path, encoding="utf-8") as handle:
            return handle.read().strip()
    except (OSError, UnicodeDecodeError):
        return None


def _gbit(rate: str | None) -> float | None:
    """``"400 Gb/sec (4X NDR)"`` -> 400.0."""
    match = re.match(r"\s*([0-9.]+)\s*Gb/sec", rate or "")
    return float(match.group(1)) if match else None


def read_rdma_ports(sys_root: str = "/sys") -> list[dict]:
    """Every port of every device in ``/sys/class/infiniband``."""
    base = os.path.join(sys_root, "class", "infiniband")
    ports = []
    for device in sorted(os.listdir(base)) if os.path.isdir(base) else []:
        ports_dir = os.path.join(base, device, "ports")
        for port in sorted(os.listdir(ports_dir)) if os.path.isdir(ports_dir) else []:
            where = os.path.join(ports_dir, port)
            state = _read(os.path.join(where, "state")) or "unknown"
            rate = _read(os.path.join(where, "rate"))
            ports.append({
                "device": device, "port": int(port) if port.isdigit() else port,
                "state": state.split(":")[-1].strip(), "rate": rate, "gbit": _gbit(rate),
                "link_layer": _read(os.path.join(where, "link_layer")) or "unknown",
            })
    return ports


def read_interfaces(sys_root: str = "/sys") -> list[dict]:
    """Network interfaces with their state and speed (Mbit/s, None when unknown)."""
    base = os.path.join(sys_root, "class", "net")
    interfaces = []
    for name in sorted(os.listdir(base)) if os.path.isdir(base) else []:
        speed = _read(os.path.join(base, name, "speed"))
        try:
            mbit = int(speed) if speed is not None and int(speed) > 0 else None
        except ValueError:
            mbit = None
        interfaces.append({"name": name, "state": _read(os.path.join(base, name, "operstate")),
                           "mbit": mbit, "virtual": name.startswith(VIRTUAL_INTERFACES)})
    return interfaces


def peermem_loaded(sys_root: str = "/sys") -> bool:
    return any(os.path.isdir(os.path.join(sys_root, "module", name))
               for name in ("nvidia_peermem", "nv_peer_mem"))


def software() -> dict:
    info = {"python": sys.version.split()[0]}
    try:
        import torch
        import torch.distributed as dist
    except ImportError:
        info["torch"] = None
        return info
    info["torch"] = torch.__version__
    info["torch_cuda"] = torch.version.cuda
    info["cuda_available"] = bool(torch.cuda.is_available())
    info["cuda_devices"] = torch.cuda.device_count() if info["cuda_available"] else 0
    info["gloo"] = dist.is_available() and dist.is_gloo_available()
    info["nccl"] = None
    if dist.is_available() and dist.is_nccl_available():
        try:
            version = torch.cuda.nccl.version()
            info["nccl"] = ".".join(map(str, version)) if isinstance(version, tuple) else str(version)
        except Exception:  # no CUDA runtime here
            info["nccl"] = "built in (version unknown without a GPU)"
    import ciuicflow

    info["ciuicflow"] = ciuicflow.__version__
    try:
        from ciuicflow import ops

        info["extension"] = True
        info["cuda_kernels"] = bool(ops.has_cuda_kernels())
    except ImportError as exc:
        info["extension"], info["cuda_kernels"] = False, False
        info["extension_error"] = str(exc).split("\n")[0]
    return info

