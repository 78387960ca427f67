"""What a quantiser's codec is: how values are laid out in bytes (the native ops do the work).
``compression.quantized_exchange`` sends a codec's bytes over a hop; each codec lives with its
compressor (onebit.py, int8.py, int4.py, outliers.py)."""
from __future__ import annotations

import torch


def native_ops():
    """``ciuicflow.ops``, loaded on first use: states and hooks that never compress work without
    the native build."""
    from ciuicflow import ops
    return ops


class Codec:
    """How a quantiser lays values out in bytes (the native ops do the work).

    ``granule``: a chunk holds a multiple of this many elements (whole bytes of payload)."""

    name: str
    granule: int = 1
    side_bytes: int = 0  # bytes of a side block: a chunk whose scale is negative has one (the
    #                      payload's fixed part is followed by them; ``compression.outliers``)

    def payload_bytes(self, numel: int, chunk: int) -> int:
        """Bytes of the payload of ``numel`` elements in chunks of ``chunk``."""
        raise NotImplementedError

    def pack(self, x: torch.Tensor, error: torch.Tensor, chunk: int):
        """(payload uint8 [payload_bytes(n)], scales float32 [ceil(n / chunk)]); ``error`` (float32,
        n elements) holds x + error on entry's behalf, minus what was packed, on return."""
        raise NotImplementedError

    def pack_ef(self, x: torch.Tensor, error: torch.Tensor, error_decay: float,
                error_out: torch.Tensor, chunk: int, measure: bool = True,
                units: torch.Tensor | None = None):
        """``pack`` of ``x + error_decay * error``, the new error in ``error_out`` (``error`` is
        left as it was unless it is ``error_out``): (payload, scales, sums), where sums is float64
        (sum error_out^2, sum x^2) on x's device, for the guard (None without ``measure``,
        unless they come free). ``units`` (float32, x's numel): quantise in them, what an
        adaptive optimizer divides each coordinate by: ``x / units`` and ``error / units`` are
        packed, the sums are in the units, and ``error_out`` is multiplied back (plain units).
        Here in torch ops; a codec with a native one-pass version overrides it."""
        if units is not None:
            payload, scales, sums = self.pack_ef(x.float() / units, error / units, error_decay,
                                                 error_out, chunk, measure)
            error_out.mul_(units)
            return payload, scales, sums
        if error_out is not error:
            if error_decay == 1.0:
                error_out.copy_(error)
            else:
                torch.mul(error, error_decay, out=error_out)
        elif error_decay != 1.0:
            error_out.mul_(error_decay)
        payload, scales = self.pack(x, error_out, chunk)
        sums = torch.stack([torch.linalg.vector_norm(error_out, dtype=torch.float32),
                            torch.linalg.vector_norm(x, dtype=torch.float32)]).double().square() \
            if measure else None
        return payload, scales, sums

    def unpack(self, payload, scales, numel: int, chunk: int, out: torch.Tensor,
               side=None) -> torch.Tensor:
        """``side``: the side blocks, for a codec that has them (else ignored)."""
        raise NotImplementedError

    def unpack_mean(self, payload, scales, numel: int, chunk: int,
                    out: torch.Tensor, side=None) -> torch.Tensor:
        """The mean of W packed vectors (rows of ``payload`` and ``scales``), summed in row order;
        ``side``: each row's side blocks, for a codec that has them (else ignored)."""
        raise NotImplementedError
