"""1.6 bits per element with error feedback for adaptive optimizers' tensors: every element's
sign, the largest 55 of each 512-element chunk marked, and two fitted magnitudes per chunk.

Adam divides each coordinate's update by the root of its own running mean square, so it needs
each element's magnitude, which 1-bit scale x sign replaces by its chunk's. The large elements of
a gradient are few and clustered, so marking a chunk's largest 55 of 512 and sending their
positions as one number costs about half a bit per element: log2 C(512, 55) = 248 bits. Where the
1-bit states send it: ``compression.policy``; what it costs in accuracy: docs/decisions.md.

Per chunk of y (input plus the memory): the ``k = marked(chunk)`` largest |y| (ties to the lower
position) send ``hi`` (their mean |y|), the others ``lo`` (the others' mean |y|), each with its
sign. ``hi`` travels as the chunk's float32 scale, ``lo`` as one byte ``round(255 lo / hi)``; what
the byte rounds off stays in the memory.

Layout of a chunk: [chunk / 8 bytes of signs (bit i % 8 of byte i / 8: 1 negative) | the lo byte
| the rank of the marked positions p_1 < ... < p_k, sum of C(p_i, i), little-endian in
ceil(bits of C(chunk, k) - 1 / 8) bytes] (the combinatorial number system: every k-subset has one
rank below C(chunk, k)). A trimmed last chunk has a whole chunk's block: its missing elements are
neither signed nor marked (unless fewer than k elements are left: the first missing ones fill the
marks) and their magnitudes are not in its means; so a payload padded with zero bytes and zero
scales to more chunks decodes as the chunks it holds, then zeros (rank 0 at scale 0), as the
exchange needs. Chunks of 512: 100 bytes for 2048 of float32 (64 of signs, the byte, 31 of rank,
the scale), 20.5x. The codec's chunk is its
own (512), whatever the compressor's (1-bit's is 256).

Native on CPU (``ciuicflow.ops.topmark_pack`` / ``topmark_unpack_mean``, csrc/cpu/topmark.cpp)
and CUDA (csrc/cuda/topmark.cu: one thread per chunk, the same arithmetic, so the same bytes);
tensors on other devices, or on CUDA in a build without CUDA kernels, go through the CPU. An
option (``adaptive_optimizer="topmark"``), not on the policy's ladder (docs/decisions.md).
"""
from __future__ import annotations

from ciuicflow import formats
from ciuicflow.compression.codec import Codec, native_ops

CHUNK = formats.TOPMARK_CHUNK  # its layout: ciuicflow.formats


class TopMarkCodec(Codec):
    """Signs, the largest 55/512 of a chunk marked, ``hi`` and ``lo`` per chunk (module docstring)."""

    name = "topmark"
    granule = 8  # whole bytes of signs, as 1-bit's: one memory serves both
    chunk_size = CHUNK

    payload_bytes = staticmethod(formats.topmark_payload_bytes)

    def pack(self, x, error, chunk):
        if x.is_cpu or (x.is_cuda and native_ops().has_cuda_kernels()):
            return native_ops().topmark_pack(x.reshape(-1), error, chunk)
        # elsewhere: through the CPU, the memory updated where it lives
        cpu_error = error.cpu()
        payload, scales = native_ops().topmark_pack(x.reshape(-1).cpu(), cpu_error, chunk)
        error.copy_(cpu_error)
        return payload.to(x.device), scales.to(x.device)

    def unpack(self, payload, scales, numel, chunk, out, side=None):
        return self.unpack_mean(payload.view(1, -1), scales.view(1, -1), numel, chunk, out)

    def unpack_mean(self, payload, scales, numel, chunk, out, side=None):
        """Rows decoded and summed in row order per element (the same bits on every rank that
        holds the same rows), then divided by the number of rows."""
        rows = scales.shape[0]
        payload = payload.reshape(rows, -1)
        if out.is_cpu or (out.is_cuda and native_ops().has_cuda_kernels()):
            return native_ops().topmark_unpack_mean(payload, scales, numel, chunk, out=out)
        result = native_ops().topmark_unpack_mean(payload.cpu(), scales.cpu(), numel, chunk)
        return out.copy_(result)
