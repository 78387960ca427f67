"""The collectives on real gloo processes: hierarchical all-reduce, 1-bit, PowerSGD.

Each rank draws its inputs from a seed that names (rank, case), so every rank can recompute every
other rank's input and hence the exact mean, in float64, without extra communication.
"""
import os

import pytest
import torch
import torch.distributed as dist

from tests.dist_utils import run_distributed

LENGTHS = [0, 1, 2, 3, 5, 7, 8, 9, 31, 64, 100, 257, 1000, 2049, 4099, 10007]


def _input(rank, case, numel, dtype=torch.float32):
    generator = torch.Generator().manual_seed(rank * 100_003 + case)
    return (torch.randn(numel, generator=generator) * (1 + case % 3)).to(dtype)


def _exact_mean(world, case, numel, dtype=torch.float32):
    return torch.stack([_input(r, case, numel, dtype).double() for r in range(world)]).mean(0)


def _gather(tensor):
    out = [torch.empty_like(tensor) for _ in range(dist.get_world_size())]
    dist.all_gather(out, tensor)
    return out


# -- hierarchical all-reduce ----------------------------------------------------------------------


def _hierarchical_matches_exact(rank, world, node_sum="auto"):
    from ciuicflow.collectives.primitives import Traffic
    from ciuicflow.collectives import node_shm as shm
    from ciuicflow.collectives.hierarchical import hierarchical_all_reduce
    from ciuicflow.collectives.routes import NODE_SUM_ENV
    from ciuicflow.topology import Topology

    os.environ[NODE_SUM_ENV] = node_sum

    topology = Topology.detect()
    report = {"describe": topology.describe(), "hierarchical": topology.hierarchical}
    worst = {}
    for dtype, tol in [(torch.float32, 1e-6), (torch.float16, 2e-3), (torch.bfloat16, 2e-2)]:
        for case, numel in enumerate(LENGTHS):
            for op in ("mean", "sum"):
                x = _input(rank, case, numel, dtype)
                hierarchical_all_reduce(x, topology, op=op)
                want = _exact_mean(world, case, numel, dtype) * (world if op == "sum" else 1)
                scale = max(1.0, want.abs().max().item()) if numel else 1.0
                err = (x.double() - want).abs().max().item() / scale if numel else 0.0
                worst[(str(dtype), op)] = max(worst.get((str(dtype), op), 0.0), err)
                assert err <= tol, (dtype, op, numel, err)
                for other in _gather(x):
                    assert torch.equal(other, x), ("ranks disagree", dtype, numel)
    # the exact path's modelled bytes: inter-node links carry 1/L of a flat all-reduce's share
    traffic = Traffic()
    hierarchical_all_reduce(torch.ones(4000), topology, traffic=traffic)
    used = shm._NODES.get(topology.intra_group) if topology.hierarchical else None
    report.update(worst=worst, traffic=traffic.as_dict(), shared_memory=used is not None)
    return report


@pytest.mark.parametrize("layout", [
    dict(nodes=2), dict(nodes=2, node_env="override"), dict(nodes=4), dict(nodes=1),
    dict(node_sizes=[3, 1]),
], ids=["2x2-torchrun", "2x2-override", "4x1", "1x4", "uneven-3+1"])
def test_hierarchical_all_reduce_equals_exact(layout):
    results = run_distributed(_hierarchical_matches_exact, 4, **layout)
    report = results[0]
    if layout.get("nodes") == 2:
        assert report["hierarchical"] and report["describe"].startswith("2 node(s) x 2 rank(s)")
        # 4000 floats, 2 nodes x 2: inter-node = ring over 2 nodes of 8000 B = 8000 B
        assert report["traffic"]["inter_bytes"] == pytest.approx(8000.0)
        # CPU tensors, shared memory: each rank reads a reduce-scatter's and an all-gather's worth
        assert report["traffic"]["intra_bytes"] == pytest.approx(2 * 0.5 * 16000.0)
        assert report["shared_memory"]
    else:
        assert not report["hierarchical"]


@pytest.mark.parametrize("node_sum, intra_bytes", [
    ("reduce_scatter", 8000.0 + 8000.0),  # what CUDA tensors use, forced on CPU
    ("all_reduce", 16000.0 + 8000.0),     # gloo's all-reduce of the whole tensor, then a gather
])
def test_hierarchical_all_reduce_by_collectives(node_sum, intra_bytes):
    report = run_distributed(_hierarchical_matches_exact, 4, nodes=2, args=(node_sum,))[0]
    assert report["traffic"]["intra_bytes"] == pytest.approx(intra_bytes)
    assert not report["shared_memory"]


def test_world_size_one_is_identity():
    assert run_distributed(_identity_check, 1, nodes=1) == [True]


