"""1 bit, and int4 for the chunks where 1 bit errs most: what the servers of 1 bit's two phases send.

In two phases each server quantises the mean of its segment again; 1 bit there costs accuracy
and int4 twice the bytes (docs/decisions.md). This codec sends every chunk's signs and scale as
1 bit does and, for the ``REFINED_SHARE`` (a tenth) of a segment's chunks whose scale x sign errs
most (the largest ||y - scale sign(y)||^2), three more bits per element: |y| in steps of
max|y| / 7, so that those chunks decode as int4 does (levels -7..7).

Layout: 1 bit's signs of every chunk (chunk/8 bytes each, chunks of at most ``MAX_CHUNK``), then a
*side block* per refined chunk, in chunk order: the 3-bit magnitudes of ``MAX_CHUNK`` elements, low
bits first (96 bytes). A refined chunk's scale is negative (its magnitude: the int4 step), so a
receiver knows from the scales which chunks have side blocks, as with 1 bit's values
(``compression.outliers``; the exchange sends side blocks in a second, variable-size step).

Memory: a refined chunk carries all of its error (below half a step, as int4's), a plain chunk
``plain_decay`` of its own (the 1-bit default: half). The decay is applied here, as the memory is
written, so the step passes ``error_decay=1.0``.
"""
from __future__ import annotations

import torch

from ciuicflow.compression.codec import native_ops
from ciuicflow.compression.outliers import MAX_CHUNK, SideBlockCodec, _chunks_y, _padded_bytes, \
    _signs, _sum_of_squares, _write_rows
from ciuicflow.compression.registry import REFINED_SHARE

LEVELS = 7  # int4's: magnitudes 0..7 in steps of max|y| / 7
MAGNITUDE_BITS = 3


def refined_count(nchunks: int, share: float = REFINED_SHARE) -> int:
    """How many of ``nchunks`` chunks a pack refines: the nearest whole number to the share."""
    return int(share * nchunks + 0.5)


