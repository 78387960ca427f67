"""The sidecar's command line: ``ciuicflow-sidecar`` (pyproject's entry point), ``python -m
ciuicflow.kvflow.server`` and ``python -m ciuicflow.kvflow.sidecar``; flags in sidecar/config.py.

Faults (a corrupting link, a slow one) are no flags of the sidecar: tests and benchmarks run it through
ciuicflow.testing.kvflow_faults, which parses its own flags and hands their seams to ``main``.
"""
import sys

from .sidecar.app import run
from .sidecar.config import parse_command_line


def main(argv=None, **seams) -> int:
    """Run the sidecar of command line ``argv``; ``seams``: app.Sidecar's fault seams (tests only)."""
    try:
        cfg = parse_command_line(argv)
    except (ValueError, OSError) as exc:
        print(f"ciuicflow-sidecar: {exc}", file=sys.stderr)
        return 2
    return run(cfg, **seams)


if __name__ == "__main__":
    sys.exit(main())
