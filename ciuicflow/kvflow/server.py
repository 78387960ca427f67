"""The sidecar's command line: ``ciuicflow-sidecar`` (pyproject's entry point), ``python -m
ciuicflow.kvflow.server`` and ``python -m ciuicflow.kvflow.sidecar``; flags in sidecar/config.py.

The fault flags (``--test-corrupt-every``, ``--link-rate``) are not settings of the sidecar: they are handed
to ciuicflow.testing.kvflow_faults, which installs the faults through the Sidecar's seams.
"""
import sys

from .sidecar.app import run
from .sidecar.config import parse_command_line


def main(argv=None) -> int:
    try:
        cfg, fault_flags = parse_command_line(argv)
    except (ValueError, OSError) as exc:
        print(f"ciuicflow-sidecar: {exc}", file=sys.stderr)
        return 2
    faults = {}
    if any(fault_flags.values()):
        from ciuicflow.testing.kvflow_faults import Faults
        faults = Faults(corrupt_every=fault_flags["test_corrupt_every"], link_rate=fault_flags["link_rate"]).seams()
    return run(cfg, **faults)


if __name__ == "__main__":
    sys.exit(main())
