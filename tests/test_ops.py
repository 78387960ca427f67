"""The native ops against pure-torch references (tests/reference.py), on fresh random inputs."""
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import ciuicflow.ops as ops
from tests import reference as ref
from tests.devices import DEVICES

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
SIZES = [1, 7, 8, 9, 15, 64, 1000, 2047, 2048, 2049, 4099, 65_537, 1 << 20]
CHUNKS = [8, 24, 2048]
POISON_BYTE = 0xA5
POISON_FLOAT = float("nan")



def fresh(n, dtype, device, seed):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=gen) * 3
    return x.to(dtype).to(device), (torch.randn(n, generator=gen) * 0.1).to(device)


def poisoned_like(t):
    """A tensor of t's shape filled with garbage, copied into by the op under test."""
    return torch.full_like(t, POISON_BYTE if t.dtype == torch.uint8 else POISON_FLOAT)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("chunk", CHUNKS)
def test_onebit_pack_matches_reference(device, dtype, n, chunk):
    x, error = fresh(n, dtype, device, seed=n * 31 + chunk)
    want_packed, want_scales, want_error = ref.onebit_pack(x.cpu(), error.cpu(), chunk)
    packed, scales = ops.onebit_pack(x, error, chunk)
    assert packed.dtype == torch.uint8 and packed.shape == (math.ceil(n / 8),)
    assert scales.dtype == torch.float32 and scales.shape == (math.ceil(n / chunk),)
    torch.testing.assert_close(scales.cpu(), want_scales, rtol=2e-6, atol=1e-7)
    # A bit may only differ where y is within rounding of zero.
    y = x.cpu().double() + ref_error_before(x, n, chunk)
    got_bits = ref.onebit_unpack(packed.cpu(), torch.ones_like(scales.cpu()), n, chunk) > 0
    want_bits = ref.onebit_unpack(want_packed, torch.ones_like(want_scales), n, chunk) > 0
    assert torch.all((got_bits == want_bits) | (y.abs() < 1e-6))
    torch.testing.assert_close(error.cpu(), want_error, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [1, 9, 2049, 65_537])
@pytest.mark.parametrize("decay", [1.0, 0.5, 0.3])
def test_onebit_pack_ef_matches_reference(device, dtype, n, decay):
    """pack_ef = onebit_pack of x + float32(decay * error), the new error in error_out (error left
    as it was), and the float64 sums of error_out^2 and x^2."""
    chunk = 24
    x, error = fresh(n, dtype, device, seed=n + int(10 * decay))
    before = error.clone()
    error_out = poisoned_like(error)
    packed, scales, sums = ops.onebit_pack_ef(x, error, decay, error_out, chunk)
    assert torch.equal(error, before)
    decayed = (before.cpu() * decay).float()  # rounded to float32, as the op rounds it
    want_packed, want_scales, want_error = ref.onebit_pack(x.cpu(), decayed, chunk)
    torch.testing.assert_close(scales.cpu(), want_scales, rtol=2e-6, atol=1e-7)
    y = x.cpu().double() + decayed.double()
    got_bits = ref.onebit_unpack(packed.cpu(), torch.ones_like(scales.cpu()), n, chunk) > 0
    want_bits = ref.onebit_unpack(want_packed, torch.ones_like(want_scales), n, chunk) > 0
    assert torch.all((got_bits == want_bits) | (y.abs() < 1e-6))
    torch.testing.assert_close(error_out.cpu(), want_error, rtol=1e-5, atol=1e-5)
    assert sums.dtype == torch.float64 and sums.shape == (2,) and sums.device == x.device
    # sum error^2 is sum y^2 - n scale^2 (float32 squares): exact to a float32 rounding of sum y^2
    y_squares = y.square().sum().item()
    assert abs(sums[0].item() - error_out.cpu().double().square().sum().item()) \
        <= 1e-5 * y_squares + 1e-12
    assert sums[0].item() >= 0
    torch.testing.assert_close(sums[1].cpu(), x.cpu().double().square().sum(), rtol=1e-5, atol=0)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_onebit_pack_ef_in_place_with_decay_one_is_onebit_pack(device, dtype):
    """error_out may be error itself; with decay 1 the bits, scales and error are onebit_pack's."""
    n, chunk = 65_537, 256
    x, error = fresh(n, dtype, device, seed=3)
    mine = error.clone()
    packed, scales = ops.onebit_pack(x, error, chunk)
    packed_ef, scales_ef, _ = ops.onebit_pack_ef(x, mine, 1.0, mine, chunk)
    assert torch.equal(packed, packed_ef) and torch.equal(scales, scales_ef)
    assert torch.equal(error, mine)


