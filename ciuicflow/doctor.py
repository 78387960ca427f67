"""``ciuicflow doctor``: check the environment a training job is about to run in, and say what to use.

It looks at:

- GPUs and their interconnect, from ``nvidia-smi topo -m`` (or a recorded output, ``--topo-file``):
  NVLink (``NV#``: # bonded links) vs PCIe (``PIX``: one switch, ``PXB``: several switches,
  ``PHB``: through the host bridge, ``NODE``: across host bridges of a NUMA node, ``SYS``: across
  sockets), NVLink islands, and which NIC is nearest to each GPU;
- RDMA devices in ``/sys/class/infiniband`` (port state, rate, InfiniBand or Ethernet = RoCE),
  network interfaces in ``/sys/class/net``, the ``nvidia_peermem`` module (GPUDirect RDMA);
  ``--sys-root DIR`` reads ``DIR`` in place of ``/sys``;
- the NCCL settings that matter (``NCCL_IB_DISABLE``, ``NCCL_SOCKET_IFNAME``, ``NCCL_IB_HCA``,
  ``NCCL_P2P_DISABLE``, ``NCCL_NET_GDR_LEVEL``, ``NCCL_DEBUG``, ...) checked against the hardware;
- torch, NCCL and gloo, and whether ciuicflow's extension has CUDA kernels;

and ends with recommendations: which hook (``hierarchical_allreduce``, ``hierarchical_1bit``,
``hierarchical_powersgd``, ``onebit``, ``powersgd``) and which variables. Bandwidths it quotes
are nominal rates for comparison (25 GB/s per NVLink per direction, PCIe 4.0 x16 class figures),
not measurements; ``ciuicflow plan`` turns them into step-time predictions.

``detect_interconnect()`` returns the parsed interconnect (NVLink islands, GPUs per island, a
``CIUICFLOW_LOCAL_WORLD_SIZE`` that would make the hierarchical hooks reduce exactly inside
fast GPU groups) for code that wants it, e.g. topology detection.

Exit status: 0, or 1 when a finding is an error (a setting that cannot work).
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from dataclasses import asdict, dataclass, field

HOOKS = ("hierarchical_allreduce", "hierarchical_1bit", "hierarchical_powersgd", "onebit", "powersgd")

# PCIe/NVLink classes from best to worst; "SOC" is what old drivers printed for SYS
LINK_ORDER = ("NV", "PIX", "PXB", "PHB", "NODE", "SYS")
NVLINK_GBPS_PER_LINK = 25.0  # GB/s per direction per NVLink (NVLink 2, 3 and 4 alike)
# nominal GB/s per direction between two GPUs over PCIe 4.0 x16, by path
PCIE_GBPS = {"PIX": 24.0, "PXB": 20.0, "PHB": 16.0, "NODE": 12.0, "SYS": 8.0}
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
VIRTUAL_INTERFACES = ("lo", "docker", "veth", "virbr", "br-", "ifb", "tun", "tap", "cali",
                      "flannel", "cni", "kube")
_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_GPU = re.compile(r"GPU(\d+)$")


# ------------------------------------------------------------------------------------------------
# nvidia-smi topo -m


def link_class(cell: str) -> str:
    """``"NV12"`` -> ``"NV"``; PCIe classes unchanged; ``"SOC"`` (old drivers) -> ``"SYS"``."""
    cell = cell.strip()
    if re.fullmatch(r"NV\d+", cell):
        return "NV"
    if cell == "SOC":
        return "SYS"
    if cell in LINK_ORDER:
        return cell
    raise ValueError(f"unknown link {cell!r} in the nvidia-smi topo -m matrix")


@dataclass
class TopoMatrix:
    """``nvidia-smi topo -m`` as data: device labels, the link of every pair, affinities."""

    devices: list[str]                       # GPU0.., then NIC0.. or mlx5_0.. (as printed)
    links: dict[tuple[str, str], str]        # (a, b) -> cell as printed ("NV18", "PIX", ...)
    cpu_affinity: dict[int, str] = field(default_factory=dict)
    numa_affinity: dict[int, str] = field(default_factory=dict)
    nic_names: dict[str, str] = field(default_factory=dict)  # "NIC0" -> "mlx5_0"

    @property
    def gpus(self) -> list[int]:
        return [int(_GPU.match(d).group(1)) for d in self.devices if _GPU.match(d)]

    @property
    def nics(self) -> list[str]:
        return [d for d in self.devices if not _GPU.match(d)]

    def nic_name(self, label: str) -> str:
        return self.nic_names.get(label, label)


def parse_topo_matrix(text: str) -> TopoMatrix:
    """Parse the output of ``nvidia-smi topo -m`` (tabs or spaces, with or without ANSI codes)."""
    lines = [_ANSI.sub("", line) for line in text.splitlines()]
    # the header's fields start with GPU0, and so do GPU0's row's; but the row's next field is X
    header_index = next((i for i, line in enumerate(lines)
                         if line.split()[:1] == ["GPU0"] and line.split()[1:2] != ["X"]), None)
    if header_index is None:
        raise ValueError("no nvidia-smi topo -m matrix found (no header row starting with GPU0)")
    header = lines[header_index].split()
    stop = next((i for i, token in enumerate(header) if token in ("CPU", "NUMA", "GPU")
                 and i + 1 < len(header) and header[i + 1] in ("Affinity", "NUMA")), len(header))
    devices = header[:stop]
    links: dict[tuple[str, str], str] = {}
    cpu, numa = {}, {}
    for line in lines[header_index + 1:]:
        tokens = line.split()
        if not tokens:
            break  # a blank line ends the matrix
        row, cells = tokens[0], tokens[1:]
        if row not in devices:
            raise ValueError(f"matrix row {row!r} is not among the header's devices")
        if len(cells) < len(devices):
            raise ValueError(f"matrix row {row!r} has {len(cells)} cells for {len(devices)} devices")
        for column, cell in zip(devices, cells):
            if column != row:
                link_class(cell)  # validates
                links[(row, column)] = cell
            elif cell != "X":
                raise ValueError(f"matrix row {row!r} does not have X on the diagonal")
        match = _GPU.match(row)
        rest = cells[len(devices):]
        if match and rest:
            cpu[int(match.group(1))] = rest[0]
            if len(rest) > 1:
                numa[int(match.group(1))] = rest[1]
    if not any(_GPU.match(d) for d in devices):
        raise ValueError("the nvidia-smi topo -m matrix has no GPU")
    missing = [d for d in devices if (d, devices[0]) not in links and d != devices[0]]
    if missing:
        raise ValueError(f"matrix rows missing for {missing}")
    nic_names = {}
    for line in lines:
        legend = re.fullmatch(r"\s*(NIC\d+):\s*(\S+)\s*", line)
        if legend:
            nic_names[legend.group(1)] = legend.group(2)
    return TopoMatrix(devices, links, cpu, numa, nic_names)


@dataclass
class Interconnect:
    """What the matrix means for communication inside one node."""

    gpus: int
    nvlink_islands: list[list[int]]      # GPUs joined by NVLink (singletons: no NVLink)
    gpus_per_nvlink_island: int | None   # when every island has the same size
    min_nvlinks: int | None              # fewest bonded NVLinks between two GPUs of an island
    worst_gpu_link: str                  # slowest class between any two GPUs
    fast_domains: list[list[int]]        # groups inside which links beat the links between them
    suggested_local_world_size: int | None  # CIUICFLOW_LOCAL_WORLD_SIZE for fast_domains, when
    #                                         the links between them are much slower (NVLink/SYS)
    intra_node_gbps: float               # nominal bottleneck GB/s per GPU per direction
    numa_of_gpu: dict[int, str]
    nearest_nic: dict[int, dict]         # gpu -> {"nics": [names at the best distance], "link"}
    nics: list[str]

    def describe(self) -> str:
        if self.gpus == 1:
            return "1 GPU"
        if len(self.nvlink_islands) == 1:
            text = (f"{self.gpus} GPUs, all joined by NVLink (NV{self.min_nvlinks} or more, "
                    f"~{self.intra_node_gbps:.0f} GB/s per GPU per direction)")
        elif self.gpus_per_nvlink_island and self.gpus_per_nvlink_island > 1:
            text = (f"{self.gpus} GPUs in {len(self.nvlink_islands)} NVLink islands of "
                    f"{self.gpus_per_nvlink_island}, {self.worst_gpu_link} between islands")
        else:
            text = f"{self.gpus} GPUs over PCIe only (slowest path {self.worst_gpu_link})"
        return text


def _components(nodes: list[int], joined) -> list[list[int]]:
    seen, groups = set(), []
    for start in nodes:
        if start in seen:
            continue
        group, stack = [], [start]
        seen.add(start)
        while stack:
            node = stack.pop()
            group.append(node)
            for other in nodes:
                if other not in seen and joined(node, other):
                    seen.add(other)
                    stack.append(other)
        groups.append(sorted(group))
    return sorted(groups)


def analyse(matrix: TopoMatrix) -> Interconnect:
    gpus = matrix.gpus

    def cell(a: int, b: int) -> str:
        return matrix.links[(f"GPU{a}", f"GPU{b}")]

    def rank(a: int, b: int) -> int:
        return LINK_ORDER.index(link_class(cell(a, b)))

    islands = _components(gpus, lambda a, b: link_class(cell(a, b)) == "NV")
    sizes = {len(i) for i in islands}
    nv_counts = [int(cell(a, b)[2:]) for island in islands for a in island for b in island
                 if a < b]
    pairs = [(a, b) for a in gpus for b in gpus if a < b]
    worst = max((rank(a, b) for a, b in pairs), default=0)
    if len(islands) < len(gpus):
        domains = islands  # NVLink inside, PCIe between: NVLink islands are the fast groups
    else:
        domains = _components(gpus, lambda a, b: rank(a, b) < worst)
    # Grouping pays when the links between groups are much slower than inside: NVLink islands,
    # or sockets (no PCIe peer-to-peer across the SMP link). PIX vs PXB vs NODE differ too little.
    worth_grouping = len(islands) < len(gpus) or LINK_ORDER[worst] == "SYS"
    local = None
    if worth_grouping and len(domains) > 1 and len({len(d) for d in domains}) == 1 \
            and len(domains[0]) > 1 \
            and all(d == list(range(d[0], d[0] + len(d))) for d in domains):
        local = len(domains[0])
    if len(islands) == 1 and len(gpus) > 1:
        intra = NVLINK_GBPS_PER_LINK * min(nv_counts)
    else:
        intra = PCIE_GBPS[LINK_ORDER[worst]] if pairs else 0.0
    nearest = {}
    for gpu in gpus:
        options = [(LINK_ORDER.index(link_class(matrix.links[(f"GPU{gpu}", nic)])), nic)
                   for nic in matrix.nics]
        if options:
            best = min(distance for distance, _ in options)
            nearest[gpu] = {"nics": [matrix.nic_name(n) for d, n in options if d == best],
                            "link": LINK_ORDER[best]}
    return Interconnect(
        gpus=len(gpus), nvlink_islands=islands,
        gpus_per_nvlink_island=sizes.pop() if len(sizes) == 1 else None,
        min_nvlinks=min(nv_counts) if nv_counts else None, worst_gpu_link=LINK_ORDER[worst],
        fast_domains=domains, suggested_local_world_size=local, intra_node_gbps=intra,
        numa_of_gpu=dict(matrix.numa_affinity), nearest_nic=nearest,
        nics=[matrix.nic_name(n) for n in matrix.nics])


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


def detect_interconnect(topo_text: str | None = None) -> Interconnect | None:
    """The interconnect of this machine's GPUs (or of a recorded ``nvidia-smi topo -m``).

    None when there is no nvidia-smi or no GPU; raises ``ValueError`` on an unreadable matrix."""
    text = topo_text if topo_text is not None else run_nvidia_smi()
    if not text:
        return None
    return analyse(parse_topo_matrix(text))


# ------------------------------------------------------------------------------------------------
# sysfs: RDMA devices, interfaces, modules


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


# ------------------------------------------------------------------------------------------------
# NCCL variable syntax


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


# ------------------------------------------------------------------------------------------------
# Software


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


# ------------------------------------------------------------------------------------------------
# Diagnosis


@dataclass
class Finding:
    level: str  # "ok", "info", "warn", "error"
    code: str
    message: str


@dataclass
class Recommendation:
    title: str
    why: str
    hook: str | None = None
    options: dict = field(default_factory=dict)  # keyword arguments of ciuicflow.register
    env: dict = field(default_factory=dict)
    command: str | None = None


@dataclass
class Diagnosis:
    software: dict
    topology_source: str | None
    interconnect: Interconnect | None
    rdma_ports: list[dict]
    interfaces: list[dict]
    peermem: bool
    environment: dict
    nodes: int | None
    findings: list[Finding] = field(default_factory=list)
    recommendations: list[Recommendation] = field(default_factory=list)

    @property
    def active_rdma(self) -> list[dict]:
        return [p for p in self.rdma_ports if p["state"] == "ACTIVE"]

    def as_dict(self) -> dict:
        return asdict(self)

    @property
    def exit_code(self) -> int:
        return 1 if any(f.level == "error" for f in self.findings) else 0


def diagnose(topo_text: str | None = None, sys_root: str = "/sys", environ=None,
             nodes: int | None = None, software_info: dict | None = None,
             topology_source: str | None = None) -> Diagnosis:
    """Everything ``ciuicflow doctor`` finds, as data. ``topo_text=None`` runs nvidia-smi."""
    environ = dict(os.environ if environ is None else environ)
    if topo_text is None:
        topo_text = run_nvidia_smi()
        topology_source = "nvidia-smi topo -m" if topo_text else None
    interconnect = analyse(parse_topo_matrix(topo_text)) if topo_text else None
    watched = [v for v in NCCL_VARIABLES + OTHER_VARIABLES if v in environ]
    watched += sorted(v for v in environ if v.startswith("NCCL_") and v not in watched)
    if nodes is None:
        try:
            nodes = int(environ["WORLD_SIZE"]) // int(environ["LOCAL_WORLD_SIZE"])
        except (KeyError, ValueError, ZeroDivisionError):
            nodes = None
    d = Diagnosis(software=software_info if software_info is not None else software(),
                  topology_source=topology_source, interconnect=interconnect,
                  rdma_ports=read_rdma_ports(sys_root), interfaces=read_interfaces(sys_root),
                  peermem=peermem_loaded(sys_root),
                  environment={v: environ[v] for v in watched}, nodes=nodes)
    _check_software(d)
    _check_gpus(d)
    _check_network(d, environ)
    _check_nccl(d, environ)
    _recommend(d, environ)
    return d


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


def _network_candidates(d: Diagnosis) -> list[dict]:
    return [i for i in d.interfaces if not i["virtual"] and i["state"] in ("up", "unknown")]


def _check_network(d: Diagnosis, environ: dict) -> None:
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
        candidates = _network_candidates(d)
        names = ", ".join(f"{i['name']} ({i['mbit']} Mbit/s)" if i["mbit"] else i["name"]
                          for i in candidates) or "none"
        _add(d, "info", "no-rdma", f"no active InfiniBand/RoCE port: NCCL will use TCP sockets "
             f"between nodes (interfaces: {names})")


def _check_nccl(d: Diagnosis, environ: dict) -> None:
    ic = d.interconnect
    active = d.active_rdma
    if environ.get("NCCL_IB_DISABLE", "0") not in ("0", ""):
        if active:
            _add(d, "warn", "ib-disabled", f"NCCL_IB_DISABLE={environ['NCCL_IB_DISABLE']} while "
                 f"{len(active)} RDMA port(s) are active: NCCL falls back to TCP sockets; unset it")
        else:
            _add(d, "info", "ib-disabled", "NCCL_IB_DISABLE is set (no active RDMA port anyway)")
    if environ.get("NCCL_P2P_DISABLE", "0") not in ("0", "") and ic is not None:
        if len(ic.nvlink_islands) < ic.gpus:
            _add(d, "warn", "p2p-disabled", "NCCL_P2P_DISABLE is set: NVLink is not used, "
                 "GPU-to-GPU traffic goes through host memory; unset it")
        else:
            _add(d, "info", "p2p-disabled", "NCCL_P2P_DISABLE is set: PCIe peer-to-peer is off")
    if environ.get("NCCL_SHM_DISABLE", "0") not in ("0", "") and ic is not None \
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


def _inter_node_gbit(d: Diagnosis, environ: dict) -> tuple[float | None, str]:
    """Inter-node Gbit/s per node and direction, and what carries it."""
    ic = d.interconnect
    ib_off = environ.get("NCCL_IB_DISABLE", "0") not in ("0", "")
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
    candidates = _network_candidates(d)
    ifname = environ.get("NCCL_SOCKET_IFNAME")
    if ifname:
        chosen = set(socket_ifname_matches(ifname, [i["name"] for i in d.interfaces]))
        candidates = [i for i in d.interfaces if i["name"] in chosen and i["name"] != "lo"]
    speeds = [i for i in candidates if i["mbit"]]
    if not speeds:
        return None, "TCP sockets (speed unknown)"
    best = max(speeds, key=lambda i: i["mbit"])
    return best["mbit"] / 1000.0, f"TCP sockets ({best['name']})"


def _recommend(d: Diagnosis, environ: dict) -> None:
    ic = d.interconnect
    gpus = ic.gpus if ic is not None else None
    inter_gbit, carrier = _inter_node_gbit(d, environ)
    multi_node = d.nodes is None or d.nodes > 1
    if multi_node:
        d.recommendations.append(_multi_node_hook(ic, inter_gbit, carrier, d.nodes))
    if d.nodes in (None, 1) and ic is not None and ic.gpus > 1:
        d.recommendations.append(_single_node_hook(ic))
    env = {}
    if not d.active_rdma or environ.get("NCCL_IB_DISABLE", "0") not in ("0", ""):
        candidates = [i for i in _network_candidates(d) if i["name"] != "lo"]
        if len(candidates) > 1 and not environ.get("NCCL_SOCKET_IFNAME"):
            best = max(candidates, key=lambda i: i["mbit"] or 0)
            env["NCCL_SOCKET_IFNAME"] = best["name"]
            env["GLOO_SOCKET_IFNAME"] = best["name"]
    if d.active_rdma and environ.get("NCCL_IB_DISABLE", "0") not in ("0", ""):
        env["NCCL_IB_DISABLE"] = "(unset)"
    if ic is not None and environ.get("NCCL_P2P_DISABLE", "0") not in ("0", ""):
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
        f"hook {where}", facts + ": a slow network; low-rank compression (rank 16 by default: "
        "16x+ less inter-node traffic for large matrices) between nodes, exact inside; "
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


# ------------------------------------------------------------------------------------------------
# Output


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
    for name in NCCL_VARIABLES[:7] + ("NCCL_DEBUG",):
        lines.append(f"  {name}={d.environment[name]}" if name in d.environment
                     else f"  {name} unset")
    for name, value in d.environment.items():
        if name not in NCCL_VARIABLES[:7] + ("NCCL_DEBUG",):
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


def add_arguments(parser) -> None:
    parser.add_argument("--topo-file", metavar="FILE",
                        help="a saved `nvidia-smi topo -m` output to read instead of running it "
                        "('-': stdin)")
    parser.add_argument("--sys-root", metavar="DIR", default="/sys",
                        help="read DIR in place of /sys (class/infiniband, class/net, module)")
    parser.add_argument("--nodes", type=int, metavar="N",
                        help="nodes the job will use (default: WORLD_SIZE / LOCAL_WORLD_SIZE "
                        "when set, else advice for both one and several nodes)")
    parser.add_argument("--json", nargs="?", const="-", metavar="PATH",
                        help="write the diagnosis as JSON to PATH ('-' or no PATH: stdout)")


def run(args) -> int:
    if args.nodes is not None and args.nodes < 1:
        print("ciuicflow doctor: error: --nodes must be >= 1", file=sys.stderr)
        return 2
    topo_text, source = None, None
    if args.topo_file:
        try:
            if args.topo_file == "-":
                topo_text, source = sys.stdin.read(), "stdin"
            else:
                with open(args.topo_file, encoding="utf-8") as handle:
                    topo_text, source = handle.read(), args.topo_file
        except OSError as exc:
            print(f"ciuicflow doctor: error: cannot read {args.topo_file}: {exc}", file=sys.stderr)
            return 2
    try:
        diagnosis = diagnose(topo_text, sys_root=args.sys_root, nodes=args.nodes,
                             topology_source=source)
    except ValueError as exc:
        print(f"ciuicflow doctor: error: {exc}", file=sys.stderr)
        return 2
    if args.json == "-":
        print(json.dumps(diagnosis.as_dict(), indent=2))
    else:
        print(format_diagnosis(diagnosis))
        if args.json:
            with open(args.json, "w", encoding="utf-8") as handle:
                json.dump(diagnosis.as_dict(), handle, indent=2)
    return diagnosis.exit_code
