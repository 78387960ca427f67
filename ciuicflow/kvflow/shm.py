"""Shared-memory handoff between a client and the sidecar on the same host.

The bytes of a transfer go through a file in the shared-memory directory (``/dev/shm``, a tmpfs) instead
of through gRPC messages on the local API: the client writes them once, the sidecar reads them once, and
only small ``ShmRef`` handles cross the loopback gRPC connection. Files are always created by the client
(mode 0600, name ``ciuicflow-kv-*``) and unlinked as soon as both sides hold them open, so nothing is left
in ``/dev/shm`` when either process dies. The client checks once per ``Client`` that the sidecar can open
its files (``ShmProbe``); when it cannot (another host, a container without the same ``/dev/shm``), the
bytes go in-band in the gRPC messages as before.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import os
import stat
import uuid as uuidlib
from typing import Optional

SHM_DIR_ENV = "CIUICFLOW_KVFLOW_SHM_DIR"
PREFIX = "ciuicflow-kv-"
DEFAULT_DIR = "/dev/shm"


def shm_dir() -> str:
    return os.environ.get(SHM_DIR_ENV) or DEFAULT_DIR


def available() -> bool:
    d = shm_dir()
    return os.path.isdir(d) and os.access(d, os.W_OK | os.X_OK)


def create(tag: str = "") -> "tuple[int, str]":
    """A new, empty shared-memory file: (fd open read-write, path)."""
    path = os.path.join(shm_dir(), f"{PREFIX}{os.getpid()}-{tag}{uuidlib.uuid4().hex}")
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    return fd, path


def unlink(path: Optional[str]) -> None:
    if not path:
        return
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def check_path(path: str, allowed_dir: str) -> Optional[str]:
    """Why the sidecar must not open ``path`` (None: it may). Only files named ``ciuicflow-kv-*`` directly
    in the shared-memory directory."""
    if not path or "\x00" in path:
        return "empty shared-memory path"
    name = os.path.basename(path)
    if not name.startswith(PREFIX) or name in (".", ".."):
        return f"shared-memory file {path!r} is not named {PREFIX}*"
    if os.path.realpath(os.path.dirname(path)) != os.path.realpath(allowed_dir):
        return f"shared-memory file {path!r} is not in {allowed_dir}"
    return None


def open_checked(path: str, allowed_dir: str, write: bool = False) -> int:
    """Open a client's shared-memory file (no symlinks, regular files only); raises OSError/ValueError."""
    err = check_path(path, allowed_dir)
    if err:
        raise ValueError(err)
    fd = os.open(path, (os.O_RDWR if write else os.O_RDONLY) | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise ValueError(f"shared-memory file {path!r} is not a regular file")
    except BaseException:
        os.close(fd)
        raise
    return fd


def write_all(fd: int, data, offset: int) -> None:
    mv = memoryview(data).cast("B")
    done = 0
    while done < mv.nbytes:
        n = os.pwrite(fd, mv[done:], offset + done)
        if n <= 0:
            raise OSError("short write to shared memory")
        done += n


def read_exact(fd: int, length: int, offset: int) -> bytes:
    data = os.pread(fd, length, offset)
    if len(data) == length:
        return data
    parts = [data]
    got = len(data)
    while got < length:
        more = os.pread(fd, length - got, offset + got)
        if not more:
            raise EOFError(f"shared-memory file ends at {offset + got}, {length - got} bytes short")
        parts.append(more)
        got += len(more)
    return b"".join(parts)


def read_into(fd: int, buf: memoryview, offset: int) -> None:
    done = 0
    while done < buf.nbytes:
        n = os.preadv(fd, [buf[done:]], offset + done)
        if n <= 0:
            raise EOFError(f"shared-memory file ends at {offset + done}")
        done += n


# ---------------------------------------------------------------------- freeing pages already consumed
_FALLOC_FL_KEEP_SIZE = 0x01
_FALLOC_FL_PUNCH_HOLE = 0x02
_libc = None
PAGE = 4096


def _get_libc():
    global _libc
    if _libc is None:
        try:
            lib = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
            fn = lib.fallocate
            fn.argtypes = (ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long)
            fn.restype = ctypes.c_int
            _libc = fn
        except (OSError, AttributeError):
            _libc = False
    return _libc


def release(fd: int, offset: int, length: int) -> None:
    """Best effort: give back the memory of bytes already consumed (punch a hole, whole pages only)."""
    start = (offset + PAGE - 1) // PAGE * PAGE
    end = (offset + length) // PAGE * PAGE
    if end <= start:
        return
    fn = _get_libc()
    if fn:
        fn(fd, _FALLOC_FL_PUNCH_HOLE | _FALLOC_FL_KEEP_SIZE, start, end - start)
