"""Running a list of methods on the simulated cluster in as few torchrun launches as possible: each
launch's worker appends one JSON line per method it finished; when a launch dies, the method it was
on is recorded as failed and the next launch starts after it, so a crash loses only that method."""

import json
import os
import tempfile
import time

from bench.common.report import last_error_line


def run_in_launches(cluster, todo, worker_argv, log, timeout, failed_record):
    """``worker_argv(methods, out_path)``: torchrun's script and arguments for one launch;
    ``failed_record(method, why)``: the record of a method that did not finish. Returns
    (records in run order, the probe lines' ``probe`` objects merged)."""
    records, probe, todo = [], {}, list(todo)
    deadline = time.monotonic() + timeout
    while todo:
        with tempfile.NamedTemporaryFile(suffix=".jsonl", delete=False) as f:
            out = f.name
        try:
            run = cluster.torchrun(worker_argv(todo, out), timeout=max(1.0, deadline - time.monotonic()),
                                   on_line=lambda node, line: line.startswith("[bench]") and log(line.rstrip()))
            error = None if run.ok else f"exit codes {run.returncodes}"
            tail = "\n".join(o[-4000:] for o in run.outputs)
        except TimeoutError as exc:
            error, tail = "timed out", str(exc)[-8000:]
        with open(out) as f:
            lines = [json.loads(line) for line in f if line.strip()]
        os.unlink(out)
        done = [r for r in lines if "probe" not in r]
        for r in lines:
            probe.update(r.get("probe", {}))
        records += done
        todo = todo[len(done):]
        if error is None and todo:
            error = "worker exited without these methods"
        if error is None:
            continue
        if not todo:
            log(f"[bench] launch ended badly after all methods ran ({error})")
            break
        failed = todo.pop(0)
        log(f"[bench] FAILED {failed} ({error}); output tail:\n{tail[-3000:]}")
        records.append(failed_record(failed, f"{error}: {last_error_line(tail)}"))
        if error == "timed out":
            records += [failed_record(m, "not run: time budget used up") for m in todo]
            break
    return records, probe
