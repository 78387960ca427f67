"""What a hostile peer or client sends, for the attack tests and the soak's attackers
(bench/soak/attackers.py): packed chunks whose part descriptions lie about their number, raw
data-plane sessions, request heads sent a byte at a time. One copy, so that a test and the soak
attack the sidecar the same way."""
from __future__ import annotations

import json
import socket
import threading

from ciuicflow.kvflow.transports.tcp import HEAD, STATUS


def varint(n: int) -> bytes:
    """Protobuf's base-128 varint of ``n`` >= 0."""
    out = bytearray()
    while n > 0x7F:
        out.append(n & 0x7F | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def more_block(parts: int) -> bytes:
    """Chunk.more entries 1 .. parts-1, each a valid zero-byte PartInfo (its index right): field 9,
    length, then PartInfo.index (field 1) as a varint. Built with numpy: a Python loop over a
    million parts takes seconds of CPU, which a loaded host may not give the attacker."""
    import numpy as np
    if parts > 128 ** 3:
        raise ValueError(f"at most {128 ** 3} parts")
    blocks = []
    for n in (1, 2, 3):                  # varints of n bytes: indices [128 ** (n - 1), 128 ** n)
        k = np.arange(128 ** (n - 1) if n > 1 else 1, min(parts, 128 ** n), dtype=np.int64)
        if not len(k):
            continue
        rows = np.empty((len(k), 3 + n), dtype=np.uint8)
        rows[:, 0], rows[:, 1], rows[:, 2] = 0x4A, 1 + n, 0x08
        for j in range(n):
            rows[:, 3 + j] = ((k >> (7 * j)) & 0x7F) | (0x80 if j < n - 1 else 0)
        blocks.append(rows.tobytes())
    return b"".join(blocks)


def zero_parts_frame(tid: int, block: bytes) -> bytes:
    """A serialized PeerFrame(chunk=...) of transfer ``tid``: a packed chunk of zero bytes whose
    parts (``block``, all zero-byte, in order) add up exactly; only their number is wrong."""
    import crc32c
    from ciuicflow.kvflow.proto import kvflow_pb2 as pb
    head = pb.Chunk(tid=tid, seq=0, sn=1, part=0, offset=0, crc32c=crc32c.crc32c(b""),
                    info=pb.PartInfo(index=0, nbytes=0)).SerializeToString()
    inner = head + block
    return b"\x12" + varint(len(inner)) + inner


def wire_session(port: int, frames, timeout: float = 10.0) -> list[tuple[int, object]]:
    """Send raw data-plane frames ((kind, payload) pairs) to 127.0.0.1:``port``, close the sending
    side, and return the frames that come back: (kind, payload), a STATUS frame's payload read as
    its code."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        for kind, payload in frames:
            s.sendall(HEAD.pack(kind, len(payload)) + payload)
        try:
            s.shutdown(socket.SHUT_WR)
        except OSError:
            pass        # the receiver may have refused and closed already
        data = b""
        while True:
            more = s.recv(1 << 16)
            if not more:
                break
            data += more
    out, pos = [], 0
    while pos + HEAD.size <= len(data):
        kind, n = HEAD.unpack_from(data, pos)
        payload = data[pos + HEAD.size:pos + HEAD.size + n]
        pos += HEAD.size + n
        out.append((kind, json.loads(payload)["code"] if kind == STATUS else payload))
    return out


class Trickle:
    """Slowloris: one byte (``b"G"``) on each of ``socks`` every ``period`` seconds, from a thread,
    until ``stop()``: request heads that are never finished."""

    def __init__(self, socks, period: float = 0.2):
        self._socks, self._period = list(socks), period
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            for s in self._socks:
                try:
                    s.send(b"G")
                except OSError:
                    pass
            self._stop.wait(self._period)

    def stop(self, timeout: float = 2.0) -> None:
        self._stop.set()
        self._thread.join(timeout)
