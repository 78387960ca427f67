"""1-bit chunks that also send their largest values, where a gradient is concentrated.

Scale x sign spends one bit on every element alike, and a chunk's scale (the mean |value|) clips
its large elements: with half of the memory carried (the 1-bit default ``error_decay`` 0.5) an
element far above its chunk's scale moves at the scale, not at its value (docs/convergence.md).
Where a gradient is concentrated -- the CNN's first linear layer, whose largest 1% of elements hold
61-77% of its energy from mid-training on -- that clipping cost flat 1-bit 1.5-3.5 accuracy points.
Where it is not, the clipping did no harm, and unclipping some coordinates but not others cost a
residual MLP 4 points. So the values are gated by a measure of concentration:

    in each window of ``WINDOW_CHUNKS`` chunks of y (input plus the decayed memory), if the largest
    ``TOP_SHARE`` of y^2 holds more than ``THRESHOLD`` of the window's energy, every chunk of the
    window also sends its ``values`` largest |y| as bfloat16 values with their positions, and its
    scale becomes the mean |y| of the rest.

A short last window joins the one before it: judged alone, a bucket's tail of biases and LayerNorm
gains (a few hundred elements, a different scale from the weights before them) looked concentrated
and cost the residual MLP 1.7 points.

Layout, per chunk (of at most 256 elements, so a position is one byte): [chunk/8 sign bytes |
``values`` bfloat16 values | ``values`` uint8 positions], every chunk the same size, so the payload
of whole chunks laid end to end is the payload of their concatenation (the exchange's segments
rely on it). A chunk that sends values has a negative scale (its sign bit set; the magnitude is
the scale of its rest). At 4 values per 256-element chunk: 1.5 bits per element with the scale,
21.3x fewer bytes than float32 (plain scale x sign: 1.125 bits, 28.4x).

The signs, scales and the memory of the cold chunks come from the native one-pass pack; the hot
chunks are redone here in torch ops (1-2% of a tensor's elements are values).
"""
from __future__ import annotations

import threading

import torch

from ciuicflow.compression.quantized_exchange import Codec, native_ops

WINDOW_CHUNKS = 64
TOP_SHARE = 0.01
THRESHOLD = 0.4
MAX_CHUNK = 256  # positions are one byte
ENERGY_BLOCK = 64 * WINDOW_CHUNKS * MAX_CHUNK  # y^2 is formed this many elements at a time

# Scratch buffers reused across calls, one set per thread (hooks may pack on a worker thread). A
# fresh tensor of a bucket's size costs a page fault per 4 KiB on first touch (large blocks come
# from mmap and go back to the system when freed): that made the gate cost 8x the native pack.
_scratch = threading.local()


def _buffer(name: str, numel: int, like: torch.Tensor) -> torch.Tensor:
    """A float32 buffer of at least ``numel`` elements on ``like``'s device, kept for this thread
    (its contents are whatever the last call left)."""
    buf = getattr(_scratch, name, None)
    if buf is None or buf.numel() < numel or buf.device != like.device:
        buf = torch.empty(numel, dtype=torch.float32, device=like.device)
        setattr(_scratch, name, buf)
    return buf[:numel]