def test_onebit_pack_ef_checks_its_error_buffers():
    x = torch.randn(16)
    with pytest.raises(RuntimeError, match="error has 15 elements"):
        ops.onebit_pack_ef(x, torch.zeros(15), 1.0, torch.zeros(16), 8)
    with pytest.raises(RuntimeError, match="error must be a contiguous float32"):
        ops.onebit_pack_ef(x, torch.zeros(16, dtype=torch.float64), 1.0, torch.zeros(16), 8)
    with pytest.raises(RuntimeError, match="error must be float32"):
        ops.onebit_pack_ef(x, torch.zeros(16), 1.0, torch.zeros(16, dtype=torch.float64), 8)
    with pytest.raises(RuntimeError, match="must not share memory"):
        ops.onebit_pack_ef(x, torch.zeros(16), 1.0, x, 8)  # x would be overwritten as it is read
    with pytest.raises(RuntimeError, match="must not share memory"):
        ops.onebit_pack(x, x, 8)
    buffer = torch.zeros(24)
    with pytest.raises(RuntimeError, match="one tensor or not share memory"):
        ops.onebit_pack_ef(x, buffer[:16], 1.0, buffer[8:], 8)
    ops.onebit_pack_ef(x, buffer[:16], 1.0, buffer[:16], 8)  # one tensor: in place
    ops.onebit_pack(torch.empty(0), torch.empty(0), 8)  # empty tensors share nothing


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("chunk", [8, 24, 256])
def test_onebit_chunk_energy_matches_reference(n, chunk):
    """Per chunk (sum y^2, max y^2) of y = the decoded pack + its new error, against float64 (the
    outlier gate's measure; CPU only). Spikes make the maxima differ from chunk to chunk."""
    x, error = fresh(n, torch.float32, "cpu", seed=n * 7 + chunk)
    x[::97] *= 50
    packed, scales = ops.onebit_pack(x, error, chunk)
    y = ref.onebit_unpack(packed, scales, n, chunk) + error.double()
    nchunks = -(-n // chunk)
    padded = torch.zeros(nchunks * chunk, dtype=torch.float64)
    padded[:n] = y.square()
    want = torch.stack([padded.view(nchunks, chunk).sum(1), padded.view(nchunks, chunk).amax(1)], 1)
    got = ops.onebit_chunk_energy(packed, scales, error, chunk)
    assert got.dtype == torch.float32 and got.shape == (nchunks, 2)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-30)


def test_onebit_chunk_energy_checks_its_arguments():
    packed, scales = ops.onebit_pack(torch.randn(20), torch.zeros(20), 8)
    with pytest.raises(RuntimeError, match="error must be a 1-D float32"):
        ops.onebit_chunk_energy(packed, scales, torch.zeros(20, dtype=torch.float64), 8)
    with pytest.raises(RuntimeError, match="packed has 3 bytes per vector, numel 30 needs 4"):
        ops.onebit_chunk_energy(packed, scales, torch.zeros(30), 8)
    with pytest.raises(RuntimeError, match="chunk_size must be a positive multiple of 8"):
        ops.onebit_chunk_energy(packed, scales, torch.zeros(20), 12)
    assert ops.onebit_chunk_energy(packed[:0], scales[:0], torch.zeros(0), 8).shape == (0, 2)


def test_onebit_chunk_energy_opcheck():
    """Its schema, fake kernel and autograd registration agree (it traces under torch.compile)."""
    x, error = fresh(1001, torch.float32, "cpu", seed=5)
    packed, scales = ops.onebit_pack(x, error, 24)
    torch.library.opcheck(torch.ops.ciuicflow.onebit_chunk_energy, (packed, scales, error, 24))


