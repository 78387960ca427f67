"""A quantised reduce-scatter with error feedback: what FSDP2's custom reduce-scatter runs when FSDP
shards over every rank (ciuicflow.fsdp with a 1-D mesh).

The input is W rows of S elements: row j is this rank's contribution to rank j's shard. Every row
bound for another rank is packed by the codec (1-bit, int8) with an error-feedback memory of its
own, and one all-to-all delivers them; rank j adds its own row, exact, to the W - 1 rows it
receives, decompressed. Each value is quantised once (nothing is gathered back, so there is no
server stage), and (W - 1) / W of the packed bytes leave each rank: 1/32 (1-bit) or 1/4 (int8) of
an exact reduce-scatter's float32 bytes, plus one scale per chunk.

A row on the wire: packed values | float32 scales | three float32 (this rank's non-finite flag,
||memory|| and ||rows sent|| for the accuracy guard) | float32 values of the positions kept exact
(parameters excluded from compression: the same positions of every row), summed by their receiver.
When any rank holds inf/NaN the step is an exact reduce-scatter and the memory is left as it was
(as the all-reduce exchanges do). The guard's measure (``relative_error``, ``base.update_guard``)
is the largest over the ranks, so every rank takes the guard's exact step together: an exact
(or float16) reduce-scatter of the rows plus the memory, decayed as a compressed step adds it,
after which the memory starts from zero (or from float16's rounding).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ciuicflow.collectives.primitives import Hop, Traffic, all_to_all, nonfinite_flag, \
    reduce_scatter
from ciuicflow.compression.base import GuardedMemory, guard_due, guard_payload, snapshot, \
    update_guard
from ciuicflow.compression.quantized_exchange import Codec, even_chunks

_FLAGS = 3  # float32 per row: the non-finite flag, ||memory||, ||rows sent||


class ScatterErrors(GuardedMemory):
    """Error-feedback memory of one reduce-scatter: ``error[j]`` is what this rank has not yet
    sent of its rows for rank j (float32, the compressed positions of a row padded to whole chunks;
    its own row stays zero)."""

    def __init__(self):
        super().__init__()
        self.error: torch.Tensor | None = None
        self._spare: torch.Tensor | None = None  # the next error is written here first
        self._work: torch.Tensor | None = None   # the padded float32 rows, reused
        self._mean: torch.Tensor | None = None   # the decompressed mean of the received rows
        self._split: tuple | None = None         # (exact mask, compressed at, exact at)
        self._numel: int | None = None           # compressed elements of a row laid out for
        self._loaded = False  # loaded from a checkpoint and not used since (its rows are these)

    def ensure(self, rows: int, padded: int, device, numel: int | None = None) -> None:
        """Buffers for ``rows`` rows of ``padded`` elements, ``numel`` of them compressed (the
        rest padding). The same rows chunked otherwise (the codec changed, as a codec with
        chunks of its own would) keep their memory."""
        if self.error is None:
            self.error = torch.zeros(rows, padded, device=device)
        elif tuple(self.error.shape) != (rows, padded) and numel is not None \
                and (self._numel == numel or self._loaded) and self.error.shape[0] == rows:
            error = torch.zeros(rows, padded, device=device)
            kept = min(numel, self.error.shape[1])
            error[:, :kept] = self.error[:, :kept]
            self.error = error
        elif tuple(self.error.shape) != (rows, padded):
            raise RuntimeError(f"reduce-scatter error buffer is {tuple(self.error.shape)}, this "
                               f"input needs ({rows}, {padded}): one memory serves one layout")
        elif self.error.device != torch.device(device):
            self.error = self.error.to(device)
        self._numel, self._loaded = numel, False
        if self._spare is None or self._spare.shape != self.error.shape \
                or self._spare.device != self.error.device:
            self._spare = torch.empty_like(self.error)
            self._work = torch.empty_like(self.error)
            self._mean = torch.empty(padded, device=self.error.device)

    def split(self, exact_mask: torch.Tensor | None, numel: int) -> tuple:
        """(compressed, exact) positions of a row as index tensors, or (None, None) without a
        mask; computed once per mask."""
        if exact_mask is None:
            return None, None
        if self._split is None or self._split[0] is not exact_mask:
            exact = exact_mask.reshape(-1)
            if exact.dtype != torch.bool or exact.numel() != numel:
                raise ValueError(f"exact_mask must be a bool tensor of a row's {numel} elements")
            self._split = (exact_mask, (~exact).nonzero().view(-1), exact.nonzero().view(-1))
        return self._split[1:]

    def state_dict(self) -> dict:
        return {"error": snapshot(self.error)}

    def load_state_dict(self, state: dict) -> None:
        self.error, self._spare, self._numel = snapshot(state["error"]), None, None
        self._loaded = True

    def flush(self) -> None:
        if self.error is not None:
            self.error.zero_()


def quantized_reduce_scatter(codec: Codec, errors: ScatterErrors, output: torch.Tensor,
                             rows: torch.Tensor, hop: Hop, *, chunk_size: int,
                             error_decay: float = 1.0, scale: float = 1.0,
                             traffic: Traffic | None = None,
                             exact_mask: torch.Tensor | None = None,
                             guard_threshold: float | None = None,
                             measure: bool = False, guard_half: bool = False) -> torch.Tensor:
    """``output`` (S elements) = ``scale`` x the sum over the hop's ranks of their row for this
    rank, where ``rows`` holds W x S elements (W = hop.size), row j bound for rank j.

    ``exact_mask`` (bool, S elements, the same on every rank): positions of every row reduced
    exactly. ``measure``: keep the accuracy guard's measure in ``errors.relative_error``;
    ``guard_threshold``: past it, this step is exact and sends the rows plus the decayed memory
    (in float16 with ``guard_half``, the rounding kept in the memory)."""
    world = hop.size
    rows = rows.reshape(world, -1)
    numel = rows.shape[1]
    if output.numel() != numel:
        raise ValueError(f"output holds {output.numel()} elements, a row {numel}")
    if world == 1 or numel == 0:
        output.copy_(rows[0] * scale)
        return output
    compressed_at, exact_at = errors.split(exact_mask, numel)
    ncomp = numel if compressed_at is None else compressed_at.numel()
    if ncomp == 0:  # every position exact
        return _exact(output, rows, hop, traffic, scale)
    if guard_due(errors, guard_threshold if measure else None) and errors.error is not None:
        return _guard_step(errors, output, rows, hop, traffic, scale, compressed_at, ncomp,
                           error_decay, guard_half)
    me = dist.get_rank(hop.group)
    chunk, padded = even_chunks(codec, ncomp, chunk_size)
    errors.ensure(world, padded, rows.device, numel=ncomp)
    work = errors._work
    work[:, :ncomp].copy_(rows if compressed_at is None else rows.index_select(1, compressed_at))
    work[:, ncomp:].zero_()
    work[me].zero_()  # this rank's own row is added exactly below; it sends nothing to itself
    new_error = errors._spare  # written by the pack; the memory stays as it was until the verdict
    payload, scales, sums = codec.pack_ef(work.view(-1), errors.error.view(-1), error_decay,
                                          new_error.view(-1), chunk, measure=measure)
    # The padding (zeros) unpacks to +-scale and is dropped: it owes nothing. Left in, its error
    # came back each step into its chunk's scale.
    new_error[:, ncomp:].zero_()
    # ||new error|| and ||what was packed|| for the guard
    flags = torch.cat([nonfinite_flag(rows),
                       sums.sqrt().to(torch.float32) if measure else work.new_zeros(2)])
    raw = rows.new_empty(world, 0, dtype=torch.float32) if exact_at is None else \
        rows.index_select(1, exact_at).float()
    send = torch.cat([payload.view(world, -1), scales.view(world, -1).view(torch.uint8),
                      flags.expand(world, _FLAGS).contiguous().view(torch.uint8),
                      raw.view(torch.uint8)], dim=1)
    received = torch.empty_like(send)
    all_to_all(received, send, hop, traffic)
    nbytes = (codec.payload_bytes(padded, chunk), 4 * (padded // chunk), 4 * _FLAGS, 4 * raw.shape[1])
    r_payload, r_scales, r_flags, r_raw = torch.split(received, nbytes, dim=1)
    r_flags = r_flags.contiguous().view(torch.float32)
    # the one host read: the flags pick the compressed or the exact path, the norms feed the guard
    flagged, largest_error, largest_sent = torch.cat(
        [r_flags[:, :1].sum(0), r_flags[:, 1:].max(0).values]).tolist()
    if flagged > 0:  # a rank holds inf/NaN: exact this step, memory untouched
        if traffic is not None:
            traffic.nonfinite_fallbacks += 1
        return _exact(output, rows, hop, traffic, scale)
    errors.error, errors._spare = new_error, errors.error
    if measure:
        update_guard(errors, largest_error, largest_sent)
    mean = codec.unpack_mean(r_payload.contiguous(), r_scales.contiguous().view(torch.float32),
                             padded, chunk, errors._mean)
    own = rows[me] if compressed_at is None else rows[me].index_select(0, compressed_at)
    total = mean[:ncomp].mul_(world).add_(own.float())  # own row: exact
    if exact_at is not None:
        total = torch.empty(numel, device=rows.device).index_copy_(0, compressed_at, total) \
            .index_copy_(0, exact_at, r_raw.contiguous().view(torch.float32).sum(0))
    output.copy_(total.mul_(scale) if scale != 1.0 else total)
    return output


def _exact(output, rows, hop, traffic, scale) -> torch.Tensor:
    reduce_scatter(output, rows.contiguous(), hop, traffic)
    return output.mul_(scale) if scale != 1.0 else output


def _guard_step(errors, output, rows, hop, traffic, scale, compressed_at, ncomp,
                error_decay, half) -> torch.Tensor:
    """The guard's exact step: the rows plus what the memory owes each rank, decayed as a
    compressed step would add it (``QuantizedStep._flush`` says why), reduce-scattered exactly
    (or in float16, ``half``: the rounding is owed next), with one more column holding
    this rank's non-finite flag (summed, it is every rank's verdict); the memory starts again from
    zero, unless a flag is up (the step is skipped: keep it)."""
    world, numel = rows.shape
    total = rows.new_empty(world, numel + 1, dtype=torch.float32)
    total[:, :numel] = rows
    owed = errors.error[:, :ncomp] * error_decay
    if compressed_at is None:
        total[:, :numel] += owed
    else:
        total[:, :numel].index_add_(1, compressed_at, owed)
    total[:, numel] = nonfinite_flag(total[:, :numel])
    sent, left = guard_payload(total, world, half)
    out = sent.new_empty(numel + 1)
    reduce_scatter(out, sent, hop, traffic)
    out = out.to(torch.float32)
    output.copy_(out[:numel].mul_(scale) if scale != 1.0 else out[:numel])
    if float(out[numel]) > 0:  # an overflow: the step is skipped, the memory kept
        if traffic is not None:
            traffic.nonfinite_fallbacks += 1
    else:
        errors.sent_by_guard(traffic)
        if left is not None:
            left = left[:, :numel]
            errors.error[:, :ncomp] = left if compressed_at is None else left[:, compressed_at]
    return output
