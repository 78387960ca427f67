"""A routing proxy for disaggregated serving, like vLLM's disaggregated-serving examples: each OpenAI
request goes to a prefill instance with ``max_tokens=1`` (its KV goes to the chosen decode instance's
sidecar while the prompt runs), then to that decode instance with the ``kv_transfer_params`` the prefill
returned. Standard library only (runs in either environment).

    python -m ciuicflow.integrations.vllm.proxy --port 8000 \\
        --prefill http://127.0.0.1:8100 --decode http://127.0.0.1:8200=decode0

``--decode URL=PEER``: PEER is that decode node's sidecar ``--name`` (the destination the prefill sends to).
Per request, headers ``x-ciuic-priority: high|normal|low``, ``x-ciuic-deadline-s: SECONDS`` (finite, > 0,
at most 86400) and ``x-ciuic-flow: enabled|disabled`` reach the sidecars' scheduler; a malformed one is a
400 and nothing goes upstream (the body's ``priority``, vLLM's own, is passed through and also maps to a
transfer priority when no header is given). If the prefill instance fails, the decode instance computes
the prompt itself (answer header ``x-ciuic-prefill: failed``).

Clients are untrusted (docs/security.md, The routing proxy). Transfer parameters are the proxy's alone
(proxy_params.py): a body that carries ``kv_transfer_params`` is refused with 400, and the decode request
carries only the parameters the chosen prefill instance returned for this request's own key. Every client
connection is bounded in size, time and number (proxy_io.py, proxy_server.py); answers are streamed
through, never read whole, and the prefill's answer is read with a cap.
"""
from __future__ import annotations

import argparse
import http.client
import logging
import re
import sys
import threading
import time
import urllib.parse
import uuid
from dataclasses import asdict
from typing import List, Optional, Tuple

from .proxy_io import Limits
from .proxy_router import Router, upstream_url  # noqa: F401 - upstream_url: part of this module's API
from .proxy_params import (BadRequest, client_body, json_bytes, prefill_params, prefill_request,
                           transfer_headers, with_transfer_params)
from .proxy_server import BoundedHandler, ProxyServer

log = logging.getLogger("ciuicflow.vllm.proxy")
ROUTES = ("/v1/completions", "/v1/chat/completions")
_HEADER_VALUE = re.compile(r"[\x20-\x7e]*")        # an upstream header value passed on: printable ASCII


