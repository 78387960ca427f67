"""Straggler detection (step times gathered over gloo) and hang detection (store heartbeats).

Stragglers. Every ``every`` steps each rank summarises its last window (mean step time, mean busy
time, mean time per phase) and the summaries are all-gathered over a gloo group. In synchronous
training every rank waits for the slowest inside the collectives, so wall step times are nearly
equal; the rank to blame is the one that is *busy* longest. Busy time is step time minus time in
the hooks (which includes waiting for peers); without hook statistics it is the step time. A rank
is a straggler when its busy time exceeds ``factor`` x the median over ranks and the median by at
least ``min_excess_s``; the phase reported is the one (``Monitor.phase``) exceeding its own median
by the most. The gather is a collective (every rank starts it at the same step) but asynchronous:
its result is read one step later, when every rank has long contributed.

Hangs. A collective cannot tell which rank is missing: it just blocks. So each rank publishes its
position (step, phase, a counter bumped at every transition) to the rendezvous store from a
background thread, and a watchdog thread on one rank reads everyone's. A rank whose position has
not changed for ``timeout_s`` (by the watchdog's clock, so node clocks need not agree) is stalled.
When the others wait for it in a collective they stall too; the suspects are the stalled ranks
furthest behind (lowest step, then fewest phase transitions within it); the alert also says where
every other rank is. While the ranks furthest behind still move, nobody is blamed before twice the timeout.
"""
from __future__ import annotations

import json
import logging
import statistics
import threading
import time
import zlib
from typing import Callable

log = logging.getLogger("ciuicflow.monitor")

BETWEEN_STEPS = "between steps"


# ------------------------------------------------------------------------------------------------
# Stragglers


def find_stragglers(windows: list[dict], factor: float = 1.5,
                    min_excess_s: float = 0.005) -> list[dict]:
    """Alerts for the ranks whose busy time is ``> factor x median`` (and ``> median + min_excess_s``).

    ``windows``: one summary per rank with ``rank``, ``node``, ``host``, ``first_step``,
    ``last_step``, ``busy_s``, ``step_s`` and ``phases`` (phase -> mean seconds)."""
    if factor <= 1.0:
        raise ValueError(f"straggler factor must be > 1, got {factor}")
    if len(windows) < 2:
        return []
    median_busy = statistics.median(w["busy_s"] for w in windows)
    phase_names = sorted({name for w in windows for name in w["phases"]})
    phase_medians = {name: statistics.median(w["phases"].get(name, 0.0) for w in windows)
                     for name in phase_names}
    alerts = []
    for w in windows:
        busy = w["busy_s"]
        if busy <= factor * median_busy or busy - median_busy < min_excess_s:
            continue
        phase, phase_s, phase_median = "step", busy, median_busy
        if phase_names:
            phase = max(phase_names, key=lambda n: w["phases"].get(n, 0.0) - phase_medians[n])
            phase_s, phase_median = w["phases"].get(phase, 0.0), phase_medians[phase]
        alerts.append({
            "type": "alert", "kind": "straggler", "rank": w["rank"], "node": w["node"],
            "host": w["host"], "phase": phase, "steps": [w["first_step"], w["last_step"]],
            "busy_s": busy, "median_busy_s": median_busy,
            "ratio": busy / median_busy if median_busy > 0 else None,
            "step_s": w["step_s"], "phase_s": phase_s, "median_phase_s": phase_median,
        })
    return alerts


def describe_straggler(alert: dict) -> str:
    ratio = f"x{alert['ratio']:.1f}" if alert.get("ratio") else "median 0"
    text = (f"straggler: rank {alert['rank']} (node {alert['node']}, host {alert['host']}) is busy "
            f"{alert['busy_s'] * 1e3:.1f} ms/step vs median {alert['median_busy_s'] * 1e3:.1f} ms "
            f"({ratio}) over steps {alert['steps'][0]}-{alert['steps'][1]}; phase "
            f"'{alert['phase']}'")
    if alert["phase"] != "step":
        text += (f" takes {alert['phase_s'] * 1e3:.1f} ms vs median "
                 f"{alert['median_phase_s'] * 1e3:.1f} ms")
    return text


PHASE_SLOTS = 8  # phases carried per rank and window; the rest are summed into "other"
_HEAD = 5         # first_step, last_step, step_s, busy_s, number of phases


def _phase_key(name: str) -> int:
    """A number naming a phase, identical on every rank (exact in a float64)."""
    return zlib.crc32(name.encode())


