"""The stand-ins that bench/proxy/routing.py puts behind the vLLM proxy: small OpenAI-compatible HTTP servers
that behave like vLLM with the CiuicFlowConnector for the proxy's purposes, each beside a real sidecar, and
the backlog sender that makes one decode node busy. One process each:

    python -m bench.proxy.fakes prefill --port P --sidecar API --name prefill0 [timing flags]
    python -m bench.proxy.fakes decode  --port P --sidecar API --name decode0  [timing flags]
    python -m bench.proxy.fakes backlog --sidecar API --dest decode0 --dest-sidecar API2 --size 8MiB

- **prefill**: a ``/v1/completions`` request with ``kv_transfer_params`` (``do_remote_decode``, ``ciuic_key``,
  ``ciuic_dest``, priority) "computes" its prompt layer by layer (``--prefill-us-per-token`` x tokens, split
  over ``--layers``) and hands each layer's KV (``--kv-bytes-per-token`` x tokens / layers, bytes) to its
  sidecar on one open transfer to ``ciuic_dest`` at the request's priority, as the connector's save path
  does (a thread per transfer appends, so a flow-controlled append never holds up the "forward pass"); it
  answers once the last layer is computed, with the ``kv_transfer_params`` the connector returns
  (``do_remote_prefill``, the key, the token count, its sidecar's name, the priority), while the KV is
  still on its way, as vLLM does.
- **decode**: a request with those parameters waits for the whole transfer from ``ciuic_source`` at its own
  sidecar (the connector's async load: the request waits until every layer is in), checks its size, then
  streams ``max_tokens`` tokens as server-sent events: the first after ``--decode-step-ms``, the others
  ``--tpot-ms`` apart. Without parameters (the proxy's prefill failed) it "computes" the prompt itself.
- **backlog**: keeps ``--streams`` low-priority transfers of ``--size`` bytes in flight to ``--dest`` (a
  KV migration, another fleet's traffic), and collects them at the destination's sidecar.

Each server writes one JSON line per request to ``--log`` (what it received, when).
"""
from __future__ import annotations

import argparse
import http.server
import json
import os
import queue
import sys
import threading
import time


from ciuicflow.kvflow import Client
from ciuicflow.testing.stub_http import JsonHandler

HEADER = "__ciuicflow_kv__"     # the connector's first part (transfer.py's HEADER)
_END = None


def prompt_tokens(prompt) -> int:
    """The prompt's length in tokens: a list of token ids, or a string (one token per word)."""
    if isinstance(prompt, list):
        return len(prompt)
    return len(str(prompt).split())


