"""What the cluster benches (bench/comm, bench/fsdp, bench/diloco) write: records combined over rounds,
step-time ratios within a round, the JSON / markdown / PNG outputs, and the step-and-bytes chart."""

import json
import re
import statistics

TIMED = ("step_seconds", "comm_seconds", "cpu_seconds")


def last_error_line(text: str) -> str:
    """The exception a rank died of (torchrun's own ChildFailedError report says nothing)."""
    pattern = re.compile(r"^\s*([\w.]*(Error|Exception|Interrupt)|Killed)\b.*")
    lines = [ln.strip() for ln in text.splitlines() if pattern.match(ln) and "ChildFailedError" not in ln]
    return lines[-1][:300] if lines else "see the output above"


def combine_rounds(records, per_round=None):
    """One record per method, in first-run order, from the records of every round (run order): the
    median of each timed field over the runs that finished, each run's figures in ``rounds`` (with
    its ``round``, from 0) and the count of failed runs in ``failed_runs``. ``per_round``: runs of
    each method per round (a method listed twice runs twice a round; default once). A method that
    failed every time keeps its first failure record."""
    runs: dict = {}
    for r in records:
        runs.setdefault(r["method"], []).append(r)
    out = []
    for method, tries in runs.items():
        times = (per_round or {}).get(method, 1)
        ran = [(i // times, r) for i, r in enumerate(tries) if "step_seconds" in r]
        if not ran:
            out.append(tries[0])
            continue
        combined = dict(ran[0][1])
        for field in TIMED:
            values = [r[field] for _, r in ran if r.get(field) is not None]
            if values:
                combined[field] = statistics.median(values)
        combined["rounds"] = [dict({f: r.get(f) for f in TIMED}, round=i) for i, r in ran]
        combined["failed_runs"] = len(tries) - len(ran)
        out.append(combined)
    return out


def per_round_ratios(method, floor):
    """``method``'s step time over ``floor``'s (its mean over the round) within each round both
    ran (combined records)."""
    floors: dict = {}
    for r in floor.get("rounds", []):
        floors.setdefault(r["round"], []).append(r["step_seconds"])
    return [r["step_seconds"] / statistics.mean(floors[r["round"]]) for r in method.get("rounds", [])
            if r["round"] in floors]


def write_outputs(json_path: str, records, table: str, chart=None, extra_json=None) -> list:
    """``json_path`` (the records), its ``.md`` (``table``) and, when ``chart(png_path)`` draws
    something, its ``.png``; ``extra_json``: {suffix: object} written beside them. Returns the paths."""
    stem = json_path[:-5] if json_path.endswith(".json") else json_path
    with open(json_path, "w") as f:
        json.dump(records, f, indent=1)
    with open(stem + ".md", "w") as f:
        f.write(table)
    outputs = [json_path, stem + ".md"]
    for suffix, obj in (extra_json or {}).items():
        with open(stem + suffix, "w") as f:
            json.dump(obj, f, indent=1)
        outputs.append(stem + suffix)
    if chart is not None and chart(stem + ".png"):
        outputs.append(stem + ".png")
    return outputs


def step_and_bytes_chart(records, path, title) -> bool:
    """Seconds per step (with the time a collective was in flight, where measured, and the
    ``no_comm`` floor) beside inter-node bytes per step (log scale), one bar per method."""
    import textwrap

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = [r for r in records if "step_seconds" in r]
    if not rows:
        return False
    names = [r["method"] for r in rows]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 0.45 * len(rows) + 2.2))
    ypos = range(len(rows))
    ax1.barh(ypos, [r["step_seconds"] for r in rows], color="#4c72b0", label="step")
    if any(r.get("comm_seconds") is not None for r in rows):
        ax1.barh(ypos, [min(r.get("comm_seconds") or 0, r["step_seconds"]) for r in rows], color="#dd8452",
                 alpha=0.8, label="communication in flight")
    floor = next((r for r in rows if r["method"] == "no_comm"), None)
    if floor:
        ax1.axvline(floor["step_seconds"], color="k", ls="--", lw=1, label="no_comm floor")
    ax1.set_yticks(list(ypos), names)
    ax1.invert_yaxis()
    ax1.set_xlabel("seconds per step")
    ax1.legend(loc="lower right", fontsize=8)
    mb = [r.get("inter_node_bytes_per_step") for r in rows]
    if all(v is None for v in mb):
        ax2.text(0.5, 0.5, "inter-node bytes not measured\n(NOT SHAPED: loopback fallback)", ha="center",
                 va="center", transform=ax2.transAxes, color="red")
    else:
        ax2.barh(ypos, [max((v or 0) / 1e6, 1e-3) for v in mb], color="#55a868")
        ax2.set_xscale("log")
        ax2.set_xlabel("inter-node MB per step (log)")
    ax2.set_yticks(list(ypos), names)
    ax2.invert_yaxis()
    fig.suptitle("\n".join(textwrap.wrap(title, 150)), fontsize=9,
                 color="black" if rows[0].get("shaped") else "red")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True
