"""The routing proxy's HTTP server, bounded for untrusted clients: ``ProxyServer`` (a thread per
connection, up to a cap; beyond it a 503 from the accepting thread) and ``BoundedHandler`` (each request's
phases under their deadlines and byte limits, refusals, the body by Content-Length only). The request flow
itself is proxy.py's ``Handler``. Standard library only.
"""
from __future__ import annotations

import logging
import re
import socket
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Optional

from .proxy_io import Budget, ClientReader, ClientTooSlow, ClientWriter, HeadersTooLarge, Limits, MiB
from .proxy_params import BadRequest, json_bytes

log = logging.getLogger("ciuicflow.vllm.proxy")

LINGER_S = 2.0                      # after an answer given before the body was read: drain this long ...
LINGER_BYTES = 64 * MiB             # ... or this much, so the client reads the answer rather than a reset
_CONTENT_LENGTH = re.compile(r"[0-9]{1,19}")
_BUSY_BODY = b'{"error": "proxy busy: too many connections"}'
_BUSY = (b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nContent-Length: %d\r\n"
         b"Retry-After: 1\r\nConnection: close\r\n\r\n%s" % (len(_BUSY_BODY), _BUSY_BODY))


class BoundedHandler(BaseHTTPRequestHandler):
    """BaseHTTPRequestHandler with timeouts that bound a request's phase rather than one read, a header
    budget, and refusals that the client gets to read. Subclasses define ``do_GET``/``do_POST``."""
    protocol_version = "HTTP/1.1"
    limits: Limits = None   # set by serve()

    # ------------------------------------------------------------------ the connection
    def setup(self):
        self.connection = self.request
        self._accepted = time.monotonic()
        self._first, self._linger, self._answered = True, False, False
        self.connection.settimeout(self.limits.send_timeout_s)
        self.rfile = ClientReader(self.connection, self.limits.send_timeout_s)
        self.wfile = ClientWriter(self.connection)

    def finish(self):
        if self._linger:
            self._lingering_close()

    def _lingering_close(self) -> None:
        """After an answer given before the request's body was read (413, 411, ...): stop sending, then
        read and drop what the client still sends, for a moment, so that it reads the answer rather than a
        connection reset."""
        sock = self.connection
        try:
            sock.shutdown(socket.SHUT_WR)
            end, left, buf = time.monotonic() + LINGER_S, LINGER_BYTES, bytearray(65536)
            while left > 0:
                remaining = end - time.monotonic()
                if remaining <= 0:
                    break
                sock.settimeout(remaining)
                n = sock.recv_into(buf)
                if not n:
                    break
                left -= n
        except OSError:
            pass

    def log_message(self, fmt, *args):  # quiet: one line per request at debug level
        log.debug("%s " + fmt, self.address_string(), *args)

    def send_response_only(self, code, message=None):
        self._answered = self._answered or code >= 200
        super().send_response_only(code, message)

    def handle_one_request(self):
        """One request, each of its phases with its deadline (BaseHTTPRequestHandler's, with timeouts that
        bound a phase rather than one read, and a header budget)."""
        lim, r = self.limits, self.rfile
        self._answered, self.command, self.request_version, self.requestline = False, "", "HTTP/1.1", ""
        try:
            if self._first:
                start = self._accepted
            else:
                if not r.wait_for_data(time.monotonic() + lim.idle_timeout_s):
                    self.close_connection = True
                    return
                start = time.monotonic()
            self._first = False
            r.phase(start + lim.header_timeout_s, lim.max_header_bytes)
            self.raw_requestline = r.readline(65537)
            if len(self.raw_requestline) > 65536:
                self.send_error(414)
                return
            if not self.raw_requestline:
                self.close_connection = True
                return
            ok = self.parse_request()
            r.phase(None)
            if not ok:
                return
            method = getattr(self, "do_" + self.command, None)
            if method is None:
                self._refuse(501, f"unsupported method {self.command[:20]!r}")
                return
            method()
            self.wfile.flush()
        except HeadersTooLarge:
            self.close_connection = True
            if not self._answered:
                self._quick_error(431, "request headers too large")
        except ClientTooSlow:       # its request's phase (headers, body) ended before the request did
            self.close_connection = True
            if not self._answered:
                self._quick_error(408, "request not received in time")
        except OSError:             # the client went away
            self.close_connection = True

    def _quick_error(self, status: int, message: str) -> None:
        """An error answer to a client that may not be reading: one short write, then the connection ends."""
        try:
            self.connection.settimeout(0.5)
            self._send_json(status, {"error": message}, {"Connection": "close"})
        except OSError:
            pass

    # ------------------------------------------------------------------ answers
    def _send_json(self, status: int, obj, extra: Optional[dict] = None) -> None:
        data = json_bytes(obj)
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        for k, v in (extra or {}).items():
            self.send_header(k, v)
        self.end_headers()
        self.wfile.write(data)

    def _has_body(self) -> bool:
        return bool(self.headers.get("Transfer-Encoding")) or self.headers.get("Content-Length", "0").strip() != "0"

    def _refuse(self, status: int, message: str, extra: Optional[dict] = None, body_read: bool = False) -> None:
        """An error answer; the connection ends after it unless the request's body was read (lingering
        where the client may still be sending one: a POST, or any request that announced a body)."""
        extra = dict(extra or {})
        if not body_read:
            self.close_connection = True
            self._linger = self.command == "POST" or (getattr(self, "headers", None) is not None
                                                      and self._has_body())
            extra["Connection"] = "close"
        self._send_json(status, {"error": message}, extra)

    # ------------------------------------------------------------------ the request's body
    def _content_length(self) -> int:
        """The request body's size from its headers, checked against the limit (``BadRequest``)."""
        if self.headers.get("Transfer-Encoding") is not None:
            raise BadRequest(411, "chunked request bodies are not accepted: send Content-Length")
        values = self.headers.get_all("Content-Length") or []
        if not values:
            raise BadRequest(411, "Content-Length required")
        values = {v.strip() for v in values}
        if len(values) != 1 or not _CONTENT_LENGTH.fullmatch(next(iter(values))):
            raise BadRequest(400, "invalid Content-Length")
        n = int(values.pop())
        if n > self.limits.max_body_bytes:
            raise BadRequest(413, f"request body of {n} bytes; this proxy takes at most "
                                  f"{self.limits.max_body_bytes}")
        return n

    def _read_body(self, length: int) -> Optional[bytearray]:
        """The body (``length`` bytes, from ``_content_length``) within the body timeout; None if the client
        closed before sending all of it."""
        r = self.rfile
        r.phase(time.monotonic() + self.limits.body_timeout_s, length)
        raw = bytearray()
        try:
            while len(raw) < length:
                chunk = r.read(min(65536, length - len(raw)))
                if not chunk:
                    return None
                raw += chunk
        finally:
            r.phase(None)
        return raw


