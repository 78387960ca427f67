"""``diagnose()``: read the machine, check it, recommend."""
from __future__ import annotations

import os

from ciuicflow.doctor.findings import Diagnosis
from ciuicflow.doctor.interconnect import analyse, parse_topo_matrix
from ciuicflow.doctor.nccl import NCCL_VARIABLES, OTHER_VARIABLES
from ciuicflow.doctor.probes import (peermem_loaded, read_interfaces, read_rdma_ports,
                                     run_nvidia_smi, software)
from ciuicflow.doctor.recommend import add_recommendations
from ciuicflow.doctor.rules import run_checks


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
    run_checks(d, environ)
    add_recommendations(d, environ)
    return d

