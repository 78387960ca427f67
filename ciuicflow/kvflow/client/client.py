"""Python client of the KV-flow sidecar's local API.

    from ciuicflow.kvflow import Client
    client = Client("127.0.0.1:50151")
    handle = client.send("decode0", "req-17", [k0, v0, k1, v1], priority="high", deadline_s=1.0)
    handle.wait()                                   # delivered to decode0's sidecar (or KVFlowError)

    # on decode0, beside its own sidecar:
    tensors = Client("127.0.0.1:50151").recv("req-17", timeout_s=5)
    for part in client.recv_stream("req-17", timeout_s=5):   # parts as they arrive
        use(part.index, part.value)

    # layer by layer while prefill runs:
    with client.open("decode0", "req-18", priority="high") as stream:
        for layer in model_layers:
            stream.append(run(layer), name=f"layer.{i}")
    stream.handle.wait()

Payloads are bytes (returned as bytes) or a list of torch tensors (returned as tensors with the same dtype and
shape, on the CPU). A list may mix tensors and bytes. torch is imported only when tensors are used.

On the same host as its sidecar the client hands the bytes over in shared memory (``/dev/shm``, see
``proto/shm.py``): only small handles go over the local gRPC connection, and the sidecar opens only files
this process proves it holds (descriptors handed over its Unix socket, or named files with their secret).
``Client(..., shm=False)`` turns that off; the default checks once that the sidecar can open this process's
files and otherwise sends the bytes in-band.
"""
from __future__ import annotations

import json
import logging
import math
import os
import threading
from typing import Optional, Union, Any, List

import grpc

from ..proto import kvflow_pb2 as pb
from ..proto import kvflow_pb2_grpc as pb_grpc
from ..proto import runtime
from ..proto import shm as shmlib
from ..proto.messages import AUTH_METADATA, FLOW_METADATA, PRIORITY_NAMES, priority_to_pb
from .handoff import FdHandoff
from .payload import KVFlowError, messages, split_payload
from .rings import CallFinished, RingPool, ShmWriter
from .streams import RecvStream, SendHandle, SendStream

log = logging.getLogger("ciuicflow.kvflow.client")

DEFAULT_MESSAGE_BYTES = 1 << 20      # largest SendData message: a KV layer of up to 1 MiB is one message
SHM_WINDOW_BYTES = 8 << 20           # shared memory: bytes written ahead of what the sidecar has taken
SHM_RECV_RING_BYTES = 8 << 20        # shared memory: bytes the sidecar writes ahead of what recv has read
SHM_POOL_RINGS = 8                   # shared memory: idle rings kept for reuse, of each kind (send, receive)