class ProxyServer(ThreadingHTTPServer):
    """A thread per client connection, at most ``max_connections`` of them: beyond that a connection is
    answered 503 and closed by the accepting thread at once."""
    daemon_threads = True
    block_on_close = False
    request_queue_size = 1024          # a burst of connections waits for accept() rather than a SYN retry

    def __init__(self, address, handler, limits: Limits):
        self.limits = limits
        self.max_connections = connection_cap(limits.max_connections)
        self.inflight = Budget(limits.max_inflight_bytes)       # request bodies
        self.answers = Budget(limits.max_inflight_bytes)        # prefill answers (apart: no request holding
                                                                # a body waits on another for its answer)
        self.parse_gate = Budget(limits.max_body_bytes)         # JSON parsed at once (one body of the
                                                                # largest size; a larger answer: alone)
        self.connections = self.refused = 0
        self._lock = threading.Lock()
        self._refusal_logged = 0.0
        super().__init__(address, handler)

    def process_request(self, request, client_address):
        with self._lock:
            full = self.connections >= self.max_connections
            if full:
                self.refused += 1
            else:
                self.connections += 1
        if not full:
            t = threading.Thread(target=self.process_request_thread, args=(request, client_address),
                                 name="ciuicflow-vllm-proxy-conn", daemon=True)
            try:
                t.start()
                return
            except RuntimeError:        # no thread to be had
                self._release()
        self._turn_away(request)

    def _release(self) -> None:
        with self._lock:
            self.connections -= 1

    def process_request_thread(self, request, client_address):
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._release()

    def _turn_away(self, request) -> None:
        try:
            request.setblocking(False)
            request.send(_BUSY)
        except OSError:
            pass
        self.shutdown_request(request)
        now = time.monotonic()
        if now - self._refusal_logged > 10.0:
            self._refusal_logged = now
            log.warning("connection cap (%d) reached: refusing connections (%d so far)", self.max_connections,
                        self.refused)

    def handle_error(self, request, client_address):
        exc = sys.exc_info()[1]
        log.warning("connection from %s: %s: %s", client_address[0] if client_address else "?",
                    type(exc).__name__, exc)
        log.debug("traceback", exc_info=True)


def connection_cap(requested: int) -> int:
    """``requested``, lowered so that each connection's two descriptors (the client's, one upstream) fit
    under RLIMIT_NOFILE with room for the rest of the process."""
    try:
        import resource
        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    except (ImportError, OSError, ValueError):
        return requested
    if soft == resource.RLIM_INFINITY:
        return requested
    room = max(1, (soft - 64) // 2)
    if room < requested:
        log.warning("max_connections %d lowered to %d (RLIMIT_NOFILE %d: two descriptors per connection)",
                    requested, room, soft)
    return min(requested, room)