class RefinedOneBitCodec(SideBlockCodec):
    """Scale x sign, int4 in the chunks where it errs most (module docstring)."""

    name = "onebit_int4"
    marked_as = "a chunk refined to int4"
    side_bytes = MAX_CHUNK * MAGNITUDE_BITS // 8

    def __init__(self, plain_decay: float = 0.5, share: float = REFINED_SHARE):
        if not 0.0 <= float(plain_decay) <= 1.0:
            raise ValueError(f"plain_decay must be in [0, 1], got {plain_decay}")
        if not 0.0 <= float(share) <= 1.0:
            raise ValueError(f"share must be in [0, 1], got {share}")
        self.plain_decay, self.share = float(plain_decay), float(share)

    def pack_ef(self, x, error, error_decay, error_out, chunk, measure=True, units=None):
        """(payload, scales, sums) of y = x + error_decay x error; ``error_out`` gets what was
        not sent, each chunk's share of it carried (all in a refined chunk, ``plain_decay`` in
        a plain one)."""
        if units is not None:
            raise ValueError(f"{type(self).__name__} does not quantise in an optimizer's units "
                             "(the policy plans them only for the int and 1-bit codecs)")
        n = x.numel()
        sign_bytes = self._sign_bytes(chunk)
        signs, scales, sums = native_ops().onebit_pack_ef(x, error, error_decay, error_out, chunk)
        nchunks = scales.numel()
        payload = signs if signs.numel() == nchunks * sign_bytes else \
            _padded_bytes(signs, nchunks * sign_bytes)
        count = refined_count(nchunks, self.share)
        refined = None
        if n and count:
            full = n // chunk
            wrong = error_out.new_zeros(nchunks)  # 1 bit's squared error per chunk
            wrong[:full] = error_out[:full * chunk].view(full, chunk).square().sum(1)
            if full < nchunks:
                wrong[full] = error_out[full * chunk:].square().sum()
            picked = torch.topk(wrong, count, sorted=False).indices.sort().values
            y, sign = _chunks_y(payload.view(nchunks, sign_bytes), scales, error_out, n, chunk,
                                picked)
            step = y.abs().amax(1) / LEVELS
            levels = torch.where(step.view(-1, 1) > 0,
                                 y.abs() / step.clamp(min=torch.finfo(torch.float32).tiny)
                                 .view(-1, 1), 0.0).round_().clamp_(0, LEVELS)
            left = y.sub_(levels * sign * step.view(-1, 1))  # all of a refined chunk's error kept
            refined = (picked, levels.to(torch.uint8), step, left)
        if self.plain_decay != 1.0:
            error_out.mul_(self.plain_decay)
        if refined is not None:
            picked, levels, step, left = refined
            _write_rows(error_out, left, picked, n, chunk)
            scales[picked] = -step  # the marker: its sign bit (-0.0 included)
            payload = torch.cat([payload, _pack_magnitudes(levels).view(-1)])
        if not measure:  # the native sums' first is the memory before it was decayed
            return payload, scales, None
        if refined is not None or self.plain_decay != 1.0:
            sums[0] = _sum_of_squares(error_out)
        return payload, scales, sums

    def unpack_mean(self, payload, scales, numel, chunk, out, side=None):
        """The native mean of the rows' scale x sign, then each row's refined chunks corrected
        to their int4 values, one row at a time. ``side``: per row, its side blocks in chunk
        order (a row without refined chunks may have None)."""
        rows, nchunks = scales.shape
        sign_bytes = self._sign_bytes(chunk)
        magnitude, marked = self._signs_mean(payload, scales, numel, chunk, out)
        if not bool(marked.any()):
            return out
        columns = torch.arange(chunk, device=out.device)
        for row in range(rows):
            idx = torch.nonzero(marked[row]).view(-1)
            if idx.numel() == 0:
                continue
            block = side[row][:idx.numel() * self.side_bytes].view(idx.numel(), self.side_bytes)
            levels = _unpack_magnitudes(block)[:, :chunk].to(torch.float32)
            sign = _signs(payload[row, :nchunks * sign_bytes].reshape(nchunks, sign_bytes), idx,
                          chunk)
            step = magnitude[row, idx].view(-1, 1)
            change = (levels - 1.0).mul_(sign).mul_(step).div_(rows)  # int4 value - (+-step)
            flat = idx.view(-1, 1) * chunk + columns
            keep = flat < numel
            out.index_put_((flat[keep],), change[keep], accumulate=True)
        return out


def _pack_magnitudes(levels: torch.Tensor) -> torch.Tensor:
    """uint8 [k, chunk] levels 0..7 -> uint8 [k, side_bytes]: 3 bits each, low bits first, the
    chunk padded to ``MAX_CHUNK`` elements."""
    k, chunk = levels.shape
    padded = levels.new_zeros(k, MAX_CHUNK)
    padded[:, :chunk] = levels
    shifts = torch.arange(MAGNITUDE_BITS, dtype=torch.uint8, device=levels.device)
    bits = padded.unsqueeze(-1).bitwise_right_shift(shifts).bitwise_and_(1)  # [k, MAX_CHUNK, 3]
    weights = torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8,
                           device=levels.device)
    return bits.view(k, -1, 8).mul_(weights).sum(2, dtype=torch.uint8)


def _unpack_magnitudes(block: torch.Tensor) -> torch.Tensor:
    """``_pack_magnitudes``'s inverse: uint8 [k, side_bytes] -> uint8 [k, MAX_CHUNK]."""
    k = block.shape[0]
    shifts = torch.arange(8, dtype=torch.uint8, device=block.device)
    bits = block.unsqueeze(-1).bitwise_right_shift(shifts).bitwise_and_(1)  # [k, 96, 8]
    weights = torch.tensor([1, 2, 4], dtype=torch.uint8, device=block.device)
    return bits.view(k, MAX_CHUNK, MAGNITUDE_BITS).mul_(weights).sum(2, dtype=torch.uint8)
