"""Descriptors handed over by local clients: a Unix socket (``SOCK_SEQPACKET``) in the sidecar user's private
runtime directory (proto/runtime.py, ``api-NETNS-PORT.sock``) on which a client passes its shared-memory
ring's descriptor (``SCM_RIGHTS``) and gets a handle back, ``fd:HEX``, that its ShmRefs name.

Why: the sidecar then opens nothing by path for such rings, so no caller can make it open another
process's files (the old ``/proc/PID/fd/N`` paths could name any process's descriptors). Passing a
descriptor proves the caller holds it. The socket's directory is private to the sidecar's user, and each
connection's peer credentials (``SO_PEERCRED``) must be that user's (or root's).

Messages: ``R`` with one descriptor -> ``H<handle>`` (or ``E<why>``); ``D<handle>`` drops one (no answer).
A handle lives until it is dropped or its connection closes (a client that dies leaves nothing behind);
at most ``PER_CONNECTION`` per connection.
"""
from __future__ import annotations

import array
import asyncio
import fcntl
import logging
import os
import secrets
import socket
import stat
import struct
from typing import Dict, Optional, Tuple

from ..proto.shm import HANDLE_PREFIX, HEADER

log = logging.getLogger("ciuicflow.kvflow.shm")

PER_CONNECTION = 256            # handles one client connection may hold
MAX_CONNECTIONS = 256
_CRED = struct.Struct("3i")     # struct ucred: pid, uid, gid


class FdRegistry:
    """Handles of descriptors handed over: handle -> (fd, the connection that owns it)."""

    def __init__(self):
        self._fds: Dict[str, Tuple[int, object]] = {}
        self._owned: Dict[object, set] = {}

    def add(self, fd: int, owner) -> Optional[str]:
        mine = self._owned.setdefault(owner, set())
        if len(mine) >= PER_CONNECTION:
            return None
        handle = HANDLE_PREFIX + secrets.token_hex(16)
        self._fds[handle] = (fd, owner)
        mine.add(handle)
        return handle

    def dup(self, handle: str) -> int:
        """A descriptor of its own for the file behind ``handle`` (KeyError: no such handle)."""
        return os.dup(self._fds[handle][0])

    def drop(self, handle: str, owner) -> None:
        entry = self._fds.get(handle)
        if entry is not None and entry[1] is owner:
            del self._fds[handle]
            self._owned[owner].discard(handle)
            os.close(entry[0])

    def drop_owner(self, owner) -> None:
        for handle in self._owned.pop(owner, ()):
            os.close(self._fds.pop(handle)[0])

    def __len__(self) -> int:
        return len(self._fds)


def _usable(fd: int) -> Optional[str]:
    """Why the handed-over ``fd`` cannot be a ring (None: it can): a regular file, open read-write."""
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        return "not a regular file"
    if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE != os.O_RDWR:
        return "not open for reading and writing"
    if st.st_size < HEADER:
        return "smaller than a ring's header"
    return None


class HandoffServer:
    """The Unix socket clients hand their ring descriptors over on, into ``registry``."""

    def __init__(self, registry: FdRegistry, path: str):
        self.registry = registry
        self.path = path
        self.sock: Optional[socket.socket] = None
        self.conns: set = set()
        self._uid = os.geteuid()

    def start(self) -> None:
        try:
            os.unlink(self.path)        # a stale socket of a sidecar that died on this port
        except FileNotFoundError:
            pass
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC | socket.SOCK_NONBLOCK)
        old = os.umask(0o177)           # created 0600: no window in which another user could connect
        try:
            sock.bind(self.path)
        finally:
            os.umask(old)
        sock.listen(64)
        self.sock = sock
        asyncio.get_running_loop().add_reader(sock.fileno(), self._accept)

    def stop(self) -> None:
        loop = asyncio.get_running_loop()
        for conn in list(self.conns):
            self._close(conn)
        if self.sock is not None:
            loop.remove_reader(self.sock.fileno())
            self.sock.close()
            self.sock = None
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass

    def _accept(self) -> None:
        try:
            conn, _ = self.sock.accept()
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:
            log.warning("descriptor socket: accept failed: %s", exc)
            return
        pid, uid, _ = _CRED.unpack(conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _CRED.size))
        if uid not in (self._uid, 0) or len(self.conns) >= MAX_CONNECTIONS:
            log.info("descriptor socket: refused pid %d uid %d", pid, uid)
            conn.close()
            return
        conn.setblocking(False)
        self.conns.add(conn)
        asyncio.get_running_loop().add_reader(conn.fileno(), self._readable, conn)

    def _close(self, conn: socket.socket) -> None:
        if conn in self.conns:
            self.conns.discard(conn)
            asyncio.get_running_loop().remove_reader(conn.fileno())
            self.registry.drop_owner(conn)
            conn.close()

    def _readable(self, conn: socket.socket) -> None:
        fds = array.array("i")
        try:
            msg, ancdata, _, _ = conn.recvmsg(128, socket.CMSG_SPACE(fds.itemsize), socket.MSG_CMSG_CLOEXEC)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            return self._close(conn)
        for level, kind, data in ancdata:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                fds.frombytes(data[:len(data) - len(data) % fds.itemsize])
        if not msg:
            for fd in fds:
                os.close(fd)
            return self._close(conn)
        op, rest = msg[:1], msg[1:]
        try:
            if op == b"R" and len(fds) == 1:
                try:
                    why = _usable(fds[0])
                except OSError as exc:
                    why = str(exc)
                handle = None if why else self.registry.add(fds[0], conn)
                if handle is None:
                    os.close(fds[0])
                    conn.send(b"E" + (why or f"more than {PER_CONNECTION} handles").encode())
                else:
                    conn.send(b"H" + handle.encode())
                return
            for fd in fds:
                os.close(fd)
            if op == b"D":
                self.registry.drop(rest.decode("ascii", "replace"), conn)
            else:
                self._close(conn)
        except OSError:
            self._close(conn)
