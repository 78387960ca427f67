"""Restoring the spool (spool.py) when a receiver starts: nothing in the files is trusted.

Every field of a transfer's ``.meta`` is checked as a peer's would be (key, source name, priority, payload
kind, lease); its ``.idx`` records are parsed with bounded sizes and types, and what they declare is
reserved in the memory budget before any data is read; chunks are then read one at a time, checked against
their crc32c and against the order and descriptions the peer service enforces (parts in order, offsets
contiguous, PartInfo valid, packed chunks adding up). The first bad or missing chunk ends what is kept; a
transfer whose files cannot be read is removed.
"""
from __future__ import annotations

import base64
import json
import logging
import os
import stat

import crc32c

from ..core.identity import check_peer_name
from ..core.limits import chunk_cost, seconds
from ..proto import kvflow_pb2 as pb
from ..proto.messages import MAX_PACKED_PARTS, PAYLOAD_KINDS, PRIORITY_NAMES, check_key, check_part_info
from .peer_service import check_packed
from .spool import TOMBSTONE_LOG, SpoolError
from .store import TOMBSTONES, InChunk, InTransfer

log = logging.getLogger("ciuicflow.kvflow.spool")

MAX_META_BYTES = 64 << 10
MAX_IDX_BYTES = 64 << 20
MAX_CHUNK_BYTES = 1 << 30
MAX_COUNT = 1 << 32
MAX_LEASE_S = 86400.0


def _read(spool, name: str, limit: int) -> bytes:
    fd = spool.open(name, os.O_RDONLY | os.O_NONBLOCK)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size > limit:
            raise ValueError(f"{name}: not a regular file of at most {limit} bytes")
        return os.pread(fd, st.st_size, 0)
    finally:
        os.close(fd)


def _count(value, what: str):
    if value is None:
        return None
    if type(value) is not int or not 0 <= value < MAX_COUNT:
        raise ValueError(f"{what} {value!r}")
    return value


def _meta(raw: bytes) -> dict:
    meta = json.loads(raw)
    if not isinstance(meta, dict):
        raise ValueError("meta is not an object")
    key, source, uuid = meta.get("key"), meta.get("source"), meta.get("uuid")
    if not isinstance(key, str) or check_key(key):
        raise ValueError(f"bad key {key!r}")
    if not isinstance(source, str) or check_peer_name(source):
        raise ValueError(f"bad source {source!r}")
    if not isinstance(uuid, str) or len(uuid) > 256:
        raise ValueError("bad uuid")
    if meta.get("priority") not in PRIORITY_NAMES or meta.get("payload_kind") not in PAYLOAD_KINDS:
        raise ValueError(f"bad priority or payload kind {meta.get('priority')!r}, {meta.get('payload_kind')!r}")
    lease = meta.get("lease_s")
    if isinstance(lease, bool) or not isinstance(lease, (int, float)):
        raise ValueError("bad lease")
    meta["lease_s"] = seconds(lease, maximum=MAX_LEASE_S, what="lease_s")
    meta["total"] = _count(meta.get("total"), "total")
    meta["num_parts"] = _count(meta.get("num_parts"), "num_parts")
    if not isinstance(meta.get("complete"), bool):
        raise ValueError("bad complete flag")
    return meta


def _info(text) -> pb.PartInfo:
    if not isinstance(text, str):
        raise ValueError("bad PartInfo")
    return pb.PartInfo.FromString(base64.b64decode(text, validate=True))


def _records(raw: bytes):
    """The .idx records, parsed and typed, up to the first malformed one."""
    out = []
    for seq, line in enumerate(raw.splitlines()):
        try:
            rec = json.loads(line)
            if not isinstance(rec, list) or len(rec) not in (7, 8):
                break
            s, part, offset, length, crc, part_nbytes, info = rec[:7]
            ints = (s, part, offset, length, crc, part_nbytes)
            if any(type(v) is not int or v < 0 for v in ints) or s != seq or length > MAX_CHUNK_BYTES \
                    or crc >= 1 << 32:
                break
            more = rec[7] if len(rec) == 8 else []
            if not isinstance(more, list) or 1 + len(more) > MAX_PACKED_PARTS:
                break
            out.append((part, offset, length, crc, part_nbytes, _info(info) if info is not None else None,
                        tuple(_info(m) for m in more)))
        except Exception:       # noqa: BLE001 - JSON, base64 and protobuf errors alike: the log ends here
            break
    return out