def _identity_check(rank, world):
    from ciuicflow.collectives.hierarchical import hierarchical_all_reduce
    from ciuicflow.compression.onebit import onebit_all_reduce
    from ciuicflow.compression.quantized import QuantizedErrors
    from ciuicflow.compression.powersgd import PowerSGDMemory, powersgd_all_reduce
    x = torch.randn(6, 5)
    ok = True
    for reduce in (lambda t: hierarchical_all_reduce(t),
                   lambda t: onebit_all_reduce(t, QuantizedErrors(), hierarchical=False),
                   lambda t: powersgd_all_reduce(t, PowerSGDMemory(), hierarchical=False)):
        y = x.clone()
        reduce(y)
        ok = ok and torch.equal(x, y)
    return ok


def test_bad_inputs_raise_clear_errors():
    assert run_distributed(_bad_inputs, 2, nodes=1) == [True, True]


def _bad_inputs(rank, world):
    from ciuicflow.collectives.hierarchical import hierarchical_all_reduce
    from ciuicflow.compression.onebit import onebit_all_reduce
    from ciuicflow.compression.quantized import QuantizedErrors
    with pytest.raises(TypeError, match="floating-point"):
        hierarchical_all_reduce(torch.ones(4, dtype=torch.int64))
    with pytest.raises(ValueError, match="contiguous"):
        hierarchical_all_reduce(torch.ones(4, 4).t())
    with pytest.raises(ValueError, match="op must be"):
        hierarchical_all_reduce(torch.ones(4), op="max")
    with pytest.raises(ValueError, match="multiple of 8"):
        onebit_all_reduce(torch.ones(4), QuantizedErrors(), chunk_size=12)
    return True


# -- 1-bit -----------------------------------------------------------------------------------------


def _onebit_invariant(rank, world, hierarchical, chunk_size, numel, steps, exclude_every,
                      server=True):
    """Run `steps` compressed all-reduces; return what the invariant check needs."""
    from ciuicflow.collectives.primitives import Traffic
    from ciuicflow.compression.onebit import onebit_all_reduce
    from ciuicflow.compression.quantized import QuantizedErrors
    from ciuicflow.topology import Topology

    topology = Topology.detect()
    errors = QuantizedErrors()
    mask = None
    if exclude_every:
        mask = torch.zeros(numel, dtype=torch.bool)
        mask[::exclude_every] = True
    outputs, traffic = [], Traffic()
    for step in range(steps):
        x = _input(rank, step, numel)
        onebit_all_reduce(x, errors, topology, hierarchical=hierarchical, chunk_size=chunk_size,
                          exact_mask=mask, server=server, traffic=traffic)
        for other in _gather(x):
            assert torch.equal(other, x), "1-bit results differ across ranks"
        outputs.append(x)
    assert errors.relative_error > 0  # the accuracy guard's measure
    return {"outputs": torch.stack(outputs), "worker": errors.worker.clone(),
            "server": errors.server.clone(), "traffic": traffic.as_dict(),
            "relative_error": errors.relative_error,
            "local_rank": topology.local_rank if hierarchical else 0,
            "node": topology.node if hierarchical else rank, "mask": mask}


def _compressed_index(numel, mask, start, length):
    """Positions (in the full tensor) of the compressed elements of tensor[start:start+length]."""
    positions = torch.arange(start, min(start + length, numel))
    if mask is not None:
        positions = positions[~mask[positions]]
    return positions


ONEBIT_CASES = [  # hierarchical, chunk_size, numel, every n-th element excluded (0: none), phases
    (True, 2048, 10007, 0, True), (True, 64, 999, 0, True), (False, 2048, 5000, 0, True),
    (True, 16, 777, 7, True), (False, 8, 123, 5, True),
    # one phase: every rank gathers every compressed tensor; no server error
    (True, 256, 10007, 0, False), (False, 64, 5000, 0, False), (True, 16, 777, 7, False),
    (False, 8, 123, 5, False),
]


def _onebit_cases(rank, world, steps):
    return {"cases": [_onebit_invariant(rank, world, *case[:3], steps, case[3], case[4])
                      for case in ONEBIT_CASES],
            "overflow": _onebit_overflow(rank, world)}


def test_onebit_error_feedback_invariant_and_overflow():
    """sum_t out_t + mean(worker errors) + server errors == sum_t exact mean_t, per element;
    an inf on one rank makes the step exact and leaves the error buffers as they were."""
    world, nodes, steps = 4, 2, 6
    per_rank = run_distributed(_onebit_cases, world, nodes=nodes, args=(steps,))
    for index, case in enumerate(ONEBIT_CASES):
        _check_onebit_invariant([r["cases"][index] for r in per_rank], world, nodes, steps, *case)
    for r in per_rank:
        untouched, has_inf, finite_ok, fallbacks = r["overflow"]
        assert untouched and has_inf and finite_ok and fallbacks == 1


