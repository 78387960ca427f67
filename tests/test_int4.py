"""The int4 codec (what the 1-bit compressor sends an adaptive optimizer's tensors with): against a
float64 / step-by-step float32 reference on fresh inputs, odd sizes, every dtype."""
import math

import pytest
import torch

from ciuicflow.compression.int4 import Int4Codec, int4_pack, int4_unpack, int4_unpack_mean
from tests.devices import DEVICES
from tests.test_int8 import DTYPES, fresh  # the same inputs as int8's kernels are tested on

SIZES = [1, 2, 7, 255, 256, 257, 1000, 65_537]
CHUNKS = [2, 8, 256, 1000]


def reference_pack(x, error, chunk):
    """float32 arithmetic, element by element in spirit: (values -7..7, scales, new error)."""
    y = x.float() + error.float()
    n, nchunks = y.numel(), math.ceil(y.numel() / chunk)
    rows = torch.zeros(nchunks * chunk)
    rows[:n] = y
    rows = rows.view(nchunks, chunk)
    scales = rows.abs().amax(1) / 7.0
    usable = (scales > 0) & torch.isfinite(scales)
    q = torch.where(usable[:, None], torch.round(rows / scales[:, None]).clamp(-7, 7), torch.zeros(()))
    return q.view(-1)[:n], scales, (rows - q * scales[:, None]).view(-1)[:n]


def reference_unpack_nibbles(payload, n):
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
    want_q, want_scales, want_error = reference_pack(x.cpu(), before.cpu(), chunk)
    payload, scales = int4_pack(x, error, chunk)
    assert payload.dtype == torch.uint8 and payload.shape == (Int4Codec().payload_bytes(n),)
    assert torch.equal(scales.cpu(), want_scales)
    if n < 3000:  # the nibble layout, decoded byte by byte
        assert torch.equal(reference_unpack_nibbles(payload.cpu(), n), want_q)
    assert torch.equal(error.cpu(), want_error)
    # error feedback in float64: sent + new error == x + old error, each within half a step
    sent = int4_unpack(payload, scales, n, chunk, out=torch.empty(n, device=device))
    assert torch.equal(sent.cpu(), (want_q * want_scales.repeat_interleave(chunk)[:n]))
    total = x.cpu().double() + before.cpu().double()
    assert (sent.cpu().double() + error.cpu().double() - total).abs().max() < 1e-5
    step = scales.cpu().double().repeat_interleave(chunk)[:n]
    assert torch.all(error.cpu().double().abs() <= step / 2 * (1 + 1e-5) + 1e-12)
    # the mean of W rows, summed in row order then scaled by 1/W in float32
    rows, row_scales = torch.stack([payload, torch.flip(payload, [0])]), torch.stack([scales, scales * 0.5])
    mean = int4_unpack_mean(rows, row_scales, n, chunk, out=torch.empty(n, device=device))
    index = torch.arange(n) // chunk
    want = torch.zeros(n)
    for w in range(2):
        want = want + reference_unpack_nibbles(rows[w].cpu(), n) * row_scales[w].cpu()[index]
    assert torch.equal(mean.cpu(), want * torch.tensor(0.5))


def test_non_finite_chunks_unpack_to_non_finite_and_leave_others_alone():
    x = torch.randn(24)
    x[3], x[13] = float("inf"), float("nan")
    error = torch.zeros(24)
    payload, scales = int4_pack(x, error, 8)
    assert math.isinf(scales[0]) and math.isnan(scales[1]) and math.isfinite(scales[2])
    out = int4_unpack(payload, scales, 24, 8, out=torch.empty(24))
    assert not torch.isfinite(out[:16]).any() and torch.isfinite(out[16:]).all()
    assert not torch.isfinite(error[:16]).any() and torch.isfinite(error[16:]).all()


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="even"):
        int4_pack(torch.zeros(4), torch.zeros(4), 3)
    with pytest.raises(ValueError, match="float32"):
        int4_pack(torch.zeros(4), torch.zeros(4, dtype=torch.float16), 2)
