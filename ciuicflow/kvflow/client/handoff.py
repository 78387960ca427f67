"""The client's end of its sidecar's descriptor socket (sidecar/fd_handoff.py): a ring's descriptor goes over
with ``SCM_RIGHTS`` and its handle (``fd:HEX``) comes back; the sidecar then uses that descriptor, and
opens nothing of this process's by path. Reachable only by the sidecar's user on its host (the socket
sits in that user's private runtime directory, proto/runtime.py)."""
from __future__ import annotations

import os
import select
import socket
import threading
from typing import Optional

from ..proto import runtime

TIMEOUT_S = 5.0


class FdHandoff:
    """One connection to the sidecar's descriptor socket. The sidecar forgets every handle of a connection
    that closes, and a sidecar that restarts has a new socket: ``generation`` counts the connections, so
    rings handed over on an earlier one are not reused (RingPool), and ``register`` reconnects once when the
    sidecar went away."""

    def __init__(self, path: str):
        self.path = path
        self.generation = 0
        self._lock = threading.Lock()
        self._pid = os.getpid()
        self._sock = self._connect()

    def _connect(self) -> socket.socket:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
        sock.settimeout(TIMEOUT_S)
        try:
            sock.connect(self.path)
        except BaseException:
            sock.close()
            raise
        self.generation += 1
        return sock

    @classmethod
    def for_address(cls, address: str) -> Optional["FdHandoff"]:
        """The descriptor socket of the sidecar at ``address`` (None: not reachable from here)."""
        port = runtime.port_of(address)
        try:
            path = runtime.api_file(port, "sock") if port is not None else None
            return cls(path) if path else None
        except OSError:
            return None

    def alive(self) -> bool:
        """Whether the sidecar still holds this connection (no hang-up, nothing unread)."""
        with self._lock:
            return self._alive()

    def _alive(self) -> bool:
        if self._sock.fileno() < 0:
            return False
        try:
            readable, _, _ = select.select([self._sock], [], [], 0)
        except (OSError, ValueError):
            return False
        return not readable             # the sidecar never sends unasked: readable means hung up

    def _reconnect(self) -> None:
        """A new connection (OSError while the sidecar is not there; the next call tries again)."""
        self._sock.close()
        self._sock = self._connect()

    def _register(self, fd: int) -> bytes:
        socket.send_fds(self._sock, [b"R"], [fd])
        reply = self._sock.recv(256)
        if not reply:
            raise ConnectionResetError("the sidecar closed its descriptor socket")
        return reply

    def register(self, fd: int) -> str:
        """Hand ``fd`` over; its handle (of connection ``generation``). Raises OSError when the sidecar
        refuses it or cannot be reached."""
        with self._lock:
            if os.getpid() != self._pid:
                raise OSError("descriptor socket inherited across fork")
            if not self._alive():
                self._reconnect()
            try:
                reply = self._register(fd)
            except OSError:
                self._reconnect()
                reply = self._register(fd)
        if not reply.startswith(b"H"):
            raise OSError(f"the sidecar refused the descriptor: {reply[1:].decode(errors='replace')}")
        return reply[1:].decode()

    def drop(self, handle: str) -> None:
        """The sidecar may close its copy of ``handle``'s descriptor (transfers using it keep theirs)."""
        with self._lock:
            try:
                self._sock.send(b"D" + handle.encode())
            except OSError:
                pass

    def close(self) -> None:
        self._sock.close()
