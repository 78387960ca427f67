"""bench/convergence/frontier.py on hand-made records: points, the families' frontiers, the verdicts."""
import json

from bench.convergence import frontier


def _record(method, value, nbytes, seed=0, task="t", metric="accuracy"):
    return {"task": task, "method": method, "seed": seed, "metric": metric, "value": value,
            "inter_node_bytes_per_step": nbytes}


def test_a_rerun_replaces_its_seed_and_diloco_is_judged_at_each_synchronous_methods_bytes(tmp_path):
    first = [_record("exact", 0.90, 1000), _record("hierarchical_1bit", 0.89, 100),
             _record("diloco_int4_h16", 0.80, 5), _record("diloco_int4_h8", 0.895, 50)]
    rerun = [_record("diloco_int4_h16", 0.92, 5)]  # the same task, method and seed, run again
    a, b = tmp_path / "a.jsonl", tmp_path / "b.json"
    a.write_text("".join(json.dumps(r) + "\n" for r in first))
    b.write_text(json.dumps(rerun))
    records = frontier.load([str(a), str(b)])
    by_task = frontier.points(records)
    rows = {p["method"]: p for p in by_task["t"]}
    assert rows["diloco_int4_h16"]["value"] == 0.92  # replaced, not averaged with 0.80
    assert [p["method"] for p in frontier.frontier(by_task["t"], "diloco")] == ["diloco_int4_h16"]
    verdicts = {c["synchronous"]: (c["diloco"], c["verdict"]) for c in frontier.compare(by_task["t"])}
    assert verdicts == {"exact": ("diloco_int4_h16", "ahead"),
                        "hierarchical_1bit": ("diloco_int4_h16", "ahead")}


def test_behind_and_no_row_are_said_and_loss_is_lower_is_better():
    rows = frontier.points([_record("exact", 1.50, 1000, metric="val_loss"),
                            _record("onebit", 1.52, 50, metric="val_loss"),
                            _record("diloco_int4_h16", 1.51, 100, metric="val_loss")])["t"]
    verdicts = {c["synchronous"]: c["verdict"] for c in frontier.compare(rows)}
    # at exact's bytes DiLoCo's best is 1.51 (behind 1.50); none sends <= onebit's 50 bytes
    assert verdicts == {"exact": "behind", "onebit": "no DiLoCo row"}
