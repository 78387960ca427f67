"""KV-flow benchmark: what flow control buys when KV caches share a link, and what the sidecar costs.

1. Shaped link. Two sidecars, prefill0 and decode0, on two simulated nodes (network namespaces) joined by a
   link shaped with tc tbf (ciuicflow/cluster.py). Beside each runs a client process: the sender replays an
   open-loop arrival schedule of KV-cache transfers sized from DeepSeek-V3's real footprint (61 layers x
   (kv_lora_rank 512 + qk_rope_head_dim 64) x 2 bytes = 70,272 bytes per token; each request is sent as 61
   parts, one per layer, as a paged MLA cache holds them), the receiver collects every transfer layer by layer and checks
   its bytes. Short high-priority requests and long low-priority ones arrive at ~80% of the link rate. The
   same schedule runs with ``x-ciuic-flow: enabled`` (mode "flow") and without it (mode "fifo"), then each
   mode once more with a backlog (every request at t=0, phase "saturated") to measure goodput at full load.
   Per class: p50/p99/max transfer latency (arrival -> last layer at the decode client) and time to first
   layer, goodput (payload bytes delivered per second) and link utilisation (bytes on the veth, per second,
   over the rate).
2. Raw throughput on loopback (no shaping): the same bytes through the two sidecars (flow and fifo) and
   through a plain gRPC stream (a minimal streaming service written here: one stream per request, one
   message per layer part, straight from sender to receiver - what a naive connector does). All requests
   are issued at once. ciuicflow: from the phase's start (the sender issues every send) until the receiving
   process holds, and has compared with what was sent, the last part of every request; its clients hand the
   bytes to their own sidecar in shared memory when they can (same host), and the sidecar-to-sidecar hop is
   gRPC over TCP on 127.0.0.1. Plain gRPC: from the first request issued until the receiving server has
   answered for every stream (it answers once it holds all of a stream's bytes and has compared each
   message with what was sent, as ciuicflow's receiver does).
   Throughput = payload bytes / that time; best of --raw-reps. --raw-only runs just this part.

Writes a list of records as JSON (--json), a markdown table and a PNG latency chart next to it.

    python bench/kvflow.py                                  # 100 Mbit/s link, 40 s of arrivals per mode
    python bench/kvflow.py --smoke --json out/kvflow.json   # CI: well under a minute
    python bench/kvflow.py --rate 400mbit --duration 60 --load 0.8 --check-targets

Needs root for namespaces and tc; without them the link is emulated on loopback by the receiving sidecar's
--link-rate, and every output says so (NOT tc-shaped).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import random
import shlex
import struct
import subprocess
import sys
import tempfile
import threading
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

LAYERS = 61                       # DeepSeek-V3
LATENT, ROPE, ELEM = 512, 64, 2    # kv_lora_rank, qk_rope_head_dim, bf16
BYTES_PER_TOKEN = LAYERS * (LATENT + ROPE) * ELEM      # 70,272
BUFFER_BYTES = 48 << 20           # payload parts are slices of one seeded random buffer (both sides have it)
WARMUP_PART = 144 << 10           # warm-up transfers: 61 x 144 KiB = 9 MB, past an 8 MiB ring (its pages all touched)
PEER_PORT = 50152

SMOKE = dict(rate="100mbit", duration=6.0, high_tokens="8:32", low_tokens="128:384", saturation_s=2.5,
             raw_requests=4, raw_tokens=128, raw_reps=3, timeout=120.0)


# ---------------------------------------------------------------------- workload
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


# ---------------------------------------------------------------------- worker processes (sender, receiver)
def _wait_file(path: str, timeout: float) -> str:
    deadline = time.monotonic() + timeout
    while True:
        try:
            with open(path) as fh:
                text = fh.read()
            if text.endswith("\n"):
                return text
        except FileNotFoundError:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} did not appear within {timeout:g}s")
        time.sleep(0.01)


def _write(path: str, text: str) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as fh:
        fh.write(text if text.endswith("\n") else text + "\n")
    os.replace(tmp, path)


def _sleep_until(t: float) -> None:
    while True:
        d = t - time.monotonic()
        if d <= 0:
            return
        time.sleep(min(d, 0.05))


def sender_worker(plan: dict, api: str, sync: str) -> None:
    from ciuicflow.kvflow import Client, KVFlowError
    buf = memoryview(payload_buffer(plan["seed"]))
    clients = {"flow": Client(api, flow=True), "fifo": Client(api, flow=False)}
    for c in clients.values():
        c.wait_ready(60)
    # Connect the sidecars' peer link before any clock starts (the plain gRPC client, too, connects first),
    # with enough bytes (61 layers of 144 KiB) for the link's controller to measure its rate, as it has in a
    # sidecar that has been running for a while; as many transfers at once as a phase has (raw loopback),
    # so that the clients hold the shared-memory rings a long-running server would have (see _RingPool).
    warm = [clients["flow"].send(plan["dest"], f"__warmup__{i}", [bytes(WARMUP_PART)] * LAYERS)
            for i in range(plan.get("warmup_transfers", 1))]
    for handle in warm:
        handle.wait(plan["timeout"])
    for phase in plan["phases"]:
        name = phase["name"]
        _write(os.path.join(sync, f"{name}.sender.ready"), "ready")
        t0 = float(_wait_file(os.path.join(sync, f"{name}.go"), plan["timeout"]))
        client = clients[phase["mode"]]
        out = {}
        waiters = []

        def wait(req, handle):
            rec = out[req["key"]]
            try:
                r = handle.wait(plan["timeout"])
                rec.update(done=time.monotonic(), bytes=r.bytes, chunks=r.chunks, retransmits=r.retransmits)
            except (KVFlowError, TimeoutError) as exc:
                rec.update(done=None, error=str(exc))

        for req in phase["requests"]:
            _sleep_until(t0 + req["at"])
            submitted = time.monotonic()
            parts = [buf[off:off + n] for off, n in request_parts(req)]
            out[req["key"]] = {"submitted": submitted}
            try:
                handle = client.send(plan["dest"], req["key"], parts, priority=req["priority"])
            except Exception as exc:  # noqa: BLE001 - recorded as a lost transfer
                out[req["key"]].update(done=None, error=f"send: {exc}")
                continue
            th = threading.Thread(target=wait, args=(req, handle), daemon=True)
            th.start()
            waiters.append(th)
        for th in waiters:
            th.join()
        try:    # the sending sidecar's view of the link (controller state, memory peaks) for the record
            out["__sidecar__"] = client.stats()["peers"].get(plan["dest"], {})
        except KVFlowError as exc:
            out["__sidecar__"] = {"error": str(exc)}
        _write(os.path.join(sync, f"{name}.sender.json"), json.dumps(out))


def _memcmp_equal(buf: bytes):
    """same(off, value): whether ``value`` equals ``buf[off:off + len(value)]``, by one memcmp (slicing
    bytes copies the slice first; a memoryview compares item by item, 40x slower)."""
    import ctypes
    memcmp = ctypes.CDLL(None).memcmp
    memcmp.argtypes = (ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t)
    memcmp.restype = ctypes.c_int
    base = ctypes.cast(ctypes.c_char_p(buf), ctypes.c_void_p).value

    def same(off: int, value: bytes) -> bool:
        if off < 0 or off + len(value) > len(buf):
            return False
        return memcmp(base + off, ctypes.c_char_p(value), len(value)) == 0
    return same


def receiver_worker(plan: dict, api: str, sync: str) -> None:
    from ciuicflow.kvflow import Client
    buf = payload_buffer(plan["seed"])
    same = _memcmp_equal(buf)
    client = Client(api)
    client.wait_ready(60)
    warm = [threading.Thread(target=client.recv, args=(f"__warmup__{i}",), kwargs={"timeout_s": plan["timeout"]})
            for i in range(plan.get("warmup_transfers", 1))]
    for th in warm:
        th.start()
    for th in warm:
        th.join()
    for phase in plan["phases"]:
        name = phase["name"]
        _write(os.path.join(sync, f"{name}.receiver.ready"), "ready")
        t0 = float(_wait_file(os.path.join(sync, f"{name}.go"), plan["timeout"]))
        out = {}

        def receive(req):
            expected = request_parts(req)
            rec = out[req["key"]] = {"first_layer": None, "last": None, "bytes": 0, "ok": False}
            _sleep_until(t0 + req["at"] - 0.05)
            try:
                n = 0
                for part in client.recv_stream(req["key"], timeout_s=plan["timeout"]):
                    off, size = expected[part.index]
                    if part.nbytes != size or not same(off, bytes(part.value)):
                        raise ValueError(f"part {part.index} differs from what was sent")
                    n += 1
                    rec["bytes"] += size
                    if n == 1:      # layer 0
                        rec["first_layer"] = time.monotonic()
                rec["last"] = time.monotonic()
                rec["ok"] = n == len(expected)
                if not rec["ok"]:
                    rec["error"] = f"{n} of {len(expected)} parts"
            except Exception as exc:  # noqa: BLE001 - recorded as a lost transfer
                rec["error"] = str(exc)

        threads = [threading.Thread(target=receive, args=(req,), daemon=True) for req in phase["requests"]]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        _write(os.path.join(sync, f"{name}.receiver.json"), json.dumps(out))


# ---------------------------------------------------------------------- plain gRPC baseline
PLAIN_METHOD = "/bench.PlainKV/Push"
GRPC_OPTIONS = [("grpc.max_receive_message_length", 64 << 20), ("grpc.max_send_message_length", 64 << 20)]


def plain_server(port_file: str, seed: int) -> None:
    """A minimal streaming service: each request stream is one transfer, one message per part, bytes held
    in memory until the stream ends (as a decode server would) and compared with what was sent (as
    ciuicflow's receiving worker does), answered with the byte count."""
    from concurrent.futures import ThreadPoolExecutor
    import grpc
    same = _memcmp_equal(payload_buffer(seed))

    def push(request_iterator, context):
        md = dict(context.invocation_metadata())
        expected = request_parts({"key": md.get("x-key", ""), "tokens": int(md.get("x-tokens", 0))})
        held = []
        for msg in request_iterator:
            if len(held) >= len(expected) or len(msg) != expected[len(held)][1] or not same(expected[len(held)][0], msg):
                context.abort(grpc.StatusCode.DATA_LOSS, f"part {len(held)} differs from what was sent")
            held.append(msg)
        return struct.pack("<Q", sum(len(m) for m in held))

    server = grpc.server(ThreadPoolExecutor(max_workers=32), options=GRPC_OPTIONS)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
        "bench.PlainKV", {"Push": grpc.stream_unary_rpc_method_handler(push)}),))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    _write(port_file, str(port))
    server.wait_for_termination()


