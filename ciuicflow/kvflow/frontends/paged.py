"""Paged KV caches (an inference server's blocks, one ``[num_blocks, block_size, ...]`` tensor per layer)
<-> KV-flow transfers of layout "paged": one request's blocks gathered from its block table, written into
the destination's own free blocks."""
from __future__ import annotations

from typing import Any, List, Optional, Sequence

from .format import CacheFormatError, ReceivedCache, receive_layers, send_tensors


def _block_index(block_ids, num_blocks: int):
    import torch
    ids = torch.as_tensor(block_ids, dtype=torch.long).reshape(-1)
    if ids.numel() == 0:
        raise CacheFormatError("block_ids is empty")
    if int(ids.min()) < 0 or int(ids.max()) >= num_blocks:
        raise CacheFormatError(f"block ids must be in [0, {num_blocks}), got {ids.tolist()}")
    return ids


def gather_blocks(kv_caches: Sequence[Any], block_ids) -> List[Any]:
    """Per layer, the blocks of one request ``[len(block_ids), block_size, ...]`` from paged KV caches
    ``[num_blocks, block_size, ...]`` (one tensor per layer, as inference servers hold them)."""
    if not kv_caches:
        raise CacheFormatError("no paged KV layers given")
    out = []
    for i, kv in enumerate(kv_caches):
        if kv.dim() < 2:
            raise CacheFormatError(f"layer {i}: paged KV must be [num_blocks, block_size, ...], got {tuple(kv.shape)}")
        out.append(kv.index_select(0, _block_index(block_ids, kv.shape[0]).to(kv.device)))
    return out


def send_blocks(client, dest: str, key: str, kv_caches: Sequence[Any], block_ids, num_tokens: Optional[int] = None,
                meta: Optional[dict] = None, priority: str = "normal", deadline_s: Optional[float] = None, **kwargs):
    """Send one request's blocks of paged KV caches (one ``[num_blocks, block_size, ...]`` tensor per layer)."""
    blocks = gather_blocks(kv_caches, block_ids)
    block_size = int(blocks[0].shape[1])
    return send_tensors(client, dest, key, [[b] for b in blocks], ["blocks"], layout="paged",
                        extra={"block_size": block_size, "num_blocks": int(blocks[0].shape[0]),
                               "num_tokens": num_tokens}, meta=meta, priority=priority,
                        deadline_s=deadline_s, **kwargs)


def scatter_blocks(blocks: Sequence[Any], kv_caches: Sequence[Any], block_ids) -> None:
    """Write received per-layer blocks into this side's paged KV caches at ``block_ids`` (in place)."""
    if len(blocks) != len(kv_caches):
        raise CacheFormatError(f"{len(blocks)} layers of blocks for {len(kv_caches)} paged KV layers")
    for i, (b, kv) in enumerate(zip(blocks, kv_caches)):
        ids = _block_index(block_ids, kv.shape[0])
        if ids.numel() != b.shape[0] or tuple(b.shape[1:]) != tuple(kv.shape[1:]):
            raise CacheFormatError(f"layer {i}: received blocks {tuple(b.shape)} do not fit {ids.numel()} blocks "
                                   f"of {tuple(kv.shape[1:])}")
        kv.index_copy_(0, ids.to(kv.device), b.to(device=kv.device, dtype=kv.dtype))


def recv_blocks(client, key: str, kv_caches: Optional[Sequence[Any]] = None, block_ids=None,
                timeout_s: Optional[float] = None) -> ReceivedCache:
    """Receive a ``send_blocks`` transfer; with ``kv_caches`` and ``block_ids``, also write the blocks into
    them (the destination's own free blocks)."""
    received = receive_layers(client, key, timeout_s)
    if received.header["layout"] != "paged":
        raise CacheFormatError(f"transfer {key!r} holds a {received.header['layout']!r} cache, not paged blocks")
    if kv_caches is not None:
        if block_ids is None:
            raise CacheFormatError("block_ids is needed to write received blocks into kv_caches")
        scatter_blocks([layer.tensors[0] for layer in received.layers], kv_caches, block_ids)
    return received
