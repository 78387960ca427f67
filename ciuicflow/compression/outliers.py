"""1-bit chunks that also send their largest values, where a gradient is concentrated.

Scale x sign spends one bit on every element alike, and a chunk's scale (the mean |value|) clips
its large elements: with half of the memory carried (the 1-bit default ``error_decay`` 0.5) an
element far above its chunk's scale moves at the scale, not at its value. Where a gradient is
concentrated (a few elements hold most of a layer's energy) that clipping costs accuracy; where it
is not, it does no harm, and unclipping some coordinates but not others does (the measurements:
docs/decisions.md). So the values are gated by a measure of concentration:

    in each window of ``WINDOW_CHUNKS`` chunks of y (input plus the decayed memory), if the largest
    ``TOP_SHARE`` of y^2 holds more than ``THRESHOLD`` of the window's energy, every chunk of the
    window also sends its ``values`` largest |y| as bfloat16 values with their positions, and its
    scale becomes the mean |y| of the rest.

A short last window joins the one before it: judged alone, a bucket's tail of biases and LayerNorm
gains (a few hundred elements, a different scale from the weights before them) looks concentrated.

Layout: the plain 1-bit signs of every chunk (of at most 256 elements, so a position is one
byte), chunk/8 bytes each, then a *side block* for each chunk that sends values, in chunk order:
[``values`` bfloat16 values | ``values`` uint8 positions]. A chunk that sends values has a negative
scale (its sign bit set; the magnitude is the scale of its rest), so a receiver knows from the
scales which chunks have side blocks and how many: the exchange sends the signs in fixed-size rows
and the side blocks in a second, variable-size exchange (``quantized_exchange``), only where some
rank has one. Plain scale x sign: 1.125 bits per element, 28.4x fewer bytes than float32; a chunk
with 4 values adds 12 bytes (1.5 bits per element where every chunk sends values, 21.3x).

The signs, scales and the memory of the cold chunks come from the native one-pass pack, the gate's
measure (each chunk's energy and largest square) from a native pass on CPU; y is rebuilt in torch
ops only for the windows the measure's bounds cannot decide and for the hot chunks, which are
redone here (1-2% of a tensor's elements are values).
"""
from __future__ import annotations

import torch

from ciuicflow.compression.codec import Codec, native_ops
from ciuicflow.compression.registry import VALUES_MAX_CHUNK

WINDOW_CHUNKS = 64
TOP_SHARE = 0.01
THRESHOLD = 0.4
MAX_CHUNK = VALUES_MAX_CHUNK  # positions are one byte
ENERGY_BLOCK = 64 * WINDOW_CHUNKS * MAX_CHUNK  # squares formed this many at a time (a bounded buffer)


