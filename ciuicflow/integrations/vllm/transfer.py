"""One request's KV blocks through the sidecar: the transfer format, the prefill side's ``OutgoingKV``
(a layer's blocks appended as soon as that layer has run) and the decode side's ``IncomingKV`` (received
layer by layer in a thread and written into this instance's own blocks). No vLLM import, so the tests
drive these against real sidecars with paged caches of vLLM's shapes.

Transfer ``key`` (a "tensors" transfer of the sidecar), parts in order:

    part 0       bytes "ciuicflow.vllm.header": JSON {format, layers (names), num_blocks, num_tokens,
                 tokens_sha (of the prompt's token ids), block_shape, dtype, checksum}
    parts 1..L   tensor "L{i}:{crc32c hex or -}": layer i's blocks [num_blocks, *block_shape], whole blocks
                 in the block table's order; layers in the order the forward pass saved them

Whole blocks, never tokens: vLLM's CPU tile layout stores K transposed inside each (block, head) tile, so a
per-token slice would be wrong; a block is the same bytes on both sides whatever the layout. The blocks
are gathered (a copy) when the layer is saved, so vLLM may reuse its own blocks right after.
"""
from __future__ import annotations

import hashlib
import json
import logging
import math
import threading
import time
from typing import Any, Dict, List, Optional, Sequence

log = logging.getLogger("ciuicflow.vllm")

FORMAT = "ciuicflow.vllm/1"
HEADER = "ciuicflow.vllm.header"


class TransferFormatError(ValueError):
    """A received transfer that does not fit this instance (other model, layout, prompt, or corrupted)."""


def tokens_sha(token_ids: Sequence[int]) -> str:
    return hashlib.sha256(json.dumps([int(t) for t in token_ids]).encode()).hexdigest()[:32]


def block_dim(cache, num_blocks: Optional[int] = None) -> int:
    """The dimension of a paged cache that indexes blocks: 0 on CPU ([num_blocks, ...], MLA's 3-D view
    too); 1 for layouts that put K and V first ([2, num_blocks, ...])."""
    if num_blocks is None or cache.shape[0] == num_blocks:
        return 0
    if cache.dim() > 1 and cache.shape[1] == num_blocks:
        return 1
    raise TransferFormatError(f"no block dimension of size {num_blocks} in a KV cache {tuple(cache.shape)}")


def gather(cache, block_ids: Sequence[int], dim: int = 0):
    """The blocks ``block_ids`` of one layer's paged cache, as a new contiguous tensor with the blocks first."""
    import torch
    ids = torch.as_tensor(list(block_ids), dtype=torch.long, device=cache.device)
    out = cache.index_select(dim, ids)
    if dim:
        out = out.movedim(dim, 0)
    return out.contiguous()


def scatter(blocks, cache, block_ids: Sequence[int], dim: int = 0) -> None:
    """Write ``blocks`` [n, ...] into ``cache``'s blocks ``block_ids`` (in place)."""
    import torch
    ids = torch.as_tensor(list(block_ids), dtype=torch.long, device=cache.device)
    src = blocks.to(device=cache.device)
    if dim:
        src = src.movedim(0, dim)
    cache.index_copy_(dim, ids, src)


def _recv_takes_source(client) -> bool:
    # Sidecars that scope keys by sender take recv_stream(..., source=NAME); older Clients do not.
    import inspect
    try:
        return "source" in inspect.signature(client.recv_stream).parameters
    except (TypeError, ValueError):
        return False


def crc(t) -> str:
    import crc32c
    import torch
    if t.numel() == 0:
        return "00000000"
    return f"{crc32c.crc32c(t.reshape(-1).view(torch.uint8).numpy()):08x}"


def block_shape(cache, dim: int = 0) -> List[int]:
    shape = list(cache.shape)
    del shape[dim]
    return shape


