"""The 2-bit codec (``compression.twobit``, what a 1-bit state sends an adaptive optimizer's tensors
with under ``adaptive_optimizer="twobit"``): against a float64 element-by-element reference on fresh
inputs, odd sizes and every gradient dtype; the byte layout decoded by hand; the error-feedback
invariant; the mean of rows; the prefix property the exchange's padding relies on. Its exchange
over real processes: tests/test_adaptive_optimizers.py."""
import pytest
import torch

import ciuicflow.ops

from ciuicflow.compression.onebit import OneBitCodec
from ciuicflow.compression.twobit import THRESHOLD, TwoBitCodec
from tests.codec_properties import check_mean_of_rows, check_zero_padding, fresh
from tests.devices import CUDA_SKIP_REASON

CODEC = TwoBitCodec()
SIZES = [1, 3, 8, 255, 256, 257, 1000, 4099]
CHUNKS = [8, 64, 256]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def reference(x, error, chunk):
    """(levels sent as float64, hi per chunk, lo byte per chunk, codes) element by element."""
    y = x.double() + error.double()
    n = y.numel()
    sent = torch.empty(n, dtype=torch.float64)
    his, bytes_, codes = [], [], []
    for start in range(0, n, chunk):
        z = y[start:start + chunk]
        a = z.abs()
        large = a > THRESHOLD * a.square().mean().sqrt()
        small_mean = a[~large].mean() if (~large).any() else torch.tensor(0.0, dtype=torch.float64)
        hi = a[large].mean() if large.any() else small_mean
        lo_byte = int(torch.round(small_mean / hi * 255)) if hi > 0 else 0
        hi32 = float(hi.float())
        level = torch.where(large, torch.tensor(hi32, dtype=torch.float64),
                            torch.tensor(hi32 * lo_byte / 255, dtype=torch.float64))
        sent[start:start + chunk] = torch.where(z < 0, -level, level)
        his.append(hi32)
        bytes_.append(lo_byte)
        codes.extend(int(neg) | (int(big) << 1) for neg, big in zip((z < 0).tolist(), large.tolist()))
    return sent, torch.tensor(his), bytes_, codes


def decode_layout(payload, n, chunk):
    """[lo byte | chunk/4 bytes of codes] per chunk, element i at bits 2 (i % 4) of byte i // 4."""
    data, los, codes, at = payload.tolist(), [], [], 0
    for start in range(0, n, chunk):
        count = min(chunk, n - start)
        los.append(data[at])
        body = data[at + 1:at + 1 + -(-count // 4)]
        codes.extend(((body[i // 4] >> (2 * (i % 4))) & 3) for i in range(count))
        at += 1 + -(-count // 4)
    assert at == len(data)
    return los, codes


def cuda_pack(x, error, chunk):
    """The CUDA kernel (where a GPU and this build's CUDA kernels exist), its results on the CPU."""
    if CUDA_SKIP_REASON is not None:
        pytest.skip(CUDA_SKIP_REASON)
    memory = error.cuda()
    payload, scales = CODEC.pack(x.cuda(), memory, chunk)
    assert payload.is_cuda and scales.is_cuda
    error.copy_(memory.cpu())
    return payload.cpu(), scales.cpu()


# CPU's op, CUDA's, and the torch ops of other devices
PACKS = {"native": CODEC.pack, "cuda": cuda_pack, "torch": CODEC.pack_torch}


@pytest.mark.parametrize("impl", sorted(PACKS))
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("chunk", CHUNKS)
def test_pack_and_unpack_match_float64_reference(impl, dtype, n, chunk):
    x, error = fresh(n, dtype, seed=n * 31 + chunk)
    before = error.clone()
    want, want_hi, want_bytes, want_codes = reference(x, before, chunk)
    payload, scales = PACKS[impl](x, error, chunk)
    assert payload.dtype == torch.uint8 and payload.numel() == CODEC.payload_bytes(n, chunk)
    assert scales.dtype == torch.float32 and scales.numel() == -(-n // chunk)
    torch.testing.assert_close(scales.double(), want_hi.double(), rtol=1e-5, atol=0)
    if n <= 1000:
        los, codes = decode_layout(payload, n, chunk)
        # a lo byte may round the other way where float32 sums meet a half exactly: none here
        assert los == want_bytes
        assert codes == want_codes
    out = torch.empty(n)
    CODEC.unpack(payload, scales, n, chunk, out)
    torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-7)
    # error feedback: what was sent plus the new memory is the input plus the old memory
    total = x.double() + before.double()
    assert (out.double() + error.double() - total).abs().max() < 1e-5 * (1 + total.abs().max())


def test_the_level_bit_halves_the_error_of_scale_times_sign():
    """On Gaussian values the level bit takes 1-bit's relative error (||y - C(y)|| / ||y||, 0.60)
    to about 0.34; a codec that ignored it (every element at one magnitude) could not."""
    x = torch.randn(1 << 16, generator=torch.Generator().manual_seed(5))
    errors = {}
    for name, codec in (("twobit", CODEC), ("onebit", OneBitCodec())):
        error = torch.zeros_like(x)
        codec.pack(x, error, 256)
        errors[name] = (error.norm() / x.norm()).item()
    assert errors["twobit"] < 0.38 < 0.55 < errors["onebit"], errors


def test_mean_of_rows_is_their_row_order_sum_over_w():
    check_mean_of_rows(CODEC)


def test_zero_bytes_after_a_payload_unpack_to_zeros():
    check_zero_padding(CODEC)


def test_the_native_op_is_the_cpu_pack_and_passes_opcheck():
    x, error = fresh(1001, torch.float32, seed=3)
    torch.library.opcheck(torch.ops.ciuicflow.twobit_pack.default, (x, error.clone(), 16))
    native = CODEC.pack(x, error.clone(), 64)
    assert torch.equal(native[0], ciuicflow.ops.twobit_pack(x, error.clone(), 64)[0])
    with pytest.raises(RuntimeError, match="multiple of 4"):
        ciuicflow.ops.twobit_pack(x, error.clone(), 6)


@pytest.mark.parametrize("impl", sorted(PACKS))
def test_constant_zero_and_non_finite_chunks(impl):
    chunk = 8
    x = torch.tensor([2.0] * 8 + [0.0] * 8 + [1.0, float("nan")] + [1.0] * 6 + [-3.0] * 8)
    error = torch.zeros_like(x)
    payload, scales = PACKS[impl](x, error, chunk)
    out = CODEC.unpack(payload, scales, x.numel(), chunk, torch.empty(x.numel()))
    assert torch.equal(out[:8], x[:8]) and torch.equal(out[8:16], x[8:16])  # exact: one level
    assert torch.equal(out[24:], x[24:])
    assert torch.isnan(scales[2])  # a chunk holding NaN says so (the exchange then goes exact)
    with pytest.raises(ValueError, match="multiple of 4"):
        CODEC.pack_torch(torch.ones(6), torch.zeros(6), 6)
    empty, empty_scales = PACKS[impl](torch.ones(0), torch.zeros(0), 8)
    assert empty.numel() == 0 and empty_scales.numel() == 0
