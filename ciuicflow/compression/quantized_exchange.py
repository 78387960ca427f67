"""Quantisation with error feedback over a route: what 1-bit and int8 share.

A ``Codec`` turns a float vector into bytes: a payload and one float32 scale per chunk of
``chunk`` elements, with error feedback (``pack(x, error)`` adds ``error`` to ``x``, quantises, and
leaves in ``error`` what the quantisation dropped). ``QuantizedStep`` runs the exchange over a hop
of W ranks in one of two forms:

- two phases (the form 1-bit Adam uses): the tensor is cut into W segments and rank j is the
  "server" of segment j.
  1. worker: each rank packs its tensor plus its worker error, keeping what that drops;
  2. all-to-all: segment j of every rank goes to rank j;
  3. server: rank j averages the W packed copies of its segment (``unpack_mean``), adds its server
     error, packs again (with the step's ``server_codec`` where it has one: 1 bit's server sends
     int4 beyond four ranks, ``QuantizedCompressor.server_codec_for``) and keeps what that drops
     as its server error;
  4. all-gather: every rank receives every packed segment and unpacks the whole tensor.
- one phase: every rank gathers every rank's packed tensor and averages them itself: no second
  quantisation, (W-1) instead of 2(W-1)/W of the packed bytes, the same for W = 2.

The result is bit-for-bit the same on every rank (it is unpacked from the same bytes). What has not
been sent yet is exactly what the error buffers hold: summed over steps, output + mean(worker
errors) + server errors equals the sum of the exact means (tests/compression/test_quantized_exchange.py).

Positions that must stay exact (parameters excluded from compression) travel in the same
collectives as float32 values: summed by their server, gathered back. Every rank also sends a
non-finite flag (and, for the accuracy guard, two norms) to every server; when any rank holds
inf/NaN the step becomes an exact all-reduce and the error buffers are left as they were (AMP's
GradScaler then sees the overflow and skips the step).
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist

from ciuicflow.collectives.primitives import Hop, Traffic, all_gather, all_reduce, all_to_all, \
    nonfinite_flag
from ciuicflow.compression.base import GuardedMemory, guard_due, guard_payload, snapshot, \
    update_guard
from ciuicflow.compression.codec import Codec, native_ops
from ciuicflow.compression.exchange_rows import count_marked, exchange_side, pack_rows, padded, \
    side_per_row, unpack_rows

__all__ = ["Codec", "QuantizedErrors", "QuantizedStep", "even_chunks", "native_ops"]


class QuantizedErrors(GuardedMemory):
    """Error-feedback memory of one tensor's quantised all-reduce (float32, on the tensor's device).

    ``worker``: what this rank has not yet sent of its input (W segments, padding included);
    ``server``: what it has not yet sent of the mean of the segment it serves."""

    def __init__(self):
        super().__init__()
        self.worker: torch.Tensor | None = None
        self.server: torch.Tensor | None = None
        self._spare: torch.Tensor | None = None  # the next worker error is written here first
        self._mean: torch.Tensor | None = None   # the server's decompressed mean, reused
        self._out: torch.Tensor | None = None    # the decompressed result, reused
        self._splits: dict = {}
        self._numel: int | None = None  # the compressed elements the buffers were laid out for
        self._loaded = False  # loaded from a checkpoint and not used since
        # quantise in the optimizer's units when given them; False once the ranks disagreed on
        # them (QuantizedStep). The buffers hold plain (gradient) units either way.
        self.in_units = True
        # the guard's measure (base.update_guard): ||worker error|| over the running mean of
        # ||input||, the largest over the ranks of the exchange (the same on all)

    def ensure(self, layout: "_Layout", device) -> None:
        shapes = (layout.parts * layout.segment, layout.segment if layout.server else 0)
        if self.worker is None:
            self.worker = torch.zeros(shapes[0], device=device)
            self.server = torch.zeros(shapes[1], device=device)
        elif (self.worker.numel(), self.server.numel()) != shapes \
                and (self._numel == layout.numel or self._loaded):
            # The same tensor, chunked otherwise: its codec changed (an adaptive optimizer's
            # parameters learnt after a compressed step, or not yet known in a resumed
            # process). The worker memory is the tensor's elements in
            # order, padding after: it carries over. The server's is its segment's, and segments
            # moved: it restarts.
            device = self.worker.device if device is None else device
            worker = torch.zeros(shapes[0], device=device)
            kept = min(layout.numel, self.worker.numel())
            worker[:kept] = self.worker[:kept]
            self.worker, self.server = worker, torch.zeros(shapes[1], device=device)
        elif (self.worker.numel(), self.server.numel()) != shapes:
            raise RuntimeError(
                f"1-bit error buffers hold ({self.worker.numel()}, {self.server.numel()}) elements "
                f"but this tensor needs {shapes}: one QuantizedErrors serves one tensor layout")
        elif self.worker.device != torch.device(device) and device is not None:
            self.worker, self.server = self.worker.to(device), self.server.to(device)
        self._numel, self._loaded = layout.numel, False
        if self._spare is None or self._spare.shape != self.worker.shape \
                or self._spare.device != self.worker.device:
            # reused every step: fresh buffers this size would cost a page fault per 4 KiB
            self._spare = torch.empty_like(self.worker)
            self._mean = torch.empty_like(self.server)
            self._out = torch.empty_like(self.worker)

    def state_dict(self) -> dict:
        """Copies: the buffers themselves are reused and overwritten by later steps."""
        # and where its ladder stands (policy.climb): the rung, the steps in a row over the
        # tolerance, the running gradient norm the measure divides by (-1: none yet), and
        # whether it still quantises in the optimizer's units (``in_units``)
        ladder = torch.tensor([self.rung, self.over, -1.0 if self._grad_norm_ema is None
                               else self._grad_norm_ema, float(self.in_units)],
                              dtype=torch.float64)
        return {"worker": snapshot(self.worker), "server": snapshot(self.server), "ladder": ladder}

    def load_state_dict(self, state: dict) -> None:
        self.worker, self.server = snapshot(state["worker"]), snapshot(state["server"])
        ladder = state.get("ladder")
        if ladder is not None:
            rung, over, ema, *in_units = ladder.tolist()
            self.rung, self.over = int(rung), int(over)
            self._grad_norm_ema = None if ema < 0 else ema
            self.in_units = bool(in_units[0]) if in_units else True
        self._spare, self._numel = None, None
        self._loaded = True  # its tensor is the one it is loaded for (the caller's key says so)

    def flush(self) -> None:
        """Forget what was not sent (after an exact step that sent it)."""
        if self.worker is not None:
            self.worker.zero_()
            self.server.zero_()


def even_chunks(codec: Codec, numel: int, chunk_size: int) -> tuple[int, int]:
    """(chunk, padded length) for ``numel`` > 0 values: as many chunks as ``chunk_size`` asks for,
    but evened out, so padding stays under a granule per chunk."""
    nchunks = -(-numel // chunk_size)
    chunk = -(-numel // nchunks)
    chunk = -(-chunk // codec.granule) * codec.granule
    return chunk, nchunks * chunk


@dataclass(frozen=True)
class _Layout:
    """How ``numel`` compressed and ``exact`` exact elements are cut over ``world`` ranks."""

    numel: int
    exact: int
    world: int
    segment: int  # compressed elements per segment, a whole number of chunks
    chunk: int    # elements per scale; a multiple of the codec's granule (whole bytes)
    raw: int      # exact elements per segment
    server: bool  # two phases (segments served by ranks) or one (the whole tensor)
    packed_bytes: int  # payload bytes per segment (the fixed part)
    side_bytes: int = 0  # bytes of a side block (the codec's), 0 without
    fingerprint: bool = False  # the flag row ends with the units' fingerprint

    @staticmethod
    def plan(codec: Codec, numel: int, exact: int, world: int, chunk_size: int,
             server: bool, fingerprint: bool = False) -> "_Layout":
        """Two phases: ``world`` segments, one per server. One phase: a single segment (the whole
        tensor) that every rank gathers from every other."""
        parts = world if server else 1
        per_rank = -(-numel // parts)
        raw = -(-exact // parts)
        if per_rank == 0:
            return _Layout(numel, exact, world, 0, chunk_size, raw, server, 0, codec.side_bytes,
                           fingerprint)
        chunk, segment = even_chunks(codec, per_rank, chunk_size)
        return _Layout(numel, exact, world, segment, chunk, raw, server,
                       codec.payload_bytes(segment, chunk), codec.side_bytes, fingerprint)

    def served_with(self, codec: Codec) -> "_Layout":
        """The layout of the servers' all-gather where they pack with ``codec`` (the same chunks:
        its granule divides them)."""
        if self.chunk % codec.granule:
            raise ValueError(f"the server's codec {codec.name} needs chunks of a multiple of "
                             f"{codec.granule} elements, these hold {self.chunk}")
        return replace(self, packed_bytes=codec.payload_bytes(self.segment, self.chunk)
                       if self.segment else 0, side_bytes=codec.side_bytes)

    @property
    def parts(self) -> int:
        return self.world if self.server else 1

    @property
    def nscales(self) -> int:
        return self.segment // self.chunk if self.segment else 0

    @property
    def flag_floats(self) -> int:
        """The flag row: non-finite flag, ||worker error||, ||input||; with side blocks also the
        blocks this row's segment has and the blocks the rank has in all; last, with
        ``fingerprint``, the units' (``QuantizedStep``: whether every rank quantised in the same)."""
        return (5 if self.side_bytes else 3) + self.fingerprint