class SideBlockCodec(Codec):
    """1 bit's signs of every chunk (of at most ``MAX_CHUNK`` elements), then a side block of
    ``side_bytes`` for each marked chunk (a negative scale), in chunk order: the layout of this
    module's codec and of ``compression.refined``'s. A subclass packs (``pack_ef``) and says what
    a marked chunk's block adds to its scale x sign (``unpack_mean``)."""

    granule = 8
    marked_as = "a marked chunk"  # for the error on too long a chunk

    def _sign_bytes(self, chunk: int) -> int:
        if chunk > MAX_CHUNK:
            raise ValueError(f"{self.marked_as} holds at most {MAX_CHUNK} elements, got {chunk}")
        return chunk // 8

    def payload_bytes(self, numel: int, chunk: int) -> int:
        """The fixed part: every chunk's signs (the side blocks follow it, ``pack_ef``)."""
        return -(-numel // chunk) * self._sign_bytes(chunk)

    def pack(self, x, error, chunk):
        payload, scales, _ = self.pack_ef(x, error, 1.0, error, chunk, measure=False)
        return payload, scales

    def unpack(self, payload, scales, numel, chunk, out, side=None):
        """``payload``: the signs, then the side blocks (as ``pack_ef`` lays them out), unless
        ``side`` holds those."""
        if side is None:
            fixed = scales.numel() * self._sign_bytes(chunk)
            payload, side = payload[:fixed], payload[fixed:]
        self.unpack_mean(payload.view(1, -1), scales.view(1, -1), numel, chunk, out, side=[side])
        return out

    def _signs_mean(self, payload, scales, numel, chunk, out):
        """The native mean of the rows' |scale| x sign into ``out``; (|scales|, the marked chunks
        of each row)."""
        signs = payload.reshape(scales.shape[0], -1)[:, :(numel + 7) // 8]  # rows apart: in place
        if not signs.is_cpu:  # CUDA's native op reads contiguous rows
            signs = signs.contiguous()
        magnitude = scales.abs()
        native_ops().onebit_unpack_mean(signs, magnitude, numel, chunk, out=out)
        return magnitude, torch.signbit(scales)


class OneBitOutlierCodec(SideBlockCodec):
    """Scale x sign, plus ``values`` values per chunk in concentrated windows (module docstring)."""

    name = "onebit"
    marked_as = "a chunk that sends values"

    def __init__(self, values: int = 4):
        if not 1 <= int(values) <= 16:
            raise ValueError(f"values must be in [1, 16], got {values}")
        self.values = int(values)

    @property
    def side_bytes(self) -> int:
        """Bytes of a marked chunk's side block: its values and their positions."""
        return 3 * self.values

    def pack_ef(self, x, error, error_decay, error_out, chunk, measure=True, units=None):
        """(payload, scales, sums): the payload is the signs (``payload_bytes``), then the side
        blocks of the chunks whose scale is negative, in chunk order."""
        if units is not None:
            raise ValueError(f"{type(self).__name__} does not quantise in an optimizer's units "
                             "(the policy plans them only for the int and 1-bit codecs)")
        n, k = x.numel(), self.values
        sign_bytes = self._sign_bytes(chunk)
        signs, scales, sums = native_ops().onebit_pack_ef(x, error, error_decay, error_out, chunk)
        nchunks = scales.numel()
        padded = signs if signs.numel() == nchunks * sign_bytes else \
            _padded_bytes(signs, nchunks * sign_bytes)
        if n == 0:
            return padded, scales, sums
        # y = what was packed: the new memory plus what the signs decode to (error_out may be the
        # memory it was computed from, so y cannot be rebuilt from the inputs); formed only for the
        # chunks that need it
        sign_rows = padded.view(nchunks, sign_bytes)

        def chunks_y(idx):
            return _chunks_y(sign_rows, scales, error_out, n, chunk, idx)

        energy = _chunk_energy(signs, scales, error_out, chunk)
        hot = torch.nonzero(_concentrated(energy, n, chunk, chunks_y)).view(-1)
        if hot.numel() == 0:
            return padded, scales, sums
        yh, sign = chunks_y(hot)
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
        # the new memory, in place of yh: y minus what it decodes to (+-the rest's scale by the
        # sent bit -- not by the sign of y rebuilt, which is +0 where y was far below the scale --
        # and the bfloat16 value where picked); written by whole rows, as boolean masks cost 10x
        left = yh.sub_(sign.mul_(rest_scale.view(-1, 1)))
        left.scatter_(1, positions, picked.sub_(values.float()))
        _write_rows(error_out, left, hot, n, chunk)
        scales[hot] = -rest_scale  # the marker: its sign bit (-0.0 included)
        payload = padded.new_empty(padded.numel() + hot.numel() * self.side_bytes)
        payload[:padded.numel()] = padded
        side = payload[padded.numel():].view(hot.numel(), self.side_bytes)
        side[:, :2 * k] = values.view(torch.uint8)
        side[:, 2 * k:] = positions.to(torch.uint8)
        if sums is not None:  # the memory changed: its energy again
            sums[0] = _sum_of_squares(error_out)
        return payload, scales, sums

    def unpack_mean(self, payload, scales, numel, chunk, out, side=None):
        """The native mean of the rows' scale x sign, then each row's values in row order, one
        row at a time (within a row a position is written once: no order to depend on).
        ``payload``: [rows, bytes] signs; ``side``: per row, its side blocks in chunk order (at
        least as many as its marked chunks; a row without marked chunks may have None)."""
        rows, nchunks = scales.shape
        sign_bytes, k = self._sign_bytes(chunk), self.values
        magnitude, hot = self._signs_mean(payload, scales, numel, chunk, out)
        if not bool(hot.any()):
            return out
        for row in range(rows):
            idx = torch.nonzero(hot[row]).view(-1)
            if idx.numel() == 0:
                continue
            block = side[row][:idx.numel() * self.side_bytes].view(idx.numel(), self.side_bytes)
            values = block.new_empty(idx.numel(), 2 * k).copy_(block[:, :2 * k]) \
                .view(torch.bfloat16)  # a copy: the blocks may lie at odd offsets
            positions = block[:, 2 * k:].long()
            sign_rows = payload[row, :nchunks * sign_bytes].view(nchunks, sign_bytes)
            bits = sign_rows.index_select(0, idx).gather(1, positions // 8).long() \
                >> (positions % 8) & 1
            signed = magnitude[row, idx].view(-1, 1) * (2 * bits - 1)  # what the mean holds there
            change = (values.float() - signed) / rows
            flat = idx.view(-1, 1) * chunk + positions
            keep = flat < numel  # padding's positions are never picked; a trimmed chunk's are
            out.index_put_((flat[keep],), change[keep], accumulate=True)
        return out


def _padded_bytes(signs: torch.Tensor, length: int) -> torch.Tensor:
    out = signs.new_zeros(length)
    out[:signs.numel()] = signs
    return out


def _sum_of_squares(t: torch.Tensor) -> torch.Tensor:
    """sum t^2 (float64, 0-d), from float32 sums of blocks: torch's float32 norm of a 12.5M-element
    tensor drifted 1e-3 from the exact sum, and a float64 copy of the tensor cost 20x this."""
    total = torch.zeros((), dtype=torch.float64, device=t.device)
    buffer = t.new_empty(min(t.numel(), ENERGY_BLOCK))
    for start in range(0, t.numel(), ENERGY_BLOCK):
        block = t[start:start + ENERGY_BLOCK]
        total += torch.mul(block, block, out=buffer[:block.numel()]).sum().double()
    return total


def _chunk_energy(signs, scales, error, chunk):
    """float32 [nchunks, 2]: per chunk (sum y^2, max y^2) of y = scale x sign + error, what a
    plain pack packed. One native pass on CPU; torch ops elsewhere (``_chunk_energy_torch``)."""
    if error.device.type == "cpu":
        return native_ops().onebit_chunk_energy(signs, scales, error, chunk)
    return _chunk_energy_torch(signs, scales, error, chunk)


def _chunk_energy_torch(signs, scales, error, chunk):
    """``_chunk_energy`` in torch ops (the reference of the native one)."""
    n, nchunks = error.numel(), scales.numel()
    y = error.new_zeros(nchunks * chunk)
    native_ops().onebit_unpack(signs, scales, n, chunk, out=y[:n])
    y[:n] += error
    energy = y.view(nchunks, chunk).square()
    return torch.stack([energy.sum(1), energy.amax(1)], dim=1)


def _signs(sign_rows: torch.Tensor, idx: torch.Tensor, chunk: int) -> torch.Tensor:
    """+-1 (float32 [len(idx), chunk]) from the packed bits of chunks ``idx``."""
    shifts = torch.arange(8, dtype=torch.uint8, device=sign_rows.device)
    bits = sign_rows.index_select(0, idx).unsqueeze(-1).bitwise_right_shift(shifts).bitwise_and_(1)
    return bits.view(idx.numel(), chunk).to(torch.float32).mul_(2).sub_(1)


def _write_rows(target: torch.Tensor, rows: torch.Tensor, idx: torch.Tensor, numel: int,
                chunk: int) -> None:
    """``target``'s chunks ``idx`` (ascending) = ``rows``; the last chunk may be short (its
    padding is not written)."""
    full = numel // chunk
    if idx.numel() and int(idx[-1]) == full and numel > full * chunk:
        target[full * chunk:] = rows[-1, :numel - full * chunk]
        idx, rows = idx[:-1], rows[:-1]
    if idx.numel():
        target[:full * chunk].view(full, chunk).index_copy_(0, idx, rows)


def _chunks_y(sign_rows, scales, error, numel, chunk, idx):
    """(y, sign), float32 [len(idx), chunk] each, for the chunks ``idx`` (ascending): y = scale x
    sign + error, as the plain pack left them; sign is +-1 from the packed bits. Padding past
    ``numel`` is 0 in y."""
    sign = _signs(sign_rows, idx, chunk)
    full = numel // chunk
    tail = numel - full * chunk
    padded = bool(tail) and idx.numel() > 0 and int(idx[-1]) == full
    whole = idx[:-1] if padded else idx
    rows = error.new_zeros(idx.numel(), chunk)
    if whole.numel():
        torch.index_select(error[:full * chunk].view(full, chunk), 0, whole,
                           out=rows[:whole.numel()])
    if padded:
        rows[-1, :tail] = error[full * chunk:]
    y = rows.addcmul_(sign, scales.index_select(0, idx).view(-1, 1))  # +-scale exactly, then + e
    if padded:
        y[-1, tail:] = 0.0
    return y, sign


def _concentrated(energy: torch.Tensor, numel: int, chunk: int, chunks_y) -> torch.Tensor:
    """Per chunk: does its window's largest ``TOP_SHARE`` of y^2 hold more than ``THRESHOLD`` of
    the window's energy? (bool [nchunks]). ``energy``: ``_chunk_energy``'s [nchunks, 2];
    ``chunks_y(idx)``: (y, sign) of the chunks idx, for the windows the bounds cannot decide."""
    nchunks = energy.shape[0]
    windows = max(1, nchunks // WINDOW_CHUNKS)
    full = (windows - 1) * WINDOW_CHUNKS  # chunks of the windows before the last, all full

    def window_energy(first, count):
        def rows(which):  # y^2 of windows ``which`` (of ``count`` chunks from ``first``)
            idx = (first[which].view(-1, 1) + torch.arange(count, device=energy.device)).view(-1)
            return chunks_y(idx)[0].square_().view(which.numel(), -1)
        return rows

    verdicts = []
    if full:
        firsts = torch.arange(0, full, WINDOW_CHUNKS, device=energy.device)
        part = energy[:full].view(windows - 1, WINDOW_CHUNKS, 2)
        verdicts.append(_top_holds(part[..., 0], part[..., 1], WINDOW_CHUNKS * chunk,
                                   window_energy(firsts, WINDOW_CHUNKS)))
    last = energy[full:].view(1, -1, 2)
    verdicts.append(_top_holds(last[..., 0], last[..., 1], numel - full * chunk,
                               window_energy(torch.tensor([full], device=energy.device),
                                             nchunks - full)))
    per_window = torch.cat(verdicts)
    counts = torch.full((windows,), WINDOW_CHUNKS, device=energy.device)
    counts[-1] = nchunks - full
    return per_window.repeat_interleave(counts, output_size=nchunks)


def _top_holds(sums: torch.Tensor, maxima: torch.Tensor, elements: int, energy_rows) -> torch.Tensor:
    """Per row (a window of whole chunks; ``sums`` and ``maxima`` [rows, chunks] its chunks' sum
    and largest of y^2): do its largest ``TOP_SHARE`` of ``elements`` hold more than ``THRESHOLD``
    of its energy? ``energy_rows(rows)``: y^2 of those windows, for the topk where the bounds
    cannot decide."""
    top = max(1, int(elements * TOP_SHARE))
    limit = THRESHOLD * sums.sum(1)
    held = torch.zeros_like(limit, dtype=torch.bool)
    # First the coarsest bound, ``top`` times the window's largest: it rules out most windows of
    # a gradient that is not concentrated, before the sort below (which cost more than the rest)
    open_rows = torch.nonzero(top * maxima.amax(1) * (1 + 1e-3) > limit).view(-1)
    if open_rows.numel() == 0:
        return held
    if open_rows.numel() < limit.numel():
        held[open_rows] = _top_holds(sums[open_rows], maxima[open_rows], elements,
                                     lambda rows: energy_rows(open_rows[rows]))
        return held
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
    held |= surely
    candidates = torch.nonzero((bound * (1 + 1e-3) > limit) & ~surely).view(-1)
    per_block = max(1, ENERGY_BLOCK // max(1, elements))  # bounds the y^2 held at once
    for start in range(0, candidates.numel(), per_block):
        which = candidates[start:start + per_block]
        rows = energy_rows(which)
        held[which] = rows.topk(top, dim=1).values.sum(1) > limit[which]
    return held