NODE_SUM_SIZES = [1, 7, 8, 9, 31, 1000, 65537, 200_003]  # the last two span several threads' ranges


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("terms", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("n", NODE_SUM_SIZES)
def test_node_sum_into_is_torchs_sum_bit_for_bit(dtype, terms, n):
    """The intra-node step's sum: (t0 + t1 + ...) / divisor in list order, the same bits as torch's
    add, add_, div_ (which the ranks rely on to hold identical means), and within a rounding per
    step of the float64 sum."""
    from ciuicflow.collectives.node_shm import _sum_into_torch

    gen = torch.Generator().manual_seed(n * 11 + terms)
    inputs = [(torch.randn(n, generator=gen) * 10 ** torch.randint(-3, 4, (n,), generator=gen))
              .to(dtype) for _ in range(terms)]
    for divisor in (1.0, 2.0, 3.0):
        out = torch.full((n,), float("nan"), dtype=dtype)
        flag = ops.node_sum_into(inputs, divisor, out)
        want = torch.empty(n, dtype=dtype)
        want_flag = _sum_into_torch(inputs, divisor, want)
        assert torch.equal(out, want), (dtype, terms, n, divisor)
        assert flag.dtype == torch.float32 and flag.shape == (1,) and float(flag) == 0.0
        assert float(want_flag) == 0.0
        exact = torch.stack([t.double() for t in inputs]).sum(0) / divisor
        steps = terms + (divisor != 1)
        eps = torch.finfo(dtype).eps
        assert ((out.double() - exact).abs()
                <= steps * eps * torch.stack([t.double().abs() for t in inputs]).sum(0)
                / divisor + steps * torch.finfo(dtype).tiny).all()  # subnormals: absolute


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
def test_node_sum_into_flags_a_non_finite_anywhere(dtype, bad):
    """Every position, lane tails and the last element included, in any term; and finite
    inputs whose sum overflows (compressing that would not survive either)."""
    n = 70_001
    for terms in (1, 2, 3, 4, 5):  # each count has a loop of its own
        for position in (0, 5, 7, 8, 65535, 65536, n - 1):
            for which in {0, terms - 1}:
                inputs = [torch.randn(n).to(dtype) for _ in range(terms)]
                inputs[which][position] = bad
                out = torch.empty(n, dtype=dtype)
                flag = ops.node_sum_into(inputs, 3.0, out)
                assert float(flag) == 1.0, (terms, position, which)
                assert not torch.isfinite(out[position])
    big = torch.finfo(dtype).max
    inputs = [torch.full((10,), big, dtype=dtype), torch.full((10,), big, dtype=dtype)]
    assert float(ops.node_sum_into(inputs, 2.0, torch.empty(10, dtype=dtype))) == 1.0


def test_node_sum_into_checks_its_arguments():
    out = torch.empty(8)
    with pytest.raises(RuntimeError, match="needs at least one term"):
        ops.node_sum_into([], 1.0, out)
    with pytest.raises(RuntimeError, match="term 1 must be a contiguous 1-D tensor of 8"):
        ops.node_sum_into([torch.ones(8), torch.ones(9)], 1.0, out)
    with pytest.raises(RuntimeError, match="term 1 must be a contiguous"):
        ops.node_sum_into([torch.ones(8), torch.ones(16)[::2]], 1.0, out)
    with pytest.raises(RuntimeError, match="term 0 is BFloat16, out is Float"):
        ops.node_sum_into([torch.ones(8, dtype=torch.bfloat16)], 1.0, out)
    with pytest.raises(RuntimeError, match="out must be float32, float16 or bfloat16"):
        ops.node_sum_into([torch.ones(8, dtype=torch.float64)], 1.0, out.double())
    with pytest.raises(RuntimeError, match="divisor must be positive"):
        ops.node_sum_into([torch.ones(8)], 0.0, out)
    with pytest.raises(RuntimeError, match="divisor must be positive"):
        ops.node_sum_into([torch.ones(8)], float("inf"), out)
    assert float(ops.node_sum_into([torch.ones(0)], 1.0, torch.empty(0))) == 0.0


def test_node_sum_into_opcheck():
    """Its schema, fake kernel and autograd registration agree."""
    terms = [torch.randn(1001) for _ in range(3)]
    torch.library.opcheck(torch.ops.ciuicflow.node_sum_into, (terms, 3.0, torch.empty(1001)))


def ref_error_before(x, n, chunk):
    # fresh() is deterministic, so the error the op saw can be regenerated.
    return fresh(n, x.dtype, "cpu", seed=n * 31 + chunk)[1].double()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("n", SIZES)
def test_onebit_unpack_matches_reference(device, n):
    chunk = 24
    gen = torch.Generator().manual_seed(n)
    packed = torch.randint(0, 256, (math.ceil(n / 8),), dtype=torch.uint8, generator=gen)
    scales = torch.rand(math.ceil(n / chunk), generator=gen) + 0.1
    out = ops.onebit_unpack(packed.to(device), scales.to(device), n, chunk)
    torch.testing.assert_close(out.cpu(), ref.onebit_unpack(packed, scales, n, chunk).float())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("world", [1, 2, 3, 8])
@pytest.mark.parametrize("n", [1, 9, 2049, 65_537])
def test_onebit_unpack_mean_matches_reference(device, world, n):
    chunk = 2048
    gen = torch.Generator().manual_seed(world * 1000 + n)
    packed = torch.randint(0, 256, (world, math.ceil(n / 8)), dtype=torch.uint8, generator=gen)
    scales = torch.rand(world, math.ceil(n / chunk), generator=gen)
    out = ops.onebit_unpack_mean(packed.to(device), scales.to(device), n, chunk)
    want = ref.onebit_unpack_mean(packed, scales, n, chunk)
    torch.testing.assert_close(out.cpu(), want.float(), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("n", [1, 9, 255, 257, 2049, 65_537])
@pytest.mark.parametrize("chunk", [8, 24, 256])
def test_onebit_unpack_mean_reads_rows_apart_and_signs_in_blocks(world, n, chunk):
    """What the exchange hands the unpack without copying it: rows of a larger buffer, and the
    outlier codec's blocks (signs at each block's start, other bytes after them): the same bits
    as contiguous rows, whatever the other bytes hold."""
    gen = torch.Generator().manual_seed(world * 7919 + n + chunk)
    nchunks, sign_bytes, extra = math.ceil(n / chunk), chunk // 8, 12
    blocks = torch.randint(0, 256, (world, nchunks, sign_bytes + extra), dtype=torch.uint8,
                           generator=gen)
    scales = torch.rand(world, nchunks, generator=gen) + 0.1
    packed = blocks[:, :, :sign_bytes].reshape(world, -1)[:, :math.ceil(n / 8)].contiguous()
    want = ref.onebit_unpack_mean(packed, scales, n, chunk).float()
    got = ops.onebit_unpack_mean(blocks[:, :, :sign_bytes], scales, n, chunk)
    assert torch.equal(got, ops.onebit_unpack_mean(packed, scales, n, chunk))
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    wide = torch.randint(0, 256, (world, packed.shape[1] + 37), dtype=torch.uint8, generator=gen)
    wide[:, 5:5 + packed.shape[1]] = packed
    apart = wide[:, 5:5 + packed.shape[1]]
    assert world == 1 or not apart.is_contiguous()
    assert torch.equal(ops.onebit_unpack_mean(apart, scales, n, chunk), got)


def test_onebit_unpack_mean_checks_its_blocks():
    blocks = torch.zeros(2, 3, 4, dtype=torch.uint8)
    scales = torch.ones(2, 3)
    ops.onebit_unpack_mean(blocks, scales, 20, 8)  # three chunks of 8, the last one partial
    with pytest.raises(RuntimeError, match="needs 2 blocks and scales, got 3 and 3"):
        ops.onebit_unpack_mean(blocks, scales, 16, 8)
    with pytest.raises(RuntimeError, match="blocks of 4 bytes cannot hold 5 bytes"):
        ops.onebit_unpack_mean(torch.zeros(2, 1, 4, dtype=torch.uint8), torch.ones(2, 1), 40, 40)
    with pytest.raises(RuntimeError, match="blocks have 2 vectors, scales 1"):
        ops.onebit_unpack_mean(blocks, scales[:1], 20, 8)
    with pytest.raises(RuntimeError, match="blocks must be uint8"):
        ops.onebit_unpack_mean(blocks.float(), scales, 20, 8)


@pytest.mark.parametrize("device", DEVICES)
def test_out_variants_overwrite_poisoned_buffers(device):
    n, chunk, world = 4099, 24, 3
    gen = torch.Generator().manual_seed(7)
    packed = torch.randint(0, 256, (world, math.ceil(n / 8)), dtype=torch.uint8, generator=gen)
    scales = torch.rand(world, math.ceil(n / chunk), generator=gen)
    out = poisoned_like(torch.empty(n)).to(device)
    got = ops.onebit_unpack(packed[0].to(device), scales[0].to(device), n, chunk, out=out)
    assert got.data_ptr() == out.data_ptr()
    torch.testing.assert_close(out.cpu(), ref.onebit_unpack(packed[0], scales[0], n, chunk).float())
    out = poisoned_like(torch.empty(n)).to(device)
    ops.onebit_unpack_mean(packed.to(device), scales.to(device), n, chunk, out=out)
    want = ref.onebit_unpack_mean(packed, scales, n, chunk).float()
    torch.testing.assert_close(out.cpu(), want, rtol=1e-6, atol=1e-6)
    with pytest.raises(RuntimeError, match="out must be"):
        ops.onebit_unpack(packed[0], scales[0], n, chunk, out=torch.empty(n - 1))


@pytest.mark.parametrize("chunk", [24, 2048])
@pytest.mark.parametrize("offset", [0, 1])
def test_large_unpack_into_aligned_and_misaligned_buffers(chunk, offset):
    """Outputs of 8 MiB and more take the streaming-store path, which needs 16-byte alignment: an
    aligned buffer streams, one offset by a float falls back to normal stores. Both must be exact."""
    n = (8 << 20) // 4 + 13
    gen = torch.Generator().manual_seed(chunk + offset)
    packed = torch.randint(0, 256, (math.ceil(n / 8),), dtype=torch.uint8, generator=gen)
    scales = torch.rand(math.ceil(n / chunk), generator=gen) + 0.1
    buffer = poisoned_like(torch.empty(n + 1))
    out = buffer[offset:offset + n]
    ops.onebit_unpack(packed, scales, n, chunk, out=out)
    torch.testing.assert_close(out, ref.onebit_unpack(packed, scales, n, chunk).float())
    if offset == 0:
        assert math.isnan(buffer[n])  # nothing written past the end


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("offset", [0, 1])
def test_large_unpack_mean_is_the_rank_order_sum(world, offset):
    """unpack_mean's large outputs stream too (aligned ones): the bits must be those of summing
    the rows' unpacked values in rank order in float32 and scaling once, which every rank of an
    exchange computes alike; the tail past the last multiple of 8 takes the generic loop."""
    n, chunk = (8 << 20) // 4 + 13, 24
    gen = torch.Generator().manual_seed(world + offset)
    packed = torch.randint(0, 256, (world, math.ceil(n / 8)), dtype=torch.uint8, generator=gen)
    scales = torch.rand(world, math.ceil(n / chunk), generator=gen) + 0.1
    buffer = poisoned_like(torch.empty(n + 1))
    out = buffer[offset:offset + n]
    ops.onebit_unpack_mean(packed, scales, n, chunk, out=out)
    want = ops.onebit_unpack(packed[0], scales[0], n, chunk)
    for w in range(1, world):
        want += ops.onebit_unpack(packed[w], scales[w], n, chunk)
    want *= 1.0 / world
    assert torch.equal(out, want)
    torch.testing.assert_close(out, ref.onebit_unpack_mean(packed, scales, n, chunk).float())
    if offset == 0:
        assert math.isnan(buffer[n])


@pytest.mark.parametrize("device", DEVICES)
def test_pack_unpack_outputs_are_fully_written(device):
    """Output buffers start from a garbage-filled allocator state: every byte must be written."""
    n, chunk = 4099, 24
    for _ in range(3):  # fill the allocator's free blocks with poison
        poisoned_like(torch.empty(n, device=device)).sum()
    x, error = fresh(n, torch.float32, device, seed=1)
    packed, scales = ops.onebit_pack(x, error.clone(), chunk)
    assert torch.isfinite(scales).all()
    out = ops.onebit_unpack(packed, scales, n, chunk)
    assert torch.isfinite(out).all() and out.abs().min() > 0


@pytest.mark.parametrize("device", DEVICES)
def test_tail_bits_beyond_numel_are_zero(device):
    packed, _ = ops.onebit_pack(torch.ones(9, device=device), torch.zeros(9, device=device), 8)
    assert packed.tolist() == [0xFF, 0x01]


@pytest.mark.parametrize("device", DEVICES)
def test_zero_and_negative_zero_count_as_positive(device):
    x = torch.tensor([0.0, -0.0, -1.0, 1.0, -0.0, 0.0, -2.0, 3.0], device=device)
    packed, scales = ops.onebit_pack(x, torch.zeros(8, device=device), 8)
    assert packed.item() == 0b10111011
    assert scales.item() == pytest.approx(7.0 / 8)


@pytest.mark.parametrize("device", DEVICES)
def test_all_zero_input_round_trips_to_zero(device):
    x = torch.zeros(100, device=device)
    error = torch.zeros(100, device=device)
    packed, scales = ops.onebit_pack(x, error, 16)
    assert torch.all(scales == 0) and torch.all(error == 0)
    assert torch.all(ops.onebit_unpack(packed, scales, 100, 16) == 0)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("device", DEVICES)
def test_non_finite_input_poisons_only_its_chunk(device, bad):
    x = torch.randn(64, device=device)
    x[20] = bad
    error = torch.zeros(64, device=device)
    packed, scales = ops.onebit_pack(x, error, 16)
    assert not torch.isfinite(scales[1])
    assert torch.isfinite(scales[[0, 2, 3]]).all()
    assert torch.isfinite(error[:16]).all() and torch.isfinite(error[32:]).all()
    out = ops.onebit_unpack(packed, scales, 64, 16)
    assert not torch.isfinite(out[16:32]).any()


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda: ops.onebit_pack(torch.randn(10), torch.zeros(10), 12), "multiple of 8"),
        (lambda: ops.onebit_pack(torch.randn(10), torch.zeros(9), 8), "error has 9"),
        (lambda: ops.onebit_pack(torch.randn(10), torch.zeros(10).double(), 8), "float32"),
        (lambda: ops.onebit_pack(torch.randn(2, 5), torch.zeros(10), 8), "1-D"),
        (lambda: ops.onebit_pack(torch.randn(10).double(), torch.zeros(10), 8), "float32, float16"),
        (lambda: ops.onebit_unpack(torch.zeros(2, dtype=torch.uint8), torch.ones(1), 17, 8), "needs 3"),
        (lambda: ops.onebit_unpack(torch.zeros(2, dtype=torch.uint8), torch.ones(1), 16, 8), "needs 2"),
        (lambda: ops.onebit_unpack_mean(torch.zeros(2, dtype=torch.uint8), torch.ones(1), 16, 16), "2-D"),
        (lambda: ops.orthogonalize_(torch.randn(3)), r"\[n, r\]"),
    ],
)
def test_bad_arguments_raise_clear_errors(call, message):
    with pytest.raises(RuntimeError, match=message):
        call()


