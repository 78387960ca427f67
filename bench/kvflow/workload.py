"""The KV-flow benchmark's workload (bench/kvflow): DeepSeek-V3-sized KV-cache requests, their parts in
a seeded payload buffer both sides hold, open-loop and backlogged arrival schedules, the phases of a run."""
from __future__ import annotations

import random

LAYERS = 61                       # DeepSeek-V3
LATENT, ROPE, ELEM = 512, 64, 2    # kv_lora_rank, qk_rope_head_dim, bf16
BYTES_PER_TOKEN = LAYERS * (LATENT + ROPE) * ELEM      # 70,272
BUFFER_BYTES = 48 << 20           # payload parts are slices of one seeded random buffer (both sides have it)


def parse_range(text: str, what: str):
    lo, sep, hi = str(text).partition(":")
    try:
        lo, hi = int(lo), int(hi if sep else lo)
    except ValueError:
        raise ValueError(f"{what} must be TOKENS or LO:HI, got {text!r}") from None
    if not 1 <= lo <= hi:
        raise ValueError(f"{what}: need 1 <= LO <= HI, got {text!r}")
    return lo, hi


def request_bytes(tokens: int) -> int:
    return tokens * BYTES_PER_TOKEN


def request_parts(req: dict, buffer_bytes: int = BUFFER_BYTES):
    """[(offset, nbytes)] of a request's parts in the payload buffer: one part per layer holding the latent and
    the rotary key of every token (576 values, as paged MLA caches store them)."""
    rng = random.Random(req["key"])
    n = req["tokens"] * (LATENT + ROPE) * ELEM
    return [(rng.randrange(0, buffer_bytes - n + 1), n) for _ in range(LAYERS)]


def payload_buffer(seed: int, n: int = BUFFER_BYTES) -> bytes:
    return random.Random(seed).randbytes(n)


def open_loop(rate_Bps: float, load: float, duration: float, high_share: float, high_tokens, low_tokens,
              seed: int, tag: str):
    """Poisson arrivals of both classes over ``duration`` s, time-scaled so that the offered bytes are exactly
    ``load`` x the link rate."""
    rng = random.Random(seed)
    classes = (("high", high_share, high_tokens), ("low", 1.0 - high_share, low_tokens))
    reqs = []
    for priority, share, (lo, hi) in classes:
        if share <= 0:
            continue
        mean = request_bytes((lo + hi) / 2)
        lam = share * load * rate_Bps / mean
        t = rng.expovariate(lam)
        while t < duration:
            reqs.append({"priority": priority, "tokens": rng.randint(lo, hi), "at": t})
            t += rng.expovariate(lam)
    offered = sum(request_bytes(r["tokens"]) for r in reqs)
    scale = offered / (load * rate_Bps * duration)
    for r in reqs:
        r["at"] *= scale
    reqs.sort(key=lambda r: r["at"])
    for i, r in enumerate(reqs):
        r["key"] = f"{tag}/{i}-{r['priority']}"
    return reqs


def backlog(total_bytes: float, tokens, priority: str, seed: int, tag: str):
    rng = random.Random(seed)
    reqs, size = [], 0
    while size < total_bytes:
        n = rng.randint(*tokens)
        reqs.append({"priority": priority, "tokens": n, "at": 0.0, "key": f"{tag}/{len(reqs)}-{priority}"})
        size += request_bytes(n)
    return reqs


def shaped_phases(args, rate_Bps: float) -> list:
    reqs = open_loop(rate_Bps, args.load, args.duration, args.high_share, args.high_range, args.low_range,
                     args.seed, "open")
    phases = []
    for mode in ("flow", "fifo"):
        phases.append({"name": f"open_loop-{mode}", "phase": "open_loop", "mode": mode,
                       "requests": [dict(r, key=f"{mode}/{r['key']}") for r in reqs]})
    if args.saturation_s > 0:
        sat = backlog(rate_Bps * args.saturation_s, args.low_range, "low", args.seed + 1, "sat")
        for mode in ("flow", "fifo"):
            phases.append({"name": f"saturated-{mode}", "phase": "saturated", "mode": mode,
                           "requests": [dict(r, key=f"{mode}/{r['key']}") for r in sat]})
    return phases


def raw_phases(args) -> list:
    reqs = [{"priority": "low", "tokens": args.raw_tokens, "at": 0.0, "key": f"raw/{i}"}
            for i in range(args.raw_requests)]
    phases = []
    for rep in range(args.raw_reps):
        for mode in ("flow", "fifo"):
            phases.append({"name": f"raw-{mode}-{rep}", "phase": "raw_loopback", "mode": mode, "rep": rep,
                           "requests": [dict(r, key=f"{mode}{rep}/{r['key']}") for r in reqs]})
    return phases
