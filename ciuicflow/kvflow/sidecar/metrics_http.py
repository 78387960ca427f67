"""The metrics endpoint (``--metrics-port``): a small HTTP/1.1 server on the sidecar's event loop that
answers ``GET /metrics`` with the registry's text format, and nothing else.

It needs no token, so whoever reaches ``--metrics-host`` may connect; what they can make it hold is
bounded like every other port's: at most ``max_connections`` connections (more are answered 503 and
closed before anything is made for them, listener.py), no thread per connection, a request head of at
most MAX_REQUEST_BYTES that must arrive within ``header_timeout_s`` in all (a client sending a byte now
and then gains nothing), one request per connection, and a response the client does not take within
``idle_timeout_s`` is dropped. Anything that is not a well-formed request is answered with a 4xx status
and closed, without a traceback.
"""
from __future__ import annotations

import asyncio
import logging
from typing import Optional, Tuple

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from ..transports.listener import BoundedListener

log = logging.getLogger("ciuicflow.kvflow.metrics")

MAX_REQUEST_BYTES = 8192        # request line and headers
LINGER_S = 1.0                  # after the response: what the client still sends is read and dropped ...
LINGER_BYTES = 64 << 10         # ... this long, at most this much (a close with unread input resets the
                                # connection, which can destroy the response before the client reads it)
_REASONS = {200: "OK", 400: "Bad Request", 404: "Not Found", 405: "Method Not Allowed",
            408: "Request Timeout", 431: "Request Header Fields Too Large", 500: "Internal Server Error",
            503: "Service Unavailable"}


def response(status: int, body: bytes = b"", content_type: str = "text/plain; charset=utf-8",
             extra: str = "") -> bytes:
    head = (f"HTTP/1.1 {status} {_REASONS[status]}\r\nContent-Type: {content_type}\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n{extra}\r\n")
    return head.encode("ascii") + body


BUSY = response(503, b"too many metrics connections\n")


def route(head: bytes) -> Tuple[int, str]:
    """The status for a request head (its request line; headers are not needed) and, for 405, its
    Allow header."""
    parts = head.split(b"\r\n", 1)[0].split(b" ")
    if len(parts) != 3 or not parts[2].startswith(b"HTTP/1."):
        return 400, ""
    method, target = parts[0], parts[1]
    if target.split(b"?", 1)[0] != b"/metrics":
        return 404, ""
    if method != b"GET":
        return 405, "Allow: GET\r\n"
    return 200, ""


class MetricsServer:
    """Serves ``registry`` on one port; ``start(host, port)``, ``close()``."""

    def __init__(self, registry, max_connections: int, header_timeout_s: float, idle_timeout_s: float):
        self.registry = registry
        self.header_timeout_s = header_timeout_s
        self.idle_timeout_s = idle_timeout_s
        self.listener = BoundedListener(self._accepted, max_connections, what="metrics", refusal=BUSY)
        self._tasks: set = set()

    def start(self, host: str, port: int) -> int:
        return self.listener.start(host, port)

    def close(self) -> None:
        self.listener.close()
        for task in list(self._tasks):
            task.cancel()

    def _accepted(self, sock) -> None:
        task = asyncio.get_running_loop().create_task(self._serve(sock))
        self._tasks.add(task)
        task.add_done_callback(self._done)

    def _done(self, task: asyncio.Task) -> None:
        self._tasks.discard(task)
        self.listener.release()

    async def _serve(self, sock) -> None:
        writer = None
        try:
            reader, writer = await asyncio.open_connection(sock=sock, limit=MAX_REQUEST_BYTES)
            answer = await self._answer(reader)
            if answer is not None:
                writer.write(answer)
                await asyncio.wait_for(writer.drain(), self.idle_timeout_s)
                writer.write_eof()
                await asyncio.wait_for(_discard(reader), LINGER_S)
        except (OSError, asyncio.TimeoutError, asyncio.IncompleteReadError, asyncio.LimitOverrunError) as exc:
            log.debug("metrics connection ended: %r", exc)
        except Exception:               # noqa: BLE001 - never a traceback per stranger
            log.debug("metrics connection failed", exc_info=True)
        finally:
            if writer is not None:
                writer.transport.abort()
            else:
                sock.close()

    async def _answer(self, reader: asyncio.StreamReader) -> Optional[bytes]:
        """The response to the request on ``reader`` (None: the client closed without one)."""
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), self.header_timeout_s)
        except asyncio.TimeoutError:
            return response(408, b"request head not received in time\n")
        except asyncio.LimitOverrunError:
            return response(431, f"request head over {MAX_REQUEST_BYTES} bytes\n".encode())
        except asyncio.IncompleteReadError as exc:
            return response(400, b"incomplete request\n") if exc.partial else None
        status, extra = route(head)
        if status != 200:
            return response(status, f"{_REASONS[status]}: only GET /metrics is served\n".encode(), extra=extra)
        return response(200, generate_latest(self.registry), CONTENT_TYPE_LATEST)


async def _discard(reader: asyncio.StreamReader) -> None:
    left = LINGER_BYTES
    while left > 0:
        data = await reader.read(min(left, 16 << 10))
        if not data:
            return
        left -= len(data)
