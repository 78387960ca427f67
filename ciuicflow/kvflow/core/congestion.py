"""Per-peer congestion control from per-chunk acknowledgements: pure logic, clock injected.

The model is BBR's (Cardwell et al., "BBR: Congestion-Based Congestion Control", ACM Queue 2016):
  * each acknowledged chunk yields a delivery-rate sample (bytes delivered between the chunk's send and
    its acknowledgement, over that interval) and an RTT sample;
  * the bottleneck bandwidth estimate is the windowed maximum of the rate samples (over ``bw_window_rounds``
    round trips), the propagation delay estimate the windowed minimum RTT (over ``min_rtt_window_s``);
  * sending is paced at ``pacing_gain * btl_bw`` and bytes in flight are capped near
    ``cwnd_gain * btl_bw * min_rtt`` (the bandwidth-delay product), so queues below the sender stay short;
  * modes: STARTUP (gain 2/ln2 until the bandwidth stops growing for 3 rounds), DRAIN (empties the queue
    STARTUP built), PROBE_BW (gain cycle 1.25, 0.75, 1 x 6, one phase per min RTT), PROBE_RTT (every
    ``min_rtt_window_s`` without a new minimum: shrink to ``min_cwnd`` for ``probe_rtt_s`` to re-measure).
  * samples taken while the sender had nothing to send (app-limited) only ever raise the estimate.
  * ack aggregation (as Linux BBR's ``extra_acked``): when acknowledgements arrive in bursts after a
    pause (a busy host, a batching receiver), more is acknowledged in an epoch than ``btl_bw`` explains;
    the windowed maximum of that excess is added to the window, so the sender keeps the pipe full across
    the pause instead of idling on a BDP computed from one quiet, low RTT sample.

The owner calls ``on_send(sn, nbytes)`` when a chunk goes out, ``on_ack(sn)`` when its acknowledgement
(positive or not: the bytes crossed the link either way) comes back, ``on_app_limited()`` when it has
nothing to send, and ``reset()`` when the connection is lost. It asks ``can_send(nbytes)`` (window) and
``send_delay()`` (pacing) before each chunk.
"""
from __future__ import annotations

import collections
import math
import time
from dataclasses import dataclass
from typing import Callable, Deque, Dict, Optional, Tuple

from .chunking import chunk_bytes

STARTUP, DRAIN, PROBE_BW, PROBE_RTT = "startup", "drain", "probe_bw", "probe_rtt"
HIGH_GAIN = 2.0 / math.log(2.0)          # 2.885
PROBE_BW_GAINS = (1.25, 0.75, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0)


@dataclass
class _Sent:
    nbytes: int
    sent_time: float
    delivered: int
    delivered_time: float
    first_sent_time: float
    app_limited: bool


@dataclass
class RateSample:
    rate: float          # bytes/s
    rtt: float           # seconds
    app_limited: bool