def plain_client(address: str, requests, seed: int) -> dict:
    import grpc
    buf = memoryview(payload_buffer(seed))
    channel = grpc.insecure_channel(address, options=GRPC_OPTIONS)
    grpc.channel_ready_future(channel).result(timeout=60)
    push = channel.stream_unary(PLAIN_METHOD)
    cpu0 = time.process_time()
    t0 = time.monotonic()
    futures = []
    for req in requests:
        parts = request_parts(req)
        futures.append(push.future((bytes(buf[off:off + n]) for off, n in parts),
                                   metadata=(("x-key", req["key"]), ("x-tokens", str(req["tokens"])))))
    total = sum(struct.unpack("<Q", f.result())[0] for f in futures)
    seconds = time.monotonic() - t0
    cpu = time.process_time() - cpu0
    channel.close()
    expected = sum(request_bytes(r["tokens"]) for r in requests)
    return {"bytes": total, "expected": expected, "seconds": seconds, "client_cpu_s": cpu}


def worker_main(argv) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--worker", required=True, choices=("sender", "receiver", "plain-server", "plain-client"))
    p.add_argument("--plan")
    p.add_argument("--api")
    p.add_argument("--sync")
    p.add_argument("--port-file")
    p.add_argument("--address")
    p.add_argument("--out")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    if a.worker == "plain-server":
        plain_server(a.port_file, a.seed)
        return 0
    with open(a.plan) as fh:
        plan = json.load(fh)
    if a.worker == "sender":
        sender_worker(plan, a.api, a.sync)
    elif a.worker == "receiver":
        receiver_worker(plan, a.api, a.sync)
    else:
        _write(a.out, json.dumps(plain_client(a.address, plan["phases"][0]["requests"], plan["seed"])))
    return 0