def _served_as_int4(rank, world, steps, numel, chunk_size):
    """The default 1-bit compressor where six nodes exchange (two phases, int4 from the servers),
    and with server_codec="same" (1 bit from them): what the invariant check needs, and the
    first step's distance from the exact mean."""
    from ciuicflow.collectives.primitives import Traffic
    from ciuicflow.compression.onebit import OneBitCompressor
    from ciuicflow.compression.quantized import QuantizedErrors, quantized_all_reduce
    from ciuicflow.topology import Topology

    topology = Topology.detect()
    out = {}
    for server_codec in ("auto", "same", "onebit_int4"):
        compressor = OneBitCompressor(chunk_size=chunk_size, error_decay=1.0,
                                      server_codec=server_codec)
        errors, traffic, outputs = QuantizedErrors(), Traffic(), []
        for step in range(steps):
            x = _input(rank, step, numel)
            quantized_all_reduce(compressor, x, errors, topology, traffic=traffic)
            for other in _gather(x):
                assert torch.equal(other, x), "1-bit results differ across ranks"
            outputs.append(x)
        out[server_codec] = {
            "outputs": torch.stack(outputs), "worker": errors.worker.clone(),
            "server": errors.server.clone(), "traffic": traffic.as_dict(),
            "relative_error": errors.relative_error, "local_rank": topology.local_rank,
            "node": topology.node, "mask": None,
            "first_gap": (outputs[0].double() - _exact_mean(world, 0, numel)).norm().item()}
    return out


def test_beyond_four_nodes_the_servers_send_int4():
    """Six nodes exchange in two phases; by default the servers pack each segment's mean as int4
    (registry.SERVER_FAMILY): the error-feedback invariant holds with the int4 memory, the result
    is nearer the exact mean than with 1 bit from the servers, and the servers' bytes are int4's;
    the same with server_codec="onebit_int4" (1 bit, int4 in a tenth of the chunks)."""
    world, steps, numel, chunk = 6, 4, 6007, 64
    per_rank = run_distributed(_served_as_int4, world, nodes=world, args=(steps, numel, chunk),
                               timeout=300)
    for codec in ("auto", "same", "onebit_int4"):
        _check_onebit_invariant([r[codec] for r in per_rank], world, world, steps, True, chunk,
                                numel, 0, True)
    auto, same = per_rank[0]["auto"], per_rank[0]["same"]
    refined = per_rank[0]["onebit_int4"]
    assert auto["first_gap"] < 0.8 * same["first_gap"], (auto["first_gap"], same["first_gap"])
    # server_codec="onebit_int4": a tenth of the servers' chunks (two of each segment's 16) as
    # int4, the rest 1 bit: nearer exact than 1 bit from the servers
    assert refined["first_gap"] < same["first_gap"], (refined["first_gap"], same["first_gap"])
    # per rank: (W-1)/W of the workers' packed bytes, then as much of the servers': 1 bit plus
    # scales (and any values) both ways with "same"; with int4 the second half is 4 bits + scales
    worker = same["traffic"]["inter_bytes"] / 2
    int4 = steps * (world - 1) / world * numel * (4 / 8 + 4 / chunk)
    assert auto["traffic"]["inter_bytes"] == pytest.approx(worker + int4, rel=0.03), \
        (auto["traffic"], same["traffic"])
    segment, nchunks = 1024, 16  # 6007 / 6 elements per server, in chunks of 64
    refined_bytes = steps * (world - 1) * (segment / 8 + 4 * nchunks + 2 * 96)
    assert refined["traffic"]["inter_bytes"] == pytest.approx(worker + refined_bytes, rel=0.03), \
        (refined["traffic"], same["traffic"])


def _onebit_overflow_by_reduce_scatter(rank, world):
    from ciuicflow.collectives.routes import NODE_SUM_ENV

    os.environ[NODE_SUM_ENV] = "reduce_scatter"
    return _onebit_overflow(rank, world)


def test_onebit_overflow_with_reduce_scatter_node_sum():
    """The inf sits in the shard of local rank 0; local rank 1 learns of it from the node's flag."""
    for untouched, has_inf, finite_ok, fallbacks in run_distributed(
            _onebit_overflow_by_reduce_scatter, 4, nodes=2):
        assert untouched and has_inf and finite_ok and fallbacks == 1


