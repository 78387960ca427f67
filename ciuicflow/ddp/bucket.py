"""What a DDP hook keeps of a bucket, and the per-bucket memories that outlive DDP's buckets."""
from __future__ import annotations

import hashlib
from typing import Callable

import torch.distributed as dist


class BucketView:
    """What a hook reads from a GradBucket, in the hook's thread (the bucket object is not kept)."""

    __slots__ = ("index", "buffer", "is_last", "segments", "parameters")

    def __init__(self, index, buffer, is_last, segments, parameters):
        self.index, self.buffer, self.is_last = index, buffer, is_last
        self.segments, self.parameters = segments, parameters

    @classmethod
    def read(cls, bucket: dist.GradBucket) -> "BucketView":
        buffer = bucket.buffer()
        base = buffer.storage_offset()
        segments = [(g.storage_offset() - base, tuple(g.shape)) for g in bucket.gradients()]
        return cls(bucket.index(), buffer, bucket.is_last(), segments, bucket.parameters())

    def key(self, hierarchical: bool) -> str:
        """Names this bucket's memory: same layout, same key (in every process, after resume)."""
        layout = repr((str(self.buffer.dtype), self.segments)).encode()
        digest = hashlib.sha1(layout).hexdigest()[:12]
        return f"{'h' if hierarchical else 'f'}{self.index}:{self.buffer.numel()}:{digest}"


class BucketMemories:
    """Memory objects by bucket key, with the layout each was made for.

    DDP rebuilds its buckets after its first step (its first step uses one bucket holding every
    parameter), so right after a resume the buckets differ from the checkpoint's for one step.
    Such a bucket is cut into the checkpoint's buckets (found by parameter name) and each piece is
    reduced with its own memory, in the checkpoint's order: the resumed run then computes what
    the uninterrupted run did. Without names (no ``register``/``bind_model``), or when the pieces
    do not fit, the bucket is all-reduced exactly that step and the memory kept for later.
    """

    def __init__(self, make: Callable[[], object]):
        self._make = make
        self.entries: dict[str, tuple[dict, object]] = {}  # key -> (layout, memory)
        self.pending: set[str] = set()  # loaded from a checkpoint, not used since
        self._seen: set[str] = set()    # used during the current step
        self._steps_since_load = 0

    def get(self, bucket: BucketView, hierarchical: bool, names):
        """The bucket's memory, a new one, or None when a checkpoint's memory is still pending."""
        key = bucket.key(hierarchical)
        entry = self.entries.get(key)
        if entry is None:
            if self.pending:
                return None
            layout = {"index": bucket.index, "numel": bucket.buffer.numel(),
                      "dtype": str(bucket.buffer.dtype), "segments": bucket.segments,
                      "params": names, "hierarchical": hierarchical}
            entry = self.entries[key] = (layout, self._make())
        self.pending.discard(key)
        self._seen.add(key)
        return entry[1]

    def pieces(self, bucket: BucketView, hierarchical: bool, names):
        """Pending checkpoint buckets that exactly tile ``bucket``: [(key, layout, memory)]."""
        if names is None:
            return None
        where = {}
        for name, (offset, shape) in zip(names, bucket.segments):
            where[name] = (offset, shape)
        pieces, covered = [], set()
        for key in self.pending:
            layout, memory = self.entries[key]
            params = layout["params"]
            if layout["hierarchical"] != hierarchical or not params \
                    or layout["dtype"] != str(bucket.buffer.dtype) \
                    or not all(p in where for p in params):
                continue
            shapes = [tuple(shape) for _, shape in layout["segments"]]
            if any(shape != where[p][1] for p, shape in zip(params, shapes)):
                continue
            pieces.append((key, layout, memory))
            covered.update(params)
        if covered != set(where) or sum(len(p[1]["params"]) for p in pieces) != len(where):
            return None
        return sorted(pieces, key=lambda p: p[1]["index"])

    def mark_used(self, key: str) -> None:
        self.pending.discard(key)
        self._seen.add(key)

    def end_of_step(self, warn: Callable[[str, str], None]) -> None:
        self._steps_since_load += 1
        if self.pending and self._steps_since_load >= 2:
            warn("stale", "ciuicflow: the checkpoint's DDP buckets never came back; their "
                 "error-feedback memory is dropped")
            for key in self.pending:
                del self.entries[key]
            self.pending.clear()
        # memory of buckets that no longer exist (DDP rebuilt them) is dropped
        for key in [k for k in self.entries if k not in self._seen and k not in self.pending]:
            del self.entries[key]
        self._seen = set()

    def state_dict(self) -> dict:
        return {key: {"layout": layout, "tensors": memory.state_dict()}
                for key, (layout, memory) in self.entries.items()}

    def load_state_dict(self, state: dict) -> None:
        self.entries = {}
        for key, entry in state.items():
            memory = self._make()
            memory.load_state_dict(entry["tensors"])
            self.entries[key] = (entry["layout"], memory)
        self.pending = set(self.entries)
        self._seen = set()
        self._steps_since_load = 0