# ---------------------------------------------------------------------- orchestration
class Testbed:
    """Two sidecars with a sender process beside prefill0 and a receiver process beside decode0."""

    def __init__(self, name, workdir, launches, listens, sidecar_args=((), ()), link_bytes=None):
        from ciuicflow.kvflow.sidecar.process import SidecarProcess
        self.name = name
        self.dir = os.path.join(workdir, name)
        os.makedirs(self.dir, exist_ok=True)
        self.launch = launches
        self.link_bytes = link_bytes or (lambda: None)
        self.sidecars = [
            SidecarProcess("prefill0", listens[0], {"decode0": listens[1]},
                           os.path.join(self.dir, "sidecar-prefill0.log"), args=sidecar_args[0], launch=launches[0]),
            SidecarProcess("decode0", listens[1], {"prefill0": listens[0]},
                           os.path.join(self.dir, "sidecar-decode0.log"), args=sidecar_args[1], launch=launches[1]),
        ]
        self.workers = []
        self.sync = os.path.join(self.dir, "sync")

    def start_sidecars(self):
        for sc in self.sidecars:
            sc.start()

    def start_workers(self, plan: dict, timeout: float):
        for sc in self.sidecars:
            sc.wait_ready(timeout)
        plan_path = os.path.join(self.dir, "plan.json")
        with open(plan_path, "w") as fh:
            json.dump(plan, fh)
        os.makedirs(self.sync, exist_ok=True)
        for k, role in ((0, "sender"), (1, "receiver")):
            log = open(os.path.join(self.dir, f"{role}.log"), "wb")
            argv = [sys.executable, os.path.abspath(__file__), "--worker", role, "--plan", plan_path,
                    "--api", self.sidecars[k].api, "--sync", self.sync]
            self.workers.append((role, self.launch[k](argv, stdout=log, stderr=subprocess.STDOUT,
                                                      stdin=subprocess.DEVNULL), log))

    def _check_workers(self):
        for role, proc, _ in self.workers:
            if proc.poll() not in (None, 0):
                raise RuntimeError(f"{self.name}: {role} process exited with {proc.returncode}:\n"
                                   f"{_tail(os.path.join(self.dir, role + '.log'))}")

    def _wait(self, path: str, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        while True:
            try:
                return _wait_file(path, 0.2)
            except TimeoutError:
                self._check_workers()
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{self.name}: {os.path.basename(path)} not written within {timeout:g}s "
                                       f"(see {self.dir})") from None

    def run_phase(self, phase: dict, timeout: float) -> dict:
        name = phase["name"]
        for role in ("sender", "receiver"):
            self._wait(os.path.join(self.sync, f"{name}.{role}.ready"), timeout)
        before = self.link_bytes()
        pids = {f"sidecar {sc.name}": sc.proc.pid for sc in self.sidecars}
        pids.update({role: proc.pid for role, proc, _ in self.workers})
        cpu_before = {role: cpu_seconds(pid) for role, pid in pids.items()}
        t0 = time.monotonic() + 0.3
        _write(os.path.join(self.sync, f"{name}.go"), repr(t0))
        sent = json.loads(self._wait(os.path.join(self.sync, f"{name}.sender.json"), timeout))
        received = json.loads(self._wait(os.path.join(self.sync, f"{name}.receiver.json"), timeout))
        after = self.link_bytes()
        # per process; includes the workers' wait for "go" (a 10 ms poll)
        cpu = {role: cpu_seconds(pid) - cpu_before[role] for role, pid in pids.items()}
        link = None
        if before is not None and after is not None:
            link = after[0][0] - before[0][0]      # bytes out of node 0 onto its veth
        return {"t0": t0, "sent": sent, "received": received, "link_tx_bytes": link, "cpu_s": sum(cpu.values()),
                "cpu_s_by_process": cpu,
                "sidecar": sent.pop("__sidecar__", None)}

    def stop_workers(self):
        for role, proc, fh in self.workers:
            if proc.poll() is None:
                proc.kill()
                try:
                    proc.wait(10)
                except subprocess.TimeoutExpired:
                    pass
            fh.close()
        self.workers = []


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds used so far by a process (Linux /proc; 0 once it is gone)."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            fields = fh.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")     # utime, stime (ticks)
    except (OSError, IndexError, ValueError):
        return 0.0


