"""The soak's ledger verdict (bench/kvflow_soak_ledger.py) on made-up events: it finds what it must."""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "bench"))
from kvflow_soak_ledger import Ledger, passed, read_all, verdict  # noqa: E402


def ok(key, t, dest="d0", src="p0"):
    return {"ev": "ok", "key": key, "t": t, "dest": dest, "src": src, "size": 10}


def test_verdict_counts_losses_duplicates_and_corruption():
    events = [{"ev": "intent", "key": k, "t": 0} for k in "abcdef"]
    events += [ok("a", 1), ok("b", 1), ok("c", 1), ok("d", 1, dest="d1"), ok("e", 1, dest="d1")]
    events += [{"ev": "delivered", "key": "a", "t": 2, "t0": 2, "sha_ok": True},
               {"ev": "acked", "key": "a", "t": 3},
               {"ev": "delivered", "key": "a", "t": 5, "t0": 4, "sha_ok": True},     # after its ack: duplicate
               {"ev": "delivered", "key": "b", "t": 2, "t0": 2, "sha_ok": True},
               {"ev": "delivered", "key": "b", "t": 3, "t0": 2.5, "sha_ok": True},   # before any ack: fine
               {"ev": "delivered", "key": "c", "t": 2, "t0": 2, "sha_ok": False},    # corrupted, and lost
               {"ev": "kill", "who": "d1", "t": 2}, {"ev": "kill", "who": "p0", "t": 3}]
    v = verdict(events, memory_receivers=("d1",))
    assert v["duplicates"] == ["a"] and v["corrupted"] == ["c"] and v["redelivered_before_ack"] == 1
    assert v["lost"] == ["c"]                           # d, e: both their sidecars died (memory receiver)
    assert v["lost_allowed"] == ["d", "e"] and not passed(v)
    clean = [e for e in events if e.get("key") not in ("a", "c", "d", "e")]
    assert passed(verdict(clean, ("d1",)))


def test_ledger_lines_are_durable_and_read_back(tmp_path):
    led = Ledger(str(tmp_path / "x.jsonl"))
    led.write("intent", key="k")
    led.close()
    with open(tmp_path / "x.jsonl", "a") as fh:
        fh.write('{"ev": "torn')                        # a writer killed mid-line
    assert [e["key"] for e in read_all(str(tmp_path))] == ["k"]
