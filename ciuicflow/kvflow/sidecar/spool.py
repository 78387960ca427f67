"""Receiver spool (``--spool-dir``): received chunks are written through to disk, and made durable
(``fdatasync``) before they are acknowledged, so an acknowledged chunk (and a committed transfer) survives a
receiver killed at any point: it resumes from its last acknowledged chunk when it comes back, and keeps
completed-but-uncollected transfers (their lease restarts). The outcomes of the latest transfers
(collected, expired) are kept too, so a sender retrying after a restart is not delivered twice.

Per transfer, named by the SHA-256 of its (source, key): ``.meta`` (JSON), ``.data`` (chunk bytes back to
back) and ``.idx`` (one JSON line per chunk: seq, part, offset, length, crc32c, part bytes, PartInfo, and for
a packed chunk the PartInfos of its further parts); ``tombstones.log``: one JSON line per outcome.

The directory is private (created 0700; one that is a symlink or another user's is refused, one of this
user's open to others is made 0700), files are created 0600 relative to the directory opened at start and never through a symlink
(``O_NOFOLLOW``). Restoring (spool_restore.py) trusts nothing in them. A file that cannot be written (a
symlink planted in its place, a full disk) raises ``SpoolError``: its transfer fails with that status, the
sidecar goes on, and each such file is logged once, however often its transfer is tried again.
"""
from __future__ import annotations

import base64
import contextlib
import errno
import hashlib
import json
import logging
import os
import stat
from typing import Dict, List, Tuple

import grpc

from ..proto import kvflow_pb2 as pb

log = logging.getLogger("ciuicflow.kvflow.spool")

TOMBSTONE_LOG = "tombstones.log"
_FLAGS = os.O_NOFOLLOW | os.O_CLOEXEC
MAX_LOGGED = 1024       # files whose refusal was logged, remembered so that it is logged once


class SpoolError(OSError):
    """A spool file that cannot be written: ``code`` is the status its transfer fails with."""

    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code = code
        self.message = message


def private_dir(directory: str) -> int:
    """The spool directory, created if missing, as a descriptor; raises PermissionError unless it is this
    user's directory (not a symlink). One of this user's that others may enter (sidecars before this made
    theirs with the umask) is made private (0700), with a warning."""
    try:
        os.mkdir(directory, 0o700)
    except FileExistsError:
        pass
    st = os.lstat(directory)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
        raise PermissionError(f"--spool-dir {directory} must be a directory of this user (uid {os.geteuid()}), "
                              "not a symlink")
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | _FLAGS)
    if st.st_mode & 0o077:
        log.warning("--spool-dir %s was open to other users (mode %o): made 0700", directory, st.st_mode & 0o777)
        os.fchmod(fd, 0o700)
    return fd


