"""The prefill side of one request's KV transfer (``OutgoingKV``): each layer's gathered blocks go to the
sidecar as soon as that layer has run, without ever holding up vLLM's forward pass.

Why a thread per transfer: the sidecar client's ``append`` blocks while the sidecar will not take more of
the transfer (with flow control, a normal/low transfer is read only ``--ingest-readahead`` bytes ahead of
what the link has carried, plus the client's shared-memory window). Called from ``save_kv_layer`` that
stalled the whole prefill engine, every request of the batch and every later one, for as long as the slow
link needed to drain a large low-priority transfer: 8.3 s for 35 MB at 20 Mbit/s (FIFO: 0.15 s), 2.7 s for
28 MB at 40 Mbit/s (tests/integrations/vllm/test_outgoing.py). Here the forward pass only queues the (already
copied) blocks; a thread of this transfer appends them, so a blocked low-priority transfer holds back only
itself, and a high-priority one behind it reaches the sidecar's scheduler at once.
"""
from __future__ import annotations

import json
import logging
import queue
import threading
import time
from typing import Optional, Sequence

from .transfer import FORMAT, HEADER, TransferFormatError, crc

log = logging.getLogger("ciuicflow.vllm")
_END = None


class OutgoingKV:
    """Prefill side, one request: opened at its first saved layer, ``add_layer`` per layer (queued for the
    sidecar at once: layer-wise pipelining), ``close`` once every layer is in; ``handle`` completes when the
    destination sidecar holds all of it. Errors are kept (``error``), never raised into vLLM's forward."""

    def __init__(self, client, req_id: str, key: str, dest: str, block_ids: Sequence[int], num_tokens: int,
                 token_sha: str, layer_names: Sequence[str], priority: str = "normal",
                 deadline_s: Optional[float] = None, flow: bool = True, checksum: bool = True,
                 corrupt_layer: int = -1):
        self.client = client
        self.req_id = req_id
        self.key = key
        self.dest = dest
        self.block_ids = list(block_ids)
        self.num_tokens = int(num_tokens)
        self.token_sha = token_sha
        self.layer_names = list(layer_names)
        self.priority = priority
        self.deadline_s = deadline_s
        self.flow = flow
        self.checksum = checksum
        self.corrupt_layer = corrupt_layer
        self.stream = None
        self.handle = None
        self.error: Optional[BaseException] = None
        self._added: set = set()
        self._queue: "queue.Queue" = queue.Queue()
        self._feeder: Optional[threading.Thread] = None
        self.started = time.monotonic()
        # wall-clock stamps for the benchmark's phase breakdown (phases.py): first layer queued, stream
        # ended, destination holds it all; append_s: time the forward pass spent in add_layer
        self.t_open = self.t_close = self.t_done = None
        self.append_s = 0.0
        self.nbytes = 0

    def _open(self, first_layer) -> None:
        self.stream = self.client.open(self.dest, self.key, priority=self.priority, deadline_s=self.deadline_s,
                                       flow=self.flow)
        header = {"format": FORMAT, "layers": self.layer_names, "num_blocks": len(self.block_ids),
                  "num_tokens": self.num_tokens, "tokens_sha": self.token_sha,
                  "block_shape": list(first_layer.shape[1:]), "dtype": str(first_layer.dtype).removeprefix("torch."),
                  "checksum": self.checksum}
        self._queue.put((HEADER, json.dumps(header, sort_keys=True).encode()))
        self._feeder = threading.Thread(target=self._feed, name=f"ciuicflow-send-{self.req_id}", daemon=True)
        self._feeder.start()

    def _feed(self) -> None:
        """This transfer's parts into the sidecar, in order; blocks here, not in the forward pass."""
        while True:
            item = self._queue.get()
            if item is _END:
                break
            if self.error is not None:
                continue        # failed: drop what is queued (the stream is cancelled)
            name, value = item
            try:
                self.stream.append(value, name=name)
            except BaseException as exc:  # noqa: BLE001
                self.fail(exc)
        if self.error is None:
            try:
                self.stream.close()
                self.t_close = time.time()
            except BaseException as exc:  # noqa: BLE001
                self.fail(exc)

    def add_layer(self, index: int, blocks) -> None:
        """Queue layer ``index``'s gathered blocks (a copy: vLLM may reuse its own blocks; any order; each
        layer once)."""
        if self.error is not None:
            return
        t0 = time.monotonic()
        try:
            if index in self._added or not 0 <= index < len(self.layer_names):
                raise TransferFormatError(f"layer {index} saved twice or unknown")
            if self.stream is None:
                self.t_open = time.time()
                self._open(blocks)
            tag = crc(blocks) if self.checksum else "-"
            if index == self.corrupt_layer:       # test only: enough to change tokens; the receiver must notice
                blocks[0].add_(1.0)
            self._queue.put((f"L{index}:{tag}", blocks))
            self.nbytes += blocks.numel() * blocks.element_size()
            self._added.add(index)
        except BaseException as exc:  # noqa: BLE001 - a failed transfer must not stop the forward pass
            self.fail(exc)
        self.append_s += time.monotonic() - t0

    @property
    def layers_added(self) -> int:
        return len(self._added)

    @property
    def complete(self) -> bool:
        return self.layers_added == len(self.layer_names)

    def close(self) -> None:
        """After the step: every layer queued -> the stream ends after the last one; else the transfer is
        incomplete: cancel it so the receiver fails at once instead of at its timeout."""
        if self.error is not None or self.handle is not None:
            return
        if not self.complete:
            self.fail(TransferFormatError(f"only {self.layers_added} of {len(self.layer_names)} layers saved"))
            return
        self.handle = self.stream.handle        # completes once the feeder has ended it and the peer has it
        self.handle.add_done_callback(self._on_done)
        self._queue.put(_END)

    def _on_done(self, _future) -> None:
        self.t_done = time.time()

    def fail(self, exc: BaseException) -> None:
        if self.error is None:
            self.error = exc
            log.warning("KV transfer of request %s (key %s) to %s failed: %s", self.req_id, self.key, self.dest, exc)
        if self.stream is not None:
            try:
                self.stream.cancel()      # wakes a feeder blocked in append
            except Exception:  # noqa: BLE001
                pass
        self._queue.put(_END)

    def done(self) -> bool:
        """Nothing more will happen: failed, or the destination sidecar acknowledged every chunk (or refused)."""
        if self.error is not None:
            return True
        if self.handle is None or not self.handle.done():
            return False
        try:
            self.handle.wait(0)
        except BaseException as exc:  # noqa: BLE001
            self.error = exc
            log.warning("KV transfer of request %s (key %s) to %s failed: %s", self.req_id, self.key, self.dest, exc)
        return True
