"""A routing proxy for disaggregated serving, like vLLM's disaggregated-serving examples: each OpenAI
request goes to a prefill instance with ``max_tokens=1`` (its KV goes to the chosen decode instance's
sidecar while the prompt runs), then to that decode instance with the ``kv_transfer_params`` the prefill
returned. Standard library only (runs in either environment).

    python -m ciuicflow.integrations.vllm.proxy --port 8000 \\
        --prefill http://127.0.0.1:8100 --decode http://127.0.0.1:8200=decode0

``--decode URL=PEER``: PEER is that decode node's sidecar ``--name`` (the destination the prefill sends to).
Per request, headers ``x-ciuic-priority: high|normal|low``, ``x-ciuic-deadline-s: SECONDS`` and
``x-ciuic-flow: enabled|disabled`` reach the sidecars' scheduler (the body's ``priority``, vLLM's own, is
passed through and also maps to a transfer priority when no header is given). If the prefill instance
fails, the decode instance computes the prompt itself (answer header ``x-ciuic-prefill: failed``).
"""
from __future__ import annotations

import argparse
import http.client
import itertools
import json
import logging
import sys
import threading
import time
import urllib.parse
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import List, Optional, Tuple

from . import config as C

log = logging.getLogger("ciuicflow.vllm.proxy")
ROUTES = ("/v1/completions", "/v1/chat/completions")


def _post(base: str, path: str, body: dict, timeout: float) -> Tuple[int, bytes]:
    u = urllib.parse.urlsplit(base)
    conn = http.client.HTTPConnection(u.hostname, u.port or 80, timeout=timeout)
    try:
        conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


class Router:
    """Round robin over prefill instances and over (decode URL, decode sidecar peer)."""

    def __init__(self, prefill: List[str], decode: List[Tuple[str, str]], timeout: float = 600.0):
        if not prefill or not decode:
            raise ValueError("need at least one --prefill and one --decode")
        self.prefill, self.decode, self.timeout = prefill, decode, timeout
        self._p, self._d = itertools.cycle(prefill), itertools.cycle(decode)
        self._lock = threading.Lock()
        self.stats = {"requests": 0, "prefill_failed": 0}

    def pick(self) -> Tuple[str, str, str]:
        with self._lock:
            self.stats["requests"] += 1
            return next(self._p), *next(self._d)

    def prefill_request(self, path: str, body: dict, headers, peer: str, key: str) -> dict:
        pre = dict(body)
        pre.pop("stream_options", None)
        pre.update(stream=False, max_tokens=1)
        if "max_completion_tokens" in pre:
            pre["max_completion_tokens"] = 1
        pre.pop("min_tokens", None)
        params = {C.P_DECODE: True, C.P_PREFILL: False, C.P_KEY: key, C.P_DEST: peer}
        if headers.get("x-ciuic-priority"):
            params[C.P_PRIORITY] = headers["x-ciuic-priority"]
        if headers.get("x-ciuic-deadline-s"):
            params[C.P_DEADLINE] = float(headers["x-ciuic-deadline-s"])
        if headers.get(C.P_FLOW):
            params[C.P_FLOW] = headers[C.P_FLOW]
        pre["kv_transfer_params"] = params
        return pre


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    router: Router = None  # set by serve()

    def log_message(self, fmt, *args):  # quiet: one line per request at debug level
        log.debug("%s " + fmt, self.address_string(), *args)

    def _send(self, status: int, data: bytes, extra: Optional[dict] = None) -> None:
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        for k, v in (extra or {}).items():
            self.send_header(k, v)
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        if self.path in ("/health", "/v1/models"):
            base = self.router.decode[0][0]
            u = urllib.parse.urlsplit(base)
            conn = http.client.HTTPConnection(u.hostname, u.port, timeout=30)
            try:
                conn.request("GET", self.path)
                r = conn.getresponse()
                self._send(r.status, r.read())
            except OSError as exc:
                self._send(502, json.dumps({"error": str(exc)}).encode())
            finally:
                conn.close()
            return
        self._send(404, b'{"error": "not found"}')

    def do_POST(self):
        path = self.path.split("?")[0]
        if path not in ROUTES:
            self._send(404, b'{"error": "not found"}')
            return
        try:
            body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
        except ValueError:
            self._send(400, b'{"error": "body is not JSON"}')
            return
        router = self.router
        prefill, decode, peer = router.pick()
        key = f"cf-{uuid.uuid4().hex}"
        headers = {k.lower(): v for k, v in self.headers.items()}
        extra = {}
        t0 = time.monotonic()
        try:
            status, data = _post(prefill, path, router.prefill_request(path, body, headers, peer, key), router.timeout)
            if status != 200:
                raise RuntimeError(f"prefill answered {status}: {data[:300]!r}")
            params = json.loads(data).get("kv_transfer_params")
        except (OSError, RuntimeError, ValueError) as exc:
            log.warning("prefill %s failed (%s): the decode instance computes the prompt", prefill, exc)
            router.stats["prefill_failed"] += 1
            params, extra = None, {"x-ciuic-prefill": "failed"}
        extra["x-ciuic-prefill-s"] = f"{time.monotonic() - t0:.4f}"
        extra["x-ciuic-key"] = key          # names this request's transfer in the servers' logs (phases.py)
        dec = dict(body)
        if params:
            dec["kv_transfer_params"] = params
        self._forward(decode, path, dec, extra)

    def _forward(self, base: str, path: str, body: dict, extra: dict) -> None:
        u = urllib.parse.urlsplit(base)
        conn = http.client.HTTPConnection(u.hostname, u.port, timeout=self.router.timeout)
        try:
            conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
            resp = conn.getresponse()
            if not body.get("stream"):
                self._send(resp.status, resp.read(), extra)
                return
            # stream the decode instance's server-sent events through as they come
            self.send_response(resp.status)
            self.send_header("Content-Type", resp.getheader("Content-Type", "text/event-stream"))
            self.send_header("Transfer-Encoding", "chunked")
            for k, v in extra.items():
                self.send_header(k, v)
            self.end_headers()
            while True:
                chunk = resp.read1(65536)
                if not chunk:
                    break
                self.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                self.wfile.flush()
            self.wfile.write(b"0\r\n\r\n")
        except OSError as exc:
            try:
                self._send(502, json.dumps({"error": f"decode instance: {exc}"}).encode(), extra)
            except OSError:
                pass
        finally:
            conn.close()


def serve(prefill: List[str], decode: List[Tuple[str, str]], host: str = "127.0.0.1", port: int = 0,
          timeout: float = 600.0) -> ThreadingHTTPServer:
    """Start the proxy in a background thread; ``server.server_address`` has the bound port."""
    handler = type("BoundHandler", (Handler,), {"router": Router(prefill, decode, timeout)})
    server = ThreadingHTTPServer((host, port), handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, name="ciuicflow-vllm-proxy", daemon=True).start()
    return server


def parse_decode(value: str) -> Tuple[str, str]:
    url, sep, peer = value.rpartition("=")
    if not sep or not url or not peer:
        raise argparse.ArgumentTypeError(f"--decode wants URL=PEER (the decode sidecar's name), not {value!r}")
    return url, peer


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--prefill", action="append", required=True, metavar="URL")
    p.add_argument("--decode", action="append", required=True, type=parse_decode, metavar="URL=PEER")
    p.add_argument("--timeout", type=float, default=600.0)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    server = serve(args.prefill, args.decode, args.host, args.port, args.timeout)
    log.info("proxy ready on http://%s:%d", *server.server_address[:2])
    try:
        threading.Event().wait()
    except KeyboardInterrupt:
        server.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
