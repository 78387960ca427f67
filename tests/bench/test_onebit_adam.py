"""bench/onebit/adam.py's launcher: which failures it reruns (a rank killed by a signal inside a native
library) and which it reports at once (a Python exception), and what counts as finished."""
import json

from tests import REPO

ROOT = str(REPO)
from bench.onebit.adam import _finished, _killed_by_signal  # noqa: E402


def _torchrun_report(root_exitcode, other_exitcode=-15):
    """What torchrun prints when a child fails (torch.distributed.elastic's ChildFailedError)."""
    return f"""exit codes [-9, 1]:
--- node 1 (exit 1)
/check/bench/onebit/adam.py FAILED
-------------------------------------------------------
Failures:
[1]:
  rank      : 3 (local_rank: 1)
  exitcode  : {other_exitcode} (pid: 22295)  (SIGTERM)
  traceback : Signal 15 (SIGTERM) received by PID 22295
-------------------------------------------------------
Root Cause (first observed failure):
[0]:
  rank      : 2 (local_rank: 0)
  exitcode  : {root_exitcode} (pid: 22292)
  error_file: <N/A>
"""


def test_a_rank_killed_by_a_signal_is_told_from_a_python_exception():
    assert _killed_by_signal(_torchrun_report(-6))  # SIGABRT in a native library: rerun
    assert _killed_by_signal(_torchrun_report(-11))
    # a Python exception exits 1; torchrun then stops the other ranks by SIGTERM: not a crash to rerun
    assert not _killed_by_signal(_torchrun_report(1))
    assert not _killed_by_signal("torchrun on 2 nodes did not finish in 170 s; output: exitcode  : -9")


def test_finished_names_methods_and_the_convergence_rows(tmp_path):
    path = tmp_path / "lines.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in (
        {"method": "ddp_adam", "step_seconds": 0.01}, {"method": "deepspeed_adam", "skipped": "no deepspeed"},
        {"method": "onebit_adam", "failed": "RuntimeError: x"}, {"convergence": []})) + "\n")
    assert _finished(str(path)) == {"ddp_adam", "deepspeed_adam", "onebit_adam", "convergence"}
