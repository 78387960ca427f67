"""2-bit compression with error feedback for adaptive optimizers' tensors: per element a sign and
a level bit, per chunk two fitted magnitudes.

Adam divides each coordinate's update by the root of its own running mean square. 1-bit scale x
sign gives every element of a chunk the same magnitude, so Adam's variance of the compressed
gradient is the chunk's, not the coordinate's (what that cost: docs/decisions.md). One more bit per element that tells the large elements from the small ones brings most of the
per-coordinate magnitude back at twice int4's compression.

Per chunk of y (input plus the memory): ``threshold`` = 0.9816 x RMS(y) (Lloyd-Max's boundary of a
4-level quantiser for Gaussian values); an element above it sends ``hi`` (the mean |y| of the large
elements), one at or below it ``lo`` (the mean |y| of the small ones), each with its sign. ``hi``
travels as the chunk's float32 scale, ``lo`` as one byte ``round(255 lo / hi)`` (what the byte
rounds off stays in the memory, as every other rounding does).

Layout of a chunk: [the lo byte | chunk / 4 bytes of 2-bit codes], element i of the chunk at bits
2 (i % 4) of byte i / 4: bit 0 the sign (1: negative), bit 1 the level (1: ``hi``). A trimmed last
chunk has ceil(its elements / 4) bytes of codes, so the payload of the first k chunks is a prefix
of the payload of more (the exchange pads a segment with zero bytes and zero scales: whole chunks
that unpack to 0). 256
elements per chunk: 2 + 40 / 256 bits per element, 14.8x fewer bytes than float32.

The pack is native on CPU and CUDA (``ciuicflow.ops.twobit_pack``, csrc/cpu/twobit.cpp and
csrc/cuda/twobit.cu) and torch ops elsewhere (``pack_torch``, also where a build has no CUDA
kernels); the unpack is torch ops everywhere (a gather per row). Timings: docs/decisions.md.
"""
from __future__ import annotations

import torch

from ciuicflow import formats
from ciuicflow.compression.codec import Codec, native_ops

THRESHOLD = 0.9816  # x the chunk's RMS
_SHIFTS = (0, 2, 4, 6)


class TwoBitCodec(Codec):
    """Sign and level bit per element, ``hi`` and ``lo`` per chunk (module docstring)."""

    name = "twobit"
    granule = 8  # chunks laid out as 1-bit's (whole bytes of signs), so one memory serves both

    payload_bytes = staticmethod(formats.twobit_payload_bytes)

    def pack(self, x, error, chunk):
        if x.is_cpu or (x.is_cuda and native_ops().has_cuda_kernels()):
            # the native op (it checks chunk and error as pack_torch does)
            return native_ops().twobit_pack(x.reshape(-1), error, chunk)
        return self.pack_torch(x, error, chunk)

    def pack_torch(self, x, error, chunk):
        """``pack`` in torch ops (any device; the native ops sum in another order, so a scale may
        differ in its last bit)."""
        if chunk % 4:
            raise ValueError(f"twobit chunks hold a multiple of 4 elements, got {chunk}")
        n = x.numel()
        if n == 0:
            return (torch.zeros(0, dtype=torch.uint8, device=x.device),
                    torch.zeros(0, dtype=torch.float32, device=x.device))
        nchunks = -(-n // chunk)
        y = error.add_(x.reshape(-1))  # the memory becomes y; what is sent comes off it below
        if n % chunk:
            z = torch.zeros(nchunks * chunk, dtype=torch.float32, device=y.device)
            z[:n] = y
            z = z.view(nchunks, chunk)
        else:  # read in place: nothing below reads z after the memory changes
            z = y.view(nchunks, chunk)
        count = torch.full((nchunks,), float(chunk), device=y.device)
        count[-1] = n - (nchunks - 1) * chunk  # the padding is neither large nor small
        magnitude = z.abs()
        rms = magnitude.square().sum(1).div_(count).sqrt_()
        large = magnitude > (THRESHOLD * rms).unsqueeze(1)
        n_large = large.sum(1)
        # the padding's magnitude is 0: it adds nothing to either sum
        sum_large = torch.where(large, magnitude, 0.0).sum(1)
        sum_small = magnitude.sum(1).sub_(sum_large)
        hi = sum_large / n_large.clamp(min=1)
        lo = sum_small / (count - n_large).clamp(min=1)
        # a chunk without a large element (all equal, or all zero) sends everything as lo: hi
        # carries the magnitude then, and the byte says lo = hi
        hi = torch.where(n_large == 0, lo, hi)
        ratio = torch.where(hi > 0, lo / hi, torch.zeros_like(hi)).mul_(255).round_()
        ratio = torch.nan_to_num(ratio, nan=0.0).clamp_(0, 255)
        hi = torch.where(torch.isfinite(rms), hi, torch.full_like(hi, float("nan")))
        codes = (z < 0).to(torch.uint8).bitwise_or_(large.to(torch.uint8) << 1)
        error.sub_(_levels(hi, hi * ratio / 255).gather(1, codes.long()).view(-1)[:n])
        codes = codes.view(nchunks, chunk // 4, 4)
        packed = codes[..., 0] | (codes[..., 1] << 2) | (codes[..., 2] << 4) | (codes[..., 3] << 6)
        payload = torch.cat([ratio.to(torch.uint8).unsqueeze(1), packed], dim=1)
        return payload.view(-1)[:self.payload_bytes(n, chunk)], hi.to(torch.float32)

    def unpack(self, payload, scales, numel, chunk, out, side=None):
        return self.unpack_mean(payload.view(1, -1), scales.view(1, -1), numel, chunk, out)

    def unpack_mean(self, payload, scales, numel, chunk, out, side=None):
        """Rows decoded one at a time and summed in row order (the same bits on every rank that
        holds the same rows), then divided by the number of rows."""
        rows, nchunks = scales.shape
        payload = payload.reshape(rows, -1)
        width = 1 + chunk // 4
        total = None
        for row in range(rows):
            value = self._decode(payload[row], scales[row], numel, chunk, nchunks, width)
            total = value if total is None else total.add_(value)
        out.copy_(total.view(-1)[:numel]).div_(rows)
        return out

    def _decode(self, payload, hi, numel, chunk, nchunks, width):
        blocks = torch.zeros(nchunks * width, dtype=torch.uint8, device=payload.device)
        used = self.payload_bytes(numel, chunk)
        blocks[:used] = payload[:used]
        blocks = blocks.view(nchunks, width)
        hi = hi.to(torch.float32).unsqueeze(1)
        lo = hi * blocks[:, :1].to(torch.float32) / 255
        codes = torch.stack([(blocks[:, 1:] >> s) & 3 for s in _SHIFTS], dim=2).view(nchunks, chunk)
        return _levels(hi, lo).gather(1, codes.long())


def _levels(hi, lo):
    """[chunks, 4]: each chunk's value of codes 0-3 (bit 0 the sign, bit 1 the level)."""
    hi, lo = hi.view(-1, 1), lo.view(-1, 1)
    return torch.cat([lo, -lo, hi, -hi], dim=1)