class Spool:
    def __init__(self, directory: str):
        self.dir = directory
        self.dirfd = private_dir(directory)
        self._files: Dict[Tuple[str, str], Tuple[int, int]] = {}       # (source, key) -> (data fd, idx fd)
        self._tomb_lines = 0
        self._logged: set = set()

    @contextlib.contextmanager
    def _writing(self, what: str):
        """Raise any OSError of the block as a SpoolError about ``what`` (or the file it names)."""
        try:
            yield
        except SpoolError:
            raise
        except OSError as exc:
            raise self._refused(exc.filename or what, exc) from None

    def _refused(self, name: str, exc: OSError) -> SpoolError:
        if exc.errno == errno.ELOOP:
            why = "a symlink is in its place (not followed)"
        else:
            why = exc.strerror or str(exc)
        code = grpc.StatusCode.RESOURCE_EXHAUSTED if exc.errno in (errno.ENOSPC, errno.EDQUOT) \
            else grpc.StatusCode.FAILED_PRECONDITION
        message = f"spool file {name} cannot be written: {why}"
        if (name, exc.errno) not in self._logged:
            if len(self._logged) < MAX_LOGGED:
                self._logged.add((name, exc.errno))
            log.warning("%s (in %s)", message, self.dir)
        return SpoolError(code, message)

    # ------------------------------------------------------------------ files
    def base(self, entry) -> str:
        """Files named by the transfer's (source, key): keys are scoped by source."""
        return hashlib.sha256(f"{entry.source}\0{entry.key}".encode()).hexdigest()

    @staticmethod
    def legacy_base(entry) -> str:
        """How sidecars before keys were scoped by source named a transfer's files (by its key alone)."""
        return hashlib.sha256(entry.key.encode()).hexdigest()

    def adopt(self, old: str, entry) -> None:
        """Rename a legacy transfer's files to their name now (and make them private)."""
        new = self.base(entry)
        for ext in (".meta", ".data", ".idx"):
            fd = self.open(old + ext, os.O_RDONLY | os.O_NONBLOCK)     # never through a symlink
            try:
                os.fchmod(fd, 0o600)
            finally:
                os.close(fd)
            os.replace(old + ext, new + ext, src_dir_fd=self.dirfd, dst_dir_fd=self.dirfd)

    def open(self, name: str, flags: int) -> int:
        return os.open(name, flags | _FLAGS, 0o600, dir_fd=self.dirfd)

    def _write_file(self, name: str, text: bytes) -> None:
        """``name``'s new content, durable, replacing the old one at once (no half-written file)."""
        tmp = name + ".tmp"
        fd = self.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        try:
            _write_all(fd, text)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, name, src_dir_fd=self.dirfd, dst_dir_fd=self.dirfd)
        os.fsync(self.dirfd)

    def _meta(self, entry, complete: bool = False) -> None:
        meta = {"key": entry.key, "source": entry.source, "uuid": entry.uuid, "priority": entry.priority,
                "payload_kind": entry.payload_kind, "lease_s": entry.lease_s, "total": entry.total,
                "num_parts": entry.num_parts, "complete": complete or entry.complete}
        self._write_file(self.base(entry) + ".meta", json.dumps(meta).encode())

    def _close(self, entry) -> None:
        fds = self._files.pop((entry.source, entry.key), None)
        if fds:
            for fd in fds:
                os.close(fd)

    def _open(self, entry):
        fds = self._files.get((entry.source, entry.key))
        if fds is None:
            base = self.base(entry)
            flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND
            data_fd = self.open(base + ".data", flags)
            try:
                fds = (data_fd, self.open(base + ".idx", flags))
            except OSError:
                os.close(data_fd)
                raise
            self._files[(entry.source, entry.key)] = fds
        return fds

    # ------------------------------------------------------------------ a transfer's life
    def create(self, entry) -> None:
        self._close(entry)
        base = self.base(entry)
        with self._writing(base):
            for ext in (".data", ".idx"):
                os.close(self.open(base + ext, os.O_WRONLY | os.O_CREAT | os.O_TRUNC))
            self._meta(entry)

    def append(self, entry, chunk, seq: int = None, sync: bool = True) -> None:
        """Write ``chunk`` (and, with ``sync``, make it durable: the caller acknowledges it next)."""
        with self._writing(self.base(entry)):
            data_fd, idx_fd = self._open(entry)
            seq = len(entry.chunks) - 1 if seq is None else seq
            info = _b64(chunk.info) if chunk.info is not None else None
            _write_all(data_fd, chunk.data)
            record = [seq, chunk.part, chunk.offset, len(chunk.data), chunk.crc, chunk.part_nbytes, info]
            if chunk.more:
                record.append([_b64(m) for m in chunk.more])
            _write_all(idx_fd, (json.dumps(record) + "\n").encode())
            if sync:
                os.fdatasync(data_fd)
                os.fdatasync(idx_fd)

    def rewrite(self, entry) -> None:
        self.create(entry)
        for seq, chunk in enumerate(entry.chunks):
            self.append(entry, chunk, seq, sync=False)
        with self._writing(self.base(entry)):
            for fd in self._files.get((entry.source, entry.key), ()):
                os.fdatasync(fd)

    def complete(self, entry) -> None:
        """The transfer is complete: durable before its sender is told (the meta file, replaced)."""
        with self._writing(self.base(entry)):
            self._meta(entry, complete=True)

    def delete(self, entry) -> None:
        self._close(entry)
        self.remove(self.base(entry))

    def remove(self, base: str) -> None:
        for ext in (".meta", ".data", ".idx", ".meta.tmp"):
            try:
                os.unlink(base + ext, dir_fd=self.dirfd)
            except FileNotFoundError:
                pass

    # ------------------------------------------------------------------ outcomes (de-duplication)
    def tombstone(self, source: str, key: str, reason: str, uuid: str, keep: int) -> None:
        """Record an outcome (collected, expired) durably; the log is rewritten when it grows past twice
        ``keep`` lines (the caller passes its tombstones then: ``compact``)."""
        with self._writing(TOMBSTONE_LOG):
            fd = self.open(TOMBSTONE_LOG, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
            try:
                _write_all(fd, (json.dumps([source, key, reason, uuid]) + "\n").encode())
                os.fdatasync(fd)
            finally:
                os.close(fd)
        self._tomb_lines += 1

    def needs_compaction(self, keep: int) -> bool:
        return self._tomb_lines > 2 * keep

    def compact(self, tombstones: List[Tuple[str, str, str, str]]) -> None:
        with self._writing(TOMBSTONE_LOG):
            self._write_file(TOMBSTONE_LOG, "".join(json.dumps(list(t)) + "\n" for t in tombstones).encode())
        self._tomb_lines = len(tombstones)


def _write_all(fd: int, data) -> None:
    view = memoryview(data).cast("B")
    while view.nbytes:
        n = os.write(fd, view)
        view = view[n:]


def _b64(info: pb.PartInfo) -> str:
    return base64.b64encode(info.SerializeToString()).decode()