class QuantizedStep:
    """One quantised exchange over a hop: ``step(x, hop, flag, offset, traffic) -> mean of x``.

    ``error_decay``: the share of the error-feedback memory carried into the next step (1: all
    of it, classic error feedback). ``server``: two phases (each rank serves a segment and
    compresses its mean again) or one (every rank gathers every rank's compressed tensor and
    averages them itself: no second compression, (W-1) instead of 2(W-1)/W of the compressed bytes,
    the same for W = 2). ``guard_threshold``: when the largest relative error of the last step
    (``errors.relative_error``) exceeds it, this step sends exactly what it would have compressed
    (``_flush``).
    ``measure``: compute that measure (two norms per call, free with a native one-pass pack; and a
    read of them on the host). ``guard_half``: the guard's step sends float16, not float32.
    ``server_codec``: what a server packs its segment's mean with (None: ``codec``), in
    ``codec``'s chunks, its memory carried by ``server_error_decay`` (None: ``error_decay``).
    ``units``: the tensor's size per coordinate as its optimizer sees it (an adaptive optimizer's
    root mean square, the whole tensor's layout; None: 1). The tensor is quantised in those
    units: each coordinate divided by its unit before packing and multiplied back after, so the
    rounding noise is even where the optimizer looks (a chunk's scale no longer set by the
    coordinates whose RMS is largest) and the guard's norms are the optimizer's. Every rank of
    the exchange must hold the same units (DDP's replicas do). ``fingerprint`` (the same on every
    rank of the exchange: an adaptive optimizer steps the tensor, whether or not this rank has
    its units) adds their fingerprint to the flag row; where the ranks disagree (ZeRO's shards, a
    rank without optimizer state) the step is an exact all-reduce and the memory quantises in
    plain units from then on (``QuantizedErrors.in_units``). Without it, ``units`` is refused.
    """

    needs_flag = True

    def __init__(self, codec: Codec, errors: QuantizedErrors, chunk_size: int,
                 exact_mask: torch.Tensor | None = None, *, error_decay: float = 1.0,
                 server: bool = True, guard_threshold: float | None = None,
                 measure: bool = True, guard_half: bool = False,
                 server_codec: Codec | None = None, server_error_decay: float | None = None,
                 units: torch.Tensor | None = None, fingerprint: bool = False):
        if units is not None and not fingerprint:
            raise ValueError("units need fingerprint=True: the ranks must be able to tell that "
                             "they quantised in the same units")
        self.codec = codec
        self.server_codec = codec if server_codec is None else server_codec
        self.server_error_decay = float(error_decay if server_error_decay is None
                                        else server_error_decay)
        self.errors = errors
        self.chunk_size = chunk_size
        self.exact_mask = exact_mask
        self.error_decay = float(error_decay)
        self.server = bool(server)
        self.guard_threshold = guard_threshold if measure else None
        self.measure = bool(measure)
        self.guard_half = bool(guard_half)
        self.units = units
        self.fingerprint = bool(fingerprint)

    def __call__(self, x: torch.Tensor, hop: Hop, flag, offset: int,
                 traffic: Traffic | None) -> torch.Tensor:
        codec = self.codec
        world = hop.size
        if world == 1:
            return x
        errors = self.errors
        if guard_due(errors, self.guard_threshold) and errors.worker is not None:
            return self._flush(x, hop, offset, traffic)
        compressed_at, exact_at = self._split(offset, x.numel(), x.device)
        xc = x if compressed_at is None else x[compressed_at]
        xe = x.new_empty(0, dtype=torch.float32) if exact_at is None else x[exact_at].float()
        layout = _Layout.plan(codec, xc.numel(), xe.numel(), world, self.chunk_size, self.server,
                              self.fingerprint)
        errors.ensure(layout, x.device)
        parts = layout.parts

        # Phase 1 (worker): compress into the spare buffer; a fallback leaves the error as it was.
        worker_error = errors._spare
        norms = x.new_zeros(2, dtype=torch.float32)
        sums = None
        unit = self._units_at(offset, x.numel(), compressed_at, x.device) \
            if self.units is not None and errors.in_units else None
        if layout.segment:
            # Segments are whole chunks, so packing the unpadded values gives the first bytes and
            # scales of the padded layout; the padding's bits and scales stay zero (it unpacks to 0).
            # One pass: the decayed memory, the pack and the guard's norms.
            # With units: in the optimizer's units, the memory too (it is kept in plain units).
            packed, scales, sums = codec.pack_ef(xc, errors.worker[:layout.numel],
                                                 self.error_decay, worker_error[:layout.numel],
                                                 layout.chunk, measure=self.measure, units=unit)
            fixed = codec.payload_bytes(layout.numel, layout.chunk)
            packed, side = packed[:fixed], packed[fixed:]
            packed = padded(packed, parts * layout.packed_bytes)
            scales = padded(scales, parts * layout.nscales)
            worker_error[layout.numel:].zero_()  # padding carries no error
            if self.measure:  # the flag row's ||worker error|| and ||input|| for the guard
                norms = sums.sqrt().to(torch.float32) if self.units is None or unit is not None \
                    else self._norms_in_units(xc, worker_error[:layout.numel], offset, x.numel(),
                                              compressed_at)
        else:
            packed = side = x.new_empty(0, dtype=torch.uint8)
            scales = x.new_empty(0, dtype=torch.float32)
        if flag is None:  # a flat route: this rank checks its own input. The pack's sum of x^2
            # (float64) is non-finite exactly where x holds inf/NaN (or squares past float32's
            # range: a false alarm that only makes the step exact), so no extra pass over x.
            flag = nonfinite_flag(x) if sums is None else torch.maximum(
                nonfinite_flag(xe), (~torch.isfinite(sums[1:])).to(torch.float32))
        # The flag row: non-finite flag, then ||worker error|| and ||input|| for the guard (and the
        # side blocks: per segment and in all), maybe the units' fingerprint (``_Layout.flag_floats``).
        flags = torch.cat([flag.to(torch.float32).view(1), norms]).view(1, 3).expand(parts, 3)
        if layout.side_bytes:
            marked = count_marked(scales, parts)
            flags = torch.cat([flags, marked.view(-1, 1), marked.sum().expand(parts, 1)], dim=1)
        if self.fingerprint:
            fingerprint = x.new_full((1,), -1.0, dtype=torch.float32) if unit is None else \
                unit.sum(dtype=torch.float64).to(torch.float32).view(1)
            flags = torch.cat([flags, fingerprint.view(1, 1).expand(parts, 1)], dim=1)
        raw = padded(xe, parts * layout.raw)
        if self.server:
            send = pack_rows(world, packed, scales, flags, raw)
            received = torch.empty_like(send)
            all_to_all(received, send, hop, traffic)
        else:
            send = pack_rows(1, packed, scales, flags, raw)
            received = send.new_empty(world, send.shape[1])
            all_gather(received, send.view(-1), hop, traffic)
        r_packed, r_scales, r_flags, r_raw = unpack_rows(received, layout, with_flag=True)

        # The one host read of the exchange (a device sync on GPUs; with overlap=True it happens on
        # the hooks' worker thread, not in backward): the flags' sum picks the path, the largest
        # norms (the same on every rank of the exchange) feed the guard; with side blocks, how
        # many every rank has (the same on every rank: whether they are exchanged) and how many
        # each sends this rank.
        # Whether every rank quantised in the same units: their fingerprints' spread.
        fingerprints = r_flags[:, -1] if self.fingerprint else r_flags.new_zeros(r_flags.shape[0])
        side_counts = r_flags[:, 3:layout.flag_floats - self.fingerprint]
        read = torch.cat([r_flags[:, :1].sum(0), r_flags[:, 1:3].max(0).values,
                          (fingerprints.max() - fingerprints.min()).view(1),
                          fingerprints.abs().max().view(1),
                          side_counts[:, 1:].sum(0), side_counts[:, :1].view(-1)]).tolist()
        flagged, largest_error, largest_input, spread, size = read[:5]
        if flagged > 0:  # a rank holds inf/NaN: exact this step, errors untouched
            if traffic is not None:
                traffic.nonfinite_fallbacks += 1
            x.div_(world)
            return all_reduce(x, hop, traffic)
        if spread > 1e-5 * size:  # not the same units on every rank: exact this step, and plain
            # units from now on (every rank read the same rows: every rank turns alike)
            errors.in_units = False
            warnings.warn("ciuicflow: the ranks of a quantised exchange hold different optimizer "
                          "states for one tensor (ZeRO's shards, or a rank without optimizer "
                          "state yet); it is quantised in plain units from now on", RuntimeWarning)
            x.div_(world)
            return all_reduce(x, hop, traffic)
        errors.worker, errors._spare = worker_error, errors.worker
        if self.measure:
            update_guard(errors, largest_error, largest_input)
        r_side = None
        if layout.side_bytes and read[5] > 0:  # some rank has side blocks: the second exchange
            sent = marked.tolist()  # per segment: to each server, or one count to every rank
            r_side = exchange_side(side, [int(c) for c in sent], [int(c) for c in read[6:]],
                                    layout.side_bytes, hop, traffic)
        if not self.server:
            return self._finish(x, layout, compressed_at, exact_at, r_packed, r_scales,
                                r_raw.sum(0).div_(world), mean_of_rows=True, side=r_side,
                                unit=unit)

        # Phase 2 (server of segment `me`): average, compress again with the server error, gather.
        me = dist.get_rank(hop.group)
        real = max(0, min(layout.segment, layout.numel - me * layout.segment))
        served = layout if self.server_codec is codec else layout.served_with(self.server_codec)
        if layout.segment:
            mean = codec.unpack_mean(r_packed, r_scales, layout.segment, layout.chunk,
                                     errors._mean,
                                     side=side_per_row(r_side, r_scales, layout.side_bytes))
            mean[real:] = 0
            served_units = None
            if unit is not None:  # the mean is in the units; the server's memory is kept plain
                served_units = unit.new_ones(layout.segment)
                served_units[:real] = unit[me * layout.segment:me * layout.segment + real]
                errors.server.div_(served_units)
            s_packed, s_scales, _ = self.server_codec.pack_ef(
                mean, errors.server, self.server_error_decay, errors.server, layout.chunk,
                measure=False)
            if served_units is not None:
                errors.server.mul_(served_units)
            s_packed, s_side = s_packed[:served.packed_bytes], s_packed[served.packed_bytes:]
            errors.server[real:].zero_()
        else:
            s_packed, s_scales, s_side = packed[:0], scales[:0], side[:0]
        raw_mean = r_raw.sum(0).div_(world)
        send2 = pack_rows(1, s_packed, s_scales, None, raw_mean)
        gathered = send2.new_empty(world, send2.shape[1])
        all_gather(gathered, send2.view(-1), hop, traffic)
        g_packed, g_scales, _, g_raw = unpack_rows(gathered, served, with_flag=False)
        g_side = None
        if served.side_bytes:  # every rank has every server's scales: the same decision
            counts = count_marked(g_scales, world).tolist()
            if sum(counts) > 0:
                g_side = exchange_side(s_side, [s_side.numel() // served.side_bytes],
                                        [int(c) for c in counts], served.side_bytes, hop, traffic)
        return self._finish(x, served, compressed_at, exact_at, g_packed, g_scales,
                            g_raw.reshape(-1), mean_of_rows=False, side=g_side,
                            codec=self.server_codec, unit=unit)

    def _finish(self, x, layout, compressed_at, exact_at, packed, scales, raw, mean_of_rows,
                side=None, codec=None, unit=None):
        """Write the decompressed result into x: the rows' mean (one phase) or the rows laid end to
        end (two phases: row j is segment j). ``side``: the rows' side blocks, in row order;
        ``codec``: the rows' (None: the step's); ``unit``: the units the rows were quantised in
        (None: plain), multiplied back."""
        codec, errors = codec or self.codec, self.errors
        nbytes = (lambda n: codec.payload_bytes(n, layout.chunk))
        nscales = (lambda n: -(-n // layout.chunk))
        rows_side = side_per_row(side, scales, layout.side_bytes) if mean_of_rows else None
        unpack = (lambda n, out: codec.unpack_mean(  # rows apart: the codecs read them in place
            packed[:, :nbytes(n)], scales[:, :nscales(n)].contiguous(), n,
            layout.chunk, out, side=rows_side)) if mean_of_rows else \
            (lambda n, out: codec.unpack(packed.reshape(-1)[:nbytes(n)],
                                         scales.view(-1)[:nscales(n)], n, layout.chunk, out,
                                         side=side))
        if compressed_at is None and x.dtype == torch.float32 and x.is_contiguous():
            if layout.numel:  # straight into x: the first numel elements of the padded layout
                unpack(layout.numel, x)
                if unit is not None:
                    x.mul_(unit)
            return x
        if layout.segment:
            out = unpack(layout.parts * layout.segment, errors._out)[:layout.numel]
            if unit is not None:
                out.mul_(unit)
        else:
            out = x.new_empty(0, dtype=torch.float32)
        if compressed_at is None:
            x.copy_(out)
        else:
            x[compressed_at] = out.to(x.dtype)
            x[exact_at] = raw[:layout.exact].to(x.dtype)
        return x

    def _flush(self, x, hop, offset, traffic):
        """The guard's exact step: what this step would have compressed (x plus the decayed
        memory: the worker's, and the server's of the segment this rank serves), averaged exactly
        instead; with all of the memory carried (``error_decay`` 1) the sum over steps stays the
        exact one. The memory starts again from zero or, sent as float16 (``guard_half``), from
        what the rounding dropped (excluded positions, which have no memory, are rounded too).
        Not the whole memory where some decays: a step that paid all of it at once hurt
        (``cnn_sgd_cosine``, guard at 0.5: 0.897 against 0.9625; docs/hooks.md)."""
        errors = self.errors
        compressed_at, _ = self._split(offset, x.numel(), x.device)
        pending = x.new_zeros(x.numel(), dtype=torch.float32)
        numel = x.numel() if compressed_at is None else compressed_at.numel()
        owed = errors.worker[:numel] * self.error_decay
        if errors.server.numel():  # this rank's segment's server error, held by this rank only:
            # times W, as the mean below divides everything by W
            me = dist.get_rank(hop.group)
            seg = errors.server.numel()
            lo, hi = me * seg, min(numel, (me + 1) * seg)
            if hi > lo:
                owed[lo:hi] += errors.server[:hi - lo] * (hop.size * self.server_error_decay)
        if compressed_at is None:
            pending += owed
        else:
            pending[compressed_at] = owed
        total = x.float() + pending
        total.div_(hop.size)
        sent, left = guard_payload(total, hop.size, self.guard_half)
        all_reduce(sent, hop, traffic)  # mean of (x + worker error) + server error, decayed
        x.copy_(sent)
        if bool(nonfinite_flag(sent) > 0):  # an overflow: the step is skipped, keep the memory
            if traffic is not None:
                traffic.nonfinite_fallbacks += 1
            return x
        errors.sent_by_guard(traffic)
        if left is not None:  # in the worker memory's units: the input's, before the mean
            left.mul_(hop.size)
            errors.worker[:numel] = left if compressed_at is None else left[compressed_at]
        return x

    def _units_at(self, offset: int, length: int, compressed_at, device) -> torch.Tensor:
        """``units`` over the compressed positions of x[offset:offset+length] (float32)."""
        units = self.units.view(-1)[offset:offset + length]
        if units.numel() < length:  # a route's last shard runs into its padding
            units = torch.cat([units, units.new_ones(length - units.numel())])
        if compressed_at is not None:
            units = units[compressed_at]
        return units.to(device, torch.float32)

    def _norms_in_units(self, xc, error, offset: int, length: int, compressed_at):
        """||error / units|| and ||input / units|| over the compressed positions: the guard's
        norms as the optimizer sees them (``units``: what it divides each coordinate by)."""
        units = self._units_at(offset, length, compressed_at, xc.device)
        return torch.stack([torch.linalg.vector_norm(error / units),
                            torch.linalg.vector_norm(xc.float() / units)]).to(torch.float32)

    def _split(self, offset: int, length: int, device):
        """Index tensors of the compressed and the exact positions of x[offset:offset+length]."""
        if self.exact_mask is None:
            return None, None
        key = (offset, length)
        cached = self.errors._splits.get(key)
        if cached is None:
            exact = torch.zeros(length, dtype=torch.bool, device=device)
            window = self.exact_mask.view(-1)[offset:offset + length]
            exact[:window.numel()] = window.to(device)
            if not bool(exact.any()):
                cached = (None, None)
            else:
                cached = ((~exact).nonzero().view(-1), exact.nonzero().view(-1))
            self.errors._splits[key] = cached
        return cached
