"""The client's end of its sidecar's descriptor socket (sidecar/fd_handoff.py): a ring's descriptor goes over
with ``SCM_RIGHTS`` and its handle (``fd:HEX``) comes back; the sidecar then uses that descriptor, and
opens nothing of this process's by path. Reachable only by the sidecar's user on its host (the socket
sits in that user's private runtime directory, proto/runtime.py)."""
from __future__ import annotations

import os
import socket
import threading
from typing import Optional

from ..proto import runtime

TIMEOUT_S = 5.0


class FdHandoff:
    def __init__(self, path: str):
        self.path = path
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
        self._sock.settimeout(TIMEOUT_S)
        self._lock = threading.Lock()
        self._pid = os.getpid()
        try:
            self._sock.connect(path)
        except BaseException:
            self._sock.close()
            raise

    @classmethod
    def for_address(cls, address: str) -> Optional["FdHandoff"]:
        """The descriptor socket of the sidecar at ``address`` (None: not reachable from here)."""
        port = runtime.port_of(address)
        try:
            path = runtime.api_file(port, "sock") if port is not None else None
            return cls(path) if path else None
        except OSError:
            return None

    def register(self, fd: int) -> str:
        """Hand ``fd`` over; its handle. Raises OSError when the sidecar refuses it."""
        with self._lock:
            if os.getpid() != self._pid:
                raise OSError("descriptor socket inherited across fork")
            socket.send_fds(self._sock, [b"R"], [fd])
            reply = self._sock.recv(256)
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
