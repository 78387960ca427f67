"""The topmark codec (``compression.topmark``: every sign, the largest 55/512 of a chunk marked by the
rank of their positions, two fitted magnitudes; what a 1-bit state sends an adaptive optimizer's
tensors with): against a float64 element-by-element reference on fresh inputs, odd sizes and
every gradient dtype, its bytes decoded by hand (the rank with Python's exact integers); the
error-feedback invariant; the mean of rows; zero padding; corrupt ranks refused. Its exchange over
real processes: tests/test_adaptive_optimizers.py."""
import math

import pytest
import torch

import ciuicflow.ops

from ciuicflow.compression.onebit import OneBitCodec
from ciuicflow.compression.topmark import TopMarkCodec
from ciuicflow.formats import topmark_marked as marked, topmark_rank_bytes as rank_bytes
from ciuicflow.compression.twobit import TwoBitCodec
from tests.codec_properties import check_mean_of_rows, check_zero_padding, fresh
from tests.devices import needs_cuda

CODEC = TopMarkCodec()
SIZES = [1, 3, 8, 255, 511, 512, 513, 1000, 4099]
CHUNKS = [8, 64, 256, 512]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def reference(x, error, chunk):
    """(values sent as float64, hi per chunk, lo byte per chunk, signs, marked positions per chunk)
    element by element; y in float32 as the kernel adds it."""
    y = (x.float() + error).double()
    n = y.numel()
    sent = torch.empty(n, dtype=torch.float64)
    his, los, signs, marks = [], [], [], []
    for start in range(0, n, chunk):
        z = y[start:start + chunk]
        a = z.abs()
        k = marked(chunk)  # a trimmed last chunk marks as many, its missing elements last
        top = sorted(sorted(range(z.numel()), key=lambda i: (-a[i].item(), i))[:k])
        top += list(range(z.numel(), k))
        large = torch.zeros(chunk, dtype=torch.bool)
        large[top] = True
        large = large[:z.numel()]
        hi = a[large].mean()
        lo = a[~large].mean() if (~large).any() else torch.tensor(0.0, dtype=torch.float64)
        lo_byte = int(torch.round(lo / hi * 255)) if hi > 0 else 0
        hi32 = float(hi.float())
        level = torch.where(large, torch.tensor(hi32, dtype=torch.float64),
                            torch.tensor(hi32 * lo_byte / 255, dtype=torch.float64))
        sent[start:start + chunk] = torch.where(z < 0, -level, level)
        his.append(hi32)
        los.append(lo_byte)
        signs.extend((z < 0).tolist())
        marks.append(top)
    return sent, torch.tensor(his), los, signs, marks


