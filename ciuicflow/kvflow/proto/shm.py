"""Shared-memory handoff between a client and the sidecar on the same host.

The bytes of a transfer go through a file in the shared-memory directory (``/dev/shm``, a tmpfs) instead
of through gRPC messages on the local API: the client writes them once, the sidecar reads them once, and
only small ``ShmRef`` handles cross the loopback gRPC connection. Files are always created by the client
(mode 0600, name ``ciuicflow-kv-*``), and nothing is left in ``/dev/shm`` when either process dies.

The sidecar opens only what its caller proves it holds (another local process's rings stay out of reach,
whatever the caller names). A client names a file in one of two ways:

- by a handle, ``fd:HEX`` (``is_handle``): the client hands the file's descriptor over the sidecar's Unix
  socket (``SCM_RIGHTS``, in the sidecar user's private runtime directory, see runtime.py, peer credentials
  checked) and gets the handle back; the client unlinks the file as soon as it is created and keeps the
  ring for its next transfers (``Client``'s ring pool), so a transfer does not pay for fresh tmpfs pages
  (allocating, zeroing and freeing them cost about as much as the copy into them);
- by its name in ``/dev/shm`` with the file's secret, ``PATH#HEX`` (``named_ref``), where the socket is
  out of reach (a container that shares only ``/dev/shm``, a client of another user): the client writes a
  random secret into the file's header (``new_secret``), which only processes that can read the file know;
  the sidecar opens the name without following links (``openat`` from the directory it opened at start,
  ``O_NOFOLLOW``), checks what it opened and compares the secret before anything else, and unlinks the
  name once both sides hold the file. Each transfer has a new file.

``/proc/PID/fd/N`` paths (older clients) are refused. The client checks once per ``Client`` which way works
(``ShmProbe``); when neither does (another host), the bytes go in-band in the gRPC messages as before.
"""
from __future__ import annotations

import os
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


HANDLE_PREFIX = "fd:"            # a descriptor handed over the sidecar's Unix socket: "fd:" + 32 hex digits
SECRET_OFFSET = 64              # a named file's secret, in its header page (after the read position)
SECRET_BYTES = 32


def is_handle(ref: str) -> bool:
    return ref.startswith(HANDLE_PREFIX)


def named_ref(path: str, secret: bytes) -> str:
    """How a file is named to the sidecar by its path: the path and its secret."""
    return f"{path}#{secret.hex()}"


def split_named(ref: str) -> "tuple[str, Optional[bytes]]":
    """(path, secret or None) of a named reference."""
    path, sep, secret = ref.partition("#")
    try:
        return path, bytes.fromhex(secret) if sep else None
    except ValueError:
        return path, None


def new_secret(fd: int) -> bytes:
    """Write a fresh random secret into the file's header; returns it (named files prove possession)."""
    secret = os.urandom(SECRET_BYTES)
    write_all(fd, secret, SECRET_OFFSET)
    return secret


def unlink(ref: Optional[str]) -> None:
    """Remove a named file's name (nothing to do for a handle: the client unlinked it already)."""
    if not ref or is_handle(ref):
        return
    try:
        os.unlink(split_named(ref)[0])
    except FileNotFoundError:
        pass


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
