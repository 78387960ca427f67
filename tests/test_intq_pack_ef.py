"""ops.int8_pack_ef / ops.int4_pack_ef (CPU): the error feedback, the optimizer's units and the
guard's sums in one pass. Bit for bit the torch ops they replace (Codec.pack_ef's: divide by the
units, decay the memory, pack, multiply back), with the sums against float64; every dtype, odd
sizes and chunks, decays 1 and 0.5, in place and apart, non-finite chunks; clear refusals."""
import math

import pytest
import torch

import ciuicflow.ops as ops
from ciuicflow.compression.codec import Codec
from ciuicflow.compression.int4 import Int4Codec
from ciuicflow.compression.int8 import Int8Codec
from tests.int8_reference import DTYPES, fresh

FAMILIES = {"int8": Int8Codec(), "int4": Int4Codec()}
SIZES = [1, 7, 255, 256, 257, 1000, 65_537]
CHUNKS = [2, 8, 256, 1000]


def _units(n, seed):
    gen = torch.Generator().manual_seed(seed)
    return torch.rand(n, generator=gen).pow(3) * 10 + 1e-3


def torch_path(codec, x, error, decay, chunk, units):
    """What the codec did before the native pass: ``Codec.pack_ef`` in torch ops."""
    error_out = torch.empty_like(error)
    payload, scales, sums = Codec.pack_ef(codec, x, error.clone(), decay, error_out, chunk,
                                          units=units)
    return payload, scales, sums, error_out


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("chunk", CHUNKS)
@pytest.mark.parametrize("with_units", [False, True])
@pytest.mark.parametrize("decay", [1.0, 0.5])
def test_one_pass_is_the_torch_ops_bit_for_bit(family, dtype, n, chunk, with_units, decay):
    codec = FAMILIES[family]
    x, error = fresh(n, dtype, "cpu", seed=n * 13 + chunk)
    units = _units(n, n + chunk) if with_units else None
    want_payload, want_scales, want_sums, want_error = torch_path(codec, x, error, decay, chunk,
                                                                  units)
    error_out = torch.full_like(error, float("nan"))
    before = error.clone()
    pack_ef = getattr(ops, f"{family}_pack_ef")
    values, scales, sums = pack_ef(x, error, decay, error_out, chunk, units)
    assert torch.equal(error, before)                       # read, not written
    assert torch.equal(values.view(torch.uint8), want_payload)
    assert torch.equal(scales, want_scales)
    assert torch.equal(error_out, want_error)
    # the guard's sums: float64 sums of the new error in the units and of x in the units
    u = torch.ones(n, dtype=torch.float64) if units is None else units.double()
    e2 = (want_error.double() / u).square().sum() if units is not None else \
        want_error.double().square().sum()
    xu = x.float() / units if units is not None else x.float()
    x2 = xu.double().square().sum()
    assert sums.dtype == torch.float64 and sums.shape == (2,)
    assert sums[0].item() == pytest.approx(e2.item(), rel=1e-5, abs=1e-12)
    assert sums[1].item() == pytest.approx(x2.item(), rel=1e-5)
    # the codec's own pack_ef (the native pass on CPU) agrees with it
    again = torch.empty_like(error)
    payload, c_scales, c_sums = codec.pack_ef(x, error, decay, again, chunk, units=units)
    assert torch.equal(payload, want_payload) and torch.equal(again, want_error)
    assert torch.equal(c_sums, sums)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_in_place_memory_and_error_feedback_in_the_units(family):
    """error_out may be error; in the units, what was sent plus the new memory is x plus the
    decayed old memory, each element to within half a step of its chunk's scale in the units."""
    n, chunk = 5000, 256
    x, error = fresh(n, torch.float32, "cpu", seed=3)
    units = _units(n, 4)
    want = torch_path(FAMILIES[family], x, error, 1.0, chunk, units)
    memory = error.clone()
    values, scales, _ = getattr(ops, f"{family}_pack_ef")(x, memory, 1.0, memory, chunk, units)
    assert torch.equal(memory, want[3])
    sent = getattr(ops, f"{family}_unpack")(values, scales, n, chunk).double()
    in_units = x.double() / units.double() + error.double() / units.double()
    residual = memory.double() / units.double()
    # float32 rounding of values up to ~1e4 in these units (some units are ~1e-3)
    assert (sent + residual - in_units).abs().max() < 1e-6 * in_units.abs().max()
    step = scales.double().repeat_interleave(chunk)[:n]
    assert torch.all(residual.abs() <= step / 2 * (1 + 1e-4) + 1e-12)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_non_finite_chunks_stay_non_finite_and_alone(family):
    x, error = torch.randn(24), torch.zeros(24)
    x[3], x[13] = float("inf"), float("nan")
    units = torch.full((24,), 2.0)
    error_out = torch.empty(24)
    _, scales, _ = getattr(ops, f"{family}_pack_ef")(x, error, 1.0, error_out, 8, units)
    assert math.isinf(scales[0]) and math.isnan(scales[1]) and math.isfinite(scales[2])
    assert not torch.isfinite(error_out[:16]).any() and torch.isfinite(error_out[16:]).all()


def test_bad_arguments_are_refused():
    x, error = torch.randn(10), torch.zeros(10)
    with pytest.raises(RuntimeError, match="error_out must be a contiguous float32"):
        ops.int4_pack_ef(x, error, 1.0, torch.zeros(9), 4)
    with pytest.raises(RuntimeError, match="units must be a contiguous float32"):
        ops.int8_pack_ef(x, error, 1.0, torch.zeros(10), 4, torch.ones(10, dtype=torch.float64))
    with pytest.raises(RuntimeError, match="units must be a contiguous float32"):
        ops.int8_pack_ef(x, error, 1.0, torch.zeros(10), 4, torch.ones(9))
    shared = torch.zeros(12)
    with pytest.raises(RuntimeError, match="one tensor or not overlap"):
        ops.int8_pack_ef(x, shared[:10], 1.0, shared[2:], 4)
    with pytest.raises(RuntimeError, match="chunk_size must be a multiple of 2"):
        ops.int4_pack_ef(x, error, 1.0, torch.zeros(10), 3)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_opcheck(family):
    op = getattr(torch.ops.ciuicflow, f"{family}_pack_ef").default
    x, error = torch.randn(1001), torch.randn(1001) * 0.01
    torch.library.opcheck(op, (x, error, 0.5, torch.empty(1001), 16, None))
    torch.library.opcheck(op, (x, error, 1.0, torch.empty(1001), 16, _units(1001, 1)))