class StragglerDetector:
    """Collects this rank's steps and, every ``every`` steps, gathers and compares windows.

    The gather is asynchronous: ``start`` sends this rank's window summary (a float64 tensor) on
    the monitor's gloo group and returns; ``finish`` collects everyone's, normally one step later,
    when every rank has long sent its own, so the training loop does not wait on it."""

    def __init__(self, group, every: int, factor: float, min_excess_s: float, *, rank: int,
                 node_of_rank: list[int], hosts: list[str]):
        import torch

        if every < 1:
            raise ValueError(f"straggler_every must be >= 1, got {every}")
        if factor <= 1.0:
            raise ValueError(f"straggler_factor must be > 1, got {factor}")
        self.group, self.every = group, every
        self.factor, self.min_excess_s = factor, min_excess_s
        self.rank, self.node_of_rank, self.hosts = rank, node_of_rank, hosts
        self._window: list[tuple] = []
        self._phase_names = {_phase_key("other"): "other"}
        size = _HEAD + 2 * PHASE_SLOTS
        self._outputs = [torch.zeros(size, dtype=torch.float64) for _ in node_of_rank]
        self._input = torch.zeros(size, dtype=torch.float64)
        self._work = None
        self.gather_s = 0.0  # time spent starting and finishing gathers

    @property
    def in_flight(self) -> bool:
        return self._work is not None

    def add(self, step: int, step_s: float, busy_s: float, phases: dict | None) -> bool:
        """Record a step; True when a check is due (call ``start`` on every rank then)."""
        self._window.append((step, step_s, busy_s, phases))
        return len(self._window) >= self.every

    def _encode(self) -> None:
        window, n = self._window, len(self._window)
        phases: dict[str, float] = {}
        for _, _, _, step_phases in window:
            for name, seconds in (step_phases or {}).items():
                phases[name] = phases.get(name, 0.0) + seconds / n
        ranked = sorted(phases.items(), key=lambda item: -item[1])
        if len(ranked) > PHASE_SLOTS:
            ranked = ranked[:PHASE_SLOTS - 1] + [("other", sum(t for _, t in ranked[PHASE_SLOTS - 1:]))]
        values = [window[0][0], window[-1][0], sum(w[1] for w in window) / n,
                  sum(w[2] for w in window) / n, len(ranked)]
        for name, seconds in ranked:
            key = _phase_key(name)
            self._phase_names[key] = name
            values += [key, seconds]
        self._input.zero_()
        self._input[:len(values)] = self._input.new_tensor(values)

    def start(self) -> None:
        """Send this rank's window (collective, asynchronous)."""
        import torch.distributed as dist

        if self._work is not None:
            raise RuntimeError("a straggler check is already in flight: finish() it first")
        began = time.perf_counter()
        self._encode()
        self._window = []
        self._work = dist.all_gather(self._outputs, self._input, group=self.group, async_op=True)
        self.gather_s += time.perf_counter() - began

    def finish(self) -> tuple[list[dict], list[dict]]:
        """Wait for the gather started last; return (every rank's window, straggler alerts)."""
        began = time.perf_counter()
        self._work.wait()
        self._work = None
        windows = []
        for rank, row in enumerate(self._outputs):
            values = row.tolist()
            phases = {}
            for i in range(int(values[4])):
                key, seconds = int(values[_HEAD + 2 * i]), values[_HEAD + 2 * i + 1]
                phases[self._phase_names.get(key, f"phase#{key:08x}")] = seconds
            windows.append({"rank": rank, "node": self.node_of_rank[rank],
                            "host": self.hosts[rank], "first_step": int(values[0]),
                            "last_step": int(values[1]), "step_s": values[2],
                            "busy_s": values[3], "phases": phases})
        self.gather_s += time.perf_counter() - began
        return windows, find_stragglers(windows, self.factor, self.min_excess_s)


# ------------------------------------------------------------------------------------------------
# Hangs


def find_hang_suspects(positions: dict[int, dict], stalled_for: dict[int, float],
                       timeout_s: float) -> list[int]:
    """The stalled ranks to blame: those furthest behind (lowest step, then fewest transitions).

    ``positions``: rank -> heartbeat (``step``, ``ordinal``: phase transitions within the step,
    ``closed``); ``stalled_for``: rank -> seconds without progress, for the ranks past the timeout.
    When the ranks furthest behind still move, the stalled ones may just be waiting for them:
    they are blamed only after twice the timeout (a rank hung ahead of ranks that never catch up).
    Every live rank between steps at the same step is a pause (evaluation, checkpointing), not a hang:
    nobody waits in a collective for anybody. Closed ranks are ignored."""
    live = {r: p for r, p in positions.items() if not p.get("closed")}
    stalled = [r for r in stalled_for if r in live]
    if not stalled:
        return []
    if all(p.get("phase") == BETWEEN_STEPS for p in live.values()) \
            and len({p["step"] for p in live.values()}) == 1:
        return []

    def behind(rank):
        return (live[rank]["step"], live[rank]["ordinal"])

    lowest = min(behind(r) for r in live)
    suspects = [r for r in stalled if behind(r) == lowest]
    if not suspects:
        suspects = [r for r in stalled if stalled_for[r] >= 2 * timeout_s]
    return sorted(suspects)