def _tail(path: str, n: int = 2500) -> str:
    try:
        with open(path, errors="replace") as fh:
            return fh.read()[-n:]
    except FileNotFoundError:
        return ""


def _host_launch(argv, **kwargs):
    from ciuicflow.kvflow.sidecar.process import child_env
    return subprocess.Popen(argv, cwd=REPO, env=child_env(), start_new_session=True, **kwargs)


# ---------------------------------------------------------------------- statistics
def percentile(values, q: float):
    """Nearest-rank percentile (with fewer than 100 samples p99 is the maximum)."""
    if not values:
        return None
    s = sorted(values)
    return s[max(0, math.ceil(q * len(s)) - 1)]


def phase_records(phase: dict, result: dict, base: dict) -> list:
    t0 = result["t0"]
    rows = {}
    ends = []
    for req in phase["requests"]:
        s = result["sent"].get(req["key"], {})
        r = result["received"].get(req["key"], {})
        arrival = t0 + req["at"]
        ok = bool(r.get("ok")) and s.get("done") is not None and r.get("bytes") == request_bytes(req["tokens"])
        row = {"priority": req["priority"], "ok": ok, "bytes": request_bytes(req["tokens"]),
               "latency": (r["last"] - arrival) if ok else None,
               "ttfl": (r["first_layer"] - arrival) if ok and r.get("first_layer") else None,
               "sender_latency": (s["done"] - arrival) if s.get("done") else None,
               "submit_lag": (s["submitted"] - arrival) if s.get("submitted") else None,
               "error": s.get("error") or r.get("error")}
        rows.setdefault(req["priority"], []).append(row)
        if ok:
            ends.append(r["last"])
    window = (max(ends) - t0) if ends else None
    out = []
    all_rows = [row for group in rows.values() for row in group]
    groups = list(rows.items()) + ([("all", all_rows)] if len(rows) > 1 else [])
    for priority, group in groups:
        lat = [x["latency"] for x in group if x["latency"] is not None]
        ttfl = [x["ttfl"] for x in group if x["ttfl"] is not None]
        delivered = sum(x["bytes"] for x in group if x["ok"])
        rec = dict(base)
        rec.update({
            "priority": priority, "aggregate": priority == "all", "requests": len(group), "lost": sum(1 for x in group if not x["ok"]),
            "p50_s": percentile(lat, 0.50), "p99_s": percentile(lat, 0.99), "max_s": max(lat) if lat else None,
            "ttfl_p50_s": percentile(ttfl, 0.50), "ttfl_p99_s": percentile(ttfl, 0.99),
            "ttfl_max_s": max(ttfl) if ttfl else None,
            "bytes": delivered, "window_s": window,
            "goodput_bytes_per_s": delivered / window if window else 0.0,
            "link_bytes_per_s": (result["link_tx_bytes"] / window) if window and result["link_tx_bytes"] else None,
            "max_submit_lag_s": max((x["submit_lag"] for x in group if x["submit_lag"] is not None), default=None),
            "latencies_s": sorted(lat),
            "errors": sorted({x["error"] for x in group if x["error"]})[:5],
            "sender_sidecar": result.get("sidecar"),
            "cpu_s": result.get("cpu_s"),
            "cpu_s_by_process": result.get("cpu_s_by_process"),
        })
        rate = rec.get("link_rate_bytes_per_s")
        rec["link_utilisation"] = (rec["link_bytes_per_s"] / rate) if rate and rec["link_bytes_per_s"] else None
        rec["goodput_fraction_of_link"] = (rec["goodput_bytes_per_s"] / rate) if rate else None
        out.append(rec)
    return out