class Handler(BoundedHandler):
    """The request flow: check the request, prefill (its parameters only for this request's key), then
    relay the decode instance's answer."""
    router: Router = None   # set by serve()

    def handle_expect_100(self):
        # "Expect: 100-continue": refuse a request we would refuse anyway before the client sends its body
        try:
            if self.command == "POST" and self.path.split("?")[0] in ROUTES:
                self._content_length()
                transfer_headers(self.headers)
        except BadRequest as exc:
            self._refuse(exc.status, exc.message)
            return False
        return super().handle_expect_100()

    def do_GET(self):
        if self._has_body():
            self._refuse(400, "GET with a body")
        elif self.path in ("/health", "/v1/models"):
            decode = self.router.any_decode()
            if decode is None:
                self._refuse(503, "no decode server registered", {"Retry-After": "1"})
            else:
                self._relay(decode, "GET", self.path, None, {})
        else:
            self._refuse(404, "not found")

    def do_POST(self):
        path = self.path.split("?")[0]
        if path not in ROUTES:
            self._refuse(404, "not found")
            return
        try:
            length = self._content_length()
            asked = transfer_headers(self.headers)
        except BadRequest as exc:
            self._refuse(exc.status, exc.message)
            return
        inflight = self.server.inflight
        if not inflight.take(length):
            self._refuse(503, "proxy busy: too many request bytes in flight", {"Retry-After": "1"})
            return
        try:
            self._complete(path, length, asked)
        finally:
            inflight.give(length)

    def _complete(self, path: str, length: int, asked: dict) -> None:
        raw = self._read_body(length)
        if raw is None:                         # the client went away
            self.close_connection = True
            return
        router, gate = self.router, self.server.parse_gate
        key = f"cf-{uuid.uuid4().hex}"
        if not gate.take(length, self.limits.body_timeout_s):
            self._refuse(503, "proxy busy", {"Retry-After": "1"}, body_read=True)
            return
        try:
            body, brace = client_body(raw)
            empty = not body
            try:
                prefill, decode, peer = router.pick()
            except RuntimeError as exc:
                self._refuse(503, str(exc), {"Retry-After": "1"}, body_read=True)
                return
            try:
                pre = json_bytes(prefill_request(body, asked, peer, key))
            except BaseException:
                router.done(peer)
                raise
            del body
        except BadRequest as exc:
            self._refuse(exc.status, exc.message, body_read=True)
            return
        except RecursionError:      # parsed, but nested too deeply to write back
            self._refuse(400, "body nested too deeply", body_read=True)
            return
        finally:
            gate.give(length)
        extra = {}
        t0 = time.monotonic()
        try:
            params = self._prefill(prefill, path, pre, key)
        except (OSError, http.client.HTTPException, RuntimeError, ValueError, RecursionError) as exc:
            log.warning("prefill %s failed (%s): the decode instance computes the prompt", prefill, exc)
            router.count("prefill_failed")
            params, extra = None, {"x-ciuic-prefill": "failed"}
        del pre
        extra["x-ciuic-prefill-s"] = f"{time.monotonic() - t0:.4f}"
        extra["x-ciuic-key"] = key          # names this request's transfer in the servers' logs (phases.py)
        extra["x-ciuic-decode"] = peer
        try:
            self._relay(decode, "POST", path, with_transfer_params(raw, brace, empty, params) if params else raw,
                        extra)
        finally:
            router.done(peer)

    def _prefill(self, base: str, path: str, body: bytes, key: str) -> bytes:
        """The prefill call; its answer is read up to ``max_prefill_answer_bytes`` (counted in the prefill
        answers held at once) and must carry this request's own key. Its parameters, as JSON."""
        cap = self.limits.max_prefill_answer_bytes
        u = urllib.parse.urlsplit(base)
        conn = http.client.HTTPConnection(u.hostname, u.port or 80, timeout=self.router.timeout)
        try:
            conn.request("POST", path, body, {"Content-Type": "application/json"})
            resp = conn.getresponse()
            if resp.status != 200:
                raise RuntimeError(f"prefill answered {resp.status}: {resp.read(300)!r}")
            if resp.length is not None and resp.length > cap:
                raise RuntimeError(f"prefill answer of {resp.length} bytes (at most {cap} taken)")
            need = resp.length if resp.length is not None else cap
            server = self.server
            if not server.answers.take(need, self.limits.body_timeout_s):
                raise RuntimeError("proxy busy: no room for the prefill answer")
            try:
                data = resp.read(need + 1)
                if len(data) > cap:
                    raise RuntimeError(f"prefill answer over {cap} bytes")
                if not server.parse_gate.take(len(data), self.limits.body_timeout_s):
                    raise RuntimeError("proxy busy: no room to read the prefill answer")
                try:
                    return prefill_params(data, key)
                finally:
                    server.parse_gate.give(len(data))
            finally:
                server.answers.give(need)
        finally:
            conn.close()

    def _relay(self, base: str, method: str, path: str, body: Optional[bytes], extra: dict) -> None:
        """Send the request upstream and stream its answer through as it comes (never read whole)."""
        u = urllib.parse.urlsplit(base)
        conn = http.client.HTTPConnection(u.hostname, u.port or 80, timeout=self.router.timeout)
        try:
            try:
                conn.request(method, path, body, {"Content-Type": "application/json"} if body is not None else {})
                resp = conn.getresponse()
            except (OSError, http.client.HTTPException) as exc:
                self._send_json(502, {"error": f"upstream {base}: {exc}"}, extra)
                return
            if resp.status < 200:       # an interim answer (103, 101) that http.client hands over as the answer
                self._send_json(502, {"error": f"upstream {base}: interim answer {resp.status}"}, extra)
                return
            content_type = resp.getheader("Content-Type", "application/json")
            if not _HEADER_VALUE.fullmatch(content_type):      # e.g. a folded value, with CR LF inside
                content_type = "application/json"
            self.send_response(resp.status)
            self.send_header("Content-Type", content_type)
            chunked = False
            if resp.length is not None:
                self.send_header("Content-Length", str(resp.length))
            elif self.request_version != "HTTP/1.0":
                chunked = True
                self.send_header("Transfer-Encoding", "chunked")
            else:
                self.close_connection = True
                self.send_header("Connection", "close")
            for k, v in extra.items():
                self.send_header(k, v)
            self.end_headers()
            while True:
                try:
                    chunk = resp.read1(65536)
                except (OSError, http.client.HTTPException) as exc:
                    log.warning("upstream %s failed mid-answer (%s): the client's connection is closed", base, exc)
                    self.close_connection = True
                    return
                if not chunk:
                    break
                self.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk) if chunked else chunk)
            if resp.length:             # http.client counts down what is left: the upstream closed early
                log.warning("upstream %s closed %d bytes short of its answer: the client's connection is closed",
                            base, resp.length)
                self.close_connection = True
            elif chunked:
                self.wfile.write(b"0\r\n\r\n")
        finally:
            conn.close()


