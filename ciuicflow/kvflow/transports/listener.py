"""A listening TCP socket that holds at most ``max_connections`` accepted connections (the data plane's and
the metrics endpoint's).

asyncio's own servers accept a whole backlog's worth of connections in one go and only then let the
protocol see them: a flood makes the process hold that many descriptors beyond any cap, and under a low
descriptor limit accept() fails with EMFILE. Here a connection beyond the cap is answered (``refusal``)
and closed at once, before anything else is made for it, so the descriptors held never exceed the cap
by more than the one being refused.
"""
from __future__ import annotations

import asyncio
import logging
import socket
from typing import Callable, Optional

log = logging.getLogger("ciuicflow.kvflow.listener")

ACCEPT_BATCH = 16           # connections accepted per wake-up (then other work gets its turn)
PAUSE_S = 1.0               # accept() failed for want of resources: try again after this


class BoundedListener:
    """Calls ``on_accept(sock)`` (a non-blocking socket) for each connection while fewer than
    ``max_connections`` are held; the owner calls ``release()`` once for each when it is closed. Beyond
    the cap: ``refusal`` is sent (best effort), the socket closed and ``on_refused()`` called."""

    def __init__(self, on_accept: Callable[[socket.socket], None], max_connections: int, *, what: str,
                 refusal: bytes = b"", on_refused: Optional[Callable[[], None]] = None):
        self.on_accept = on_accept
        self.max_connections = max_connections
        self.what = what
        self.refusal = refusal
        self.on_refused = on_refused
        self.count = 0
        self.sock: Optional[socket.socket] = None
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._resume: Optional[asyncio.TimerHandle] = None

    @property
    def port(self) -> int:
        return self.sock.getsockname()[1] if self.sock is not None else 0

    def start(self, host: str, port: int, backlog: int = 128) -> int:
        """Listen on ``host:port`` (the first address ``host`` resolves to); the port bound."""
        family, kind, proto, _, address = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM,
                                                             flags=socket.AI_PASSIVE)[0]
        sock = socket.socket(family, kind, proto)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(address)
            sock.listen(backlog)
            sock.setblocking(False)
        except BaseException:
            sock.close()
            raise
        self.sock = sock
        self._loop = asyncio.get_running_loop()
        self._loop.add_reader(sock.fileno(), self._accept)
        return self.port

    def release(self) -> None:
        self.count = max(self.count - 1, 0)

    def close(self) -> None:
        if self._resume is not None:
            self._resume.cancel()
            self._resume = None
        if self.sock is not None:
            self._loop.remove_reader(self.sock.fileno())
            self.sock.close()
            self.sock = None

    def _accept(self) -> None:
        for _ in range(ACCEPT_BATCH):
            try:
                conn, _ = self.sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:      # out of descriptors or memory despite the caps: back off
                self._pause(exc)
                return
            if self.count >= self.max_connections:
                self._refuse(conn)
                continue
            conn.setblocking(False)
            self.count += 1
            try:
                self.on_accept(conn)
            except Exception:           # noqa: BLE001 - one connection's failure must not stop the listener
                log.exception("%s: accepting a connection failed", self.what)
                conn.close()
                self.release()

    def _refuse(self, conn: socket.socket) -> None:
        try:
            conn.setblocking(False)
            if self.refusal:
                conn.send(self.refusal)
        except OSError:
            pass
        conn.close()
        if self.on_refused is not None:
            self.on_refused()

    def _pause(self, exc: OSError) -> None:
        log.warning("%s: accept failed (%s): not accepting for %gs", self.what, exc, PAUSE_S)
        self._loop.remove_reader(self.sock.fileno())

        def resume():
            self._resume = None
            if self.sock is not None:
                self._loop.add_reader(self.sock.fileno(), self._accept)
        self._resume = self._loop.call_later(PAUSE_S, resume)