@pytest.mark.parametrize("device", DEVICES)
@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(1, 5000),
    chunk=st.sampled_from([8, 16, 64, 2048]),
    steps=st.integers(1, 4),
    seed=st.integers(0, 2**31 - 1),
)
def test_error_feedback_invariant(device, n, chunk, steps, seed):
    """Over several steps, what was sent plus what is still in the error buffer equals the sum of
    the inputs: error feedback loses nothing."""
    gen = torch.Generator().manual_seed(seed)
    error = torch.zeros(n, device=device)
    sent = torch.zeros(n, dtype=torch.float64, device=device)
    total = torch.zeros(n, dtype=torch.float64, device=device)
    for _ in range(steps):
        x = torch.randn(n, generator=gen).to(device)
        error_before = error.clone()
        packed, scales = ops.onebit_pack(x, error, chunk)
        out = ops.onebit_unpack(packed, scales, n, chunk)
        torch.testing.assert_close(out + error, x + error_before, rtol=1e-5, atol=1e-5)
        sent += out.double()
        total += x.double()
    torch.testing.assert_close(sent + error.double(), total, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("device", DEVICES)
@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 3000), chunk=st.sampled_from([8, 40, 2048]), seed=st.integers(0, 2**31 - 1))
def test_round_trip_of_a_sign_vector_is_exact_to_rounding(device, n, chunk, seed):
    """Packing a vector that is already +-scale per chunk leaves no error and round-trips exactly."""
    gen = torch.Generator().manual_seed(seed)
    signs = torch.randint(0, 2, (n,), generator=gen).float() * 2 - 1
    scale = (torch.rand(-(-n // chunk), generator=gen) + 0.5).repeat_interleave(chunk)[:n]
    x = (signs * scale).to(device)
    error = torch.zeros(n, device=device)
    packed, scales = ops.onebit_pack(x, error, chunk)
    torch.testing.assert_close(ops.onebit_unpack(packed, scales, n, chunk), x, rtol=1e-5, atol=0)
    assert error.abs().max() <= 1e-5 * x.abs().max()  # the mean of |x| is rounded in float32


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
# (70000, 4), (2, 40000, 3), (1, 300000, 2): tall enough for the CUDA kernel's several blocks per
# matrix (every 16384 rows one more); the rest take one block per matrix
@pytest.mark.parametrize("shape", [(1, 1), (7, 1), (33, 4), (1000, 7), (3, 17, 5), (2, 4097, 2), (5, 5),
                                   (70000, 4), (2, 40000, 3), (1, 300000, 2)])
def test_orthogonalize_matches_reference(device, dtype, shape):
    gen = torch.Generator().manual_seed(sum(shape))
    m = torch.randn(shape, generator=gen).to(dtype)
    want = ref.orthogonalize(m)
    got = ops.orthogonalize_(m.to(device))
    assert got.dtype == dtype and got.shape == shape
    tol = {torch.float32: 1e-4, torch.float16: 2e-3, torch.bfloat16: 1e-2}[dtype]
    torch.testing.assert_close(got.cpu().double(), want, rtol=tol, atol=tol)
    if shape[-2] >= shape[-1]:  # tall: the columns are orthonormal
        q = got.cpu().double()
        eye = torch.eye(shape[-1], dtype=torch.float64).expand(q.shape[:-2] + (shape[-1], shape[-1]))
        torch.testing.assert_close(q.transpose(-1, -2) @ q, eye, rtol=0, atol=tol * 10)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("rows", [10, 50_000])
def test_orthogonalize_keeps_zero_columns_zero_and_honours_eps(device, rows):
    m = torch.randn(rows, 3, device=device)
    m[:, 1] = 0
    ops.orthogonalize_(m)
    assert torch.all(m[:, 1] == 0) and torch.isfinite(m).all()
    col = torch.full((rows, 1), 2.0, device=device)  # norm 2 sqrt(rows)
    ops.orthogonalize_(col, eps=1.0)
    torch.testing.assert_close(col, torch.full((rows, 1), 2.0 / (2 * math.sqrt(rows) + 1), device=device))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("rows", [8, 50_000])
def test_orthogonalize_non_finite_does_not_crash(device, rows):
    m = torch.randn(rows, 3, device=device)
    m[0, 1] = float("inf")
    ops.orthogonalize_(m)
    assert torch.isfinite(m[:, 0]).all() and torch.isnan(m[:, 2]).all()


@pytest.mark.parametrize("device", DEVICES)
def test_orthogonalize_non_contiguous_view_in_place(device):
    base = torch.randn(4, 20)
    want = ref.orthogonalize(base.t())
    base = base.to(device)
    view = base.t()  # [20, 4], not contiguous
    ops.orthogonalize_(view)
    torch.testing.assert_close(base.t().cpu().double(), want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck(device):
    x, error = fresh(1000, torch.float32, device, seed=3)
    torch.library.opcheck(torch.ops.ciuicflow.onebit_pack.default, (x, error, 16))
    torch.library.opcheck(torch.ops.ciuicflow.onebit_pack_ef.default,
                          (x, error, 0.5, torch.empty_like(error), 16))
    packed, scales = ops.onebit_pack(x, error.clone(), 16)
    torch.library.opcheck(torch.ops.ciuicflow.onebit_unpack.default, (packed, scales, 1000, 16))
    torch.library.opcheck(
        torch.ops.ciuicflow.onebit_unpack_mean.default,
        (torch.stack([packed, packed]), torch.stack([scales, scales * 2]), 1000, 16),
    )
    torch.library.opcheck(
        torch.ops.ciuicflow.onebit_unpack_into.default, (packed, scales, 1000, 16, torch.empty(1000, device=device))
    )
    torch.library.opcheck(torch.ops.ciuicflow.orthogonalize_.default,
                          (torch.randn(30, 4, device=device), 0.0))


@pytest.mark.parametrize("device", DEVICES)
def test_ops_trace_under_torch_compile(device):
    @torch.compile(backend="aot_eager", fullgraph=True)
    def roundtrip(x, error):
        packed, scales = ops.onebit_pack(x, error, 64)
        return ops.onebit_unpack(packed, scales, x.numel(), 64)

    x, error = fresh(1000, torch.float32, device, seed=4)
    eager_error = error.clone()
    want = ops.onebit_unpack(*ops.onebit_pack(x, eager_error, 64), 1000, 64)
    torch.testing.assert_close(roundtrip(x, error), want)
    torch.testing.assert_close(error, eager_error)