class OneBitOutlierCodec(Codec):
    """Scale x sign, plus ``values`` values per chunk in concentrated windows (module docstring)."""

    name = "onebit"
    granule = 8

    def __init__(self, values: int = 4):
        if not 1 <= int(values) <= 16:
            raise ValueError(f"values must be in [1, 16], got {values}")
        self.values = int(values)

    def _sign_bytes(self, chunk: int) -> int:
        if chunk > MAX_CHUNK:
            raise ValueError(f"a chunk that sends values holds at most {MAX_CHUNK} elements, "
                             f"got {chunk}")
        return chunk // 8

    def block_bytes(self, chunk: int) -> int:
        return self._sign_bytes(chunk) + 3 * self.values

    def payload_bytes(self, numel: int, chunk: int) -> int:
        return -(-numel // chunk) * self.block_bytes(chunk)

    def pack(self, x, error, chunk):
        payload, scales, _ = self.pack_ef(x, error, 1.0, error, chunk, measure=False)
        return payload, scales

    def pack_ef(self, x, error, error_decay, error_out, chunk, measure=True):
        n, k = x.numel(), self.values
        sign_bytes = self._sign_bytes(chunk)
        signs, scales, sums = native_ops().onebit_pack_ef(x, error, error_decay, error_out, chunk)
        nchunks = scales.numel()
        payload = signs.new_zeros(nchunks, self.block_bytes(chunk))
        padded = signs.new_zeros(nchunks * sign_bytes)
        padded[:signs.numel()] = signs
        payload[:, :sign_bytes] = padded.view(nchunks, sign_bytes)
        if n == 0:
            return payload.view(-1), scales, sums
        # y = what was packed: the new memory plus what the signs decode to (error_out may be the
        # memory it was computed from, so y cannot be rebuilt from the inputs)
        y = _buffer("y", nchunks * chunk, x)
        y[n:].zero_()
        native_ops().onebit_unpack(signs, scales, n, chunk, out=y[:n])
        y[:n] += error_out
        hot = torch.nonzero(_concentrated(y.view(nchunks, chunk), n, chunk)).view(-1)
        if hot.numel() == 0:
            return payload.view(-1), scales, sums
        yh = y.view(nchunks, chunk).index_select(0, hot)
        full = n // chunk  # chunks without padding; only the last chunk can hold some
        real = (n - hot * chunk).clamp(max=chunk)  # elements of each chunk that are not padding
        size = yh.abs()
        total = size.sum(1)  # padding is 0
        tail = n - full * chunk
        padded_hot = bool(tail) and int(hot[-1]) == full
        if padded_hot:  # padding is never picked
            size[-1, tail:] = -1.0
        top_abs, positions = size.topk(k, dim=1)
        picked_real = (top_abs >= 0).sum(1)
        picked = yh.gather(1, positions)
        values = picked.to(torch.bfloat16)
        rest = (total - top_abs.clamp(min=0).sum(1)).clamp(min=0)
        rest_scale = rest / (real - picked_real).clamp(min=1)
        # the new memory, in place of yh: y minus what it decodes to (+-the rest's scale, and the
        # bfloat16 value where picked); written by whole rows, as boolean masks cost 10x the rest
        column_scale = rest_scale.view(-1, 1)
        left = yh.sub_(torch.where(yh >= 0, column_scale, -column_scale))
        left.scatter_(1, positions, picked.sub_(values.float()))
        if padded_hot:
            error_out[full * chunk:] = left[-1, :tail]
            hot_full, left = hot[:-1], left[:-1]
        else:
            hot_full = hot
        if hot_full.numel():
            error_out[:full * chunk].view(full, chunk).index_copy_(0, hot_full, left)
        scales[hot] = -rest_scale  # the marker: its sign bit (-0.0 included)
        payload[hot, sign_bytes:sign_bytes + 2 * k] = values.view(torch.uint8)
        payload[hot, sign_bytes + 2 * k:] = positions.to(torch.uint8)
        if sums is not None:
            sums[0] = torch.linalg.vector_norm(error_out, dtype=torch.float64).square()
        return payload.view(-1), scales, sums

    def unpack(self, payload, scales, numel, chunk, out):
        self.unpack_mean(payload.view(1, -1), scales.view(1, -1), numel, chunk, out)
        return out

    def unpack_mean(self, payload, scales, numel, chunk, out):
        """The native mean of the rows' scale x sign, then each row's values in row order, one
        row at a time (within a row a position is written once: no order to depend on)."""
        rows, nchunks = scales.shape
        sign_bytes, k = self._sign_bytes(chunk), self.values
        blocks = payload.view(rows, nchunks, -1)
        signs = blocks[:, :, :sign_bytes].reshape(rows, -1)[:, :(numel + 7) // 8].contiguous()
        magnitude = scales.abs()
        native_ops().onebit_unpack_mean(signs, magnitude, numel, chunk, out=out)
        hot = torch.signbit(scales)
        if not bool(hot.any()):
            return out
        start = torch.arange(nchunks, device=out.device).view(-1, 1) * chunk
        for row in range(rows):
            if not bool(hot[row].any()):
                continue
            block = blocks[row]
            values = block.new_empty(nchunks, 2 * k).copy_(block[:, sign_bytes:sign_bytes + 2 * k]) \
                .view(torch.bfloat16)
            positions = block[:, sign_bytes + 2 * k:].long()
            bits = block.gather(1, positions // 8).long() >> (positions % 8) & 1
            signed = magnitude[row].view(-1, 1) * (2 * bits - 1)  # what the mean holds there
            change = (values.float() - signed) / rows
            flat = start + positions
            keep = hot[row].view(-1, 1) & (flat < numel)
            # cold chunks and padding add an exact zero at a position of their own chunk
            out.index_put_((torch.where(keep, flat, start).view(-1),),
                           torch.where(keep, change, 0.0).view(-1), accumulate=True)
        return out


def _concentrated(y: torch.Tensor, numel: int, chunk: int) -> torch.Tensor:
    """Per chunk of ``y`` [nchunks, chunk]: does its window's largest ``TOP_SHARE`` of y^2 hold
    more than ``THRESHOLD`` of the window's energy? (bool [nchunks])"""
    nchunks = y.shape[0]
    windows = max(1, nchunks // WINDOW_CHUNKS)
    flat = y.view(-1)
    full = (windows - 1) * WINDOW_CHUNKS * chunk  # the windows before the last, all full
    window = WINDOW_CHUNKS * chunk
    verdicts = []
    step = max(window, ENERGY_BLOCK // window * window)
    for start in range(0, full, step):  # y^2 a block at a time, in a reused buffer
        part = flat[start:min(full, start + step)]
        e = torch.mul(part, part, out=_buffer("energy", part.numel(), y)).view(-1, window)
        verdicts.append(_top_holds(e, window, chunk))
    last = flat[full:].square().view(1, -1)
    verdicts.append(_top_holds(last, numel - full, chunk))
    per_window = torch.cat(verdicts)
    counts = torch.full((windows,), WINDOW_CHUNKS, device=y.device)
    counts[-1] = nchunks - (windows - 1) * WINDOW_CHUNKS
    return per_window.repeat_interleave(counts, output_size=nchunks)


def _top_holds(energy: torch.Tensor, elements: int, chunk: int) -> torch.Tensor:
    """Per row (a window of whole chunks) of ``energy``: do its largest ``TOP_SHARE`` of
    ``elements`` hold more than ``THRESHOLD`` of it?"""
    top = max(1, int(elements * TOP_SHARE))
    per_chunk = energy.view(energy.shape[0], -1, chunk)
    sums, maxima = per_chunk.sum(2), per_chunk.amax(2)
    limit = THRESHOLD * sums.sum(1)
    # The topk costs 10x the rest of the pack, so windows that cannot pass skip it. An upper bound
    # of the top ``top``'s energy: no element is above its chunk's largest, and no chunk gives more
    # than its sum; the best split of ``top`` elements over the chunks under those caps fills the
    # chunks in order of their largest (a fractional knapsack). The 1e-3 margin covers the sums'
    # rounding; the verdicts are the topk's.
    maxima, order = maxima.sort(1, descending=True)
    worth = sums.gather(1, order) / maxima.clamp(min=torch.finfo(maxima.dtype).tiny)
    taken = torch.minimum((top - (worth.cumsum(1) - worth)).clamp(min=0), worth)
    bound = (taken * maxima).sum(1)
    # A lower bound too: the chunks' largest elements are ``top`` distinct elements or fewer, so
    # the top ``top`` hold at least the largest of them; a window above the limit by it passes.
    surely = maxima[:, :top].sum(1) > limit * (1 + 1e-3)
    held = surely.clone()
    candidates = torch.nonzero((bound * (1 + 1e-3) > limit) & ~surely).view(-1)
    if candidates.numel():
        rows = energy.index_select(0, candidates)
        held[candidates] = rows.topk(top, dim=1).values.sum(1) > limit[candidates]
    return held
