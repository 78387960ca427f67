"""Receiver spool (``--spool-dir``): received chunks are written through to disk before they are
acknowledged, so a receiving sidecar killed mid-transfer resumes from its last acknowledged chunk when it
comes back, and keeps completed-but-uncollected transfers (their lease restarts).

Per transfer, named by the SHA-256 of its key: ``.meta`` (JSON), ``.data`` (chunk bytes back to back) and
``.idx`` (one JSON line per chunk: seq, part, offset, length, crc32c, part bytes, PartInfo, and for a packed
chunk the PartInfos of its further parts). On restore,
chunks are checked against their crc32c; the first bad or missing one ends what is kept.
"""
from __future__ import annotations

import base64
import hashlib
import json
import logging
import os
import time
from typing import Dict, Tuple

import crc32c

from ..proto import kvflow_pb2 as pb
from .store import InChunk, InTransfer

log = logging.getLogger("ciuicflow.kvflow.spool")


class Spool:
    def __init__(self, directory: str):
        self.dir = directory
        os.makedirs(directory, exist_ok=True)
        self._files: Dict[str, Tuple] = {}

    def _base(self, entry) -> str:
        """Files named by the transfer's (source, key): keys are scoped by source."""
        name = hashlib.sha256(f"{entry.source}\0{entry.key}".encode()).hexdigest()
        return os.path.join(self.dir, name)

    def _meta(self, entry) -> None:
        meta = {"key": entry.key, "source": entry.source, "uuid": entry.uuid, "priority": entry.priority,
                "payload_kind": entry.payload_kind, "lease_s": entry.lease_s, "total": entry.total,
                "num_parts": entry.num_parts, "complete": entry.complete}
        base = self._base(entry)
        with open(base + ".meta.tmp", "w") as fh:
            json.dump(meta, fh)
        os.replace(base + ".meta.tmp", base + ".meta")

    def _close(self, entry) -> None:
        files = self._files.pop((entry.source, entry.key), None)
        if files:
            for fh in files:
                fh.close()

    def _open(self, entry, mode: str = "ab"):
        files = self._files.get((entry.source, entry.key))
        if files is None:
            base = self._base(entry)
            files = (open(base + ".data", mode), open(base + ".idx", mode))
            self._files[(entry.source, entry.key)] = files
        return files

    def create(self, entry) -> None:
        self._close(entry)
        base = self._base(entry)
        for ext in (".data", ".idx"):
            open(base + ext, "wb").close()
        self._meta(entry)

    def append(self, entry, chunk, seq: int = None) -> None:
        data_fh, idx_fh = self._open(entry)
        seq = len(entry.chunks) - 1 if seq is None else seq
        info = _b64(chunk.info) if chunk.info is not None else None
        data_fh.write(chunk.data)
        data_fh.flush()
        record = [seq, chunk.part, chunk.offset, len(chunk.data), chunk.crc, chunk.part_nbytes, info]
        if chunk.more:
            record.append([_b64(m) for m in chunk.more])
        idx_fh.write((json.dumps(record) + "\n").encode())
        idx_fh.flush()

    def rewrite(self, entry) -> None:
        self.create(entry)
        for seq, chunk in enumerate(entry.chunks):
            self.append(entry, chunk, seq)

    def complete(self, entry) -> None:
        self._meta(entry)

    def delete(self, entry) -> None:
        self._close(entry)
        base = self._base(entry)
        for ext in (".meta", ".data", ".idx"):
            try:
                os.unlink(base + ext)
            except FileNotFoundError:
                pass

    def restore(self, budget, store) -> int:
        """Load what the directory holds into ``store`` (memory from ``budget``); the number restored."""

        restored = 0
        for name in sorted(os.listdir(self.dir)):
            if not name.endswith(".meta"):
                continue
            base = os.path.join(self.dir, name[:-len(".meta")])
            try:
                with open(base + ".meta") as fh:
                    meta = json.load(fh)
                entry = InTransfer(meta["key"], meta["source"], meta["uuid"], meta["priority"],
                                   meta["payload_kind"], meta["lease_s"], None, store.labels(meta["source"]))
                with open(base + ".data", "rb") as fh:
                    blob = fh.read()
                with open(base + ".idx", "rb") as fh:
                    lines = fh.read().splitlines()
                pos = 0
                for seq, line in enumerate(lines):
                    try:
                        s, part, offset, length, crc, part_nbytes, info, *more = json.loads(line)
                    except ValueError:
                        break
                    data = blob[pos:pos + length]
                    if s != seq or len(data) != length or crc32c.crc32c(data) != crc:
                        break
                    pos += length
                    pinfo = pb.PartInfo.FromString(base64.b64decode(info)) if info else None
                    more = [pb.PartInfo.FromString(base64.b64decode(m)) for m in more[0]] if more else ()
                    chunk = InChunk(part, offset, data, pinfo, crc, part_nbytes, more)
                    entry.chunks.append(chunk)
                    entry.bytes += length
                    entry.cost += chunk.cost
                entry.total = meta.get("total")
                entry.num_parts = meta.get("num_parts")
                if meta.get("complete") and entry.total == len(entry.chunks):
                    entry.complete = True
                    entry.completed_at = time.monotonic()
                entry.detached_at = time.monotonic()
            except (OSError, ValueError, KeyError) as exc:
                log.warning("dropping unreadable spool entry %s: %s", base, exc)
                for ext in (".meta", ".data", ".idx"):
                    try:
                        os.unlink(base + ext)
                    except FileNotFoundError:
                        pass
                continue
            if not budget.try_reserve(entry.account, entry.cost):
                log.warning("spool entry %r does not fit in the memory cap; dropped", entry.key)
                entry.bytes = entry.cost = 0
                self.delete(entry)
                continue
            store.insert(entry)
            self.rewrite(entry)      # drop whatever followed the last good chunk
            restored += 1
        return restored


def _b64(info: pb.PartInfo) -> str:
    return base64.b64encode(info.SerializeToString()).decode()
