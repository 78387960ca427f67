"""``nvidia-smi topo -m`` as data, and what it means for communication inside one node.

Link classes: NVLink (``NV#``: # bonded links) vs PCIe (``PIX``: one switch, ``PXB``: several
switches, ``PHB``: through the host bridge, ``NODE``: across host bridges of a NUMA node,
``SYS``: across sockets). The bandwidths are nominal rates for comparison, not measurements.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field

from ciuicflow.doctor.probes import run_nvidia_smi

# PCIe/NVLink classes from best to worst; "SOC" is what old drivers printed for SYS
LINK_ORDER = ("NV", "PIX", "PXB", "PHB", "NODE", "SYS")
NVLINK_GBPS_PER_LINK = 25.0  # GB/s per direction per NVLink (NVLink 2, 3 and 4 alike)
# nominal GB/s per direction between two GPUs over PCIe 4.0 x16, by path
PCIE_GBPS = {"PIX": 24.0, "PXB": 20.0, "PHB": 16.0, "NODE": 12.0, "SYS": 8.0}
_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_GPU = re.compile(r"GPU(\d+)$")


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


def detect_interconnect(topo_text: str | None = None) -> Interconnect | None:
    """The interconnect of this machine's GPUs (or of a recorded ``nvidia-smi topo -m``).

    None when there is no nvidia-smi or no GPU; raises ``ValueError`` on an unreadable matrix."""
    text = topo_text if topo_text is not None else run_nvidia_smi()
    if not text:
        return None
    return analyse(parse_topo_matrix(text))

