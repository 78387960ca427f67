"""The int4 ops (what the 1-bit compressor sends an adaptive optimizer's tensors with where values
are quantised twice): against a step-by-step float32 reference and a byte-by-byte decoding of
the nibbles, on fresh inputs, odd sizes, every dtype and device; the error-feedback invariant in
float64 (non-finite chunks, opcheck and the distributed exchange: tests/test_int8.py, for both
formats)."""
import math

import pytest
import torch

import ciuicflow.ops as ops
from tests.devices import DEVICES
from tests.int8_reference import DTYPES, fresh, reference_pack  # int8's, at 7 levels

SIZES = [1, 2, 7, 255, 256, 257, 1000, 65_537]
CHUNKS = [2, 8, 256, 1000]


def decode_nibbles(payload, n):
    """Element i in byte i // 2, the low nibble for even i, two's complement in 4 bits."""
    out = []
    for byte in payload.tolist():
        for nibble in (byte & 0xF, byte >> 4):
            out.append(nibble - 16 if nibble >= 8 else nibble)
    return torch.tensor(out[:n], dtype=torch.float32)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("chunk", CHUNKS)
def test_pack_and_unpack_match_reference(device, dtype, n, chunk):
    x, error = fresh(n, dtype, device, seed=n * 7 + chunk)
    before = error.clone()
    want_q, want_scales, want_error = reference_pack(x.cpu(), before.cpu(), chunk, levels=7.0)
    want_q = want_q.float()
    payload, scales = ops.int4_pack(x, error, chunk)
    assert payload.dtype == torch.uint8 and payload.shape == (math.ceil(n / 2),)
    assert torch.equal(scales.cpu(), want_scales)
    if n < 3000:  # the nibble layout, decoded byte by byte
        assert torch.equal(decode_nibbles(payload.cpu(), n), want_q)
    if n % 2:  # the pad nibble of an odd tail is 0
        assert int(payload[-1]) >> 4 == 0
    assert torch.equal(error.cpu(), want_error)
    # error feedback in float64: sent + new error == x + old error, each within half a step
    sent = ops.int4_unpack(payload, scales, n, chunk)
    assert torch.equal(sent.cpu(), want_q * want_scales.repeat_interleave(chunk)[:n])
    total = x.cpu().double() + before.cpu().double()
    assert (sent.cpu().double() + error.cpu().double() - total).abs().max() < 1e-5
    step = scales.cpu().double().repeat_interleave(chunk)[:n]
    assert torch.all(error.cpu().double().abs() <= step / 2 * (1 + 1e-5) + 1e-12)
    # the mean of W rows, summed in row order then scaled by 1/W in float32
    rows, row_scales = torch.stack([payload, torch.flip(payload, [0])]), torch.stack([scales, scales * 0.5])
    mean = ops.int4_unpack_mean(rows, row_scales, n, chunk)
    index = torch.arange(n) // chunk
    want = torch.zeros(n)
    for w in range(2):
        want = want + decode_nibbles(rows[w].cpu(), n) * row_scales[w].cpu()[index]
    assert torch.equal(mean.cpu(), want * torch.tensor(0.5))


def test_bad_arguments_are_refused():
    x, error = torch.randn(10), torch.zeros(10)
    with pytest.raises(RuntimeError, match="multiple of 2"):
        ops.int4_pack(x, error, 3)
    with pytest.raises(RuntimeError, match="error must be a contiguous float32"):
        ops.int4_pack(x, torch.zeros(9), 4)
    payload, scales = ops.int4_pack(x, error, 4)
    with pytest.raises(RuntimeError, match="values must be uint8"):
        ops.int4_unpack(payload.view(torch.int8), scales, 10, 4)
    with pytest.raises(RuntimeError, match="values has 5 bytes per vector, numel 12 needs 6"):
        ops.int4_unpack(payload, torch.ones(3), 12, 4)
