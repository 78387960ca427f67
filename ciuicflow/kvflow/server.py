"""``python -m ciuicflow.kvflow.server`` and ``ciuicflow-sidecar`` (pyproject's entry point): the sidecar
process, ``ciuicflow.kvflow.sidecar``."""
import sys

from .sidecar.app import main

if __name__ == "__main__":
    sys.exit(main())