def _check_onebit_invariant(results, world, nodes, steps, hierarchical, chunk_size, numel,
                            exclude_every, two_phase):
    case = (hierarchical, chunk_size, numel, exclude_every, two_phase)
    if not two_phase:
        assert all(r["server"].numel() == 0 for r in results), case
    # the guard's measure is agreed on by the ranks of an exchange
    for i in {r["local_rank"] for r in results}:
        assert len({r["relative_error"] for r in results if r["local_rank"] == i}) == 1, case
    sent = results[0]["outputs"].double().sum(0)
    exact = sum(_exact_mean(world, step, numel) for step in range(steps))
    mask = results[0]["mask"]
    held = torch.zeros(numel, dtype=torch.float64)
    if hierarchical:
        # Each shard i (held by local rank i of each node) has its own worker errors (one per
        # node: node-level quantities) and servers (segment j on node j's local rank i).
        local = world // nodes
        shard_len = -(-numel // local)
        for i in range(local):
            holders = [r for r in results if r["local_rank"] == i]
            positions = _compressed_index(numel, mask, i * shard_len, shard_len)
            worker = torch.stack([h["worker"].double() for h in holders]).mean(0)
            server = torch.cat([h["server"].double()
                                for h in sorted(holders, key=lambda h: h["node"])])
            held[positions] += worker[:positions.numel()]
            if server.numel():
                held[positions] += server[:positions.numel()]
    else:
        positions = _compressed_index(numel, mask, 0, numel)
        worker = torch.stack([r["worker"].double() for r in results]).mean(0)
        server = torch.cat([r["server"].double() for r in results])
        held[positions] += worker[:positions.numel()]
        if server.numel():
            held[positions] += server[:positions.numel()]
    gap = (sent + held - exact).abs().max().item()
    assert gap < 1e-4 * steps, (case, gap)
    # the error buffers are not trivially zero: compression dropped something
    assert held.abs().max().item() > 0.1, case
    if mask is not None:  # excluded positions are exact every step
        assert (results[0]["outputs"][:, mask].double()
                - torch.stack([_exact_mean(world, s, numel)[mask] for s in range(steps)])
                ).abs().max().item() < 1e-5, case
    # bytes: the compressed step carries about 1/32 of float32 bytes (plus scales and padding)
    traffic = results[0]["traffic"]
    if not exclude_every and numel > 4000:
        exchange = nodes if hierarchical else world
        # one phase sends (W-1) compressed tensors where two send 2(W-1)/W; the chunks also
        # reserve 4 values (24 bits each, compression.outliers)
        bits = 1 + 32 / chunk_size + (0 if chunk_size > 256 else 96 / chunk_size)
        floor = 0.8 * 32 / bits * (1 if two_phase else 2 / exchange)
        assert traffic["exact_inter_bytes"] / traffic["inter_bytes"] > floor, (case, traffic)


def _onebit_overflow(rank, world, hierarchical=True, bad=float("inf"), exclude_every=0):
    from ciuicflow.collectives.primitives import Traffic
    from ciuicflow.compression.onebit import onebit_all_reduce
    from ciuicflow.compression.quantized import QuantizedErrors

    mask = None
    if exclude_every:
        mask = torch.zeros(300, dtype=torch.bool)
        mask[5::exclude_every] = True
    errors, traffic = QuantizedErrors(), Traffic()
    options = dict(chunk_size=16, traffic=traffic, hierarchical=hierarchical, exact_mask=mask)
    onebit_all_reduce(_input(rank, 1, 300), errors, **options)
    before = (errors.worker.clone(), errors.server.clone())
    x = _input(rank, 2, 300)
    if rank == 3:
        x[5] = bad
    onebit_all_reduce(x, errors, **options)
    untouched = torch.equal(before[0], errors.worker) and torch.equal(before[1], errors.server)
    exact = _exact_mean(world, 2, 300).float()
    finite_ok = torch.allclose(x[6:], exact[6:], atol=1e-6)
    return untouched, not bool(torch.isfinite(x[5])), finite_ok, traffic.nonfinite_fallbacks


def _flat_overflows(rank, world):
    return [_onebit_overflow(rank, world, hierarchical=False),
            _onebit_overflow(rank, world, hierarchical=False, bad=float("nan"), exclude_every=7)]


def test_onebit_flat_overflow_in_compressed_and_in_exact_positions():
    """On a flat route each rank checks its own input (from the pack's sum of squares, and the
    exact positions apart): an inf where values are compressed, or a NaN where they are sent
    exactly, makes the step exact everywhere, the memory untouched."""
    for results in run_distributed(_flat_overflows, 4, nodes=2):
        for untouched, nonfinite, finite_ok, fallbacks in results:
            assert untouched and nonfinite and finite_ok and fallbacks == 1



# -- PowerSGD --------------------------------------------------------------------------------------


def _powersgd_checks(rank, world, hierarchical):
    from ciuicflow.collectives.primitives import Traffic
    from ciuicflow.compression.powersgd import PowerSGDMemory, powersgd_all_reduce

    shapes = [(24, 16), (16,), (8, 2, 3), (5,)]
    numel = sum(torch.Size(s).numel() for s in shapes)
    segments, offset = [], 0
    for s in shapes:
        segments.append((offset, s))
        offset += torch.Size(s).numel()
    # full rank: P Q^T reproduces M exactly, so the result is the exact mean
    x = _input(rank, 0, numel)
    powersgd_all_reduce(x, PowerSGDMemory(), segments=segments, rank=16, hierarchical=hierarchical,
                        min_compression_rate=0.0)
    full_rank_err = (x.double() - _exact_mean(world, 0, numel)).abs().max().item()
    # rank 1, several steps: sum_t out_t + mean(error) == sum_t exact mean_t
    memory, outputs, traffic = PowerSGDMemory(), [], Traffic()
    for step in range(5):
        x = _input(rank, 10 + step, numel)
        powersgd_all_reduce(x, memory, segments=segments, rank=1, hierarchical=hierarchical,
                            step=step, traffic=traffic)
        for other in _gather(x):
            assert torch.allclose(other, x, atol=1e-6)
        outputs.append(x)
    return {"full_rank_err": full_rank_err, "sum": torch.stack(outputs).double().sum(0),
            "error": memory.error.double(), "traffic": traffic.as_dict(), "numel": numel}


def _powersgd_all_checks(rank, world):
    return {"hierarchical": _powersgd_checks(rank, world, True),
            "flat": _powersgd_checks(rank, world, False),
            "overflow": _powersgd_overflow(rank, world)}


def test_powersgd_exact_at_full_rank_error_feedback_invariant_and_overflow():
    world = 4
    per_rank = run_distributed(_powersgd_all_checks, world, nodes=2)
    for mode in ("hierarchical", "flat"):
        results = [r[mode] for r in per_rank]
        assert all(r["full_rank_err"] < 1e-4 for r in results), \
            (mode, [r["full_rank_err"] for r in results])
        numel = results[0]["numel"]
        exact = sum(_exact_mean(world, 10 + s, numel) for s in range(5))
        mean_error = torch.stack([r["error"] for r in results]).mean(0)
        gap = (results[0]["sum"] + mean_error - exact).abs().max().item()
        assert gap < 1e-4, (mode, gap)
        assert mean_error.abs().max().item() > 0.1, mode  # rank 1 does drop something
        traffic = results[0]["traffic"]
        assert traffic["inter_bytes"] < traffic["exact_inter_bytes"], mode
    # a NaN on one rank: the step is exact, the memory untouched
    for r in per_rank:
        untouched, has_nan, rest_ok, fallbacks = r["overflow"]
        assert untouched and has_nan and rest_ok and fallbacks == 1


def _powersgd_overflow(rank, world):
    from ciuicflow.collectives.primitives import Traffic
    from ciuicflow.compression.powersgd import PowerSGDMemory, powersgd_all_reduce

    memory, traffic = PowerSGDMemory(), Traffic()
    powersgd_all_reduce(_input(rank, 1, 400).view(20, 20), memory, traffic=traffic)
    before = (memory.error.clone(), memory.q.clone())
    x = _input(rank, 2, 400).view(20, 20)
    if rank == 0:
        x[0, 0] = float("nan")
    powersgd_all_reduce(x, memory, step=1, traffic=traffic)
    untouched = torch.equal(before[0], memory.error) and torch.equal(before[1], memory.q)
    exact = _exact_mean(world, 2, 400).float().view(20, 20)
    return (untouched, bool(torch.isnan(x[0, 0])),
            torch.allclose(x.view(-1)[1:], exact.view(-1)[1:], atol=1e-6),
            traffic.nonfinite_fallbacks)


# -- the shared-memory node sum -------------------------------------------------------------------


def _shared_memory_fallback(rank, world, break_attach):
    import warnings

    from ciuicflow.collectives import node_shm as shm
    from ciuicflow.collectives.hierarchical import hierarchical_all_reduce
    from ciuicflow.topology import Topology

    topology = Topology.detect()
    if break_attach == "attach" and topology.local_rank == 1:  # as if on another host
        def no_attach(path, nbytes):
            raise FileNotFoundError(path)
        shm._attach = no_attach
    if break_attach == "grow" and topology.local_rank == 0:  # as if /dev/shm were small
        create = shm._create

        def small_shm(nbytes):
            if nbytes > 2 << 20:
                raise OSError(28, "No space left on device")
            return create(nbytes)
        shm._create = small_shm
    results = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for case, numel in enumerate([3, 4099, 300_001, 17]):  # 300_001 grows the segment
            x = _input(rank, case, numel)
            hierarchical_all_reduce(x, topology)
            results.append((x - _exact_mean(world, case, numel).float()).abs().max().item())
    used = shm._NODES.get(topology.intra_group) is not None
    return max(results), used, [str(w.message) for w in caught]


@pytest.mark.parametrize("break_attach", [None, "attach", "grow"],
                         ids=["shared", "cannot-attach", "cannot-grow"])
def test_shared_memory_node_sum_and_its_fallback(break_attach):
    """A node whose ranks cannot map each other's segment, or cannot grow it, falls back to gloo,
    with a warning, and still reduces exactly; either way nothing is left in /dev/shm."""
    before = set(os.listdir("/dev/shm"))
    for worst, used, messages in run_distributed(_shared_memory_fallback, 4, nodes=2,
                                                 args=(break_attach,)):
        assert worst < 1e-5
        assert used is (break_attach is None)
        assert any("cannot share memory" in m for m in messages) is (break_attach is not None)
    assert not [name for name in set(os.listdir("/dev/shm")) - before
                if name.startswith("ciuicflow-") and not name.startswith("ciuicflow-kv-")]


def _kept_outputs(rank, world):
    from ciuicflow.collectives import node_shm as shm
    from ciuicflow.collectives.routes import EXACT, HierarchicalRoute
    from ciuicflow.compression.onebit import OneBitCompressor
    from ciuicflow.topology import Topology

    route = HierarchicalRoute(Topology.detect())
    gaps, kept = [], []

    def check(result, flat, case, numel):
        kept.append(result.data_ptr() != flat.data_ptr())
        return (result.double() - _exact_mean(world, case, numel)).abs().max().item()

    # two keys: the first result survives the second reduction, and its key's next call
    a, b = _input(rank, 1, 4099), _input(rank, 2, 300_001)
    result_a = route.reduce(a, EXACT, None, keep=0)
    result_b = route.reduce(b, EXACT, None, keep=1)
    gaps += [check(result_a, a, 1, 4099), check(result_b, b, 2, 300_001)]
    c = _input(rank, 3, 5000)  # a larger tensor under key 0: its area grows
    gaps.append(check(route.reduce(c, EXACT, None, keep=0), c, 3, 5000))
    gaps.append(check(result_b, b, 2, 300_001))
    # a compressed step gives the same bits kept or not (same memory, same input)
    compressor = OneBitCompressor()
    memories = [compressor.new_memory(), compressor.new_memory()]
    same = []
    for case in (4, 5):
        step = [compressor.step(m, route, None, False, None) for m in memories]
        in_place = _input(rank, case, 70_000)
        route.reduce(in_place, step[0], None)
        x = _input(rank, case, 70_000)
        same.append(torch.equal(route.reduce(x, step[1], None, keep=2), in_place))
    # keys are each process's own: ranks that name one call differently still agree on an area
    e = _input(rank, 7, 3000)
    gaps.append(check(route.reduce(e, EXACT, None, keep=("mine", rank)), e, 7, 3000))
    f = _input(rank, 8, 3000)  # and where one rank has an area under its key and another not
    gaps.append(check(route.reduce(f, EXACT, None, keep=0 if rank % 2 else ("mine", rank)), f, 8,
                      3000))
    # a rank of each node without a key: nobody keeps
    g = _input(rank, 9, 3000)
    gaps.append(check(route.reduce(g, EXACT, None, keep=None if rank % 2 else 4), g, 9, 3000))
    # over the budget: written into the tensor
    shm.KEEP_BYTES = 0
    d = _input(rank, 6, 1000)
    over = route.reduce(d, EXACT, None, keep=3)
    gaps.append(check(over, d, 6, 1000))
    return max(gaps), kept, same


def _two_models_one_backward(rank, world, shared_state=False):
    import ciuicflow
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    models = [DDP(torch.nn.Sequential(torch.nn.Linear(40, 300), torch.nn.Linear(300, 7)))
              for _ in range(2)]
    for model in models:
        if shared_state:  # the default state, one per hook: both models' buckets go through it
            model.register_comm_hook(None, ciuicflow.hierarchical_allreduce)
        else:
            ciuicflow.register(model, "hierarchical_allreduce")
    from ciuicflow.collectives import node_shm

    worst, areas = 0.0, []
    for step in range(4):
        inputs = [_input(rank, 10 * step + m, 16 * 40).view(16, 40) for m in range(2)]
        for model in models:
            model.zero_grad()
        sum(model(x).square().mean() for model, x in zip(models, inputs)).backward()
        for model, x in zip(models, inputs):  # the mean of every rank's gradient, by hand
            plain = [p.detach().clone().requires_grad_() for p in model.module.parameters()]
            out = torch.nn.functional.linear(torch.nn.functional.linear(x, plain[0], plain[1]),
                                             plain[2], plain[3])
            grads = torch.autograd.grad(out.square().mean(), plain)
            for p, g in zip(model.module.parameters(), grads):
                dist.all_reduce(g)
                worst = max(worst, (p.grad - g / world).abs().max().item())
        areas.append(sum(len(segment._kept) for segment in node_shm._NODES.values() if segment))
    return worst, areas


@pytest.mark.parametrize("shared_state", [False, True])
def test_two_models_in_one_backward_get_their_own_means(shared_state):
    """Two DDP models reduced in one backward pass (DDP copies both results out only at its end):
    each bucket's kept output is its own, so neither model receives the other's gradients; also
    where both use the hook's default state and their buckets have the same index and size."""
    for worst, areas in run_distributed(_two_models_one_backward, 4, nodes=2, args=(shared_state,)):
        assert worst < 1e-5
        assert areas[1] >= 2 and areas[1:] == [areas[1]] * 3, areas  # one per model: no growth


def test_kept_outputs_are_the_means_and_outlive_other_keys():
    """With a key (a DDP bucket's), the node's output is handed back instead of copied into the
    tensor; it stays the mean while other keys are reduced, and a compressed step gives the same
    bits either way; past the budget the tensor holds the mean as before."""
    for worst, kept, same in run_distributed(_kept_outputs, 4, nodes=2):
        assert worst < 1e-5
        assert kept == [True, True, True, True, True, True, False, False]
        assert same == [True, True]


# -- 1-bit: error decay and the accuracy guard -----------------------------------------------------


def _onebit_decay_and_guard(rank, world):
    from ciuicflow import ops
    from ciuicflow.collectives.primitives import Traffic
    from ciuicflow.compression.onebit import onebit_all_reduce
    from ciuicflow.compression.quantized import QuantizedErrors
    from ciuicflow.topology import Topology

    topology = Topology.detect()
    numel, chunk = 1000, 40
    out = {}
    # error_decay=0: no memory at all, the mean of each rank's scale x sign of its own input
    errors = QuantizedErrors()
    for step in range(3):
        x = _input(rank, 50 + step, numel)
        onebit_all_reduce(x, errors, topology, hierarchical=False, chunk_size=chunk,
                          error_decay=0.0, server=False)
        want = torch.zeros(numel, dtype=torch.float64)
        for r in range(world):
            packed, scales = ops.onebit_pack(_input(r, 50 + step, numel), torch.zeros(numel),
                                             chunk)
            want += ops.onebit_unpack(packed, scales, numel, chunk).double() / world
        out.setdefault("decay0_gap", 0.0)
        out["decay0_gap"] = max(out["decay0_gap"], (x.double() - want).abs().max().item())
    # the guard: a threshold every step exceeds makes the next step exact and send the memory
    for server in (True, False):
        errors, traffic = QuantizedErrors(), Traffic()
        x0 = _input(rank, 60, numel)
        onebit_all_reduce(x0, errors, topology, chunk_size=chunk, server=server,
                          guard_threshold=1e-6, traffic=traffic)
        held = errors.worker[:numel].double().clone()
        held_server = errors.server.double().clone()
        x1 = _input(rank, 61, numel)
        onebit_all_reduce(x1, errors, topology, chunk_size=chunk, server=server,
                          guard_threshold=1e-6, traffic=traffic)
        out[f"guard{server}"] = {
            "sent": (x0.double() + x1.double()), "held": held, "held_server": held_server,
            "zero_after": bool(errors.worker.abs().max() == 0), "exact_steps":
            traffic.guard_exact_steps, "local_rank": topology.local_rank, "node": topology.node}
    return out


def test_onebit_error_decay_zero_and_the_guards_exact_step():
    """error_decay=0 is plain scale x sign compression of each rank's input, averaged; a guard
    step is exact, sends what the memory held (two steps sum to the exact sum), and empties it."""
    world, nodes = 4, 2
    results = run_distributed(_onebit_decay_and_guard, world, nodes=nodes)
    for r in results:
        assert r["decay0_gap"] < 1e-5, r["decay0_gap"]
    exact = _exact_mean(world, 60, 1000) + _exact_mean(world, 61, 1000)
    for server in (True, False):
        per = [r[f"guard{server}"] for r in results]
        for p in per:
            assert p["zero_after"] and p["exact_steps"] == 1, (server, p)
            # hierarchical: the exchange is per shard; two steps together are exact
            assert (p["sent"] - exact).abs().max().item() < 1e-4, server
        # and the first step alone was not: compression did drop something
        assert max(p["held"].abs().max().item() for p in per) > 0.01


def _onebit_fp16_guard(rank, world):
    import torch.distributed as dist

    from ciuicflow.collectives.primitives import Traffic
    from ciuicflow.compression.onebit import onebit_all_reduce
    from ciuicflow.compression.quantized import QuantizedErrors
    from ciuicflow.topology import Topology

    topology = Topology.detect()
    numel, chunk = 1000, 40
    out = {}
    for server in (True, False):
        for guard in ("exact", "fp16"):
            errors = QuantizedErrors()
            x0 = _input(rank, 60, numel)
            onebit_all_reduce(x0, errors, topology, hierarchical=False, chunk_size=chunk,
                              server=server, guard_threshold=1e-6, guard=guard, error_decay=0.5)
            owed = errors.worker[:numel].clone()  # what this rank owes, in the input's units
            if server:  # and the server error of the segment it serves, times W (see _flush)
                seg = errors.server.numel()
                lo = dist.get_rank() * seg
                hi = min(numel, lo + seg)
                owed[lo:hi] += errors.server[:hi - lo] * world
            # the guard's step sends what a compressed step would have compressed: the memory
            # decayed as that step would have added it
            contribution = (_input(rank, 61, numel) + 0.5 * owed) / world
            want = contribution.clone()
            dist.all_reduce(want)
            x1, traffic = _input(rank, 61, numel), Traffic()
            onebit_all_reduce(x1, errors, topology, hierarchical=False, chunk_size=chunk,
                              server=server, guard_threshold=1e-6, guard=guard, traffic=traffic,
                              error_decay=0.5)
            out[(server, guard)] = {
                "gap": (x1 - want).abs().max().item(), "guard_steps": traffic.guard_exact_steps,
                "bytes": traffic.inter_bytes + traffic.intra_bytes,
                "memory": errors.worker[:numel].clone(),
                "rounding": (contribution - contribution.half().float()) * world,
                "server_memory": errors.server.abs().max().item() if server else 0.0}
    return out


def test_onebit_guard_step_sends_the_decayed_memory_in_float32_or_float16():
    """The guard's step (error_decay 0.5) sends the input plus the decayed memory: in float32
    (guard="exact"), or in float16 (guard="fp16": half the bytes), where what each rank's rounding
    dropped becomes its memory."""
    world = 4
    results = run_distributed(_onebit_fp16_guard, world, nodes=2)
    for r in results:
        for server in (True, False):
            full, half = r[(server, "exact")], r[(server, "fp16")]
            assert full["guard_steps"] == half["guard_steps"] == 1, (server, full, half)
            assert half["bytes"] * 2 == full["bytes"], (server, half["bytes"], full["bytes"])
            assert full["gap"] < 1e-6, (server, full["gap"])
            # float16: off by its rounding (values up to ~5), not more
            assert 1e-6 < half["gap"] < 1e-2, (server, half["gap"])
            assert full["memory"].abs().max().item() == 0, server
            assert half["memory"].abs().max().item() > 0 and half["server_memory"] == 0, server
            assert torch.equal(half["memory"], half["rounding"]), server


def test_guard_payload_in_float16():
    """float16 for the guard's step: rounded, clamped to 1/W of float16's range (the excess owed,
    not lost), inf and NaN kept (so the sum shows them and the step is skipped)."""
    from ciuicflow.compression.base import guard_payload

    total = torch.tensor([1.0, 3.14159, 1e6, -1e6, float("inf"), float("-inf"), float("nan")])
    same, nothing = guard_payload(total, 4, half=False)
    assert same is total and nothing is None
    sent, owed = guard_payload(total, 4, half=True)
    assert sent.dtype == torch.float16
    limit = torch.finfo(torch.float16).max / 4
    assert sent[0] == 1.0 and owed[0] == 0.0
    assert 0 < abs(owed[1].item()) < 2e-3 and sent[1].float() + owed[1] == total[1]
    assert abs(sent[2].item()) <= limit and sent[2].float() + owed[2] == 1e6
    assert sent[3].float() + owed[3] == -1e6
    assert sent[4].item() == float("inf") and sent[5].item() == float("-inf")
    assert sent[6].isnan()


def _powersgd_fp16_guard(rank, world):
    from ciuicflow.collectives.primitives import Traffic
    from ciuicflow.compression.powersgd import PowerSGDMemory, powersgd_all_reduce

    numel, segments = 24 * 16, [(0, (24, 16))]
    memory = PowerSGDMemory()
    options = dict(segments=segments, rank=1, hierarchical=False, guard="fp16",
                   guard_threshold=1e-6)
    # step 0 compressed (its measure is learnt in the next step's first all-reduce), step 1 the
    # guard's: the input plus the error, over W, in float16
    powersgd_all_reduce(_input(rank, 70, numel), memory, step=0, **options)
    contribution = (_input(rank, 71, numel) + memory.error) / world
    x, traffic = _input(rank, 71, numel), Traffic()
    powersgd_all_reduce(x, memory, step=1, traffic=traffic, **options)
    want = contribution.clone()
    torch.distributed.all_reduce(want)
    return {"guard_steps": traffic.guard_exact_steps, "gap": (x - want).abs().max().item(),
            "error": memory.error.clone(),
            "rounding": (contribution - contribution.half().float()) * world}


def test_powersgd_guard_fp16_step_keeps_its_rounding():
    for r in run_distributed(_powersgd_fp16_guard, 4, nodes=2):
        assert r["guard_steps"] == 1, r
        assert 1e-6 < r["gap"] < 1e-2, r["gap"]  # float16's rounding of the mean, not more
        assert r["error"].abs().max().item() > 0
        assert torch.equal(r["error"], r["rounding"])
