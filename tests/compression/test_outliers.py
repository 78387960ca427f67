"""The 1-bit codec with values in concentrated windows (compression.outliers) against a float64
reference written from its rule, on fresh random inputs, odd sizes and every input dtype; and on
real gloo processes, flat `onebit` through it (its error-feedback invariant)."""
import pytest
import torch

from ciuicflow.compression import outliers
from ciuicflow.compression.outliers import OneBitOutlierCodec
from tests.dist_utils import run_distributed

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def reference(y, chunk, k):
    """(decoded, hot chunks) of y (float64) by the rule, loop by loop: windows of 64 chunks, the
    last one with any short rest; in a window whose largest 1% of y^2 holds > 0.4 of its energy,
    each chunk sends its k largest |y| (bfloat16) and the mean |y| of the rest as its scale."""
    n = y.numel()
    nchunks = -(-n // chunk)
    windows = max(1, nchunks // 64)
    decoded = torch.zeros(n, dtype=torch.float64)
    hot = torch.zeros(nchunks, dtype=torch.bool)
    for w in range(windows):
        first, end = w * 64, (nchunks if w == windows - 1 else (w + 1) * 64)
        energy = y[first * chunk:min(end * chunk, n)].square()
        top = max(1, int(energy.numel() * 0.01))
        hot[first:end] = energy.sort(descending=True).values[:top].sum() > 0.4 * energy.sum()
    for c in range(nchunks):
        part = y[c * chunk:min((c + 1) * chunk, n)]
        out = torch.empty_like(part)
        if hot[c]:
            picked = part.abs().argsort(descending=True)[:k]
            rest = torch.ones(part.numel(), dtype=torch.bool)
            rest[picked] = False
            scale = part[rest].abs().mean() if rest.any() else torch.tensor(0.0, dtype=torch.float64)
            out = torch.where(part >= 0, scale, -scale)
            out[picked] = part[picked].to(torch.bfloat16).double()
        else:
            scale = part.abs().mean()
            out = torch.where(part >= 0, scale, -scale)
        decoded[c * chunk:c * chunk + part.numel()] = out
    return decoded, hot


def spiky(n, seed, concentrated_windows, chunk):
    """Gaussian values; the chunks of the windows listed get a few large spikes (clearly
    concentrated: far from the threshold either way)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=gen)
    for w in concentrated_windows:
        lo, hi = w * 64 * chunk, min((w + 1) * 64 * chunk, n)
        x[lo:hi:97] *= 40
    return x


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n, chunk, windows", [
    (1, 8, [0]), (7, 8, [0]), (300, 64, [0]), (300, 64, []), (64 * 256 + 5, 256, [0]),
    (3 * 64 * 256 + 1000, 256, [1]), (3 * 64 * 256 + 1000, 256, [2]), (5 * 64 * 24 + 7, 24, [0, 3]),
])
@pytest.mark.parametrize("decay", [1.0, 0.5])
def test_pack_and_unpack_match_the_rule(dtype, n, chunk, windows, decay):
    codec = OneBitOutlierCodec(4)
    x = spiky(n, n + chunk, windows, chunk).to(dtype)
    error = torch.randn(n, generator=torch.Generator().manual_seed(n)) * 0.1
    before = error.clone()
    error_out = torch.empty(n)
    payload, scales, sums = codec.pack_ef(x, error, decay, error_out, chunk)
    assert torch.equal(error, before)  # the memory is read, the new one written elsewhere
    y = x.float() + (before * decay)  # as the native pack rounds it
    want, hot = reference(y.double(), chunk, 4)
    assert torch.equal(torch.signbit(scales), hot)  # the marker
    # the signs of every chunk, then 12 bytes (4 values, 4 positions) per chunk that sends values
    assert codec.payload_bytes(n, chunk) == -(-n // chunk) * chunk // 8
    assert payload.dtype == torch.uint8
    assert payload.numel() == codec.payload_bytes(n, chunk) + 12 * int(hot.sum())
    out = codec.unpack(payload, scales, n, chunk, torch.full((n,), float("nan")))
    assert torch.allclose(out.double(), want, rtol=1e-5, atol=1e-5)
    # what was not sent is the memory, and the guard's sums say so
    assert torch.allclose(error_out.double(), y.double() - out.double(), atol=1e-5)
    assert sums[0].item() == pytest.approx(error_out.double().square().sum().item(), rel=1e-5)
    assert sums[1].item() == pytest.approx(x.double().square().sum().item(), rel=1e-5)


def test_the_memory_may_be_the_error_it_is_computed_from():
    codec, n, chunk = OneBitOutlierCodec(4), 2 * 64 * 256 + 300, 256
    x = spiky(n, 1, [0, 1], chunk)
    error = torch.randn(n) * 0.1
    y = x + error * 0.5
    payload, scales, _ = codec.pack_ef(x, error, 0.5, error, chunk)  # in place, as the server's
    out = codec.unpack(payload, scales, n, chunk, torch.empty(n))
    assert torch.signbit(scales).all()
    assert torch.allclose(out.double(), reference(y.double(), chunk, 4)[0], rtol=1e-5, atol=1e-5)
    assert torch.allclose(error, y - out, atol=1e-5)


@pytest.mark.parametrize("rows", [1, 2, 3, 5])
@pytest.mark.parametrize("n, chunk", [(9, 8), (1000, 64), (2 * 64 * 256 + 77, 256)])
def test_unpack_mean_is_the_mean_of_the_rows_and_the_same_every_time(rows, n, chunk):
    codec = OneBitOutlierCodec(4)
    payloads, scales = [], []
    for r in range(rows):
        windows = [0] if r % 2 == 0 else []  # hot chunks in some rows, not in others
        error = torch.zeros(n)
        p, s, _ = codec.pack_ef(spiky(n, 10 * r + n, windows, chunk), error, 1.0, error, chunk)
        payloads.append(p)
        scales.append(s)
    fixed = codec.payload_bytes(n, chunk)
    signs, scale = torch.stack([p[:fixed] for p in payloads]), torch.stack(scales)
    side = [p[fixed:] for p in payloads]
    assert any(s.numel() for s in side) or n < 64  # 9 elements: one spike may be small
    want = torch.stack([codec.unpack(payloads[r], scale[r], n, chunk, torch.empty(n)).double()
                        for r in range(rows)]).mean(0)
    got = codec.unpack_mean(signs, scale, n, chunk, torch.full((n,), float("nan")), side=side)
    assert torch.allclose(got.double(), want, rtol=1e-5, atol=1e-5)
    again = codec.unpack_mean(signs, scale, n, chunk, torch.empty(n), side=side)
    assert torch.equal(got, again)
    # the side blocks are where the values are: without them the hot rows decode wrong
    if any(s.numel() for s in side):
        blank = [torch.zeros_like(s) for s in side]
        wrong = codec.unpack_mean(signs, scale, n, chunk, torch.empty(n), side=blank)
        assert not torch.allclose(wrong.double(), want, rtol=1e-5, atol=1e-5)


def test_a_short_last_window_is_judged_with_the_one_before_it():
    """A bucket's tail (biases: a few large values after a long Gaussian weight) does not make
    its own window; judged alone it would send values."""
    codec, chunk = OneBitOutlierCodec(4), 256
    n = 64 * chunk + 3 * chunk
    x = torch.randn(n, generator=torch.Generator().manual_seed(3))
    x[64 * chunk:] *= 0.01
    x[64 * chunk::50] = 5.0  # concentrated within the tail, small against the window
    error = torch.zeros(n)
    _, scales, _ = codec.pack_ef(x, error, 1.0, error, chunk)
    assert not torch.signbit(scales).any()


def gate(y, numel, chunk):
    """The gate's verdict per chunk on a given y (whole chunks; padding 0)."""
    rows = y.view(-1, chunk)
    energy = rows.square()
    return outliers._concentrated(torch.stack([energy.sum(1), energy.amax(1)], 1), numel, chunk,
                                  lambda idx: (rows.index_select(0, idx), None))


@pytest.mark.parametrize("share", [0.39, 0.41])
def test_the_gate_is_exact_at_its_threshold(share):
    """A window whose largest 1% are all equal holds exactly top x its largest: the shortcut that
    skips the topk of windows under that bound must not decide such a window either way."""
    chunk = 256
    numel = outliers.WINDOW_CHUNKS * chunk
    top = int(numel * outliers.TOP_SHARE)
    y = torch.ones(numel)
    # top elements of energy a each, the rest 1: top a / (top a + rest) = share
    a = share * (numel - top) / ((1 - share) * top)
    y[torch.randperm(numel, generator=torch.Generator().manual_seed(3))[:top]] = a ** 0.5
    verdict = gate(y, numel, chunk)
    assert verdict.shape == (outliers.WINDOW_CHUNKS,)
    assert bool(verdict.all()) == (share > outliers.THRESHOLD)
    assert bool(verdict.any()) == (share > outliers.THRESHOLD)


def test_the_gate_matches_a_plain_topk_on_heavy_and_light_tails():
    """Both shortcuts (an upper bound that rules windows out, a lower bound that rules them in)
    give the verdicts of the topk they skip, on windows on either side of the threshold."""
    chunk, gen = 256, torch.Generator().manual_seed(11)
    elements = outliers.WINDOW_CHUNKS * chunk
    top = int(elements * outliers.TOP_SHARE)
    verdicts = []
    for df in (0.8, 1.2, 1.6, 2.0, 2.5, 3.0, 30.0):
        y = torch.randn(8, elements, generator=gen) / \
            torch.rand(8, elements, generator=gen).pow(1 / df)  # Pareto-like tails: heavier as df falls
        energy = y.square()
        expected = energy.topk(top, dim=1).values.sum(1) > outliers.THRESHOLD * energy.sum(1)
        per_chunk = energy.view(8, -1, chunk)
        got = outliers._top_holds(per_chunk.sum(2), per_chunk.amax(2), elements,
                                  lambda rows: energy[rows])
        assert torch.equal(got, expected), df
        verdicts += expected.tolist()
    assert any(verdicts) and not all(verdicts)  # both sides of the threshold were tried


@pytest.mark.parametrize("n, chunk, windows", [
    (7, 8, [0]), (64 * 256 + 5, 256, [0]), (3 * 64 * 256 + 1000, 256, [2]), (5 * 64 * 24 + 7, 24, [0, 3]),
    (4 * 64 * 256, 256, []),
])
def test_the_native_energy_and_the_torch_one_give_the_same_pack(monkeypatch, n, chunk, windows):
    """The gate's energy comes from a native op on CPU and from torch ops elsewhere (CUDA): both
    give the same bytes, scales and memory."""
    codec = OneBitOutlierCodec(4)
    x = spiky(n, 5 * n + chunk, windows, chunk)
    error = torch.randn(n, generator=torch.Generator().manual_seed(n)) * 0.1
    outputs = []
    for energy in (outliers._chunk_energy, outliers._chunk_energy_torch):
        monkeypatch.setattr(outliers, "_chunk_energy", energy)
        error_out = torch.empty(n)
        payload, scales, sums = codec.pack_ef(x, error, 0.5, error_out, chunk)
        outputs.append((payload, scales, error_out, sums))
    for native, torch_ops in zip(*outputs):
        assert torch.equal(native, torch_ops)
    assert bool(torch.signbit(outputs[0][1]).any()) is bool(windows)


def test_the_memory_follows_the_sent_sign_where_y_rounds_to_zero():
    """An element far below its chunk's scale, negative: its plain memory y + scale rounds to the
    scale, so y rebuilt from it is +0 while its bit says negative. In a chunk that sends values the
    memory must follow the bit the receiver decodes (an earlier version took the rebuilt y's sign
    and put 2 x the chunk's scale in the memory there)."""
    codec, chunk = OneBitOutlierCodec(4), 256
    n = 64 * chunk
    x = spiky(n, 21, [0], chunk)
    tiny = [5, 300, 7000]
    x[tiny] = -1e-12
    error = torch.zeros(n)
    payload, scales, _ = codec.pack_ef(x, error, 1.0, error, chunk)
    assert torch.signbit(scales).all()
    out = codec.unpack(payload, scales, n, chunk, torch.empty(n))
    gap = (out.double() + error.double() - x.double()).abs()
    assert gap[tiny].max() < 1e-5
    assert gap.max() < 1e-4


def test_the_guards_memory_norm_is_exact_on_a_large_tensor():
    """Where chunks send values the memory's energy is summed again: to float64 precision on a
    tensor of millions of elements (torch's float32 norm drifted by 1e-4 to 1e-3 there)."""
    codec, chunk = OneBitOutlierCodec(4), 256
    n = 3_000_001
    x = spiky(n, 8, [0, 5, 100], chunk)
    error = torch.randn(n, generator=torch.Generator().manual_seed(8))
    _, scales, sums = codec.pack_ef(x, error, 0.5, error, chunk)
    assert torch.signbit(scales).any()
    assert sums[0].item() == pytest.approx(error.double().square().sum().item(), rel=1e-6)


@pytest.mark.parametrize("share", [0.38, 0.42])
@pytest.mark.parametrize("path", ["native", "torch"])
def test_both_energy_paths_decide_windows_near_the_threshold(monkeypatch, share, path):
    """Windows whose largest 1% hold just under and just over the threshold: the native measure
    and the torch one (CUDA's) each give the rule's verdict, so a measure a few percent off fails."""
    if path == "torch":
        monkeypatch.setattr(outliers, "_chunk_energy", outliers._chunk_energy_torch)
    codec, chunk = OneBitOutlierCodec(4), 256
    n = 2 * outliers.WINDOW_CHUNKS * chunk
    window = outliers.WINDOW_CHUNKS * chunk
    top = int(window * outliers.TOP_SHARE)
    a = share * (window - top) / ((1 - share) * top)  # top elements of energy a, the rest 1
    x = torch.ones(n)
    gen = torch.Generator().manual_seed(4)
    for w in range(2):
        x[w * window + torch.randperm(window, generator=gen)[:top]] = a ** 0.5
    error = torch.zeros(n)
    _, scales, _ = codec.pack_ef(x, error, 1.0, error, chunk)
    assert bool(torch.signbit(scales).all()) == bool(torch.signbit(scales).any()) \
        == (share > outliers.THRESHOLD)


def test_a_threshold_of_zero_sends_values_everywhere_and_of_one_nowhere(monkeypatch):
    """The gate is what decides (a reference that ignored it would pass the tests above only
    by luck of the inputs)."""
    codec, n, chunk = OneBitOutlierCodec(4), 3 * 64 * 256, 256
    x = torch.randn(n)
    for threshold, marked in [(0.0, True), (1.0, False)]:
        monkeypatch.setattr(outliers, "THRESHOLD", threshold)
        error = torch.zeros(n)
        _, scales, _ = codec.pack_ef(x, error, 1.0, error, chunk)
        assert bool(torch.signbit(scales).all()) is marked and \
            bool(torch.signbit(scales).any()) is marked


def test_bad_options_raise_clear_errors():
    from ciuicflow.compression.onebit import OneBitCompressor

    with pytest.raises(ValueError, match="values"):
        OneBitOutlierCodec(0)
    with pytest.raises(ValueError, match="at most 256"):
        OneBitOutlierCodec(4).payload_bytes(1000, 512)
    with pytest.raises(ValueError, match="outliers"):
        OneBitCompressor(outliers=-1)
    with pytest.raises(ValueError, match="outliers"):
        OneBitCompressor(outliers="many")
    with pytest.raises(ValueError, match="chunk_size <= 256"):
        OneBitCompressor(outliers=4, chunk_size=512)
    assert OneBitCompressor(chunk_size=512).own_codec(None).name == "onebit"  # auto: plain


def test_auto_sends_values_on_all_reduce_routes_only():
    from ciuicflow.collectives.routes import FlatRoute, HierarchicalRoute
    from ciuicflow.compression.onebit import OneBitCodec, OneBitCompressor

    auto = OneBitCompressor()
    # DDP's routes and HSDP's replicas in ciuicflow.fsdp (a flat route over node sums)
    assert isinstance(auto.own_codec(FlatRoute(None)), OneBitOutlierCodec)
    assert isinstance(auto.own_codec(HierarchicalRoute(None)), OneBitOutlierCodec)
    assert isinstance(auto.own_codec(None), OneBitCodec)  # FSDP's reduce-scatter
    assert isinstance(OneBitCompressor(outliers=4).own_codec(None), OneBitCodec)
    assert isinstance(OneBitCompressor(outliers=2).own_codec(HierarchicalRoute(None)),
                      OneBitOutlierCodec)
    assert isinstance(OneBitCompressor(outliers=0).own_codec(FlatRoute(None)), OneBitCodec)
    # an adaptive optimizer's tensors keep their codec (the policy's ladder: int4 first)
    from types import SimpleNamespace
    assert auto.codec_for(True, FlatRoute(SimpleNamespace(world_size=4))).name == "int4"
    assert auto.codec_for(True, FlatRoute(SimpleNamespace(world_size=2))).name == "int4"


# -- on real processes -----------------------------------------------------------------------


def _windows(rank, spread):
    """Which windows of this rank's input are concentrated: "all" ranks [0, 2], "some" ranks
    (even ones only: ranks differ in whether they have side blocks at all), or "none"."""
    return {"all": [0, 2], "some": [0, 2] if rank % 2 == 0 else [], "none": []}[spread]


def _flat_invariant(rank, world, steps, numel, chunk, phases, spread):
    from ciuicflow.collectives.primitives import Traffic
    from ciuicflow.collectives.routes import FlatRoute
    from ciuicflow.compression.onebit import OneBitCompressor
    from ciuicflow.compression.quantized import QuantizedErrors, quantized_all_reduce
    from ciuicflow.topology import Topology

    topology = Topology.detect()
    compressor = OneBitCompressor(chunk_size=chunk, error_decay=1.0, phases=phases)
    assert isinstance(compressor.own_codec(FlatRoute(topology)), OneBitOutlierCodec)
    errors, traffic, outputs = QuantizedErrors(), Traffic(), []
    for step in range(steps):
        x = spiky(numel, 1000 * rank + step, _windows(rank, spread), chunk)
        quantized_all_reduce(compressor, x, errors, topology, hierarchical=False, traffic=traffic)
        outputs.append(x)
    return {"outputs": torch.stack(outputs), "worker": errors.worker.clone(),
            "server": errors.server.clone(), "traffic": traffic.as_dict()}


@pytest.mark.parametrize("phases, spread", [(2, "all"), (1, "all"), (2, "some"), (1, "some"),
                                            (2, "none")])
def test_flat_onebit_with_values_keeps_the_error_feedback_invariant(phases, spread):
    """sum_t out_t + mean(worker errors) + server errors == sum_t exact mean_t, per element, with
    values sent (all of the memory carried, so nothing is forgotten), whether every rank, some
    ranks or none have chunks that send values; the results agree on every rank; the bytes are
    the signs' plus 12 per chunk that sends values, no more."""
    world, steps, numel, chunk = 4, 4, 3 * 64 * 256 + 1234, 256
    results = run_distributed(_flat_invariant, world, nodes=2,
                              args=(steps, numel, chunk, phases, spread))
    for r in results[1:]:
        assert torch.equal(r["outputs"], results[0]["outputs"])
    exact = sum(torch.stack([spiky(numel, 1000 * r + s, _windows(r, spread), chunk).double()
                             for r in range(world)]).mean(0) for s in range(steps))
    held = torch.stack([r["worker"].double() for r in results]).mean(0)[:numel]
    server = torch.cat([r["server"].double() for r in results])
    if phases == 2:
        held += server[:numel]
    else:
        assert server.numel() == 0
    sent = results[0]["outputs"].double().sum(0)
    assert (sent + held - exact).abs().max().item() < 1e-4 * steps
    assert held.abs().max().item() > 0.1
    # plain scale x sign: 1.125 bits per element (28.4x against float32, less a little padding);
    # every chunk with values: 1.5 bits (21.3x). Two of the three windows concentrated: between.
    traffic = results[0]["traffic"]
    ratio = traffic["exact_inter_bytes"] / traffic["inter_bytes"]
    per_phase = 1 if phases == 2 else 2 / world  # one phase sends (W-1), two 2(W-1)/W
    low, high = {"all": (21.4, 26), "some": (22, 28), "none": (27.5, 28.5)}[spread]
    assert low * per_phase < ratio < high * per_phase, traffic
