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

and ends with recommendations: which hook (a method of the compression registry) and which
variables. Bandwidths it quotes are nominal rates for comparison (25 GB/s per NVLink per direction, PCIe 4.0 x16 class figures),
not measurements; ``ciuicflow plan`` turns them into step-time predictions.

``detect_interconnect()`` returns the parsed interconnect (NVLink islands, GPUs per island, a
``CIUICFLOW_LOCAL_WORLD_SIZE`` that would make the hierarchical hooks reduce exactly inside
fast GPU groups) for code that wants it, e.g. topology detection.

Exit status: 0, or 1 when a finding is an error (a setting that cannot work).

Modules, one job each (this package re-exports their names):

- ``probes``: what is read from the machine (``nvidia-smi``, ``/sys``, the installed software);
- ``interconnect``: ``nvidia-smi topo -m`` parsed and analysed;
- ``nccl``: the watched variables and NCCL's syntax for them;
- ``findings``: the data of a diagnosis (``Diagnosis``, ``Finding``, ``Recommendation``);
- ``rules``: the checks that produce findings;
- ``recommend``: the hooks (``HOOKS``) and settings to use;
- ``diagnosis``: ``diagnose()``, which runs the above;
- ``output``: the text report; ``cli``: ``ciuicflow doctor``'s arguments and command.
"""
from ciuicflow.doctor.cli import add_arguments, run
from ciuicflow.doctor.diagnosis import diagnose
from ciuicflow.doctor.findings import Diagnosis, Finding, Recommendation
from ciuicflow.doctor.interconnect import (LINK_ORDER, NVLINK_GBPS_PER_LINK, PCIE_GBPS,
                                           Interconnect, TopoMatrix, analyse, detect_interconnect,
                                           link_class, parse_topo_matrix)
from ciuicflow.doctor.nccl import (GDR_DISTANCE, GDR_LEVELS, NCCL_DEFAULT_GDR_LEVEL,
                                   NCCL_VARIABLES, OTHER_VARIABLES, gdr_level_index,
                                   ib_hca_matches, socket_ifname_matches)
from ciuicflow.doctor.output import format_diagnosis
from ciuicflow.doctor.probes import (VIRTUAL_INTERFACES, peermem_loaded, read_interfaces,
                                     read_rdma_ports, run_nvidia_smi, software)
from ciuicflow.doctor.recommend import HOOKS

__all__ = [
    "HOOKS", "LINK_ORDER", "NVLINK_GBPS_PER_LINK", "PCIE_GBPS", "GDR_LEVELS", "GDR_DISTANCE",
    "NCCL_DEFAULT_GDR_LEVEL", "NCCL_VARIABLES", "OTHER_VARIABLES", "VIRTUAL_INTERFACES",
    "link_class", "TopoMatrix", "parse_topo_matrix", "Interconnect", "analyse", "run_nvidia_smi",
    "detect_interconnect", "read_rdma_ports", "read_interfaces", "peermem_loaded",
    "socket_ifname_matches", "ib_hca_matches", "gdr_level_index", "software", "Finding",
    "Recommendation", "Diagnosis", "diagnose", "format_diagnosis", "add_arguments", "run",
]
