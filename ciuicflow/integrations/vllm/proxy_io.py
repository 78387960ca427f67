"""What one client connection may make the routing proxy hold, and the socket reads and writes that keep
to it: ``Limits`` (sizes and timeouts), ``Budget`` (bytes held at once, across connections), and the
client's reader and writer, each read bound to its phase's deadline. Standard library only.
"""
from __future__ import annotations

import math
import socket
import sys
import threading
import time
from dataclasses import asdict, dataclass
from typing import Optional

MiB = 1 << 20


@dataclass(frozen=True)
class Limits:
    """What one client may make the proxy hold (docs/security.md, The routing proxy)."""
    max_body_bytes: int = 4 * MiB           # request body; larger: 413 (from Content-Length, before reading)
    max_header_bytes: int = 64 * 1024       # request line and headers together; larger: 431
    max_connections: int = 256              # client connections at once (lowered to fit RLIMIT_NOFILE)
    max_inflight_bytes: int = 32 * MiB      # request bodies held at once, all connections (beyond: 503); as
                                            # much again for prefill answers
    max_prefill_answer_bytes: int = 4 * MiB     # the prefill's answer (read whole); larger: prefill failed
    header_timeout_s: float = 10.0          # request line and headers, from the connection (or first byte)
    body_timeout_s: float = 30.0            # the whole body, from the end of the headers
    idle_timeout_s: float = 15.0            # keep-alive: wait for the next request's first byte
    send_timeout_s: float = 60.0            # one write of the answer to the client (a client not reading)

    def __post_init__(self):
        for k, v in asdict(self).items():
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v > 0):
                raise ValueError(f"proxy limit {k} must be a positive number, not {v!r}")
        if self.max_inflight_bytes < self.max_body_bytes:
            raise ValueError(f"max_inflight_bytes ({self.max_inflight_bytes}) must be at least max_body_bytes "
                             f"({self.max_body_bytes}), or a body of the largest size could never be taken")


class HeadersTooLarge(Exception):
    """The request line and headers went past their byte budget."""


class ClientTooSlow(TimeoutError):
    """The client's request (headers or body) did not arrive before its phase's deadline."""


class Budget:
    """Bytes held at once, across threads. A request for more than the capacity takes all of it."""

    def __init__(self, capacity: int):
        self.capacity, self.used = int(capacity), 0
        self._cv = threading.Condition()

    def take(self, n: int, timeout: float = 0.0) -> bool:
        n = min(int(n), self.capacity)
        with self._cv:
            if not self._cv.wait_for(lambda: self.used + n <= self.capacity, timeout):
                return False
            self.used += n
            return True

    def give(self, n: int) -> None:
        with self._cv:
            self.used -= min(int(n), self.capacity)
            self._cv.notify_all()


class ClientReader:
    """The read side of a client's socket. Every read belongs to a phase with a deadline (the request
    line and headers, the body, the keep-alive wait): a client trickling bytes is cut off when its phase
    ends, not when one read waits too long. The header phase also has a byte budget. After each read the
    socket's timeout is the send timeout again (writes of the answer)."""

    def __init__(self, sock: socket.socket, send_timeout: float):
        self._sock, self._send_timeout = sock, send_timeout
        self._buf = bytearray()
        self.deadline: Optional[float] = None
        self.left: Optional[int] = None         # bytes the phase may still consume (None: no budget)
        self.closed = False

    def phase(self, deadline: Optional[float], max_bytes: Optional[int] = None) -> None:
        """Reads from now on end at ``deadline`` (None: no reading) and consume at most ``max_bytes``."""
        self.deadline, self.left = deadline, max_bytes

    def _recv(self) -> bool:
        if self.deadline is None:
            raise RuntimeError("proxy: a client read outside a request phase")
        remaining = self.deadline - time.monotonic()
        if remaining <= 0:
            raise ClientTooSlow("client too slow")
        self._sock.settimeout(remaining)
        try:
            data = self._sock.recv(65536)
        except TimeoutError:
            raise ClientTooSlow("client too slow") from None
        finally:
            self._sock.settimeout(self._send_timeout)
        self._buf += data
        return bool(data)

    def _take(self, n: int) -> bytes:
        if self.left is not None:
            if n > self.left:
                raise HeadersTooLarge()
            self.left -= n
        out = bytes(self._buf[:n])
        del self._buf[:n]
        return out

    def wait_for_data(self, deadline: float) -> bool:
        """Keep-alive: whether the next request starts before ``deadline`` (False: timed out or closed)."""
        if self._buf:
            return True
        self.phase(deadline)
        try:
            return self._recv()
        except TimeoutError:
            return False

    def readline(self, limit: int = -1) -> bytes:
        limit = limit if limit is not None and limit >= 0 else sys.maxsize
        start = 0
        while True:
            i = self._buf.find(b"\n", start, limit)
            if i >= 0:
                return self._take(i + 1)
            if len(self._buf) >= limit:
                return self._take(limit)
            if self.left is not None and len(self._buf) > self.left:
                raise HeadersTooLarge()
            start = len(self._buf)
            if not self._recv():
                return self._take(len(self._buf))

    def read(self, n: int) -> bytes:
        while len(self._buf) < n:
            if not self._recv():
                break
        return self._take(min(n, len(self._buf)))

    def close(self) -> None:
        self.closed = True


class ClientWriter:
    """The write side: ``sendall`` under the socket's send timeout (unbuffered, as socketserver's own)."""

    def __init__(self, sock: socket.socket):
        self._sock, self.closed = sock, False

    def write(self, data) -> int:
        self._sock.sendall(data)
        return len(data)

    def flush(self) -> None:
        pass

    def close(self) -> None:
        self.closed = True
