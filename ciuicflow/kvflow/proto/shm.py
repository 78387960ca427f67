"""Shared-memory handoff between a client and the sidecar on the same host.

The bytes of a transfer go through a file in the shared-memory directory (``/dev/shm``, a tmpfs) instead
of through gRPC messages on the local API: the client writes them once, the sidecar reads them once, and
only small ``ShmRef`` handles cross the loopback gRPC connection. Files are always created by the client
(mode 0600, name ``ciuicflow-kv-*``), and nothing is left in ``/dev/shm`` when either process dies. The
client names a file to the sidecar in one of two ways:

- by its descriptor, ``/proc/<client pid>/fd/<fd>`` (``fd_path``), when the sidecar sees the client's
  processes (same PID namespace): the client unlinks the file as soon as it is created, and keeps the
  ring for its next transfers (``Client``'s ring pool), so a transfer does not pay for fresh tmpfs pages
  (allocating, zeroing and freeing them cost about as much as the copy into them);
- by its name in ``/dev/shm`` otherwise (a container that shares only ``/dev/shm``): the sidecar unlinks
  it once both sides hold it open, and each transfer has a new file.

The sidecar opens only files named ``ciuicflow-kv-*`` directly in the shared-memory directory, whichever
way they are named (``open_checked``). The client checks once per ``Client`` which way works
(``ShmProbe``); when neither does (another host), the bytes go in-band in the gRPC messages as before.
"""
from __future__ import annotations

import os
import re
import stat
import struct
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
    """Remove the file's name (nothing to do for a /proc/PID/fd/N path: the client unlinked it already)."""
    if not path or is_fd_path(path):
        return
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


_FD_PATH = re.compile(r"/proc/[0-9]+/fd/[0-9]+")
_DELETED = " (deleted)"


def fd_path(fd: int) -> str:
    """How the sidecar opens this process's file ``fd`` (unlinked or not)."""
    return f"/proc/{os.getpid()}/fd/{fd}"


def is_fd_path(path: str) -> bool:
    return bool(_FD_PATH.fullmatch(path))


def check_path(path: str, allowed_dir: str) -> Optional[str]:
    """Why the sidecar must not open ``path`` (None: it may). Only files named ``ciuicflow-kv-*`` directly
    in the shared-memory directory (for a ``/proc/PID/fd/N`` path: the file it leads to, checked once open)."""
    if not path or "\x00" in path:
        return "empty shared-memory path"
    if path.startswith("/proc/"):
        target = os.readlink(path) if is_fd_path(path) and os.path.islink(path) else ""
        if target.endswith(_DELETED):
            target = target[:-len(_DELETED)]
        if not target:
            return f"{path!r} is not a /proc/PID/fd/N link"
        err = check_path(target, allowed_dir)
        return f"{path!r} leads to a file the sidecar may not open: {err}" if err else None
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
    fd_link = is_fd_path(path)      # a /proc fd link is a symlink by nature: it is followed, then re-checked
    fd = os.open(path, (os.O_RDWR if write else os.O_RDONLY) | (0 if fd_link else os.O_NOFOLLOW) | os.O_CLOEXEC)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise ValueError(f"shared-memory file {path!r} is not a regular file")
        if fd_link:     # what was opened, not what the link said a moment before
            err = check_path(fd_path(fd), allowed_dir)
            if err:
                raise ValueError(err)
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


# ---------------------------------------------------------------------- rings
# A transfer's file is a ring: a header page, then ``ring`` bytes of data. Writers place bytes at a logical
# position (which only grows; ``HEADER + pos % ring`` in the file, wrapping at the end) and never more than
# ``ring`` ahead of the reader, who publishes in the header how far it has read. The same pages are written
# again and again: a fresh tmpfs page costs about as much to allocate, zero and free as the copy into it.
PAGE = 4096
HEADER = PAGE
_POS = struct.Struct("<Q")


def create_ring(tag: str, ring: int) -> "tuple[int, str]":
    """A new ring file of ``ring`` data bytes: (fd open read-write, path)."""
    fd, path = create(tag)
    try:
        os.ftruncate(fd, HEADER + ring)
    except BaseException:
        unlink(path)
        os.close(fd)
        raise
    return fd, path


def _spans(ring: int, pos: int, n: int):
    """(file offset, start, length) pieces of ``n`` bytes at logical ``pos`` in a ring of ``ring`` bytes."""
    if ring <= 0 or n > ring:
        raise ValueError(f"{n} bytes do not fit a ring of {ring}")
    at = pos % ring
    first = min(n, ring - at)
    yield HEADER + at, 0, first
    if first < n:
        yield HEADER, first, n - first


def ring_write(fd: int, ring: int, data, pos: int) -> None:
    mv = memoryview(data).cast("B")
    for offset, start, length in _spans(ring, pos, mv.nbytes):
        write_all(fd, mv[start:start + length], offset)


def ring_read_into(fd: int, ring: int, buf: memoryview, pos: int) -> None:
    for offset, start, length in _spans(ring, pos, buf.nbytes):
        read_into(fd, buf[start:start + length], offset)


def ring_read(fd: int, ring: int, pos: int, n: int) -> bytes:
    pieces = [read_exact(fd, length, offset) for offset, _, length in _spans(ring, pos, n)]
    return pieces[0] if len(pieces) == 1 else b"".join(pieces)


def publish_read(fd: int, pos: int) -> None:
    """The reader has taken everything before logical position ``pos``."""
    os.pwrite(fd, _POS.pack(pos), 0)


def read_position(fd: int) -> int:
    data = os.pread(fd, _POS.size, 0)
    return _POS.unpack(data)[0] if len(data) == _POS.size else 0
