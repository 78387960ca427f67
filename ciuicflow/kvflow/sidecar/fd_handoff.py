"""Descriptors handed over by local clients: a Unix socket (``SOCK_SEQPACKET``) in the sidecar user's private
runtime directory (proto/runtime.py, ``api-NETNS-PORT.sock``) on which a client passes its shared-memory
ring's descriptor (``SCM_RIGHTS``) and gets a handle back, ``fd:HEX``, that its ShmRefs name.

Why: the sidecar then opens nothing by path for such rings, so no caller can make it open another
process's files (the old ``/proc/PID/fd/N`` paths could name any process's descriptors). Passing a
descriptor proves the caller holds it. The socket's directory is private to the sidecar's user, and each
connection's peer credentials (``SO_PEERCRED``) must be that user's (or root's).

Messages: ``R`` with one descriptor -> ``H<handle>`` (or ``E<why>``); ``D<handle>`` drops one (no answer).
A handle lives until it is dropped or its connection closes (a client that dies leaves nothing behind).
Each handle is a descriptor the sidecar holds, so they are capped well below its descriptor limit
(core/limits.py, ``descriptor_caps``): in all, and per client (the peer process on the socket, whatever
its connections); so are the connections, in all and per client. A refusal names the cap.
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

_CRED = struct.Struct("3i")     # struct ucred: pid, uid, gid
ACCEPT_PAUSE_S = 1.0


class HandleLimit(Exception):
    """A handle refused: a cap is reached (the message names it)."""


class FdRegistry:
    """Handles of descriptors handed over: handle -> (fd, the connection that owns it, its client), at most
    ``total`` in all and ``per_client`` per client (a process: (uid, pid))."""

    def __init__(self, total: int = 4096, per_client: int = 256):
        self.total = total
        self.per_client = per_client
        self._fds: Dict[str, Tuple[int, object, Tuple[int, int]]] = {}
        self._owned: Dict[object, set] = {}
        self._per_client: Dict[Tuple[int, int], int] = {}

    def add(self, fd: int, owner, client: Tuple[int, int] = (0, 0)) -> str:
        """A new handle for ``fd`` (which it then owns); raises HandleLimit."""
        held = self._per_client.get(client, 0)
        if held >= self.per_client:
            raise HandleLimit(f"ring handle cap reached: this client (pid {client[1]}) holds {held}, the most one "
                              f"client may (derived from the sidecar's descriptor limit); drop handles first")
        if len(self._fds) >= self.total:
            raise HandleLimit(f"ring handle cap reached: the sidecar holds {self.total} handles, the most it "
                              f"takes in all (derived from its descriptor limit); try again later")
        handle = HANDLE_PREFIX + secrets.token_hex(16)
        self._fds[handle] = (fd, owner, client)
        self._owned.setdefault(owner, set()).add(handle)
        self._per_client[client] = held + 1
        return handle

    def _forget(self, handle: str) -> int:
        fd, _, client = self._fds.pop(handle)
        left = self._per_client[client] - 1
        if left:
            self._per_client[client] = left
        else:
            del self._per_client[client]
        return fd

    def dup(self, handle: str) -> int:
        """A descriptor of its own for the file behind ``handle`` (KeyError: no such handle)."""
        return os.dup(self._fds[handle][0])

    def drop(self, handle: str, owner) -> None:
        entry = self._fds.get(handle)
        if entry is not None and entry[1] is owner:
            self._owned[owner].discard(handle)
            os.close(self._forget(handle))

    def drop_owner(self, owner) -> None:
        for handle in self._owned.pop(owner, ()):
            os.close(self._forget(handle))

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

    def __init__(self, registry: FdRegistry, path: str, max_connections: int = 256):
        self.registry = registry
        self.path = path
        self.max_connections = max_connections
        self.per_client = max(2, max_connections // 4)      # connections of one client process
        self.sock: Optional[socket.socket] = None
        self.conns: Dict[socket.socket, Tuple[int, int]] = {}      # connection -> its client (uid, pid)
        self._uid = os.geteuid()
        self._warned = False

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
        except OSError as exc:          # out of descriptors despite the caps: back off, do not spin
            log.warning("descriptor socket: accept failed (%s): not accepting for %gs", exc, ACCEPT_PAUSE_S)
            loop = asyncio.get_running_loop()
            loop.remove_reader(self.sock.fileno())
            loop.call_later(ACCEPT_PAUSE_S, self._resume_accepting)
            return
        pid, uid, _ = _CRED.unpack(conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _CRED.size))
        why = self._refusal(uid, pid)
        if why:
            self._note(f"descriptor socket: refused pid {pid} uid {uid}: {why}")
            try:
                conn.send(b"E" + why.encode())     # the client's next reply: it says why
            except OSError:
                pass
            conn.close()
            return
        conn.setblocking(False)
        self.conns[conn] = (uid, pid)
        asyncio.get_running_loop().add_reader(conn.fileno(), self._readable, conn)

    def _note(self, message: str) -> None:
        """A refusal: logged once as a warning (a cap reached, or another user), then at debug level (a
        flood must not flood the log too)."""
        log.log(logging.DEBUG if self._warned else logging.WARNING, "%s", message)
        self._warned = True

    def _resume_accepting(self) -> None:
        if self.sock is not None:
            asyncio.get_running_loop().add_reader(self.sock.fileno(), self._accept)

    def _refusal(self, uid: int, pid: int) -> str:
        """Why a connection of ``uid``/``pid`` is refused ("": it is not)."""
        if uid not in (self._uid, 0):
            return "another user"
        if len(self.conns) >= self.max_connections:
            return f"connection cap reached: {self.max_connections} in all (from the sidecar's descriptor limit)"
        if sum(1 for client in self.conns.values() if client == (uid, pid)) >= self.per_client:
            return f"connection cap reached: {self.per_client} per client process"
        return ""

    def _close(self, conn: socket.socket) -> None:
        if conn in self.conns:
            del self.conns[conn]
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
                if not why:
                    try:
                        return conn.send(b"H" + self.registry.add(fds[0], conn, self.conns[conn]).encode())
                    except HandleLimit as exc:
                        why = str(exc)
                        self._note(f"descriptor socket: refused a handle of pid {self.conns[conn][1]}: {why}")
                os.close(fds[0])
                conn.send(b"E" + why.encode())
                return
            for fd in fds:
                os.close(fd)
            if op == b"D":
                self.registry.drop(rest.decode("ascii", "replace"), conn)
            else:
                self._close(conn)
        except OSError:
            self._close(conn)
