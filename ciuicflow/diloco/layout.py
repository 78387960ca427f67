"""What DiLoCo syncs and when: the model cut into fragments, each fragment's flat copy, the schedule.

A fragment is a run of whole parameters in registration order, cut so that fragments hold about the
same number of elements (Streaming DiLoCo's fragments: the network then carries about the same
load at each of the staggered syncs). Parameters are read through their local tensors, so an FSDP2
model (DTensor shards) is cut the same way on every rank of a node, each rank holding its shards.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


# dtypes that float32 holds exactly, so that float32 arithmetic with them rounds as with their
# float32 copies
_EXACT_IN_FLOAT32 = (torch.float32, torch.float16, torch.bfloat16)


def local_tensor(param: torch.Tensor) -> torch.Tensor:
    """The tensor this rank holds of ``param``: an FSDP2 DTensor's local shard, else itself."""
    to_local = getattr(param, "to_local", None)
    return to_local() if to_local is not None else param


def is_sharded(params) -> bool:
    return any(hasattr(p, "to_local") for p in params)


@dataclass
class Fragment:
    """A run of parameters, flattened in order into ``numel`` float32 elements."""

    index: int
    params: list
    numel: int

    def read(self) -> torch.Tensor:
        """This rank's values of the fragment, as one new float32 vector."""
        return torch.cat([local_tensor(p).detach().reshape(-1).to(torch.float32)
                          for p in self.params]) if self.params else torch.zeros(0)

    @torch.no_grad()
    def delta(self, anchor: torch.Tensor, out: torch.Tensor,
              snapshot: torch.Tensor | None = None) -> torch.Tensor:
        """``anchor - read()`` written into ``out`` (float32, ``numel`` elements), parameter by
        parameter: the same values without the flat copy of the parameters or a new result (each
        fresh vector of this size costs a page fault per 4 KiB). ``snapshot``: also ``read()``
        written into it (float32, ``numel`` elements), in the same pass."""
        offset = 0
        for p in self.params:
            local = local_tensor(p).detach().reshape(-1)
            n = local.numel()
            if local.dtype not in _EXACT_IN_FLOAT32:  # rounded to float32 first, as read() does
                local = local.to(torch.float32)
            if snapshot is not None:
                local = snapshot[offset:offset + n].copy_(local)
            torch.sub(anchor[offset:offset + n], local, out=out[offset:offset + n])
            offset += n
        return out

    @torch.no_grad()
    def write(self, flat: torch.Tensor, alpha: float = 0.0) -> None:
        """Set the parameters to ``flat`` (alpha 0), or to alpha x themselves + (1 - alpha) x flat
        (Streaming DiLoCo's mixing of the local and the global fragment)."""
        offset = 0
        for p in self.params:
            local = local_tensor(p)
            n = local.numel()
            value = flat[offset:offset + n].view(local.shape)
            if alpha:
                value = local.to(torch.float32).mul(alpha).add_(value, alpha=1.0 - alpha)
            local.copy_(value)
            offset += n

    @torch.no_grad()
    def write_with_progress(self, flat: torch.Tensor, since: torch.Tensor) -> None:
        """Set the parameters to ``flat`` plus how far they moved since ``since`` (their values
        when the sync was sent, ``delta``'s snapshot): the inner steps taken while the sync was in
        flight are kept, not overwritten. ``since`` is overwritten."""
        offset = 0
        for p in self.params:
            local = local_tensor(p)
            n = local.numel()
            moved = since[offset:offset + n]
            torch.sub(local.detach().reshape(-1), moved, out=moved)
            local.copy_(moved.add_(flat[offset:offset + n]).view(local.shape))
            offset += n


def split(params: list, fragments: int) -> list[Fragment]:
    """``params`` (trainable, in order) cut into ``fragments`` runs of about equal size, each
    holding at least one parameter."""
    sizes = [local_tensor(p).numel() for p in params]
    total = sum(sizes)
    cuts, acc, start = [], 0, 0
    for i, size in enumerate(sizes):
        acc += size
        left_params = len(sizes) - i - 1
        left_frags = fragments - len(cuts) - 1
        # cut once this run reaches its share, keeping one parameter for each fragment still owed
        if left_frags and (acc >= total * (len(cuts) + 1) / fragments or left_params == left_frags):
            cuts.append((start, i + 1))
            start = i + 1
    cuts.append((start, len(sizes)))
    return [Fragment(k, params[a:b], sum(sizes[a:b])) for k, (a, b) in enumerate(cuts)]


@dataclass(frozen=True)
class Schedule:
    """Fragment ``k`` of ``fragments`` is sent after inner steps ``offset(k)``, ``offset(k) + H``,
    ... (H = ``sync_every``), and applied ``delay`` inner steps after it is sent. The offsets are
    spread over the period, so with several fragments one is in flight most of the time."""

    sync_every: int
    fragments: int
    delay: int

    def offset(self, k: int) -> int:
        return (k + 1) * self.sync_every // self.fragments

    def sends_at(self, step: int) -> list[int]:
        """The fragments sent after inner step ``step`` (counted from 1)."""
        return [k for k in range(self.fragments)
                if step >= self.offset(k) and (step - self.offset(k)) % self.sync_every == 0]