class CongestionController:
    def __init__(
        self,
        clock: Callable[[], float] = time.monotonic,
        *,
        chunk_bytes: int = 256 << 10,
        min_cwnd_bytes: Optional[int] = None,
        initial_cwnd_bytes: Optional[int] = None,
        initial_rtt_s: float = 0.001,
        bw_window_rounds: int = 10,
        min_rtt_window_s: float = 10.0,
        probe_rtt_s: float = 0.2,
        pacing_slack_s: float = 0.0005,
        ack_aggregation_max_s: float = 0.1,
        min_cwnd_s: float = 0.0,
    ):
        self.clock = clock
        self.chunk_bytes = int(chunk_bytes)
        self.min_cwnd = int(min_cwnd_bytes if min_cwnd_bytes is not None else 2 * self.chunk_bytes)
        self.initial_cwnd = int(initial_cwnd_bytes if initial_cwnd_bytes is not None else 4 * self.chunk_bytes)
        self.initial_rtt_s = float(initial_rtt_s)
        self.bw_window_rounds = int(bw_window_rounds)
        self.min_rtt_window_s = float(min_rtt_window_s)
        self.probe_rtt_s = float(probe_rtt_s)
        self.pacing_slack_s = float(pacing_slack_s)
        self.extra_acked_max_s = float(ack_aggregation_max_s)   # aggregation term <= btl_bw x this; 0 = off
        self.min_cwnd_s = float(min_cwnd_s)        # > 0: the floor is at most this long of the path (floor)
        self.reset(full=True)

    # ------------------------------------------------------------------ state
    def reset(self, full: bool = False) -> None:
        """Forget what is in flight (connection lost). ``full`` also forgets the path estimates."""
        now = self.clock()
        self._sent: Dict[int, _Sent] = {}
        self.inflight = 0
        self.first_sent_time = now
        self.delivered_time = now
        self.next_send_time = now
        if full:
            self.delivered = 0
            self.round_count = 0
            self.next_round_delivered = 0
            self._bw_samples: Deque[Tuple[int, float]] = collections.deque()
            self.btl_bw = 0.0
            self.min_rtt = math.inf
            self.min_rtt_stamp = now
            self.mode = STARTUP
            self.pacing_gain = HIGH_GAIN
            self.cwnd_gain = HIGH_GAIN
            self.full_bw = 0.0
            self.full_bw_count = 0
            self.filled_pipe = False
            self.cycle_index = 0
            self.cycle_stamp = now
            self.probe_rtt_done_stamp: Optional[float] = None
            self.probe_rtt_round_done = False
            self.app_limited_until = 0
            self.samples = 0
            self.extra_acked = [0, 0]          # windowed max over two 10-round slots
            self.extra_acked_slot = 0
            self.extra_acked_slot_start = 0
        self.ack_epoch_start = now
        self.ack_epoch_acked = 0

    # ------------------------------------------------------------------ derived quantities
    @property
    def bdp(self) -> float:
        if self.btl_bw <= 0 or not math.isfinite(self.min_rtt):
            return float(self.initial_cwnd)
        return self.btl_bw * self.min_rtt

    @property
    def floor(self) -> int:
        """The smallest window: ``min_cwnd``; with ``min_cwnd_s``, once the bandwidth is measured, no more
        than that long of the path (and at least two of its chunks). A floor sized for a fast link (2 MiB
        is 170 ms of 100 Mbit/s) is 840 ms of a 20 Mbit/s link: bulk bytes in flight, in socket buffers
        and the link's queue, that a high-priority chunk picked next still waits behind."""
        if self.min_cwnd_s <= 0 or self.btl_bw <= 0:
            return self.min_cwnd
        two_chunks = 2 * chunk_bytes(self.btl_bw, self.chunk_bytes, self.min_cwnd)
        return int(max(two_chunks, min(self.min_cwnd, self.btl_bw * self.min_cwnd_s)))

    @property
    def cwnd(self) -> int:
        if self.mode == PROBE_RTT:
            return self.floor
        if self.btl_bw <= 0 or not math.isfinite(self.min_rtt):
            return max(self.initial_cwnd, self.min_cwnd)
        target = self.cwnd_gain * self.bdp + self.aggregation
        if self.mode == STARTUP:
            target = max(target, self.initial_cwnd)
        return int(max(target, self.floor))

    @property
    def aggregation(self) -> float:
        """Bytes the window carries on top of the BDP to cover bursty acknowledgements."""
        if self.btl_bw <= 0 or not self.filled_pipe:
            return 0.0
        return min(max(self.extra_acked), self.btl_bw * self.extra_acked_max_s)

    @property
    def pacing_rate(self) -> float:
        initial = HIGH_GAIN * self.initial_cwnd / max(self.initial_rtt_s, 1e-6)
        if self.btl_bw <= 0:
            return initial
        rate = self.pacing_gain * self.btl_bw
        if not self.filled_pipe:
            # As Linux BBR: the pacing rate does not fall during STARTUP, so one early sample of a tiny,
            # app-limited chunk cannot stall the sender.
            rate = max(rate, initial)
        return rate

    # ------------------------------------------------------------------ the sender asks
    def can_send(self, nbytes: int) -> bool:
        """Window check: always lets one chunk out when nothing is in flight."""
        return self.inflight == 0 or self.inflight + nbytes <= self.cwnd

    def send_delay(self) -> float:
        """Seconds to wait before the next chunk may leave (pacing); 0 = now."""
        delay = self.next_send_time - self.clock()
        return delay if delay > self.pacing_slack_s else 0.0

    # ------------------------------------------------------------------ events
    def on_app_limited(self) -> None:
        """The sender has nothing to send although the window allows it."""
        self.app_limited_until = max(self.delivered + self.inflight, 1)

    def on_send(self, sn: int, nbytes: int) -> None:
        now = self.clock()
        if self.inflight == 0:
            self.first_sent_time = now
            self.delivered_time = now
        app_limited = self.app_limited_until > self.delivered
        if not app_limited:
            self.app_limited_until = 0
        self._sent[sn] = _Sent(nbytes, now, self.delivered, self.delivered_time, self.first_sent_time, app_limited)
        self.inflight += nbytes
        gap = nbytes / self.pacing_rate
        if math.isfinite(self.min_rtt):
            # One chunk's gap never exceeds two round trips (a round trip includes sending a chunk): a
            # stale, low estimate slows the sender, it does not stop it.
            gap = min(gap, 2 * max(self.min_rtt, 1e-3))
        # A sender woken late (timer slack on a busy host) may catch up by up to one gap, so oversleeping
        # does not lower the rate below the pacing rate; the burst stays bounded to two chunks.
        self.next_send_time = max(self.next_send_time, now - gap) + gap

    def on_ack(self, sn: int) -> Optional[RateSample]:
        """An acknowledgement (of any kind) for send number ``sn``; returns the sample it gave."""
        p = self._sent.pop(sn, None)
        if p is None:
            return None
        now = self.clock()
        self.inflight -= p.nbytes
        self.delivered += p.nbytes
        self.delivered_time = now
        round_start = False
        if p.delivered >= self.next_round_delivered:
            self.next_round_delivered = self.delivered
            self.round_count += 1
            round_start = True
        self.first_sent_time = p.sent_time
        send_elapsed = p.sent_time - p.first_sent_time
        ack_elapsed = now - p.delivered_time
        interval = max(send_elapsed, ack_elapsed)
        rtt = max(now - p.sent_time, 1e-7)
        rate = (self.delivered - p.delivered) / interval if interval > 0 else 0.0
        sample = RateSample(rate, rtt, p.app_limited)
        self.samples += 1
        self._update_bw(sample)
        self._update_ack_aggregation(p.nbytes, now, round_start)
        self._update_min_rtt(sample, now)
        if round_start:
            self._check_full_pipe(sample)
        self._update_mode(now, round_start)
        return sample

    # ------------------------------------------------------------------ model updates
    def _update_bw(self, s: RateSample) -> None:
        if s.rate <= 0:
            return
        if s.app_limited and s.rate < self.btl_bw:
            return
        # Windowed max as a monotonic queue (rates decreasing from the left): a sample that a newer, larger
        # one outlives can never be the max again. O(1) per ack instead of a scan of 10 rounds of samples.
        while self._bw_samples and self._bw_samples[-1][1] <= s.rate:
            self._bw_samples.pop()
        self._bw_samples.append((self.round_count, s.rate))
        horizon = self.round_count - self.bw_window_rounds
        while self._bw_samples[0][0] < horizon:
            self._bw_samples.popleft()
        self.btl_bw = self._bw_samples[0][1]

    def _update_ack_aggregation(self, nbytes: int, now: float, round_start: bool) -> None:
        if round_start and self.round_count - self.extra_acked_slot_start >= self.bw_window_rounds:
            self.extra_acked_slot ^= 1
            self.extra_acked_slot_start = self.round_count
            self.extra_acked[self.extra_acked_slot] = 0
        if self.btl_bw <= 0:
            return
        expected = self.btl_bw * (now - self.ack_epoch_start)
        if self.ack_epoch_acked <= expected:
            # Acks are no faster than the model: start a new epoch.
            self.ack_epoch_start = now
            self.ack_epoch_acked = 0
        self.ack_epoch_acked += nbytes
        extra = self.ack_epoch_acked - self.btl_bw * (now - self.ack_epoch_start)
        slot = self.extra_acked_slot
        if extra > self.extra_acked[slot]:
            self.extra_acked[slot] = extra

    def _update_min_rtt(self, s: RateSample, now: float) -> None:
        if s.rtt <= self.min_rtt:
            self.min_rtt = s.rtt
            self.min_rtt_stamp = now

    def _check_full_pipe(self, s: RateSample) -> None:
        if self.filled_pipe or s.app_limited:
            return
        if self.btl_bw >= self.full_bw * 1.25:
            self.full_bw = self.btl_bw
            self.full_bw_count = 0
            return
        self.full_bw_count += 1
        if self.full_bw_count >= 3:
            self.filled_pipe = True

    def _enter_probe_bw(self, now: float) -> None:
        self.mode = PROBE_BW
        self.pacing_gain = 1.0
        self.cwnd_gain = 2.0
        self.cycle_index = 2          # start cruising; deterministic
        self.cycle_stamp = now

    def _update_mode(self, now: float, round_start: bool) -> None:
        if self.mode == STARTUP and self.filled_pipe:
            self.mode = DRAIN
            self.pacing_gain = 1.0 / HIGH_GAIN
            self.cwnd_gain = HIGH_GAIN
        if self.mode == DRAIN and self.inflight <= max(self.bdp, self.chunk_bytes):
            self._enter_probe_bw(now)
        if self.mode == PROBE_BW:
            phase = max(self.min_rtt, 1e-4) if math.isfinite(self.min_rtt) else self.initial_rtt_s
            if now - self.cycle_stamp > phase:
                self.cycle_index = (self.cycle_index + 1) % len(PROBE_BW_GAINS)
                self.cycle_stamp = now
                self.pacing_gain = PROBE_BW_GAINS[self.cycle_index]
        # PROBE_RTT: the minimum has not been refreshed for a whole window.
        if self.mode != PROBE_RTT and math.isfinite(self.min_rtt) and now - self.min_rtt_stamp > self.min_rtt_window_s:
            self.mode = PROBE_RTT
            self.pacing_gain = 1.0
            self.cwnd_gain = 1.0
            self.probe_rtt_done_stamp = None
            self.min_rtt = math.inf          # re-measure from the samples taken now
        if self.mode == PROBE_RTT:
            if self.probe_rtt_done_stamp is None and self.inflight <= self.floor:
                self.probe_rtt_done_stamp = now + self.probe_rtt_s
                self.probe_rtt_round_done = False
                self._probe_rtt_round = self.round_count
            elif self.probe_rtt_done_stamp is not None:
                if self.round_count > self._probe_rtt_round:
                    self.probe_rtt_round_done = True
                if self.probe_rtt_round_done and now >= self.probe_rtt_done_stamp:
                    self.min_rtt_stamp = now
                    if not math.isfinite(self.min_rtt):
                        self.min_rtt = self.initial_rtt_s
                    if self.filled_pipe:
                        self._enter_probe_bw(now)
                    else:
                        self.mode = STARTUP
                        self.pacing_gain = HIGH_GAIN
                        self.cwnd_gain = HIGH_GAIN

    def snapshot(self) -> dict:
        return {
            "mode": self.mode,
            "btl_bw_bytes_per_s": self.btl_bw,
            "min_rtt_s": self.min_rtt if math.isfinite(self.min_rtt) else None,
            "pacing_rate_bytes_per_s": self.pacing_rate,
            "cwnd_bytes": self.cwnd,
            "inflight_bytes": self.inflight,
            "delivered_bytes": self.delivered,
            "rounds": self.round_count,
            "aggregation_bytes": self.aggregation,
        }
