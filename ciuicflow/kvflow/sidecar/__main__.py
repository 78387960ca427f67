"""``python -m ciuicflow.kvflow.sidecar``: the sidecar process (same as ``ciuicflow-sidecar``)."""
import sys

from ..server import main

sys.exit(main())
