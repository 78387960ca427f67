"""The tests' name for ``ciuicflow.testing.processes`` (real gloo or NCCL processes, simulated
nodes), which the GPU bench uses too."""
from ciuicflow.testing.processes import run_distributed  # noqa: F401