class OutgoingKV:
    """Prefill side, one request: ``open`` at its first saved layer, ``add_layer`` per layer (appended to
    the sidecar at once: layer-wise pipelining), ``close`` once every layer is in; ``handle`` completes when
    the destination sidecar holds all of it. Errors are kept (``error``), never raised into vLLM's forward."""

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
        self.started = time.monotonic()

    def _open(self, first_layer) -> None:
        self.stream = self.client.open(self.dest, self.key, priority=self.priority, deadline_s=self.deadline_s,
                                       flow=self.flow)
        header = {"format": FORMAT, "layers": self.layer_names, "num_blocks": len(self.block_ids),
                  "num_tokens": self.num_tokens, "tokens_sha": self.token_sha,
                  "block_shape": list(first_layer.shape[1:]), "dtype": str(first_layer.dtype).removeprefix("torch."),
                  "checksum": self.checksum}
        self.stream.append(json.dumps(header, sort_keys=True).encode(), name=HEADER)

    def add_layer(self, index: int, blocks) -> None:
        """Append layer ``index``'s gathered blocks (any order; each layer once)."""
        if self.error is not None:
            return
        try:
            if index in self._added or not 0 <= index < len(self.layer_names):
                raise TransferFormatError(f"layer {index} saved twice or unknown")
            if self.stream is None:
                self._open(blocks)
            tag = crc(blocks) if self.checksum else "-"
            if index == self.corrupt_layer:       # test only: enough to change tokens; the receiver must notice
                blocks[0].add_(1.0)
            self.stream.append(blocks, name=f"L{index}:{tag}")
            self._added.add(index)
        except BaseException as exc:  # noqa: BLE001 - a failed transfer must not stop the forward pass
            self.fail(exc)

    @property
    def layers_added(self) -> int:
        return len(self._added)

    @property
    def complete(self) -> bool:
        return self.layers_added == len(self.layer_names)

    def close(self) -> None:
        """After the step: every layer appended -> end the stream; else the transfer is incomplete: cancel it
        so the receiver fails at once instead of at its timeout."""
        if self.error is not None or self.handle is not None:
            return
        if not self.complete:
            self.fail(TransferFormatError(f"only {self.layers_added} of {len(self.layer_names)} layers saved"))
            return
        try:
            self.handle = self.stream.close()
        except BaseException as exc:  # noqa: BLE001
            self.fail(exc)

    def fail(self, exc: BaseException) -> None:
        if self.error is None:
            self.error = exc
            log.warning("KV transfer of request %s (key %s) to %s failed: %s", self.req_id, self.key, self.dest, exc)
        if self.stream is not None:
            try:
                self.stream.cancel()
            except Exception:  # noqa: BLE001
                pass

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


