"""A quantised reduce-scatter with error feedback: what FSDP2's custom reduce-scatter runs when FSDP
shards over every rank (ciuicflow.fsdp with a 1-D mesh).

The input is W rows of S elements: row j is this rank's contribution to rank j's shard. Every row
bound for another rank is packed by the codec (1-bit, int8) with an error-feedback memory of its
own, and one all-to-all delivers them; rank j adds its own row, exact, to the W - 1 rows it
receives, decompressed. Each value is quantised once (nothing is gathered back, so there is no
server stage), and (W - 1) / W of the packed bytes leave each rank: 1/32 (1-bit) or 1/4 (int8) of
an exact reduce-scatter's float32 bytes, plus one scale per chunk.

Every row carries this rank's non-finite flag: when any rank holds inf/NaN the step is an exact
reduce-scatter and the memory is left as it was (as the all-reduce exchanges do).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ciuicflow.collectives.primitives import Hop, Traffic, all_to_all, nonfinite_flag, \
    reduce_scatter
from ciuicflow.compression.base import GuardedMemory, snapshot
from ciuicflow.compression.quantized_exchange import Codec, even_chunks


class ScatterErrors(GuardedMemory):
    """Error-feedback memory of one reduce-scatter: ``error[j]`` is what this rank has not yet
    sent of its rows for rank j (float32, rows padded to whole chunks; its own row stays zero)."""

    def __init__(self):
        super().__init__()
        self.error: torch.Tensor | None = None
        self._spare: torch.Tensor | None = None  # the next error is written here first
        self._work: torch.Tensor | None = None   # the padded float32 rows, reused
        self._mean: torch.Tensor | None = None   # the decompressed mean of the received rows

    def ensure(self, rows: int, padded: int, device) -> None:
        if self.error is None:
            self.error = torch.zeros(rows, padded, device=device)
        elif tuple(self.error.shape) != (rows, padded):
            raise RuntimeError(f"reduce-scatter error buffer is {tuple(self.error.shape)}, this "
                               f"input needs ({rows}, {padded}): one memory serves one layout")
        elif self.error.device != torch.device(device):
            self.error = self.error.to(device)
        if self._spare is None or self._spare.shape != self.error.shape \
                or self._spare.device != self.error.device:
            self._spare = torch.empty_like(self.error)
            self._work = torch.empty_like(self.error)
            self._mean = torch.empty(padded, device=self.error.device)

    def state_dict(self) -> dict:
        return {"error": snapshot(self.error)}

    def load_state_dict(self, state: dict) -> None:
        self.error, self._spare = snapshot(state["error"]), None

    def flush(self) -> None:
        if self.error is not None:
            self.error.zero_()


def quantized_reduce_scatter(codec: Codec, errors: ScatterErrors, output: torch.Tensor,
                             rows: torch.Tensor, hop: Hop, *, chunk_size: int,
                             error_decay: float = 1.0, scale: float = 1.0,
                             traffic: Traffic | None = None) -> torch.Tensor:
    """``output`` (S elements) = ``scale`` x the sum over the hop's ranks of their row for this
    rank, where ``rows`` holds W x S elements (W = hop.size), row j bound for rank j."""
    world = hop.size
    rows = rows.reshape(world, -1)
    numel = rows.shape[1]
    if output.numel() != numel:
        raise ValueError(f"output holds {output.numel()} elements, a row {numel}")
    if world == 1 or numel == 0:
        output.copy_(rows[0] * scale)
        return output
    me = dist.get_rank(hop.group)
    chunk, padded = even_chunks(codec, numel, chunk_size)
    errors.ensure(world, padded, rows.device)
    work = errors._work
    work[:, :numel].copy_(rows)
    work[:, numel:].zero_()
    work[me].zero_()  # this rank's own row is added exactly below; it sends nothing to itself
    new_error = errors._spare
    if error_decay == 1.0:
        new_error.copy_(errors.error)
    else:
        torch.mul(errors.error, error_decay, out=new_error)
    payload, scales = codec.pack(work.view(-1), new_error.view(-1), chunk)
    flag = nonfinite_flag(rows).expand(world, 1)
    send = torch.cat([payload.view(world, -1), scales.view(world, -1).view(torch.uint8),
                      flag.contiguous().view(torch.uint8)], dim=1)
    received = torch.empty_like(send)
    all_to_all(received, send, hop, traffic)
    payload_bytes, nscales = codec.payload_bytes(padded), padded // chunk
    r_payload = received[:, :payload_bytes]
    r_scales = received[:, payload_bytes:payload_bytes + 4 * nscales].contiguous().view(torch.float32)
    r_flags = received[:, payload_bytes + 4 * nscales:].contiguous().view(torch.float32)
    # the one host read: the flags pick the compressed or the exact path
    if float(r_flags.sum()) > 0:  # a rank holds inf/NaN: exact this step, memory untouched
        if traffic is not None:
            traffic.nonfinite_fallbacks += 1
        reduce_scatter(output, rows.contiguous(), hop, traffic)
        return output.mul_(scale) if scale != 1.0 else output
    errors.error, errors._spare = new_error, errors.error
    mean = codec.unpack_mean(r_payload.contiguous(), r_scales, padded, chunk, errors._mean)
    total = mean[:numel].mul_(world).add_(rows[me].float())  # own row: exact
    output.copy_(total.mul_(scale) if scale != 1.0 else total)
    return output
