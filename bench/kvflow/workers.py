"""The KV-flow benchmark's worker processes (``python -m bench.kvflow --worker ROLE``): the sender beside prefill0,
the receiver beside decode0 (both through ciuicflow's Client), and the plain gRPC baseline's server and
client. Phases are synchronised through files in a shared directory."""
from __future__ import annotations

import argparse
import json
import os
import struct
import threading
import time

from bench.kvflow.workload import LAYERS, payload_buffer, request_bytes, request_parts

WARMUP_PART = 144 << 10           # warm-up parts: LAYERS of them fill more than a default shared-memory ring (every page touched)


def wait_file(path: str, timeout: float) -> str:
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


def write_file(path: str, text: str) -> None:
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
        write_file(os.path.join(sync, f"{name}.sender.ready"), "ready")
        t0 = float(wait_file(os.path.join(sync, f"{name}.go"), plan["timeout"]))
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
        write_file(os.path.join(sync, f"{name}.sender.json"), json.dumps(out))


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
        write_file(os.path.join(sync, f"{name}.receiver.ready"), "ready")
        t0 = float(wait_file(os.path.join(sync, f"{name}.go"), plan["timeout"]))
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
        write_file(os.path.join(sync, f"{name}.receiver.json"), json.dumps(out))


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
    write_file(port_file, str(port))
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
        write_file(a.out, json.dumps(plain_client(a.address, plan["phases"][0]["requests"], plan["seed"])))
    return 0