# ---------------------------------------------------------------------- the run
def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--rate", default="100mbit", help="link rate between the two nodes (tc tbf), e.g. 100mbit")
    p.add_argument("--load", type=float, default=0.8, help="offered load as a fraction of the link rate (0.8)")
    p.add_argument("--duration", type=float, default=40.0, help="seconds of open-loop arrivals per mode (40)")
    p.add_argument("--high-share", type=float, default=0.25, help="fraction of offered bytes that is high priority")
    p.add_argument("--high-tokens", default="8:64", help="prompt tokens of a high-priority request, LO:HI")
    p.add_argument("--low-tokens", default="128:512", help="prompt tokens of a low-priority request, LO:HI")
    p.add_argument("--saturation-s", type=float, default=6.0,
                   help="backlogged phase: this many seconds of link time queued at t=0 (0: skip)")
    p.add_argument("--raw-requests", type=int, default=8, help="loopback throughput: requests sent at once")
    p.add_argument("--raw-tokens", type=int, default=256, help="loopback throughput: tokens per request")
    p.add_argument("--raw-reps", type=int, default=3, help="loopback throughput: repetitions (best counts)")
    p.add_argument("--chunk-size", default="256KiB", help="sidecar chunk size")
    p.add_argument("--sidecar-args", default="", help="extra flags for both sidecars, e.g. \"--min-cwnd 1MiB\"")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--smoke", action="store_true", help="short configuration for CI (well under a minute)")
    p.add_argument("--json", metavar="PATH", help="records as JSON (default OUT_DIR/kvflow.json)")
    p.add_argument("--out-dir", help="markdown and PNG go here (default: the --json folder, else out/kvflow)")
    p.add_argument("--no-png", action="store_true")
    p.add_argument("--loopback", action="store_true",
                   help="no namespaces: emulate the link with the receiving sidecar's --link-rate (NOT tc-shaped)")
    p.add_argument("--require-netns", action="store_true", help="fail instead of falling back to loopback")
    p.add_argument("--skip-raw", action="store_true", help="skip the loopback throughput comparison")
    p.add_argument("--raw-only", action="store_true",
                   help="only the loopback throughput comparison (no shaped link, no namespaces)")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds for any one phase")
    p.add_argument("--check-targets", action="store_true", help="exit 1 if a target is missed")
    if "--smoke" in (sys.argv[1:] if argv is None else argv):
        p.set_defaults(**SMOKE)         # smoke sizes, unless given explicitly
    args = p.parse_args(argv)
    if args.raw_only and args.skip_raw:
        p.error("--raw-only and --skip-raw exclude each other")
    from ciuicflow.cluster import parse_rate
    try:
        args.rate_bps = parse_rate(args.rate)
        args.high_range = parse_range(args.high_tokens, "--high-tokens")
        args.low_range = parse_range(args.low_tokens, "--low-tokens")
    except ValueError as exc:
        p.error(str(exc))
    if not 0 < args.load <= 1.5 or not 0 <= args.high_share <= 1 or args.duration <= 0:
        p.error("need 0 < --load <= 1.5, 0 <= --high-share <= 1, --duration > 0")
    if max(args.high_range[1], args.low_range[1], args.raw_tokens) * (LATENT + ROPE) * ELEM > BUFFER_BYTES:
        p.error("requests too long for the payload buffer")
    out_dir = args.out_dir or (os.path.dirname(os.path.abspath(args.json)) if args.json else "out/kvflow")
    args.out_dir = out_dir
    args.json = args.json or os.path.join(out_dir, "kvflow.json")
    return args


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


class PlainServer:
    """The plain gRPC receiving process (started early: it imports grpc while the sidecars start)."""

    def __init__(self, workdir: str, seed: int):
        self.dir = os.path.join(workdir, "plain")
        os.makedirs(self.dir, exist_ok=True)
        self.port_file = os.path.join(self.dir, "port")
        self._log = open(os.path.join(self.dir, "server.log"), "wb")
        self.proc = _host_launch([sys.executable, os.path.abspath(__file__), "--worker", "plain-server",
                                  "--port-file", self.port_file, "--seed", str(seed)], stdout=self._log, stderr=subprocess.STDOUT)

    def run_once(self, args, requests, rep: int) -> dict:
        """The plain client process sends the same bytes once; its measurement."""
        plan = os.path.join(self.dir, "plan.json")
        with open(plan, "w") as fh:
            json.dump({"seed": args.seed, "phases": [{"requests": requests}]}, fh)
        port = int(_wait_file(self.port_file, 120))
        out = os.path.join(self.dir, f"client-{rep}.json")
        log_path = os.path.join(self.dir, f"client-{rep}.log")
        server_cpu = cpu_seconds(self.proc.pid)
        with open(log_path, "wb") as fh:
            rc = _host_launch([sys.executable, os.path.abspath(__file__), "--worker", "plain-client",
                               "--plan", plan, "--address", f"127.0.0.1:{port}", "--out", out],
                              stdout=fh, stderr=subprocess.STDOUT).wait(args.timeout)
        if rc != 0:
            raise RuntimeError(f"plain gRPC client failed ({rc}):\n{_tail(log_path)}")
        with open(out) as fh:
            result = json.load(fh)
        result["cpu_s_by_process"] = {"client": result["client_cpu_s"],
                                      "server": cpu_seconds(self.proc.pid) - server_cpu}
        result["cpu_s"] = sum(result["cpu_s_by_process"].values())
        return result

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self._log.close()


