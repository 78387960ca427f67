"""The native ops of ciuicflow: the byte-level work of gradient compression.

Each function wraps ``torch.ops.ciuicflow.*`` (CPU kernels in ``csrc/cpu``, CUDA kernels in
``csrc/cuda``) and has a fake implementation, so the ops trace under ``torch.compile``.

Layout of a 1-bit vector of ``n`` elements with chunk size ``c`` (a positive multiple of 8):
``packed`` is uint8 with ``ceil(n / 8)`` bytes, bit ``i`` is bit ``i % 8`` (LSB first) of byte
``i // 8`` and is 1 where the value was ``>= 0`` (so ``-0.0`` counts as positive); ``scales`` is
float32 with ``ceil(n / c)`` entries, one per chunk of ``c`` consecutive elements.

Non-finite input never crashes or hangs an op. In ``onebit_pack`` an inf or NaN in ``x + error``
makes that chunk's scale inf or NaN, so the chunk decompresses to non-finite values and its error
becomes non-finite; other chunks are unaffected. Callers that must not poison their error buffers
(the hooks) check for non-finite gradients first. In ``orthogonalize_`` a non-finite entry makes
its column, and the columns after it, NaN.
"""
from __future__ import annotations

import functools

import torch

from ciuicflow import formats

try:
    from ciuicflow import _C  # noqa: F401  (loading the library registers the ops)
except ImportError as exc:  # pragma: no cover - depends on the install
    raise ImportError(
        "ciuicflow's native extension (ciuicflow._C) is not built. Install the package with "
        "`pip install --no-build-isolation -e .` in an environment where torch is installed."
    ) from exc

__all__ = [
    "onebit_pack",
    "onebit_pack_ef",
    "onebit_unpack",
    "onebit_unpack_mean",
    "onebit_chunk_energy",
    "orthogonalize_",
    "node_sum_into",
    "int8_pack",
    "int8_pack_ef",
    "int8_unpack",
    "int8_unpack_mean",
    "int4_pack",
    "int4_pack_ef",
    "int4_unpack",
    "int4_unpack_mean",
    "has_cuda_kernels",
]

# the 1-bit methods' default, so an op called without one packs as the hooks do
DEFAULT_CHUNK_SIZE = formats.DEFAULT_CHUNK_SIZE


def onebit_pack(
    x: torch.Tensor, error: torch.Tensor, chunk_size: int = DEFAULT_CHUNK_SIZE
) -> tuple[torch.Tensor, torch.Tensor]:
    """Compress ``x`` to signs and per-chunk scales, with error feedback.

    ``y = x + error``; per chunk ``scale = mean(|y|)`` (the L2-optimal scale for sign compression);
    bit ``i`` is 1 where ``y[i] >= 0``; ``error`` (float32, same numel, contiguous) is updated in
    place to ``y - scale * sign(y)``. So ``x + error_before == onebit_unpack(...) + error_after``
    up to float rounding.

    Args:
        x: 1-D float32, float16 or bfloat16.
        error: float32 with ``x.numel()`` elements, updated in place.
        chunk_size: elements per scale, a positive multiple of 8.

    Returns:
        ``(packed, scales)``: uint8 ``[ceil(n/8)]`` and float32 ``[ceil(n/chunk_size)]``.
    """
    return torch.ops.ciuicflow.onebit_pack(x, error, chunk_size)


