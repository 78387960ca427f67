"""``python -m ciuicflow.kvflow.demo prefill|decode``: a kv-demo worker process."""
import sys

from .workers import worker_main

sys.exit(worker_main())