def main(argv=None) -> int:
    if argv is None:
        argv = sys.argv[1:]
    if "--worker" in argv:
        return worker_main(argv)
    args = parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    started = time.monotonic()

    def log(msg):
        print(f"[kvflow-bench {time.monotonic() - started:6.1f}s] {msg}", file=sys.stderr, flush=True)

    from ciuicflow.cluster import SimCluster, format_rate
    workdir = tempfile.mkdtemp(prefix="ciuicflow-kvbench-")
    rate_Bps = args.rate_bps / 8
    records = []
    cluster = None if args.raw_only else SimCluster(
        nodes=2, ranks_per_node=1, rate=f"{int(args.rate_bps)}bit", require_netns=args.require_netns,
        loopback=args.loopback, log=log)
    testbeds = []
    plain_server = None
    shaped = None
    try:
        chunk = ["--chunk-size", str(args.chunk_size)] + shlex.split(args.sidecar_args)
        if cluster is not None:
            cluster.start()
        if cluster is None:
            testbed_line = "raw loopback throughput only (--raw-only): no shaped link"
        elif cluster.netns:
            shaped = Testbed("shaped", workdir,
                             (lambda argv, **kw: cluster.popen(0, argv, **kw),
                              lambda argv, **kw: cluster.popen(1, argv, **kw)),
                             (f"{cluster.node_addr(0)}:{PEER_PORT}", f"{cluster.node_addr(1)}:{PEER_PORT}"),
                             (chunk, chunk), link_bytes=cluster.link_bytes)
            testbed_line = (f"2 network-namespace nodes, link shaped to {format_rate(args.rate_bps)} with tc tbf "
                            f"(ciuicflow/cluster.py); bytes on the wire from node 0's veth counters")
        else:
            shaped = Testbed("shaped", workdir, (_host_launch, _host_launch),
                             (f"127.0.0.1:{_free_port()}", f"127.0.0.1:{_free_port()}"),
                             (chunk, chunk + ["--link-rate", str(int(rate_Bps))]))
            testbed_line = (f"!!! NOT tc-shaped ({cluster.fallback_reason or 'loopback requested'}): loopback, link "
                            f"emulated by decode0's --link-rate {format_rate(args.rate_bps)}; bytes on the wire not "
                            "measured !!!")
        if shaped is not None:
            testbeds.append(shaped)
        raw = None
        if not args.skip_raw:
            raw = Testbed("raw", workdir, (_host_launch, _host_launch),
                          (f"127.0.0.1:{_free_port()}", f"127.0.0.1:{_free_port()}"), (chunk, chunk))
            testbeds.append(raw)
        log(testbed_line)
        for tb in testbeds:
            tb.start_sidecars()
        if raw is not None:
            plain_server = PlainServer(workdir, args.seed)
        phases = shaped_phases(args, rate_Bps) if shaped is not None else []
        plan = {"seed": args.seed, "dest": "decode0", "timeout": args.timeout, "phases": phases}
        if shaped is not None:
            shaped.start_workers(plan, 120)
        if raw is not None:
            raw_plan = {"seed": args.seed, "dest": "decode0", "timeout": args.timeout, "phases": raw_phases(args),
                        "warmup_transfers": args.raw_requests}
            raw.start_workers(raw_plan, 120)
        base = {"shaped": bool(cluster is not None and cluster.shaped), "testbed": testbed_line, "link_rate_bytes_per_s": rate_Bps,
                "load": args.load, "bytes_per_token": BYTES_PER_TOKEN}
        for phase in phases:
            offered = sum(request_bytes(r["tokens"]) for r in phase["requests"])
            log(f"{phase['name']}: {len(phase['requests'])} transfers, {offered / 1e6:.0f} MB")
            result = shaped.run_phase(phase, args.timeout)
            recs = phase_records(phase, result, dict(base, phase=phase["phase"], mode=phase["mode"],
                                                      offered_bytes_per_s=(offered / args.duration
                                                                           if phase["phase"] == "open_loop" else None)))
            records += recs
            for r in recs:
                log(f"  {r['mode']:4} {r['priority']:4} p50 {_f(r['p50_s'])} p99 {_f(r['p99_s'])} "
                    f"ttfl p99 {_f(r['ttfl_p99_s'])} goodput {r['goodput_bytes_per_s'] / 1e6:.1f} MB/s lost {r['lost']}")
        if raw is not None:
            raw_base = {"shaped": False, "testbed": "loopback 127.0.0.1, unshaped", "link_rate_bytes_per_s": None,
                        "bytes_per_token": BYTES_PER_TOKEN}
            raw_recs, plain = [], []
            requests = raw_plan["phases"][0]["requests"]
            for phase in raw_plan["phases"]:       # flow, fifo, plain gRPC, then again: they share the noise
                result = raw.run_phase(phase, args.timeout)
                raw_recs += phase_records(phase, result, dict(raw_base, phase="raw_loopback", mode=phase["mode"],
                                                              rep=phase["rep"]))
                if phase["mode"] == "fifo":
                    plain.append(plain_server.run_once(args, requests, phase["rep"]))
            for mode in ("flow", "fifo"):
                reps = [r for r in raw_recs if r["mode"] == mode]
                best = max(reps, key=lambda r: r["goodput_bytes_per_s"])
                best = dict(best, lost=sum(r["lost"] for r in reps), reps=[r["goodput_bytes_per_s"] for r in reps])
                lean = min((r for r in reps if r["bytes"]), key=lambda r: r["cpu_s"] / r["bytes"])
                best["cpu_s_per_gb"] = lean["cpu_s"] / (lean["bytes"] / 1e9)
                best["cpu_s_per_gb_by_process"] = {k: v / (lean["bytes"] / 1e9)
                                                   for k, v in lean["cpu_s_by_process"].items()}
                records.append(best)
                log(f"raw loopback {mode}: best {best['goodput_bytes_per_s'] / 1e6:.1f} MB/s of "
                    f"{[round(r / 1e6, 1) for r in best['reps']]}; CPU s/GB {best['cpu_s_per_gb']:.2f} = "
                    + " + ".join(f"{v:.2f} {k}" for k, v in best["cpu_s_per_gb_by_process"].items()))
            good = [p for p in plain if p["bytes"] == p["expected"]]
            rates = [p["bytes"] / p["seconds"] for p in good]
            lean = min(good, key=lambda p: p["cpu_s"] / p["bytes"], default=None)
            records.append(dict(raw_base, phase="raw_loopback", mode="plain_grpc", priority="all",
                                requests=len(requests), lost=sum(1 for p in plain if p["bytes"] != p["expected"]) * len(requests),
                                p50_s=None, p99_s=None, max_s=None,
                                goodput_bytes_per_s=max(rates) if rates else 0.0, link_bytes_per_s=None,
                                bytes=plain[0]["expected"], reps=rates,
                                cpu_s_per_gb=lean["cpu_s"] / (lean["bytes"] / 1e9) if lean else None,
                                cpu_s_per_gb_by_process={k: v / (lean["bytes"] / 1e9)
                                                         for k, v in lean["cpu_s_by_process"].items()} if lean else None,
                                window_s=min(p["seconds"] for p in good) if good else None))
            log(f"raw loopback plain gRPC: {[round(r / 1e6, 1) for r in rates]} MB/s, CPU s/GB "
                f"{records[-1]['cpu_s_per_gb'] or 0:.2f} = "
                + " + ".join(f"{v:.2f} {k}" for k, v in (records[-1]["cpu_s_per_gb_by_process"] or {}).items()))
    finally:
        for tb in testbeds:
            tb.stop_workers()
        sidecars = [sc for tb in testbeds for sc in tb.sidecars]
        for sc in sidecars:         # all at once: each drains for a moment
            sc.terminate()
        for sc in sidecars:
            sc.stop()
        if plain_server is not None:
            plain_server.stop()
        if cluster is not None:
            cluster.close()
        log("sidecars stopped, namespaces removed")
    summary = evaluate(records)
    write_outputs(args, records, summary, testbed_line)
    lost = sum(r["lost"] for r in records if not r.get("aggregate"))
    log(f"done in {time.monotonic() - started:.0f}s; outputs in {args.out_dir}; logs in {workdir}")
    if lost:
        print(f"FAILED: {lost} transfer(s) lost or corrupted", file=sys.stderr)
        return 1
    if args.check_targets and not all(t["met"] for t in summary if t["met"] is not None):
        return 1
    return 0