def decode_layout(payload, n, chunk):
    """[signs | lo byte | rank] per chunk (a trimmed one's too), decoded with Python's integers:
    the rank is the sum of C(p_i, i) over the marked positions p_1 < ... < p_k (the combinatorial
    number system)."""
    data, los, signs, marks, at = bytes(payload.tolist()), [], [], [], 0
    for start in range(0, n, chunk):
        count = min(chunk, n - start)
        nsign = chunk // 8
        signs.extend(bool(data[at + i // 8] >> (i % 8) & 1) for i in range(count))
        assert not any(data[at + i // 8] >> (i % 8) & 1 for i in range(count, chunk))
        los.append(data[at + nsign])
        rank = int.from_bytes(data[at + nsign + 1:at + nsign + 1 + rank_bytes(chunk)], "little")
        assert rank < math.comb(chunk, marked(chunk))
        top, p = [], chunk - 1
        for i in range(marked(chunk), 0, -1):
            while math.comb(p, i) > rank:
                p -= 1
            top.append(p)
            rank -= math.comb(p, i)
            p -= 1
        marks.append(sorted(top))
        at += nsign + 1 + rank_bytes(chunk)
    assert at == len(data)
    return los, signs, marks


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("chunk", CHUNKS)
def test_pack_and_unpack_match_float64_reference(dtype, n, chunk):
    x, error = fresh(n, dtype, seed=n * 31 + chunk)
    before = error.clone()
    want, want_hi, want_los, want_signs, want_marks = reference(x, before, chunk)
    payload, scales = CODEC.pack(x, error, chunk)
    assert payload.dtype == torch.uint8 and payload.numel() == CODEC.payload_bytes(n, chunk)
    assert scales.dtype == torch.float32 and scales.numel() == -(-n // chunk)
    torch.testing.assert_close(scales.double(), want_hi.double(), rtol=1e-5, atol=0)
    los, signs, marks = decode_layout(payload, n, chunk)
    # a lo byte may round the other way where float32 sums meet a half exactly: none here
    assert los == want_los
    assert signs == want_signs
    assert marks == want_marks
    out = torch.empty(n)
    CODEC.unpack(payload, scales, n, chunk, out)
    torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-7)
    # error feedback: what was sent plus the new memory is the input plus the old memory
    total = x.double() + before.double()
    assert (out.double() + error.double() - total).abs().max() < 1e-5 * (1 + total.abs().max())


def test_twenty_times_fewer_bytes_than_float32():
    """512-element chunks: 64 bytes of signs, the lo byte, 31 of rank (log2 C(512, 55) = 247.8
    bits), the float32 scale: 100 bytes for 2048."""
    assert marked(512) == 55 and rank_bytes(512) == 31
    x = torch.randn(512 * 9)
    payload, scales = CODEC.pack(x, torch.zeros_like(x), 512)
    sent = payload.numel() + 4 * scales.numel()
    assert sent == 9 * 100
    assert 4 * x.numel() / sent > 20.4


def test_marking_the_largest_beats_a_level_bit_per_element_on_gradients():
    """On heavy-tailed values (gradients are) the marked ninth takes 1-bit's relative error
    (||y - C(y)|| / ||y||) down to about twobit's, with fewer bits; marking any other 55 (a
    broken selection) could not."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(1 << 16, generator=g) * torch.rand(1 << 16, generator=g).pow(3)
    errors = {}
    for name, codec, chunk in (("topmark", CODEC, 512), ("twobit", TwoBitCodec(), 256),
                               ("onebit", OneBitCodec(), 256)):
        error = torch.zeros_like(x)
        codec.pack(x, error, chunk)
        errors[name] = (error.norm() / x.norm()).item()
    # measured: topmark 0.44, twobit 0.41, onebit 0.69
    assert errors["topmark"] < 0.5 < 0.6 < errors["onebit"], errors
    assert errors["topmark"] < 1.15 * errors["twobit"], errors


def test_mean_of_rows_is_their_row_order_sum_over_w():
    check_mean_of_rows(CODEC)


def test_zero_bytes_after_a_payload_unpack_to_zeros():
    """A trimmed chunk keeps a whole block; the zero blocks after it are rank 0 at scale 0."""
    check_zero_padding(CODEC)


def test_a_rank_past_the_last_subset_is_refused():
    """A peer's payload is checked: a rank >= C(len, k) names no set of positions."""
    x, error = fresh(512, torch.float32, seed=2)
    payload, scales = CODEC.pack(x, error, 512)
    payload[-rank_bytes(512):] = 255
    with pytest.raises(RuntimeError, match="corrupt payload"):
        CODEC.unpack(payload, scales, 512, 512, torch.empty(512))


def test_the_native_ops_pass_opcheck_and_refuse_bad_chunks():
    x, error = fresh(1001, torch.float32, seed=3)
    torch.library.opcheck(torch.ops.ciuicflow.topmark_pack.default, (x, error.clone(), 64))
    payload, scales = ciuicflow.ops.topmark_pack(x, error.clone(), 64)
    torch.library.opcheck(torch.ops.ciuicflow.topmark_unpack_mean_into.default,
                          (payload.view(1, -1), scales.view(1, -1), 1001, 64, torch.empty(1001)))
    for chunk in (0, 4, 12, 520):
        with pytest.raises(RuntimeError, match="multiple of 8"):
            ciuicflow.ops.topmark_pack(x, error.clone(), chunk)
    with pytest.raises(RuntimeError, match="error must be"):
        ciuicflow.ops.topmark_pack(x, torch.zeros(5), 64)


def test_constant_zero_and_non_finite_chunks():
    chunk = 8
    x = torch.tensor([2.0] * 8 + [0.0] * 8 + [1.0, float("nan")] + [1.0] * 6 + [-3.0] * 8)
    error = torch.zeros_like(x)
    payload, scales = CODEC.pack(x, error, chunk)
    out = CODEC.unpack(payload, scales, x.numel(), chunk, torch.empty(x.numel()))
    assert torch.equal(out[:8], x[:8]) and torch.equal(out[8:16], x[8:16])  # exact: one level
    assert torch.equal(out[24:], x[24:])
    assert torch.isnan(scales[2])  # a chunk holding NaN says so (the exchange then goes exact)
    empty, empty_scales = CODEC.pack(torch.ones(0), torch.zeros(0), 8)
    assert empty.numel() == 0 and empty_scales.numel() == 0


@needs_cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [1, 511, 512, 3001, 70000])
@pytest.mark.parametrize("chunk", [8, 256, 512])
def test_the_cuda_kernels_send_the_cpu_kernels_bytes(dtype, n, chunk):
    """The CUDA pack runs the CPU's arithmetic in one thread per chunk: the same payload, scales
    and memory, bit for bit; its unpack the same values; a corrupt rank refused there too."""
    x, error = fresh(n, dtype, seed=n + chunk)
    want_payload, want_scales = CODEC.pack(x, error.clone(), chunk)
    want_error = error.clone()
    CODEC.pack(x, want_error, chunk)
    memory = error.cuda()
    payload, scales = CODEC.pack(x.cuda(), memory, chunk)
    assert payload.is_cuda and scales.is_cuda
    assert torch.equal(payload.cpu(), want_payload) and torch.equal(scales.cpu(), want_scales)
    assert torch.equal(memory.cpu(), want_error)
    rows = torch.stack([payload, payload]), torch.stack([scales, scales])
    out = CODEC.unpack_mean(*rows, n, chunk, torch.empty(n, device="cuda"))
    want = CODEC.unpack_mean(torch.stack([want_payload] * 2), torch.stack([want_scales] * 2), n,
                             chunk, torch.empty(n))
    assert torch.equal(out.cpu(), want)
    bad = payload.clone()
    bad[-rank_bytes(chunk):] = 255
    if math.comb(chunk, marked(chunk)) < 256 ** rank_bytes(chunk):  # room for a bad rank
        with pytest.raises(RuntimeError, match="corrupt payload"):
            CODEC.unpack(bad, scales, n, chunk, torch.empty(n, device="cuda"))