def _in_order(entry: InTransfer, part, offset, length, part_nbytes, info, more) -> bool:
    """Whether a restored chunk continues ``entry`` as the peer service would have accepted it."""
    want_part, want_offset, want_nbytes = entry.expected_next()
    if part != want_part or offset != want_offset:
        return False
    if offset == 0:
        if info is None or check_part_info(info, part):
            return False
        want_nbytes = info.nbytes
    elif info is not None:
        return False
    if part_nbytes != want_nbytes:
        return False
    if more:
        return check_packed(pb.Chunk(part=part, offset=offset, info=info, more=more), length) is None
    return offset + length <= want_nbytes and (length > 0 or want_nbytes == 0)


def _restore_one(spool, budget, store, base: str) -> str:
    """Restore one transfer's files; the name they have now (a legacy one is renamed)."""
    meta = _meta(_read(spool, base + ".meta", MAX_META_BYTES))
    entry = InTransfer(meta["key"], meta["source"], meta["uuid"], meta["priority"], meta["payload_kind"],
                       meta["lease_s"], None, store.labels(meta["source"]))
    if spool.base(entry) != base:
        if spool.legacy_base(entry) != base:
            raise ValueError("files named for another transfer")
        spool.adopt(base, entry)            # written by a sidecar before keys were scoped by source
        base = spool.base(entry)
    records = _records(_read(spool, base + ".idx", MAX_IDX_BYTES))
    reserved = sum(chunk_cost(r[2], (r[5], *r[6])) for r in records)
    if not budget.try_reserve(entry.account, reserved):       # before any data is read
        raise ValueError(f"{reserved} bytes do not fit in the memory cap")
    kept = 0
    try:
        data_fd = spool.open(base + ".data", os.O_RDONLY | os.O_NONBLOCK)
        try:
            if not stat.S_ISREG(os.fstat(data_fd).st_mode):
                raise ValueError("data is not a regular file")
            pos = 0
            for part, offset, length, crc, part_nbytes, info, more in records:
                if not _in_order(entry, part, offset, length, part_nbytes, info, more):
                    break
                data = os.pread(data_fd, length, pos)        # one chunk at a time
                if len(data) != length or crc32c.crc32c(data) != crc:
                    break
                pos += length
                entry.restore_chunk(InChunk(part, offset, data, info, crc, part_nbytes, more))
        finally:
            os.close(data_fd)
        kept = entry.cost
    finally:
        budget.release(entry.account, reserved - kept)          # what was not kept
    total, num_parts = meta["total"], meta["num_parts"]
    entry.committed(total, num_parts)
    last = entry.chunks[-1] if entry.chunks else None
    ends = (num_parts == 0 and last is None) or (
        last is not None and num_parts and last.last_part == num_parts - 1 and last.ends_part)
    if meta["complete"] and total == len(entry.chunks) and ends:
        entry.restore_complete()
    entry.detach(None)          # no stream feeds it: its sender has the resume timeout to come back
    if len(entry.chunks) != len(records):
        try:
            spool.rewrite(entry)    # drop whatever followed the last good chunk
        except OSError:
            budget.release(entry.account, entry.cost)
            raise
    store.insert(entry)
    return base


def _restore_tombstones(spool, store) -> None:
    try:
        raw = _read(spool, TOMBSTONE_LOG, MAX_IDX_BYTES)
    except FileNotFoundError:
        return
    except (OSError, ValueError) as exc:
        log.warning("spool tombstones unreadable (%s): dropped", exc)
        raw = b""
    for line in raw.splitlines()[-TOMBSTONES:]:
        try:
            source, key, reason, uuid = json.loads(line)
            if check_peer_name(source) or check_key(key) or reason not in ("collected", "expired") \
                    or not isinstance(uuid, str) or len(uuid) > 256:
                continue
            store.restore_tombstone(source, key, reason, uuid)
        except (ValueError, TypeError):
            continue
    try:
        spool.compact(store.tombstone_records())
    except SpoolError:
        pass        # logged by the spool; the outcomes are remembered in memory until the next restart


def restore(spool, budget, store) -> int:
    """Load what the spool directory holds into ``store`` (memory from ``budget``); the number restored."""
    done = set()
    for name in sorted(os.listdir(spool.dirfd)):
        if not name.endswith(".meta") or len(name) != 69 or name[:-len(".meta")] in done:
            continue
        base = name[:-len(".meta")]
        try:
            done.add(_restore_one(spool, budget, store, base))
        except SpoolError:
            spool.remove(base)          # logged by the spool, once
        except (OSError, ValueError, KeyError, TypeError) as exc:
            log.warning("dropping spool entry %s: %s", base, exc)
            spool.remove(base)
    _restore_tombstones(spool, store)
    return len(done)
