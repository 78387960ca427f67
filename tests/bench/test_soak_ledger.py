"""The soak's ledger verdict (bench/soak/ledger.py) on made-up events: it finds what it must."""

from bench.soak.ledger import Ledger, passed, read_all, verdict  # noqa: E402


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


# ---------------------------------------------------------------------- the attackers' verdict
from bench.soak.ledger import STATS_LIMIT_MS, STATS_STALL_MS, attack_report, judge, stats_during  # noqa: E402


def attack(attacker, target, t0, t1, bad=(), **extra):
    return {"ev": "attack", "t": t1, "attacker": attacker, "target": target, "t0": t0, "t1": t1,
            "did": {"x": 1}, "got": {"refused": 2}, "bad": list(bad), **extra}


def _events():
    return [ok("k1", 1.5, dest="d0"), ok("k2", 5.5, dest="d1", src="p1"),
            attack("metrics", "d0", 1, 2), attack("metrics", "d1", 5, 6, bad=["held past the timeout"]),
            {"ev": "kill", "who": "d1", "t": 6.2},                     # within the slack: excused
            attack("packed", "p0", 1, 2, bad=["a crafted chunk accepted"]),
            {"ev": "kill", "who": "p1", "t": 1.5},                     # another sidecar: excuses nothing
            {"ev": "kill", "who": "d0", "t": 2.6},                     # after the window and its slack: nothing
            attack("proxy", "proxy", 1, 3, legit_ok=0), attack("proxy", "proxy", 4, 5, legit_ok=7, peak=3),
            {"ev": "attack_skipped", "attacker": "handles", "target": "d0", "t": 1.6}]


def test_attack_report_excuses_only_rounds_whose_target_was_killed():
    r = attack_report(_events())
    m = r["metrics"]
    assert m["rounds"] == 2 and m["interrupted"] == 1 and m["excused"] == 1 and m["bad"] == []
    assert m["did"] == {"x": 2} and m["got"] == {"refused": 4}
    assert m["legit_ok"] == 2 and m["rounds_with_legit"] == 2     # k1 to d0 in [1, 2], k2 to d1 in [5, 6]
    assert r["packed"]["bad"] == ["p0: a crafted chunk accepted"] and r["packed"]["legit_ok"] == 1  # k1 from p0
    assert r["proxy"]["legit_ok"] == 7 and r["proxy"]["rounds_with_legit"] == 1   # its own count, not the ledger's
    assert r["handles"]["rounds"] == 0 and r["handles"]["skipped"] == 1


def test_judge_fails_each_missed_target():
    events = _events()
    v = verdict(events)
    report = attack_report(events)
    samples = [("d0", 1.2, 0.005), ("d0", 1.4, 0.006), ("d1", 5.5, 0.004), ("p0", 1.1, 0.003), ("p0", 8, 9.0)]
    stats = stats_during(samples, report)
    assert stats["metrics"]["n"] == 3 and stats["none"]["n"] == 1 and stats["none"]["worst_ms"] == 9000
    memory = {"d0": {"peak_mib": 100, "bound_mib": 500}}
    why = judge(v, report, stats, memory, ["metrics", "packed", "proxy", "handles"])
    assert why == ["packed: p0: a crafted chunk accepted", "handles: no round completed"]
    assert judge(v, report, stats, memory, ["metrics", "proxy"]) == []
    # no legitimate transfer during an attacker's floods
    quiet = [e for e in events if e.get("key") != "k2"]
    assert judge(verdict(quiet), attack_report(quiet), stats, memory, ["metrics"]) == []      # k1 still
    none = [e for e in events if e["ev"] != "ok"]
    assert judge(verdict(none), attack_report(none), stats, memory, ["metrics"]) == \
        ["metrics: no legitimate transfer completed during its floods"]
    # memory over its bound, Stats slow during the floods (p90, or one stall), Stats failing, a dead proxy
    assert judge(v, report, stats, {"d1": {"peak_mib": 501, "bound_mib": 500}}, ["metrics"]) == \
        ["d1: peak RSS 501 MiB over its bound 500 MiB"]
    slow = [("d0", 1.0 + i / 100, (STATS_LIMIT_MS + 5) / 1000) for i in range(20)]
    assert judge(v, report, stats_during(slow, report), memory, ["metrics"]) == \
        [f"metrics: local Stats median {STATS_LIMIT_MS + 5:g} ms during its floods (limit {STATS_LIMIT_MS:g})"]
    tail = [("d0", 1.0 + i / 100, 0.005 if i < 15 else (STATS_LIMIT_MS + 5) / 1000) for i in range(20)]
    assert judge(v, report, stats_during(tail, report), memory, ["metrics"]) == []       # a slow tail: reported
    assert stats_during(tail, report)["metrics"]["over_limit"] == 5
    stall = [("d0", 1.0 + i / 100, 0.01) for i in range(20)] + [("d1", 5.1, (STATS_STALL_MS + 1) / 1000)]
    assert judge(v, report, stats_during(stall, report), memory, ["metrics"]) == \
        [f"metrics: local Stats took {STATS_STALL_MS + 1:g} ms during its floods (stall limit {STATS_STALL_MS:g})"]
    assert judge(v, report, stats, memory, ["metrics"], stats_failures=2) == \
        ["2 local Stats calls failed while their sidecar was up"]
    assert judge(v, report, stats, memory, [], proxy={"exited": -9}) == ["the proxy exited by itself (-9)"]
    assert judge(v, report, stats, memory, [], proxy={"exited": None}, emfile=3) == \
        ["the sidecars ran out of descriptors (3 log lines)"]
