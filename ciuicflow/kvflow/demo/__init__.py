"""``ciuicflow kv-demo`` (command.py): disaggregated prefill and decode of a DeepSeek-V3-architecture model
through two KV-flow sidecars, checked token for token against decoding in one process; its model
(model.py) and worker processes (workers.py, ``python -m ciuicflow.kvflow.demo prefill|decode``)."""
from .command import add_arguments, report, run, run_demo
from .model import SIZES, build_model, greedy_decode, reference_tokens

__all__ = ["SIZES", "add_arguments", "build_model", "greedy_decode", "reference_tokens", "report", "run", "run_demo"]
