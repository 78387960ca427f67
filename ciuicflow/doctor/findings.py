"""What a diagnosis holds: the machine's facts, the findings about them, the recommendations."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

from ciuicflow.compression import registry
from ciuicflow.doctor.interconnect import Interconnect


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

    def __post_init__(self):
        if self.hook is not None:
            registry.method(self.hook)  # a hook the registry does not know is a bug here


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

    @property
    def network_candidates(self) -> list[dict]:
        """Physical interfaces that are up (or whose state the kernel does not know)."""
        return [i for i in self.interfaces if not i["virtual"] and i["state"] in ("up", "unknown")]

    def as_dict(self) -> dict:
        return asdict(self)

    @property
    def exit_code(self) -> int:
        return 1 if any(f.level == "error" for f in self.findings) else 0