class _Payload:
    """Read-only byte strings of any size up to ``cap``, sliced from one buffer (no allocation per part)."""

    def __init__(self, cap: int):
        self.buf = memoryview(os.urandom(min(cap, 1 << 16)) * max(1, -(-cap // (1 << 16))))

    def take(self, n: int) -> memoryview:
        return self.buf[:n]


class Fake(http.server.ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 256

    def __init__(self, args, handler):
        super().__init__(("127.0.0.1", args.port), handler)
        self.a = args
        self.client = Client(args.sidecar)
        self.client.wait_ready(30)
        self.log_lock = threading.Lock()
        self.log_fh = open(args.log, "a") if args.log else None
        self.payload = _Payload(args.max_part_bytes)

    def record(self, **fields) -> None:
        if self.log_fh is not None:
            with self.log_lock:
                self.log_fh.write(json.dumps(fields) + "\n")
                self.log_fh.flush()


class _Handler(JsonHandler):
    protocol_version = "HTTP/1.0"       # answers end when the connection closes (streamed ones too)
    server: Fake

    def do_GET(self):
        if self.path in ("/health", "/v1/models"):
            self._json(200, {"object": "list", "data": [{"id": "fake", "object": "model"}]})
        else:
            self._json(404, {"error": "not found"})


class _Sender:
    """One request's KV on its way to the decode side's sidecar: parts are queued by the "forward pass" and
    appended by a thread of this transfer (as the connector's OutgoingKV)."""

    def __init__(self, client: Client, dest: str, key: str, priority: str, deadline_s, flow: bool, record):
        self.stream = client.open(dest, key, priority=priority, deadline_s=deadline_s, flow=flow,
                                  payload_kind="bytes")
        self.key, self.dest, self.record = key, dest, record
        self.q: "queue.Queue" = queue.Queue()
        self.t0 = time.monotonic()
        threading.Thread(target=self._feed, daemon=True).start()

    def put(self, name: str, value) -> None:
        self.q.put((name, value))

    def end(self) -> None:
        self.q.put(_END)

    def _feed(self) -> None:
        try:
            while True:
                item = self.q.get()
                if item is _END:
                    break
                self.stream.append(item[1], name=item[0])
            self.stream.close()
            self.stream.handle.wait(120)
            self.record(ev="sent", key=self.key, dest=self.dest, s=round(time.monotonic() - self.t0, 4))
        except Exception as exc:  # noqa: BLE001 - the decode side fails its load; logged
            try:
                self.stream.cancel()
            except Exception:  # noqa: BLE001
                pass
            self.record(ev="send_failed", key=self.key, dest=self.dest, error=str(exc)[:300])


class PrefillHandler(_Handler):
    def do_POST(self):
        a = self.server.a
        body = self._body()
        params = body.get("kv_transfer_params") or {}
        tokens = prompt_tokens(body.get("prompt", ""))
        key, dest = params.get("ciuic_key"), params.get("ciuic_dest")
        priority = params.get("ciuic_priority") or "normal"
        flow = str(params.get("x-ciuic-flow", "enabled")).lower() != "disabled"
        per_layer = tokens * a.kv_bytes_per_token // a.layers
        sender = None
        if params.get("do_remote_decode") and key and dest:
            sender = _Sender(self.server.client, dest, key, priority, params.get("ciuic_deadline_s"), flow,
                             self.server.record)
            sender.put(HEADER, json.dumps({"tokens": tokens, "layers": a.layers, "layer_bytes": per_layer}).encode())
        step = tokens * a.prefill_us_per_token * 1e-6 / a.layers
        for i in range(a.layers):           # the forward pass: each layer's KV is handed over once computed
            time.sleep(step)
            if sender is not None:
                sender.put(f"L{i}", self.server.payload.take(per_layer))
        if sender is not None:
            sender.end()
        answer = {"id": f"cmpl-{key}", "object": "text_completion", "model": "fake",
                  "choices": [{"index": 0, "text": "x", "finish_reason": "length"}]}
        if sender is not None:
            answer["kv_transfer_params"] = {"do_remote_prefill": True, "ciuic_key": key, "ciuic_num_tokens": tokens,
                                            "ciuic_source": a.name, "ciuic_priority": priority}
        self._json(200, answer)


class DecodeHandler(_Handler):
    def do_POST(self):
        a = self.server.a
        t0 = time.monotonic()
        body = self._body()
        params = body.get("kv_transfer_params") or {}
        tokens = prompt_tokens(body.get("prompt", ""))
        key = params.get("ciuic_key")
        got, error = 0, None
        if params.get("do_remote_prefill") and key:
            want = tokens * a.kv_bytes_per_token // a.layers * a.layers
            try:
                stream = self.server.client.recv_stream(key, timeout_s=a.load_timeout_s,
                                                        source=params.get("ciuic_source") or None)
                for part in stream:
                    if part.name != HEADER:
                        got += len(part.value)
                if got != want:
                    error = f"received {got} bytes of KV, expected {want}"
            except Exception as exc:  # noqa: BLE001 - vLLM would recompute (kv_load_failure_policy)
                error = str(exc)[:300]
            if error is not None:
                time.sleep(tokens * a.prefill_us_per_token * 1e-6)
        else:
            time.sleep(tokens * a.prefill_us_per_token * 1e-6)      # the prompt computed here
        t_kv = time.monotonic()
        self.server.record(ev="load", key=key, bytes=got, wait_s=round(t_kv - t0, 4), error=error,
                           priority=params.get("ciuic_priority"))
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        n = max(1, int(body.get("max_tokens") or 1))
        for i in range(n):
            time.sleep(a.decode_step_ms / 1000 if i == 0 else a.tpot_ms / 1000)
            chunk = {"object": "text_completion", "choices": [{"index": 0, "text": "t", "token_ids": [7],
                                                               "finish_reason": "length" if i == n - 1 else None}]}
            self.wfile.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
            self.wfile.flush()
        self.wfile.write(b"data: [DONE]\n\n")
        self.wfile.flush()


def backlog(a) -> None:
    """``--streams`` low-priority transfers of ``--size`` bytes to ``--dest`` at all times, collected there."""
    src, dst = Client(a.sidecar), Client(a.dest_sidecar)
    src.wait_ready(30)
    dst.wait_ready(30)
    data = os.urandom(1 << 20) * max(1, a.size >> 20)
    done = {"sent": 0, "failed": 0, "bytes": 0}
    lock = threading.Lock()

    def sender(i):
        n = 0
        while True:
            n += 1
            key = f"backlog-{i}-{n}"
            t0 = time.monotonic()
            try:
                src.send(a.dest, key, data, priority="low").wait(300)
                dst.recv(key, timeout_s=60, source=a.name)
                with lock:
                    done["sent"] += 1
                    done["bytes"] += len(data)
                ok = True
            except Exception as exc:  # noqa: BLE001 - counted; the dest may not have adopted us yet
                with lock:
                    done["failed"] += 1
                ok = False
                print(f"backlog send failed: {exc}", flush=True)
                time.sleep(0.2)
            if ok and a.log:
                with open(a.log, "a") as fh:
                    fh.write(json.dumps({"ev": "backlog", "key": key, "s": round(time.monotonic() - t0, 3),
                                         "t": time.time()}) + "\n")

    for i in range(a.streams):
        threading.Thread(target=sender, args=(i,), daemon=True).start()
    print("backlog ready", flush=True)
    threading.Event().wait()


def parse_size(text: str) -> int:
    t = str(text).strip().lower().replace("ib", "").replace("b", "")
    mult = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}.get(t[-1:], 1)
    return int(float(t[:-1] if t[-1:] in "kmg" else t) * mult)


def add_timing_flags(p) -> None:
    """The fake servers' model of vLLM (also the orchestrator's flags, passed through)."""
    p.add_argument("--kv-bytes-per-token", type=int, default=8192,
                   help="KV bytes per prompt token (8 KiB: e.g. 16 layers of 1 KV head x 128 x bf16, K and V)")
    p.add_argument("--layers", type=int, default=8, help="parts per transfer (one per layer)")
    p.add_argument("--prefill-us-per-token", type=float, default=150.0, help="prefill compute per prompt token")
    p.add_argument("--decode-step-ms", type=float, default=15.0, help="decode: the first token's step")
    p.add_argument("--tpot-ms", type=float, default=10.0, help="decode: each later token")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("role", choices=("prefill", "decode", "backlog"))
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--sidecar", required=True, help="this server's sidecar's local API, HOST:PORT")
    p.add_argument("--name", default="", help="this node's sidecar name (prefill: sent as ciuic_source)")
    p.add_argument("--log", default="", help="JSON lines, one per request")
    p.add_argument("--load-timeout-s", type=float, default=60.0)
    p.add_argument("--max-part-bytes", type=parse_size, default=32 << 20)
    p.add_argument("--dest", default="", help="backlog: the decode sidecar's name")
    p.add_argument("--dest-sidecar", default="", help="backlog: its local API (to collect what was sent)")
    p.add_argument("--size", type=parse_size, default=8 << 20, help="backlog: bytes per transfer")
    p.add_argument("--streams", type=int, default=2, help="backlog: transfers in flight")
    add_timing_flags(p)
    a = p.parse_args(argv)
    if a.role == "backlog":
        backlog(a)
        return 0
    server = Fake(a, PrefillHandler if a.role == "prefill" else DecodeHandler)
    print(f"fake {a.role} ready on http://127.0.0.1:{server.server_address[1]}", flush=True)
    server.serve_forever()
    return 0


if __name__ == "__main__":
    sys.exit(main())