_DEFAULTS = Limits()


def serve(prefill: List[str], decode: List[Tuple[str, str]], host: str = "127.0.0.1", port: int = 0,
          timeout: float = 600.0, *, max_body_bytes: int = _DEFAULTS.max_body_bytes,
          max_header_bytes: int = _DEFAULTS.max_header_bytes, max_connections: int = _DEFAULTS.max_connections,
          max_inflight_bytes: int = _DEFAULTS.max_inflight_bytes,
          max_prefill_answer_bytes: int = _DEFAULTS.max_prefill_answer_bytes,
          header_timeout_s: float = _DEFAULTS.header_timeout_s, body_timeout_s: float = _DEFAULTS.body_timeout_s,
          idle_timeout_s: float = _DEFAULTS.idle_timeout_s,
          send_timeout_s: float = _DEFAULTS.send_timeout_s, registry=None, routing: str = "load") -> ProxyServer:
    """Start the proxy in a background thread; ``server.server_address`` has the bound port. ``timeout``:
    each upstream socket operation; ``registry``/``routing``: servers from the registry (Router); the rest:
    ``Limits`` (the same defaults as the command line)."""
    limits = Limits(max_body_bytes=max_body_bytes, max_header_bytes=max_header_bytes,
                    max_connections=max_connections, max_inflight_bytes=max_inflight_bytes,
                    max_prefill_answer_bytes=max_prefill_answer_bytes, header_timeout_s=header_timeout_s,
                    body_timeout_s=body_timeout_s, idle_timeout_s=idle_timeout_s, send_timeout_s=send_timeout_s)
    handler = type("BoundHandler", (Handler,), {"router": Router(prefill, decode, timeout, registry, routing),
                                                 "limits": limits})
    server = ProxyServer((host, port), handler, limits)
    threading.Thread(target=server.serve_forever, name="ciuicflow-vllm-proxy", daemon=True).start()
    return server


def parse_decode(value: str) -> Tuple[str, str]:
    url, sep, peer = value.rpartition("=")
    if not sep or not url or not peer:
        raise argparse.ArgumentTypeError(f"--decode wants URL=PEER (the decode sidecar's name), not {value!r}")
    return url, peer