def describe_hang(alert: dict, listed: int = 8) -> str:
    text = (f"hang: rank {alert['rank']} (node {alert['node']}, host {alert['host']}) has not "
            f"progressed for {alert['stalled_s']:.1f} s, at step {alert['step']}, phase "
            f"'{alert['phase']}'")
    groups: dict[tuple, list[dict]] = {}
    for other in alert.get("others", []):
        groups.setdefault((other["step"], other["phase"]), []).append(other)
    parts = []
    for (step, phase), members in sorted(groups.items()):
        ranks = ", ".join(str(m["rank"]) for m in members[:listed])
        more = f" and {len(members) - listed} more" if len(members) > listed else ""
        idle = max(m["since_s"] for m in members)
        parts.append(f"rank{'s' if len(members) > 1 else ''} {ranks}{more} at step {step}, "
                     f"phase '{phase}' (unchanged for up to {idle:.1f} s)")
    if parts:
        text += "; others: " + "; ".join(parts)
    return text


class Heartbeat:
    """This rank's position, updated by the training loop and published by a thread.

    The training loop only assigns a tuple (cheap, atomic under the GIL); the thread writes it
    to the store when it changed."""

    def __init__(self, store, rank: int, interval_s: float):
        self._store, self._key, self._interval = store, f"hb/{rank}", interval_s
        self._position = (0, 0, BETWEEN_STEPS, 0, False)  # seq, step, phase, ordinal, closed
        self._published = None
        self._stop = threading.Event()
        self._thread = None
        self.publish()

    def move(self, step: int, phase: str, ordinal: int) -> None:
        seq = self._position[0] + 1
        self._position = (seq, step, phase, ordinal, False)

    def publish(self) -> None:
        position = self._position
        if position == self._published:
            return
        seq, step, phase, ordinal, closed = position
        self._store.set(self._key, json.dumps({"seq": seq, "step": step, "phase": phase,
                                               "ordinal": ordinal, "closed": closed}))
        self._published = position

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, daemon=True,
                                        name="ciuicflow-heartbeat")
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.wait(self._interval):
            try:
                self.publish()
            except Exception as exc:  # the store went away (shutdown): stop quietly
                log.debug("ciuicflow.monitor: heartbeat stopped: %s", exc)
                return

    def close(self) -> None:
        seq, step, phase, ordinal, _ = self._position
        self._position = (seq + 1, step, phase, ordinal, True)
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        try:
            self.publish()
        except Exception as exc:
            log.debug("ciuicflow.monitor: last heartbeat not published: %s", exc)


class HangWatchdog:
    """Reads every rank's heartbeat; reports stalled ranks through ``on_alert``."""

    def __init__(self, store, world_size: int, timeout_s: float, interval_s: float,
                 ranks_info: list[dict], on_alert: Callable[[dict], None],
                 clock: Callable[[], float] = time.monotonic):
        if timeout_s <= 0:
            raise ValueError(f"hang_timeout_s must be > 0, got {timeout_s}")
        self._store = store
        self._timeout, self._interval = timeout_s, interval_s
        self._info, self._on_alert, self._clock = ranks_info, on_alert, clock
        self._keys = [f"hb/{r}" for r in range(world_size)]
        self._last_seq: dict[int, int] = {}
        self._since: dict[int, float] = {}
        self._alerted: dict[int, int] = {}  # rank -> seq already reported
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True, name="ciuicflow-watchdog")

    def start(self) -> None:
        self._thread.start()

    def poll(self) -> list[dict]:
        """One look at the heartbeats; returns (and reports) new hang alerts."""
        now = self._clock()
        positions = {r: json.loads(v) for r, v in enumerate(self._store.multi_get(self._keys))}
        stalled_for = {}
        for rank, position in positions.items():
            if self._last_seq.get(rank) != position["seq"]:
                self._last_seq[rank], self._since[rank] = position["seq"], now
                self._alerted.pop(rank, None)
            elif not position["closed"] and now - self._since[rank] >= self._timeout:
                stalled_for[rank] = now - self._since[rank]
        alerts = []
        suspects = find_hang_suspects(positions, stalled_for, self._timeout)
        fresh = [r for r in suspects if self._alerted.get(r) != positions[r]["seq"]]
        for rank in fresh:
            self._alerted[rank] = positions[rank]["seq"]
            # where everyone else is, and for how long (the ones waiting on it sit in a collective)
            others = [dict(self._where(r, p), since_s=now - self._since[r])
                      for r, p in sorted(positions.items())
                      if r not in suspects and not p.get("closed")]
            alert = dict(self._where(rank, positions[rank]), type="alert", kind="hang",
                         stalled_s=now - self._since[rank], others=others, time=time.time())
            alerts.append(alert)
            self._on_alert(alert)
        return alerts

    def _where(self, rank: int, position: dict) -> dict:
        info = self._info[rank]
        return {"rank": rank, "node": info["node"], "host": info["host"],
                "step": position["step"], "phase": position["phase"]}

    def _loop(self) -> None:
        failures = 0
        while not self._stop.wait(self._interval):
            try:
                self.poll()
                failures = 0
            except Exception as exc:
                # a store that is gone (its host rank exited) fails every time: give up then
                failures += 1
                log.debug("ciuicflow.monitor: hang watchdog poll failed: %s", exc)
                if failures >= 3:
                    log.debug("ciuicflow.monitor: hang watchdog stopped")
                    return

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)
