"""One request's KV blocks through the sidecar: the transfer format and the decode side's ``IncomingKV``
(received layer by layer in a thread and written into this instance's own blocks); the prefill side's
``OutgoingKV`` (a layer's blocks sent as soon as that layer has run) is in outgoing.py. No vLLM import, so
the tests drive these against real sidecars with paged caches of vLLM's shapes.

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


class IncomingKV:
    """Decode side, one request: a thread receives the transfer from this instance's sidecar layer by layer
    and writes each layer's blocks into ``caches`` (this instance's paged KV, by layer name) at
    ``block_ids[first:]`` as soon as it arrives (the transfer holds ``sent_blocks`` blocks, of which the first
    ``len(block_ids)`` are used). ``done`` is set when it ended; ``error`` says why it failed.
    ``checksum``: this side's policy (Settings.checksum): every layer's crc32c is checked, and a transfer
    sent without them is refused; the sender's header does not decide it.
    Nothing is written after ``done``: a failed load is reported only once the thread has stopped, so vLLM
    never recomputes blocks that a late write could overwrite."""

    def __init__(self, client, req_id: str, key: str, caches: Dict[str, Any], layer_names: Sequence[str],
                 block_ids: Sequence[int], first_block: int, num_tokens: int, token_sha: str,
                 timeout_s: float, dims: Optional[Dict[str, int]] = None, sent_blocks: Optional[int] = None,
                 source: Optional[str] = None, drain: bool = False, checksum: bool = True):
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
        self.checksum = bool(checksum)
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
        self.t_start = time.time()            # wall clock, for the benchmark's phases (phases.py)
        self.t_first: Optional[float] = None  # the first layer's blocks arrived
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

    def _checks(self, header: dict) -> bool:
        """Whether each layer's crc32c is checked: this side's policy. A sender that sent no checksums
        cannot turn the check off (a layer changed after it left would load unnoticed)."""
        if self.checksum and header.get("checksum") is not True:
            raise TransferFormatError(f"transfer {self.key!r} was sent without layer checksums; this side "
                                      "requires them (checksum on)")
        return self.checksum

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
            check = self._checks(header)
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
                if self.t_first is None:
                    self.t_first = time.time()
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