def _free_port() -> int:
    from ciuicflow.kvflow.sidecar.process import free_port
    return free_port()


def _f(x) -> str:
    return "-" if x is None else f"{x:.3f}s"


# ---------------------------------------------------------------------- targets and outputs
def _find(records, phase, mode, priority):
    for r in records:
        if r["phase"] == phase and r["mode"] == mode and r["priority"] == priority:
            return r
    return None


def evaluate(records) -> list:
    targets = []
    hf, hq = _find(records, "open_loop", "flow", "high"), _find(records, "open_loop", "fifo", "high")
    if hf and hq and hf["p99_s"] and hq["p99_s"]:
        ratio = hf["p99_s"] / hq["p99_s"]
        targets.append({"target": "high-priority p99 <= 0.3x FIFO", "value": ratio, "met": ratio <= 0.3,
                        "detail": f"flow {hf['p99_s']:.3f}s vs fifo {hq['p99_s']:.3f}s = {ratio:.2f}x"})
    sat = [r for r in records if r["phase"] == "saturated" and r["mode"] == "flow"]
    if sat and sat[0].get("link_rate_bytes_per_s"):
        frac = sat[0]["goodput_bytes_per_s"] / sat[0]["link_rate_bytes_per_s"]
        targets.append({"target": "goodput >= 90% of the shaped link rate (flow, backlogged)", "value": frac,
                        "met": frac >= 0.9, "detail": f"{sat[0]['goodput_bytes_per_s'] / 1e6:.2f} MB/s of "
                                                      f"{sat[0]['link_rate_bytes_per_s'] / 1e6:.2f} MB/s = {frac:.1%}"})
    lost = sum(r["lost"] for r in records if not r.get("aggregate"))
    targets.append({"target": "no transfer lost", "value": lost, "met": lost == 0,
                    "detail": f"{lost} lost or corrupted"})
    flow, plain = _find(records, "raw_loopback", "flow", "low"), _find(records, "raw_loopback", "plain_grpc", "all")
    if flow and plain and plain["goodput_bytes_per_s"]:
        ratio = flow["goodput_bytes_per_s"] / plain["goodput_bytes_per_s"]
        targets.append({"target": "raw loopback throughput >= 0.9x plain gRPC", "value": ratio, "met": ratio >= 0.9,
                        "detail": f"ciuicflow {flow['goodput_bytes_per_s'] / 1e6:.1f} MB/s vs plain gRPC "
                                  f"{plain['goodput_bytes_per_s'] / 1e6:.1f} MB/s = {ratio:.2f}x"})
    return targets


