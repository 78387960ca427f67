"""Which shared-memory files a local caller may make the sidecar open: only its own (proto/shm.py).

* ``fd:HEX`` handles: descriptors the caller handed over the sidecar's Unix socket (fd_handoff.py); the
  sidecar uses a duplicate, nothing is opened by path;
* ``PATH#SECRET`` named files: a name directly in the shared-memory directory, opened with ``openat`` from
  the directory descriptor taken at start (a directory swapped for a symlink later redirects nothing) and
  ``O_NOFOLLOW | O_NONBLOCK`` (no symlink, no FIFO or device that blocks or acts on open), then checked on
  the open descriptor (a regular file on the directory's filesystem) and its secret compared in constant
  time before anything else is read or written: only a process that can read the file knows it.

Everything else (``/proc/PID/fd/N``, other directories, names without a secret) is refused, and the
refusal says nothing about what the caller named (no other process's descriptor targets, no file's
existence): the reason goes to the sidecar's log only.
"""
from __future__ import annotations

import hmac
import logging
import os
import stat
from typing import Optional

from ..proto.shm import PREFIX, SECRET_BYTES, SECRET_OFFSET, is_handle, split_named

log = logging.getLogger("ciuicflow.kvflow.shm")

REFUSED = "shared-memory handle refused (a handle from this sidecar's descriptor socket, or a file of this " \
          "client's in the shared-memory directory with its secret)"


class ShmRefused(Exception):
    def __init__(self):
        super().__init__(REFUSED)


class ShmAccess:
    """Opens callers' shared-memory files for the sidecar. ``registry``: handed-over descriptors (None:
    none); ``directory``: the shared-memory directory (opened once, here)."""

    def __init__(self, directory: str, registry=None):
        self.directory = os.path.normpath(directory)
        self.registry = registry
        self._dirfd: Optional[int] = None
        self._dev = None
        try:
            self._dirfd = os.open(self.directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            self._dev = os.fstat(self._dirfd).st_dev
        except OSError as exc:
            log.info("shared-memory directory %s not usable: %s", self.directory, exc)

    def close(self) -> None:
        if self._dirfd is not None:
            os.close(self._dirfd)
            self._dirfd = None

    def open(self, ref: str) -> int:
        """A descriptor (read-write) of the caller's file ``ref``; raises ShmRefused."""
        try:
            return self._open(ref)
        except (OSError, ValueError, KeyError) as exc:
            log.debug("shared-memory reference refused: %s", exc)
            raise ShmRefused() from None

    def _name(self, ref: str):
        path, secret = split_named(ref)
        directory, name = os.path.split(path)
        if secret is None or len(secret) != SECRET_BYTES:
            raise ValueError("a named file without its secret")
        if os.path.normpath(directory or "/") != self.directory or not name.startswith(PREFIX):
            raise ValueError("not a ciuicflow-kv-* file directly in the shared-memory directory")
        if self._dirfd is None:
            raise ValueError("no shared-memory directory")
        return name, secret

    def _open(self, ref: str) -> int:
        if is_handle(ref):
            if self.registry is None:
                raise ValueError("no descriptor socket")
            return self.registry.dup(ref)
        name, secret = self._name(ref)
        fd = os.open(name, os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC,
                     dir_fd=self._dirfd)
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_dev != self._dev:
                raise ValueError("not a regular file of the shared-memory directory")
            if not hmac.compare_digest(os.pread(fd, SECRET_BYTES, SECRET_OFFSET), secret):
                raise ValueError("wrong secret")
        except BaseException:
            os.close(fd)
            raise
        return fd

    def unlink(self, ref: str, fd: int) -> None:
        """Remove a named file's name once both sides hold it open (nothing is left behind if either dies),
        only while the name still leads to the file opened as ``fd``."""
        if is_handle(ref):
            return
        try:
            name, _ = self._name(ref)
            st, opened = os.stat(name, dir_fd=self._dirfd, follow_symlinks=False), os.fstat(fd)
            if (st.st_dev, st.st_ino) == (opened.st_dev, opened.st_ino):
                os.unlink(name, dir_fd=self._dirfd)
        except (OSError, ValueError):
            pass