class Client:
    """Talks to the sidecar beside this process (its ``--api`` address).

    ``flow`` (default True) sends metadata ``x-ciuic-flow: enabled`` so transfers are chunk-scheduled and
    congestion-controlled; ``flow=False`` gives the plain FIFO baseline. ``token``: the local API's token;
    None (the default): ``$CIUICFLOW_KVFLOW_API_TOKEN``, else the file ``$CIUICFLOW_KVFLOW_API_TOKEN_FILE``,
    else the token a sidecar on this host publishes for its own user (proto/runtime.py), so a client
    running as the sidecar's user needs nothing. ``shm``: hand the bytes over in shared memory (/dev/shm) when
    the sidecar can open this process's files (None, the default: check once and fall back to in-band bytes;
    False: always in-band; True: fail if the sidecar cannot). ``shm_window_bytes`` and ``shm_recv_ring_bytes``:
    the sizes of a transfer's shared-memory ring when sending and receiving (see shm.py).
    """

    def __init__(self, address: str, *, flow: bool = True, token: Optional[str] = None,
                 message_bytes: int = DEFAULT_MESSAGE_BYTES, queue_messages: int = 8, shm: Optional[bool] = None,
                 shm_window_bytes: int = SHM_WINDOW_BYTES, shm_recv_ring_bytes: int = SHM_RECV_RING_BYTES,
                 shm_pool_rings: int = SHM_POOL_RINGS):
        self.address = address
        self._rings = RingPool(shm_pool_rings)
        self.shm = shm
        self.shm_window_bytes = int(shm_window_bytes)
        self.shm_recv_ring_bytes = max(int(shm_recv_ring_bytes), 1 << 20)
        self._shm_ok: Optional[bool] = None if shm is not False else False
        self._shm_lock = threading.Lock()
        self.flow = flow
        self._token_given = bool(token)
        self.token = token or runtime.find_api_token(address)
        self.message_bytes = int(message_bytes)
        self.queue_messages = queue_messages
        options = [("grpc.max_receive_message_length", 64 << 20), ("grpc.max_send_message_length", 64 << 20)]
        self._channel = grpc.insecure_channel(address, options=options)
        self._stub = pb_grpc.KVFlowStub(self._channel)
        # High-priority sends get a connection of their own: on a shared one their bytes queue behind the
        # bulk streams' data in the same TCP socket and HTTP/2 connection window.
        self._high_channel = grpc.insecure_channel(address, options=options + [
            ("grpc.use_local_subchannel_pool", 1)])
        self._high_stub = pb_grpc.KVFlowStub(self._high_channel)

    def _use_shm(self) -> bool:
        """Whether the bytes go in shared memory (checked once with ShmProbe)."""
        if self._shm_ok is None:
            with self._shm_lock:
                if self._shm_ok is None:
                    ok, why = self._probe_shm()
                    if not ok and self.shm:
                        raise KVFlowError(grpc.StatusCode.FAILED_PRECONDITION,
                                          f"shared memory with the sidecar is not possible: {why}")
                    self._shm_ok = ok
        return self._shm_ok

    def _probe_shm(self):
        """Whether the sidecar can open and write this process's shared-memory files: first handed over
        as descriptors (then rings are reused, see RingPool), else named with their secret; (ok, why not)."""
        if not shmlib.available():
            return False, f"{shmlib.shm_dir()} is not writable"
        ok, why = self._probe_shm_file(by_fd=True)
        if not ok:
            log.debug("shared memory by descriptor not possible (%s); trying by name", why)
            ok, why = self._probe_shm_file(by_fd=False)
        return ok, why

    def _probe_shm_file(self, by_fd: bool):
        """One way of naming files to the sidecar, tried with a probe file; by descriptor, a success keeps
        the descriptor socket for the rings."""
        handoff = FdHandoff.for_address(self.address) if by_fd else None
        if by_fd and handoff is None:
            return False, "the sidecar's descriptor socket is out of reach (another user, host or mount namespace)"
        try:
            fd, path = shmlib.create("p")
        except OSError as exc:
            if handoff is not None:
                handoff.close()
            return False, str(exc)
        ref, ok = None, False
        try:
            nonce = os.urandom(16)
            shmlib.write_all(fd, nonce + bytes(2 * shmlib.PAGE - len(nonce)), 0)
            if by_fd:
                shmlib.unlink(path)
                ref = handoff.register(fd)
            else:
                ref = shmlib.named_ref(path, shmlib.new_secret(fd))
            reply = self._stub.ShmProbe(pb.ShmProbeRequest(path=ref, nonce=nonce), metadata=self._metadata(False),
                                        timeout=30)
            if reply.ok and os.pread(fd, len(nonce), shmlib.PAGE) != nonce:
                # the rings need the sidecar to write into this process's files
                return False, "the sidecar cannot write into the shared-memory file"
            ok = reply.ok
            return reply.ok, reply.message
        except OSError as exc:
            return False, f"descriptor not taken: {exc}"
        except grpc.RpcError as exc:
            if exc.code() in (grpc.StatusCode.UNIMPLEMENTED,):
                return False, "the sidecar does not support shared memory"
            raise KVFlowError.from_rpc(exc) from None
        finally:
            shmlib.unlink(path)
            os.close(fd)
            if handoff is not None:
                if ref is not None:
                    handoff.drop(ref)
                if ok:
                    self._rings.handoff = handoff
                else:
                    handoff.close()

    def _send_ring(self, done) -> Optional[ShmWriter]:
        """A shared-memory ring for one send, or None: in-band (no shared memory, or no ring to be had right
        now, e.g. while the sidecar restarts)."""
        if not self._use_shm():
            return None
        try:
            return ShmWriter(self.shm_window_bytes, done, self._rings)
        except OSError as exc:
            log.debug("no shared-memory ring for this send (%s): in-band", exc)
            return None

    def _recv_ring(self, ring: int):
        if not self._use_shm():
            return None
        try:
            return self._rings.take("r", ring)[:2]
        except OSError as exc:
            log.debug("no shared-memory ring for this receive (%s): in-band", exc)
            return None

    def _send_stub(self, priority: str):
        return self._high_stub if priority == "high" else self._stub

    def _metadata(self, flow: Optional[bool]):
        md = []
        if self.flow if flow is None else flow:
            md.append((FLOW_METADATA, "enabled"))
        if not self.token and not self._token_given:
            self.token = runtime.find_api_token(self.address)   # the sidecar may have started since
        if self.token:
            md.append((AUTH_METADATA, f"Bearer {self.token}"))
        return tuple(md)

    @staticmethod
    def _call_timeout(seconds) -> Optional[float]:
        # The sidecar enforces deadlines and timeouts with an explicit status (and refuses NaN); this is
        # only a backstop, and none for a value gRPC cannot take.
        return float(seconds) + 30.0 if seconds and math.isfinite(float(seconds)) else None

    @staticmethod
    def _check_priority(priority: str) -> None:
        if priority not in PRIORITY_NAMES:
            raise ValueError(f"priority must be one of {PRIORITY_NAMES}, got {priority!r}")

    # ------------------------------------------------------------------ sending
    def send(self, dest: str, key: str, payload, priority: str = "normal", deadline_s: Optional[float] = None,
             *, flow: Optional[bool] = None, lease_s: Optional[float] = None, resume: bool = False,
             idempotency_key: Optional[str] = None) -> SendHandle:
        """Send ``payload`` (bytes, or a list of tensors) to peer ``dest`` under ``key``; returns at once.

        Tensors are read when their turn comes: do not modify them before ``handle.wait()`` returns.
        ``resume``: when retrying after a failed attempt (e.g. this side's sidecar died mid-transfer), set it so
        that chunks the receiver already holds with the same checksum are not sent again; without it a
        partial transfer of this key from this sidecar is discarded and sent from the start.
        ``idempotency_key``: the same key names the same transfer on every try, also after a restart of
        the sending sidecar: a receiver that holds it, or whose consumer had it, does not take it again.
        """
        self._check_priority(priority)
        kind, parts = split_payload(payload, self.message_bytes)
        header = pb.SendRequest(header=pb.SendHeader(
            dest=dest, key=key, priority=priority_to_pb(priority), deadline_s=float(deadline_s or 0.0),
            payload_kind=kind, resume=resume, lease_s=float(lease_s or 0.0), idempotency_key=idempotency_key or ""))
        message_bytes = self.message_bytes
        box = []
        writer = self._send_ring(lambda: bool(box) and box[0].done())

        def requests():
            yield header
            if writer is not None:
                try:
                    yield from writer.batches(parts)
                except CallFinished:
                    return      # the sidecar already ended the call: its status is the handle's outcome
            else:
                for info, mv in parts:
                    yield from messages(info, mv, message_bytes)
            yield pb.SendRequest(end=pb.SendEnd(num_parts=len(parts)))

        try:
            future = self._send_stub(priority).Send.future(requests(), metadata=self._metadata(flow),
                                                           timeout=self._call_timeout(deadline_s))
        except BaseException:
            if writer is not None:
                writer.close()
            raise
        if writer is not None:
            box.append(future)
            future.add_done_callback(writer.close)
        return SendHandle(future, key, dest)

    def open(self, dest: str, key: str, priority: str = "normal", deadline_s: Optional[float] = None, *,
             flow: Optional[bool] = None, lease_s: Optional[float] = None, resume: bool = False,
             payload_kind: str = "tensors", idempotency_key: Optional[str] = None) -> SendStream:
        """Open a transfer to which parts are appended as they are produced (e.g. layer by layer)."""
        self._check_priority(priority)
        return SendStream(self, dest, key, priority, deadline_s, self.flow if flow is None else flow, lease_s,
                          resume, payload_kind, self.queue_messages, idempotency_key)

    # ------------------------------------------------------------------ receiving
    def recv_stream(self, key: str, timeout_s: Optional[float] = None, *, source: Optional[str] = None,
                    manual_ack: bool = False) -> RecvStream:
        """Parts of transfer ``key`` as they arrive (waits up to ``timeout_s`` for the whole transfer).
        ``source``: only the transfer sent by that peer. Keys are scoped by the sending peer, so two peers
        may send the same key; without ``source`` such a key is refused (FAILED_PRECONDITION), and the
        first peer to send a key is the one received: name the source when peers do not trust each other.
        ``manual_ack``: the sidecar keeps the transfer after delivering it until ``ack(key)``, and delivers it
        again to a later receive (at-least-once: a consumer that dies before ``ack`` loses nothing); by
        default it is deleted once delivered (at-most-once)."""
        ring = self.shm_recv_ring_bytes
        shm_file = self._recv_ring(ring)
        try:
            call = self._stub.Recv(pb.RecvRequest(key=key, timeout_s=float(timeout_s or 0.0), source=source or "",
                                                  manual_ack=manual_ack,
                                                  shm_path=shm_file[1] if shm_file else "",
                                                  shm_ring_bytes=ring if shm_file else 0),
                                   metadata=self._metadata(False),
                                   timeout=self._call_timeout(timeout_s))
        except BaseException:
            if shm_file is not None:
                self._rings.give("r", ring, shm_file[0], shm_file[1], 0, False)
            raise
        return RecvStream(call, shm_file, ring, self._rings)

    def recv(self, key: str, timeout_s: Optional[float] = None, *, source: Optional[str] = None,
             manual_ack: bool = False) -> Union[bytes, List[Any]]:
        """The whole transfer ``key`` (from peer ``source``, see recv_stream): bytes for a bytes payload, else
        a list (tensors, bytes parts)."""
        stream = self.recv_stream(key, timeout_s, source=source, manual_ack=manual_ack)
        parts = [p.value for p in stream]
        if stream.header is not None and stream.header.payload_kind == "bytes":
            return b"".join(parts)
        return parts

    def ack(self, key: str, source: Optional[str] = None) -> None:
        """This consumer has transfer ``key`` (received with ``manual_ack=True``): the sidecar may delete it.
        Acknowledging twice is fine; NOT_FOUND when there is nothing to acknowledge (e.g. its lease expired)."""
        try:
            self._stub.Acknowledge(pb.AcknowledgeRequest(key=key, source=source or ""),
                                   metadata=self._metadata(False), timeout=30)
        except grpc.RpcError as exc:
            raise KVFlowError.from_rpc(exc) from None

    # ------------------------------------------------------------------ misc
    def stats(self) -> dict:
        try:
            return json.loads(self._stub.Stats(pb.StatsRequest(), metadata=self._metadata(False), timeout=10).json)
        except grpc.RpcError as exc:
            raise KVFlowError.from_rpc(exc) from None

    def wait_ready(self, timeout: float = 10.0) -> None:
        """Wait until both connections to the sidecar are up (and check shared memory once)."""
        grpc.channel_ready_future(self._channel).result(timeout=timeout)
        grpc.channel_ready_future(self._high_channel).result(timeout=timeout)
        self._use_shm()

    def close(self) -> None:
        self._channel.close()
        self._high_channel.close()
        self._rings.close()
        if self._rings.handoff is not None:
            self._rings.handoff.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
