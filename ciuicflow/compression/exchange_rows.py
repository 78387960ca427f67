"""How ``quantized_exchange`` lays a step's parts out in the rows it exchanges, and the second,
variable-size exchange of a codec's side blocks (1-bit's values, ``compression.outliers``).

A row (one per destination rank): packed payload (its fixed part) | float32 scales | float32 flag
row | float32 exact values. The side blocks of marked chunks (a negative scale marks them) follow
in ``exchange_side``: each receiver knows from the scales it received how many come from whom.
"""
from __future__ import annotations

import torch

from ciuicflow.collectives.primitives import Hop, Traffic, all_to_all_uneven


def padded(values: torch.Tensor, length: int) -> torch.Tensor:
    """``values`` zero-padded to ``length``: itself when it has that length, else a copy."""
    if values.numel() == length:
        return values
    out = values.new_zeros(length)
    out[:values.numel()] = values
    return out


def _as_bytes(t: torch.Tensor, rows: int) -> torch.Tensor:
    return t.contiguous().view(rows, -1).view(torch.uint8) if t.numel() else \
        t.new_empty(rows, 0, dtype=torch.uint8)


def pack_rows(rows: int, packed, scales, flags, raw) -> torch.Tensor:
    """[rows, bytes]; a row: packed signs | float32 scales | float32 flag | float32 exact values."""
    parts = [packed.view(rows, -1) if packed.numel() else packed.new_empty(rows, 0),
             _as_bytes(scales, rows)]
    if flags is not None:
        parts.append(_as_bytes(flags, rows))
    parts.append(_as_bytes(raw.to(torch.float32), rows))
    return torch.cat(parts, dim=1)


def unpack_rows(rows: torch.Tensor, layout, with_flag: bool):
    """Split what ``pack_rows`` built (one row per rank) back into its four parts (sizes from
    ``layout``, a ``quantized_exchange._Layout``). The payload stays
    a view (rows apart: the bulk of the bytes, which the codecs' unpacks read in place); the
    float parts are copied, as a float view needs aligned rows."""
    sizes = [layout.packed_bytes, 4 * layout.nscales, 4 * layout.flag_floats if with_flag else 0,
             4 * layout.raw]
    parts, start = [], 0
    for index, size in enumerate(sizes):
        part = rows[:, start:start + size]
        parts.append(part if index == 0 else part.contiguous())
        start += size
    packed, scales, flags, raw = parts
    as_float = (lambda t: t.view(torch.float32) if t.shape[1] else
                t.new_empty(t.shape[0], 0, dtype=torch.float32))
    return packed, as_float(scales), as_float(flags), as_float(raw)


def count_marked(scales: torch.Tensor, rows: int) -> torch.Tensor:
    """Chunks with a side block (a negative scale) in each of ``rows`` equal parts of ``scales``
    (float32 [rows])."""
    if scales.numel() == 0:
        return scales.new_zeros(rows)
    return torch.signbit(scales.view(rows, -1)).sum(1, dtype=torch.float32)


def exchange_side(side: torch.Tensor, sent: list, received: list, block: int, hop: Hop,
                   traffic: Traffic | None) -> torch.Tensor:
    """The side blocks' exchange: ``sent`` blocks to each rank (one count: the same blocks to
    every rank), ``received[i]`` blocks from rank i; what came, in rank order."""
    if len(sent) == 1:
        sends, counts = [side] * hop.size, sent * hop.size
    else:
        counts = sent
        sends = list(side.split([c * block for c in counts]))
    output = side.new_empty(sum(received) * block)
    all_to_all_uneven(output, torch.cat(sends), [c * block for c in received],
                      [c * block for c in counts], hop, traffic)
    return output


def side_per_row(side, scales: torch.Tensor, block: int):
    """The side blocks received (``exchange_side``) cut per row of ``scales`` (whole rows: a
    row's count includes any marked padding chunks); None without."""
    if side is None:
        return None
    counts = count_marked(scales, scales.shape[0]).tolist()
    return list(side.split([int(c) * block for c in counts]))