class IncomingKV:
    """Decode side, one request: a thread receives the transfer from this instance's sidecar layer by layer
    and writes each layer's blocks into ``caches`` (this instance's paged KV, by layer name) at
    ``block_ids[first:]`` as soon as it arrives (the transfer holds ``sent_blocks`` blocks, of which the first
    ``len(block_ids)`` are used). ``done`` is set when it ended; ``error`` says why it failed.
    Nothing is written after ``done``: a failed load is reported only once the thread has stopped, so vLLM
    never recomputes blocks that a late write could overwrite."""

    def __init__(self, client, req_id: str, key: str, caches: Dict[str, Any], layer_names: Sequence[str],
                 block_ids: Sequence[int], first_block: int, num_tokens: int, token_sha: str,
                 timeout_s: float, dims: Optional[Dict[str, int]] = None, sent_blocks: Optional[int] = None,
                 source: Optional[str] = None, drain: bool = False):
        self.client = client
        self.req_id = req_id
        self.key = key
        self.caches = caches
        self.layer_names = list(layer_names)
        self.block_ids = list(block_ids)
        self.first_block = int(first_block)
        self.sent_blocks = len(self.block_ids) if sent_blocks is None else int(sent_blocks)
        self.num_tokens = int(num_tokens)
        self.token_sha = token_sha
        self.timeout_s = float(timeout_s)
        self.source = source
        self.drain = drain              # receive and drop (nothing checked, nothing written)
        self.priority: Optional[str] = None
        self.dims = dims or {}
        self.deadline = time.monotonic() + self.timeout_s
        self.error: Optional[BaseException] = None
        self._loaded: set = set()
        self.done = threading.Event()
        self._cond = threading.Condition()
        self._cancelled = False
        self._stream = None
        self.started = time.monotonic()
        self.finished_at: Optional[float] = None
        self._thread = threading.Thread(target=self._run, name=f"ciuicflow-load-{req_id}", daemon=True)

    def start(self) -> "IncomingKV":
        self._thread.start()
        return self

    @property
    def ok(self) -> bool:
        return self.done.is_set() and self.error is None

    def failed_block_ids(self) -> List[int]:
        return self.block_ids[self.first_block:]

    def wait_layer(self, index: int) -> bool:
        """Block until layer ``index`` is written or the load ended (True: that layer is in place)."""
        with self._cond:
            while index not in self._loaded and not self.done.is_set():
                left = self.deadline + 5.0 - time.monotonic()
                if left <= 0:
                    self.cancel("timed out waiting for a layer")
                    break
                self._cond.wait(min(left, 0.5))
            return index in self._loaded

    def cancel(self, why: str = "cancelled") -> None:
        """Stop the load (a watchdog past the deadline, or shutdown); the thread ends at its next part."""
        with self._cond:
            if self._cancelled or self.done.is_set():
                return
            self._cancelled = True
            if self.error is None:
                self.error = TimeoutError(f"load of {self.key!r}: {why}")
        s = self._stream
        if s is not None:
            try:
                s.cancel()
            except Exception:  # noqa: BLE001
                pass

    def check_deadline(self) -> None:
        # The sidecar's recv ends by itself at timeout_s; this is the backstop for a sidecar that stopped
        # answering altogether.
        if not self.done.is_set() and time.monotonic() > self.deadline + 5.0:
            self.cancel(f"no complete transfer within {self.timeout_s:g}s")

    def _check_header(self, header: dict) -> None:
        if header.get("format") != FORMAT:
            raise TransferFormatError(f"unknown transfer format {header.get('format')!r}")
        if header.get("layers") != self.layer_names:
            raise TransferFormatError("the sender's layers differ from this model's "
                                      f"({len(header.get('layers') or [])} vs {len(self.layer_names)})")
        if header.get("tokens_sha") != self.token_sha or int(header.get("num_tokens", -1)) != self.num_tokens:
            raise TransferFormatError(f"transfer {self.key!r} holds another prompt "
                                      f"({header.get('num_tokens')} tokens vs {self.num_tokens})")
        if int(header.get("num_blocks", -1)) != self.sent_blocks or self.sent_blocks < len(self.block_ids):
            raise TransferFormatError(f"{header.get('num_blocks')} blocks sent, {self.sent_blocks} expected "
                                      f"({len(self.block_ids)} to load)")

    def _run(self) -> None:
        try:
            kwargs = {"source": self.source} if self.source and _recv_takes_source(self.client) else {}
            self._stream = self.client.recv_stream(self.key, timeout_s=self.timeout_s, **kwargs)
            if self._cancelled:
                self._stream.cancel()
            parts = iter(self._stream)
            first = next(parts, None)
            if self._stream.header is not None:
                self.priority = self._stream.header.priority      # as the sending sidecar scheduled it
            if self.drain:
                for _ in parts:
                    pass
                return
            if first is None or first.name != HEADER or first.is_tensor:
                raise TransferFormatError(f"transfer {self.key!r} is not a vLLM KV transfer")
            header = json.loads(bytes(first.value))
            self._check_header(header)
            check = bool(header.get("checksum"))
            for n in range(len(self.layer_names)):
                part = next(parts, None)
                if part is None:
                    raise TransferFormatError(f"transfer {self.key!r} ended after {n} of {len(self.layer_names)} layers")
                tag, _, want = part.name.partition(":")
                i = int(tag[1:]) if tag[:1] == "L" and tag[1:].isdigit() else -1
                if not part.is_tensor or not 0 <= i < len(self.layer_names) or i in self._loaded:
                    raise TransferFormatError(f"part {part.index} is {part.name!r}, not a layer's blocks")
                name = self.layer_names[i]
                blocks = part.value
                cache = self.caches[name]
                dim = self.dims.get(name, 0)
                if str(blocks.dtype) != str(cache.dtype):
                    raise TransferFormatError(f"layer {i}: {blocks.dtype} sent, the cache is {cache.dtype}")
                shape = block_shape(cache, dim)
                if list(blocks.shape[1:]) != shape:
                    if blocks[0].numel() != math.prod(shape):
                        raise TransferFormatError(f"layer {i}: blocks {tuple(blocks.shape[1:])} do not fit {shape}")
                    blocks = blocks.reshape([blocks.shape[0], *shape])      # e.g. MLA's 3-D view vs 4-D cache
                if check and crc(blocks) != want:
                    raise TransferFormatError(f"layer {i} ({name}) arrived corrupted (crc32c {crc(blocks)} != {want})")
                with self._cond:
                    if self._cancelled:
                        raise TimeoutError(f"load of {self.key!r} cancelled")
                    ids = self.block_ids[self.first_block:]
                    if ids:
                        scatter(blocks[self.first_block:len(self.block_ids)], cache, ids, dim)
                    self._loaded.add(i)
                    self._cond.notify_all()
            rest = next(parts, None)
            if rest is not None:
                raise TransferFormatError(f"transfer {self.key!r}: unexpected part {rest.name!r} after the layers")
        except BaseException as exc:  # noqa: BLE001 - any failure is a load error for vLLM, never a crash
            with self._cond:
                if self.error is None:
                    self.error = exc
            if self._stream is not None:
                try:
                    self._stream.cancel()
                except Exception:  # noqa: BLE001
                    pass
            (log.debug if self.drain else log.warning)("KV load of request %s (key %s) failed: %s", self.req_id,
                                                       self.key, self.error)
        finally:
            with self._cond:
                self.finished_at = time.monotonic()
                self.done.set()
                self._cond.notify_all()