def markdown(records, summary, testbed_line, args) -> str:
    def ms(x):
        return "-" if x is None else f"{x * 1e3:.0f}"

    def mb(x):
        return "-" if x is None else f"{x / 1e6:.2f}"

    def pct(x):
        return "-" if x is None else f"{x:.0%}"

    setup = (f"Testbed: {testbed_line}. {args.raw_requests} requests of {args.raw_tokens} tokens at once, "
             f"{BYTES_PER_TOKEN:,} bytes per token (DeepSeek-V3: 61 layers x 576 x bf16), sent per layer."
             if args.raw_only else None)
    lines = [
        "# KV-flow benchmark",
        "",
        setup or f"Testbed: {testbed_line}. Load: {args.load:.0%} of {args.rate_bps / 1e6:g} Mbit/s "
        f"({args.rate_bps / 8e6:.2f} MB/s), {args.duration:g} s of open-loop arrivals per mode; high priority "
        f"{args.high_tokens} tokens ({args.high_share:.0%} of bytes), low {args.low_tokens} tokens; "
        f"{BYTES_PER_TOKEN:,} bytes per token (DeepSeek-V3: 61 layers x 576 x bf16), sent per layer. "
        "Latency: arrival to last layer at the decode client; TTFL: to first layer. p99 is nearest-rank "
        "(the maximum below 100 samples).",
        "",
        "| phase | mode | class | n | lost | p50 ms | p99 ms | max ms | TTFL p50 ms | TTFL p99 ms | TTFL max ms "
        "| goodput MB/s | of link | link MB/s | link util. |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in records:
        lines.append(
            f"| {r['phase']} | {r['mode']} | {r['priority']} | {r.get('requests', '-')} | {r['lost']} | "
            f"{ms(r.get('p50_s'))} | {ms(r.get('p99_s'))} | {ms(r.get('max_s'))} | {ms(r.get('ttfl_p50_s'))} | "
            f"{ms(r.get('ttfl_p99_s'))} | {ms(r.get('ttfl_max_s'))} | {mb(r['goodput_bytes_per_s'])} | "
            f"{pct(r.get('goodput_fraction_of_link'))} | {mb(r.get('link_bytes_per_s'))} | "
            f"{pct(r.get('link_utilisation'))} |")
    if any(r["phase"] == "raw_loopback" for r in records):
        lines += ["", "Raw loopback rows: best of the repetitions (goodput = payload bytes / time from issuing "
                  "all requests at once until the receiving process holds them all; ciuicflow's receiver also "
                  "compares every part with what was sent, as plain gRPC's server does)."]
        cpu = [f"{r['mode']} {r['cpu_s_per_gb']:.2f}" for r in records
               if r["phase"] == "raw_loopback" and r.get("cpu_s_per_gb") is not None]
        if cpu:
            lines += ["", "CPU seconds per GB delivered, all processes of the path (ciuicflow: two clients and two "
                      "sidecars; plain gRPC: client and server), lowest of the repetitions: " + ", ".join(cpu) + "."]
        busiest = [f"{r['mode']} {max(r['cpu_s_per_gb_by_process'].values()):.2f} "
                   f"({max(r['cpu_s_per_gb_by_process'], key=r['cpu_s_per_gb_by_process'].get)})"
                   for r in records if r["phase"] == "raw_loopback" and r.get("cpu_s_per_gb_by_process")]
        if busiest:
            lines += ["", "Busiest single process of each path, CPU s/GB (on two shared cores the sum above decides "
                      "the rate; with a core per process this one would): " + ", ".join(busiest) + "."]
    lines += ["", "## Targets", ""]
    for t in summary:
        lines.append(f"- {'MET' if t['met'] else 'MISSED'}: {t['target']} - {t['detail']}")
    return "\n".join(lines) + "\n"


def chart(records, path: str, testbed_line: str, load: float) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.6))
    colors = {"flow": "tab:green", "fifo": "tab:red"}
    styles = {"high": "-", "low": "--"}
    for r in records:
        if r["phase"] != "open_loop" or r["priority"] == "all" or not r.get("latencies_s"):
            continue
        lat = r["latencies_s"]
        ys = [(i + 1) / len(lat) for i in range(len(lat))]
        ax1.step(lat, ys, where="post", color=colors[r["mode"]], linestyle=styles.get(r["priority"], ":"),
                 label=f"{r['mode']} / {r['priority']}")
    ax1.set_xscale("log")
    ax1.set_xlabel("transfer latency, s (log)")
    ax1.set_ylabel("fraction of requests")
    ax1.set_title("open loop: latency CDF per class")
    ax1.legend()
    ax1.grid(alpha=0.3)
    labels, flow_vals, fifo_vals = [], [], []
    for priority in ("high", "low"):
        for metric, name in (("p50_s", "p50"), ("p99_s", "p99"), ("ttfl_p99_s", "TTFL p99")):
            f = _find(records, "open_loop", "flow", priority)
            q = _find(records, "open_loop", "fifo", priority)
            if f and q:
                labels.append(f"{priority}\n{name}")
                flow_vals.append((f.get(metric) or 0) * 1e3)
                fifo_vals.append((q.get(metric) or 0) * 1e3)
    x = range(len(labels))
    ax2.bar([i - 0.2 for i in x], flow_vals, 0.4, color=colors["flow"], label="flow (x-ciuic-flow: enabled)")
    ax2.bar([i + 0.2 for i in x], fifo_vals, 0.4, color=colors["fifo"], label="fifo")
    ax2.set_xticks(list(x), labels)
    ax2.set_ylabel("ms")
    ax2.set_title("open loop: latency per class")
    ax2.legend()
    ax2.grid(alpha=0.3, axis="y")
    shaped = "NOT tc-shaped" not in testbed_line
    fig.suptitle(f"KV-flow: DeepSeek-V3 KV transfers at {load:.0%} load over "
                 + ("a tc-shaped link between two namespaces" if shaped else
                    "loopback, NOT tc-shaped (link emulated by --link-rate)"), fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_outputs(args, records, summary, testbed_line) -> None:
    os.makedirs(args.out_dir, exist_ok=True)
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    with open(args.json, "w") as fh:
        json.dump(records, fh, indent=1)
    stem = os.path.splitext(os.path.basename(args.json))[0]
    with open(os.path.join(args.out_dir, f"{stem}_targets.json"), "w") as fh:
        json.dump({"testbed": testbed_line, "targets": summary}, fh, indent=1)
    table = markdown(records, summary, testbed_line, args)
    with open(os.path.join(args.out_dir, f"{stem}.md"), "w") as fh:
        fh.write(table)
    print(table)
    if not args.no_png:
        chart(records, os.path.join(args.out_dir, f"{stem}.png"), testbed_line, args.load)


if __name__ == "__main__":
    sys.exit(main())