def _fixed_mmap_threshold(nbytes: int = 128 * 1024) -> None:
    """glibc: allocations of ``nbytes`` and more always get their own mapping, returned to the system when
    freed. By default glibc raises that threshold after the first large free (up to 32 MiB), and request
    bodies then come from per-thread heaps that keep what they held: measured, 8 concurrent 4 MiB bodies
    left the process at twice the resident memory. Not glibc (or no ctypes): nothing."""
    try:
        import ctypes
        ctypes.CDLL(None).mallopt(-3, int(nbytes))        # M_MMAP_THRESHOLD
    except (ImportError, OSError, AttributeError, TypeError):
        pass


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--prefill", action="append", default=[], metavar="URL")
    p.add_argument("--decode", action="append", default=[], type=parse_decode, metavar="URL=PEER")
    p.add_argument("--discovery", metavar="etcd://HOST:PORT/PREFIX",
                   help="take prefill and decode servers from the sidecars' registry (their --server-url and "
                        "--role) instead of --prefill/--decode (docs/discovery.md)")
    p.add_argument("--routing", choices=("load", "round-robin"), default="load",
                   help="with --discovery: decode server by the load its sidecar reports (default), or in turn")
    p.add_argument("--timeout", type=float, default=600.0, help="each upstream socket operation, seconds")
    d = _DEFAULTS
    p.add_argument("--max-body-bytes", type=int, default=d.max_body_bytes,
                   help="largest request body (413 beyond, from Content-Length, before reading)")
    p.add_argument("--max-header-bytes", type=int, default=d.max_header_bytes,
                   help="request line and headers together (431 beyond)")
    p.add_argument("--max-connections", type=int, default=d.max_connections,
                   help="client connections at once (beyond: 503, closed at once); lowered to fit RLIMIT_NOFILE")
    p.add_argument("--max-inflight-bytes", type=int, default=d.max_inflight_bytes,
                   help="request bodies held at once, all connections (503 beyond); as much again for prefill answers")
    p.add_argument("--max-prefill-answer-bytes", type=int, default=d.max_prefill_answer_bytes,
                   help="largest prefill answer read (beyond: the prefill counts as failed)")
    p.add_argument("--header-timeout-s", type=float, default=d.header_timeout_s,
                   help="request line and headers must arrive within this (from the connection or first byte)")
    p.add_argument("--body-timeout-s", type=float, default=d.body_timeout_s,
                   help="the whole request body must arrive within this after the headers")
    p.add_argument("--idle-timeout-s", type=float, default=d.idle_timeout_s,
                   help="a kept-alive connection with no new request for this long is closed")
    p.add_argument("--send-timeout-s", type=float, default=d.send_timeout_s,
                   help="a client that takes no part of its answer for this long is cut off")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    _fixed_mmap_threshold()
    registry = None
    if args.discovery:
        from ...kvflow.discovery.etcd import parse_target
        from .proxy_registry import RegistryView
        try:
            target = parse_target(args.discovery)
        except ValueError as exc:
            p.error(str(exc))
        registry = RegistryView(target.endpoints[0], target.prefix).start()
    try:
        server = serve(args.prefill, args.decode, args.host, args.port, args.timeout,
                       max_body_bytes=args.max_body_bytes, max_header_bytes=args.max_header_bytes,
                       max_connections=args.max_connections, max_inflight_bytes=args.max_inflight_bytes,
                       max_prefill_answer_bytes=args.max_prefill_answer_bytes,
                       header_timeout_s=args.header_timeout_s, body_timeout_s=args.body_timeout_s,
                       idle_timeout_s=args.idle_timeout_s, send_timeout_s=args.send_timeout_s,
                       registry=registry, routing=args.routing)
    except ValueError as exc:
        p.error(str(exc))
    log.info("limits: %s, connections %d", asdict(server.limits), server.max_connections)
    log.info("proxy ready on http://%s:%d", *server.server_address[:2])
    try:
        threading.Event().wait()
    except KeyboardInterrupt:
        server.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