def onebit_pack_ef(
    x: torch.Tensor, error: torch.Tensor, error_decay: float, error_out: torch.Tensor,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``onebit_pack`` of ``y = x + error_decay * error`` with the new error in ``error_out``, and
    the accuracy guard's two sums, all in one pass over memory.

    ``error`` is read, ``error_out`` written (both float32 with ``x.numel()`` elements, contiguous;
    they may be the same tensor). ``error_decay * error`` is rounded before the add, as a separate
    multiply would round it (with 1.0 this is ``onebit_pack`` exactly). The hooks keep ``error``
    intact this way until the exchange has agreed that the step is a compressed one.

    Returns:
        ``(packed, scales, sums)``: as ``onebit_pack``, and float64 ``[2]`` on ``x``'s device:
        ``(sum(error_out**2), sum(x**2))``.
    """
    return torch.ops.ciuicflow.onebit_pack_ef(x, error, float(error_decay), error_out, chunk_size)


def onebit_chunk_energy(packed: torch.Tensor, scales: torch.Tensor, error: torch.Tensor,
                        chunk_size: int = DEFAULT_CHUNK_SIZE) -> torch.Tensor:
    """Per chunk, the energy of what a pack packed: ``y = onebit_unpack(packed, scales) + error``
    (``error``: float32, the numel of the vector); returns float32 ``[ceil(n/chunk_size), 2]``
    holding each chunk's ``(sum y**2, max y**2)`` over its elements (padding excluded). The
    outlier gate's measure (``compression.outliers``), in one pass. CPU tensors only.
    """
    return torch.ops.ciuicflow.onebit_chunk_energy(packed, scales, error, chunk_size)


def node_sum_into(terms: list[torch.Tensor], divisor: float, out: torch.Tensor) -> torch.Tensor:
    """``out = (terms[0] + terms[1] + ...) / divisor`` in one pass, summed in list order (the same
    bits as ``torch.add`` then ``add_`` then ``div_``; float16 and bfloat16 round at each step as
    torch does), and a float32 ``[1]``: 1 where ``out`` holds inf or NaN (an input did, or the sum
    overflowed), else 0. The intra-node step's node sum (``collectives.node_shm``).

    Args:
        terms: one or more contiguous 1-D tensors of ``out``'s dtype and numel.
        divisor: positive; 1 skips the division.
        out: contiguous 1-D float32, float16 or bfloat16 tensor. CPU tensors only.
    """
    return torch.ops.ciuicflow.node_sum_into(list(terms), float(divisor), out)


def onebit_unpack(
    packed: torch.Tensor,
    scales: torch.Tensor,
    numel: int,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    *,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Decompress: ``out[i] = scales[i // chunk_size] * (+1 if bit i else -1)``, float32 ``[numel]``.

    ``out``: an optional contiguous float32 buffer of ``numel`` elements to write into (saves an
    allocation, which on large vectors costs more than the op).
    """
    if out is not None:
        torch.ops.ciuicflow.onebit_unpack_into(packed, scales, numel, chunk_size, out)
        return out
    return torch.ops.ciuicflow.onebit_unpack(packed, scales, numel, chunk_size)


def onebit_unpack_mean(
    packed: torch.Tensor,
    scales: torch.Tensor,
    numel: int,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    *,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Mean of ``W`` compressed vectors in one pass: ``packed [W, ceil(numel/8)]``,
    ``scales [W, ceil(numel/chunk_size)]`` -> float32 ``[numel]``.

    The vectors are summed in row order, so every rank that holds the same rows gets the same bits
    (the server step of compressed all-reduce). ``out`` as in :func:`onebit_unpack`.

    Rows need not be adjacent (only ``packed``'s last stride must be 1, else it is copied). On CPU
    ``packed`` may also be ``[W, ceil(numel/chunk_size), B]`` blocks, ``B >= chunk_size / 8``, each
    chunk's signs at the start of its block (the outlier codec's payload): read where they lie.
    """
    if out is not None:
        torch.ops.ciuicflow.onebit_unpack_mean_into(packed, scales, numel, chunk_size, out)
        return out
    return torch.ops.ciuicflow.onebit_unpack_mean(packed, scales, numel, chunk_size)


def orthogonalize_(m: torch.Tensor, eps: float = 0.0) -> torch.Tensor:
    """Orthonormalise the columns of ``m`` (``[n, r]`` or batched ``[B, n, r]``) in place by
    modified Gram-Schmidt, as PowerSGD does: each column is divided by ``norm + eps`` and removed
    from the columns after it. A zero column stays zero. float32, float16 and bfloat16 (computed in
    float32, rounded once). Returns ``m``.
    """
    torch.ops.ciuicflow.orthogonalize_(m, eps)
    return m


def int8_pack(x: torch.Tensor, error: torch.Tensor, chunk_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantise ``x`` to int8 with one scale per chunk, with error feedback.

    ``y = x + error``; per chunk ``scale = max(|y|) / 127`` (NaN if the chunk holds a NaN);
    ``values[i] = round_half_even(y[i] / scale)`` clamped to [-127, 127] (0 where the scale is 0 or
    not finite); ``error`` (float32, same numel, contiguous) becomes ``y - values * scale``.

    Returns ``(values, scales)``: int8 ``[n]`` and float32 ``[ceil(n/chunk_size)]``.
    """
    return torch.ops.ciuicflow.int8_pack(x, error, chunk_size)


def int8_pack_ef(x: torch.Tensor, error: torch.Tensor, error_decay: float, error_out: torch.Tensor,
                 chunk_size: int, units: torch.Tensor | None = None,
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``int8_pack`` of ``y = x / units + error_decay * (error / units)`` with the new error, times
    ``units``, in ``error_out``, and the accuracy guard's sums, in one pass over memory (CPU).

    ``units`` (float32, ``x.numel()`` elements, or None for 1): what the optimizer divides each
    coordinate by, so that the values are rounded as the optimizer will see them; the memory stays
    in plain units. ``error`` is read, ``error_out`` written (float32, contiguous; the same tensor
    or apart). Each step rounds as the torch ops ``xu = x.float() / units``, ``eu = error / units``,
    ``e = error_decay * eu`` (``eu`` where the decay is 1), ``int8_pack(xu, e)``, ``e * units``
    would: the same bytes, scales and new error.

    Returns ``(values, scales, sums)``: as ``int8_pack``, and float64 ``[2]``:
    ``(sum(new_error_in_units**2), sum((x / units)**2))``.
    """
    return torch.ops.ciuicflow.int8_pack_ef(x, error, float(error_decay), error_out, chunk_size,
                                            units)


def int8_unpack(values: torch.Tensor, scales: torch.Tensor, numel: int, chunk_size: int, *,
                out: torch.Tensor | None = None) -> torch.Tensor:
    """``out[i] = values[i] * scales[i // chunk_size]``, float32 ``[numel]``."""
    out = scales.new_empty(numel) if out is None else out
    torch.ops.ciuicflow.int8_unpack_into(values, scales, numel, chunk_size, out)
    return out


def int8_unpack_mean(values: torch.Tensor, scales: torch.Tensor, numel: int, chunk_size: int, *,
                     out: torch.Tensor | None = None) -> torch.Tensor:
    """Mean of ``W`` int8 vectors: ``values [W, numel]``, ``scales [W, ceil(numel/chunk_size)]``,
    summed in row order (the same bits on every rank that holds the same rows), float32."""
    out = scales.new_empty(numel) if out is None else out
    torch.ops.ciuicflow.int8_unpack_mean_into(values, scales, numel, chunk_size, out)
    return out


def int4_pack(x: torch.Tensor, error: torch.Tensor, chunk_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantise ``x`` to 4 bits with one scale per chunk, with error feedback: as ``int8_pack``
    with levels -7..7 (``scale = max(|y|) / 7``) and two values per byte, element ``i`` in byte
    ``i // 2``, the low nibble for even ``i`` (two's complement). ``chunk_size`` must be even.

    Returns ``(values, scales)``: uint8 ``[ceil(n/2)]`` and float32 ``[ceil(n/chunk_size)]``.
    """
    return torch.ops.ciuicflow.int4_pack(x, error, chunk_size)


def int4_pack_ef(x: torch.Tensor, error: torch.Tensor, error_decay: float, error_out: torch.Tensor,
                 chunk_size: int, units: torch.Tensor | None = None,
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``int8_pack_ef`` with ``int4_pack``'s format."""
    return torch.ops.ciuicflow.int4_pack_ef(x, error, float(error_decay), error_out, chunk_size,
                                            units)


def int4_unpack(values: torch.Tensor, scales: torch.Tensor, numel: int, chunk_size: int, *,
                out: torch.Tensor | None = None) -> torch.Tensor:
    """``out[i] = value(i) * scales[i // chunk_size]``, float32 ``[numel]``."""
    out = scales.new_empty(numel) if out is None else out
    torch.ops.ciuicflow.int4_unpack_into(values, scales, numel, chunk_size, out)
    return out


def int4_unpack_mean(values: torch.Tensor, scales: torch.Tensor, numel: int, chunk_size: int, *,
                     out: torch.Tensor | None = None) -> torch.Tensor:
    """Mean of ``W`` int4 vectors: ``values [W, ceil(numel/2)]``, ``scales [W, ceil(numel/chunk_size)]``,
    summed in row order (the same bits on every rank that holds the same rows), float32."""
    out = scales.new_empty(numel) if out is None else out
    torch.ops.ciuicflow.int4_unpack_mean_into(values, scales, numel, chunk_size, out)
    return out


@functools.cache  # fixed once the library is loaded (above)
def has_cuda_kernels() -> bool:
    """Whether this build of the extension has the CUDA kernels."""
    return torch._C._dispatch_has_kernel_for_dispatch_key("ciuicflow::onebit_pack", "CUDA")


def _ceil_div(a, b):
    return (a + b - 1) // b


@torch.library.register_fake("ciuicflow::onebit_pack")
def _onebit_pack_fake(x, error, chunk_size):
    n = x.numel()
    return (
        x.new_empty((_ceil_div(n, 8),), dtype=torch.uint8),
        x.new_empty((_ceil_div(n, chunk_size),), dtype=torch.float32),
    )


@torch.library.register_fake("ciuicflow::onebit_pack_ef")
def _onebit_pack_ef_fake(x, error, error_decay, error_out, chunk_size):
    packed, scales = _onebit_pack_fake(x, error_out, chunk_size)
    return packed, scales, x.new_empty((2,), dtype=torch.float64)


@torch.library.register_fake("ciuicflow::onebit_unpack")
def _onebit_unpack_fake(packed, scales, numel, chunk_size):
    return scales.new_empty((numel,), dtype=torch.float32)


@torch.library.register_fake("ciuicflow::onebit_unpack_mean")
def _onebit_unpack_mean_fake(packed, scales, numel, chunk_size):
    return scales.new_empty((numel,), dtype=torch.float32)


@torch.library.register_fake("ciuicflow::onebit_unpack_into")
def _onebit_unpack_into_fake(packed, scales, numel, chunk_size, out):
    return None


@torch.library.register_fake("ciuicflow::onebit_unpack_mean_into")
def _onebit_unpack_mean_into_fake(packed, scales, numel, chunk_size, out):
    return None


@torch.library.register_fake("ciuicflow::onebit_chunk_energy")
def _onebit_chunk_energy_fake(packed, scales, error, chunk_size):
    return scales.new_empty((scales.numel(), 2), dtype=torch.float32)


@torch.library.register_fake("ciuicflow::node_sum_into")
def _node_sum_into_fake(terms, divisor, out):
    return out.new_empty((1,), dtype=torch.float32)


@torch.library.register_fake("ciuicflow::orthogonalize_")
def _orthogonalize_fake(m, eps):
    return None


@torch.library.register_fake("ciuicflow::int8_pack")
def _int8_pack_fake(x, error, chunk_size):
    n = x.numel()
    return (x.new_empty((n,), dtype=torch.int8),
            x.new_empty((_ceil_div(n, chunk_size),), dtype=torch.float32))


@torch.library.register_fake("ciuicflow::int8_pack_ef")
def _int8_pack_ef_fake(x, error, error_decay, error_out, chunk_size, units=None):
    return (*_int8_pack_fake(x, error_out, chunk_size), x.new_empty((2,), dtype=torch.float64))


@torch.library.register_fake("ciuicflow::int4_pack_ef")
def _int4_pack_ef_fake(x, error, error_decay, error_out, chunk_size, units=None):
    return (*_int4_pack_fake(x, error_out, chunk_size), x.new_empty((2,), dtype=torch.float64))


@torch.library.register_fake("ciuicflow::int8_unpack_into")
def _int8_unpack_into_fake(values, scales, numel, chunk_size, out):
    return None


@torch.library.register_fake("ciuicflow::int8_unpack_mean_into")
def _int8_unpack_mean_into_fake(values, scales, numel, chunk_size, out):
    return None


@torch.library.register_fake("ciuicflow::int4_pack")
def _int4_pack_fake(x, error, chunk_size):
    n = x.numel()
    return (x.new_empty((_ceil_div(n, 2),), dtype=torch.uint8),
            x.new_empty((_ceil_div(n, chunk_size),), dtype=torch.float32))


@torch.library.register_fake("ciuicflow::int4_unpack_into")
def _int4_unpack_into_fake(values, scales, numel, chunk_size, out):
    return None


@torch.library.register_fake("ciuicflow::int4_unpack_mean_into")
def _int4_unpack_mean_into_fake(values, scales, numel, chunk_size, out):
    return None
