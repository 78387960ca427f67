"""The planner: its arithmetic, its CLI, and its prediction against a measurement on the simulated cluster.

Run as a script under torchrun, this file is also the measuring worker: it measures the machine's own
parameters (latency of a tiny all-reduce, intra-node bandwidth, 1-bit pack rate), then times all-reduces of
one tensor with each strategy. The test predicts those times from the machine parameters and the rate the
link was shaped to, and requires each prediction within 25% of the measurement.
"""
import argparse
import json
import sys

import pytest

from tests import REPO

ROOT = str(REPO)
from bench.comm import plan_calibration as cal  # the planner against the benches' records
from ciuicflow import plan as pl

NUMEL = 4 << 20  # 16 MiB of float32
RATE_BPS = 200e6
TOLERANCE = 0.25


# ------------------------------------------------------------------------------------ arithmetic

def test_parsers():
    assert pl.parse_count("7B") == 7e9 and pl.parse_count("25M") == 25e6 and pl.parse_count(3e5) == 3e5
    assert pl.parse_bandwidth("600GB/s") == 600e9
    assert pl.parse_bandwidth("200Gbit/s") == pl.parse_bandwidth("200gbit") == 25e9
    assert pl.parse_bandwidth("100Gb/s") == 12.5e9 and pl.parse_bandwidth("1GiB/s") == 2 ** 30
    assert pl.parse_seconds("5us") == pytest.approx(5e-6) and pl.parse_seconds("1.5ms") == pytest.approx(1.5e-3)
    for parse, bad in ((pl.parse_count, "seven"), (pl.parse_count, "0"), (pl.parse_bandwidth, "fast"),
                       (pl.parse_bandwidth, "0GB/s"), (pl.parse_seconds, "-1s"), (pl.parse_seconds, "5 days")):
        with pytest.raises(ValueError):
            parse(bad)


def test_planner_defaults_are_the_hooks_defaults():
    import ciuicflow

    assert pl.POWERSGD_RANK == ciuicflow.PowerSGDState().rank
    assert pl.estimate("powersgd", _cluster(), pl.Workload(params=1e6, optimizer="adam")).rank \
        == ciuicflow.PowerSGDState().adaptive_rank
    # every compressing method of the registry is a strategy, with the hooks' chunk size
    from ciuicflow.compression import registry
    assert set(registry.compressed_methods()) <= set(pl.STRATEGIES)
    for state, family in ((ciuicflow.OneBitState(), "onebit"), (ciuicflow.Int8State(), "int8")):
        assert state.chunk_size == registry.FAMILIES[family].cost.chunk_size


def _cluster(nodes=2, gpus=2, intra=10e9, inter=1e9, lat=0.0):
    return pl.ClusterSpec(nodes, gpus, intra, inter, lat, lat)


def test_bytes_per_link_follow_the_algorithms():
    w = pl.Workload(params=1e6)
    d = 4e6
    flat = pl.estimate("flat_ring", _cluster(), w)
    assert flat.inter_node_bytes_per_node == pytest.approx(2 * 3 / 4 * d)  # ring over 4 ranks, node order
    hier = pl.estimate("hierarchical", _cluster(), w)
    assert hier.inter_node_bytes_per_node == pytest.approx(d)  # 2 (N-1)/N of the tensor
    assert hier.intra_node_bytes_per_gpu == pytest.approx(d)  # reduce-scatter + all-gather, 2 (G-1)/G
    one = pl.estimate("hierarchical_1bit", _cluster(), w)
    # signs, a scale and, at most, 4 values (3 bytes each) per 256-element chunk (compression.outliers)
    assert one.inter_node_bytes_per_node == pytest.approx(1e6 * (1 / 8 + (4 + 12) / 256))
    assert hier.inter_node_bytes_per_node / one.inter_node_bytes_per_node > 20
    # a gradient whose windows are not concentrated sends the signs and scales alone; the share of
    # chunks with values is found back from the bytes one rank sent
    plain = pl.estimate("hierarchical_1bit", _cluster(), pl.Workload(params=1e6, values_share=0.0))
    assert plain.inter_node_bytes_per_node == pytest.approx(1e6 * (1 / 8 + 4 / 256))
    some = pl.estimate("hierarchical_1bit", _cluster(), pl.Workload(params=1e6, values_share=0.3))
    per_rank = some.inter_node_bytes_per_node / _cluster().gpus_per_node
    assert cal.fit_values_share(per_rank, "hierarchical_1bit", _cluster(), w) == pytest.approx(0.3)
    assert cal.fit_values_share(per_rank, "hierarchical", _cluster(), w) == 0.0  # sends no values
    with pytest.raises(ValueError, match="values_share"):
        pl.Workload(params=1e6, values_share=1.5)
    square = pl.Workload(params=1e6, matrix_shapes=[(1000, 1000)])
    ps = pl.estimate("hierarchical_powersgd", _cluster(), square, rank=4)
    assert ps.inter_node_bytes_per_node == pytest.approx(2000 * 4 * 4)  # P and Q, 4 bytes, 2 (N-1)/N = 1
    assert pl.estimate("flat_ring", _cluster(nodes=1, gpus=1), w).comm_seconds == 0


def test_one_bit_exchanges_in_one_phase_up_to_four_nodes():
    """1 bit's own codec goes in one phase up to four exchanging ranks (registry.ONE_PHASE_RANKS,
    QuantizedCompressor.two_phases): N-1 packed copies per node, not two phases' 2(N-1)/N; beyond,
    two phases whose servers send int4 (registry.SERVER_FAMILY): (N-1)/N of the workers' packed
    bytes and as much of the servers'; int8 always in two beyond two ranks."""
    w = pl.Workload(params=1e6)
    packed, served = 1e6 * (1 / 8 + (4 + 12) / 256), 1e6 * (4 / 8 + 4 / 256)
    for nodes, sent in ((2, packed), (3, 2 * packed), (4, 3 * packed),
                        (5, 4 / 5 * (packed + served)), (8, 7 / 8 * (packed + served))):
        # (flat onebit with one rank per node: the same exchange among the nodes)
        for method, gpus in (("hierarchical_1bit", 2), ("onebit", 1), ("fsdp_hierarchical_1bit", 2)):
            got = pl.estimate(method, _cluster(nodes=nodes, gpus=gpus), w)
            assert got.inter_node_bytes_per_node == pytest.approx(sent), (method, nodes, gpus)
            one_phase = 2 < nodes <= 4
            assert ("inter_all_to_all" in got.parts or "all_to_all" in got.parts) != one_phase or \
                nodes == 2, (method, nodes, gpus, got.parts)
        int8 = pl.estimate("hierarchical_int8", _cluster(nodes=nodes), w)
        assert int8.inter_node_bytes_per_node == pytest.approx(2 * (nodes - 1) / nodes * 1e6 * (1 + 4 / 256))
    # --server-codec: what the servers send beyond four nodes (the workers' 1 bit unchanged)
    refined = 1e6 * (1 / 8 + 4 / 256 + 0.1 * 96 / 256)  # a tenth of the chunks' 96-byte int4 blocks
    for codec, served_bytes in (("onebit_int4", refined), ("same", packed), ("int4", served),
                                ("auto", served)):
        got = pl.estimate("hierarchical_1bit", _cluster(nodes=8), pl.Workload(params=1e6, server_codec=codec))
        assert got.inter_node_bytes_per_node == pytest.approx(7 / 8 * (packed + served_bytes)), codec
        four = pl.estimate("hierarchical_1bit", _cluster(nodes=4), pl.Workload(params=1e6, server_codec=codec))
        assert four.inter_node_bytes_per_node == pytest.approx(3 * packed), codec  # one phase there
    with pytest.raises(ValueError, match="server_codec"):
        pl.Workload(params=1e6, server_codec="int2")


def test_phases_are_costed_as_the_states_take_them(capsys):
    """Workload.phases (``--phases``) follows the states' ``phases`` (registry.two_phases): 2 costs
    two phases on three and four nodes too, with 1 bit from the servers unless ``server_codec``
    names a codec (then that, as QuantizedCompressor.server_codec_for sends it); 1 costs N-1
    copies on any N; int8 follows the option too."""
    packed = 1e6 * (1 / 8 + (4 + 12) / 256)
    refined = 1e6 * (1 / 8 + 4 / 256 + 0.1 * 96 / 256)
    for nodes in (3, 4, 8):
        two = pl.estimate("hierarchical_1bit", _cluster(nodes=nodes), pl.Workload(params=1e6, phases=2))
        assert two.inter_node_bytes_per_node == pytest.approx((nodes - 1) / nodes * 2 * packed), nodes
        assert "inter_all_to_all" in two.parts
        asked = pl.estimate("hierarchical_1bit", _cluster(nodes=nodes),
                            pl.Workload(params=1e6, phases=2, server_codec="onebit_int4"))
        assert asked.inter_node_bytes_per_node == pytest.approx((nodes - 1) / nodes * (packed + refined))
        one = pl.estimate("hierarchical_1bit", _cluster(nodes=nodes), pl.Workload(params=1e6, phases=1))
        assert one.inter_node_bytes_per_node == pytest.approx((nodes - 1) * packed), nodes
        int8 = pl.estimate("hierarchical_int8", _cluster(nodes=nodes), pl.Workload(params=1e6, phases=1))
        assert int8.inter_node_bytes_per_node == pytest.approx((nodes - 1) * 1e6 * (1 + 4 / 256))
    # two nodes with phases=2 and a named server codec: the servers send it there too
    two_nodes = pl.estimate("hierarchical_1bit", _cluster(nodes=2),
                            pl.Workload(params=1e6, phases=2, server_codec="onebit_int4"))
    assert two_nodes.inter_node_bytes_per_node == pytest.approx(0.5 * (packed + refined))
    # the CLI's flag reaches the workload
    from ciuicflow.plan.cli import _build
    parser = argparse.ArgumentParser()
    pl.add_arguments(parser)
    workload = _build(parser.parse_args(["--params", "1M", "--nodes", "4", "--phases", "2",
                                         "--server-codec", "onebit_int4"]))[1]
    assert workload.phases == 2 and workload.server_codec == "onebit_int4"
    assert _build(parser.parse_args(["--params", "1M", "--nodes", "4"]))[1].phases == "auto"
    assert pl.run(parser.parse_args(["--params", "1M", "--nodes", "4", "--phases", "2"])) == 0
    assert "phases=2, server_codec='auto'" in capsys.readouterr().out
    with pytest.raises(ValueError, match="phases"):
        pl.Workload(params=1e6, phases=3)


def test_under_adam_the_one_bit_methods_cost_their_adaptive_codec():
    """--optimizer adam: the 1-bit methods send an adaptive optimizer's gradients with their
    default policy, auto (docs/hooks.md, "Adaptive optimizers"): the ladder's first rung, int4, on
    every route and device, so they cost what hierarchical_int4 / int4 cost; the other methods do
    not change."""
    sgd, adam = pl.Workload(params=1e6), pl.Workload(params=1e6, optimizer="adam")
    for nodes in (2, 4):
        for ours, int4 in (("hierarchical_1bit", "hierarchical_int4"), ("onebit", "int4"),
                           ("fsdp_hierarchical_1bit", "fsdp_hierarchical_int4"), ("fsdp_onebit", "fsdp_int4")):
            under_adam = pl.estimate(ours, _cluster(nodes=nodes), adam)
            assert under_adam.inter_node_bytes_per_node == pytest.approx(
                pl.estimate(int4, _cluster(nodes=nodes), sgd).inter_node_bytes_per_node), (ours, nodes)
            # (FSDP's parameter all-gathers do not change; flat onebit's phases differ by codec)
            if ours == "hierarchical_1bit":
                # int4: 4.125 bits per element; DDP's 1-bit at most 1.5 (4 values per chunk of a
                # concentrated window, compression.outliers); 1.125 without them would give 3.7.
                # SGD's 1 bit goes in one phase on four nodes: 3 copies against two phases' 1.5
                copies = 2 if nodes == 4 else 1
                assert under_adam.inter_node_bytes_per_node > 2.5 / copies * pl.estimate(
                    ours, _cluster(nodes=nodes), sgd).inter_node_bytes_per_node, ours
    assert pl.estimate("hierarchical_1bit", _cluster(), adam).inter_node_bytes_per_node == pytest.approx(
        1e6 * (4 / 8 + 4 / 256))
    for other in ("hierarchical_int8", "int4", "hierarchical", "flat_ring"):
        assert pl.estimate(other, _cluster(), adam).as_dict() == pl.estimate(other, _cluster(), sgd).as_dict()
    # PowerSGD sends an adaptive optimizer's tensors at twice its rank (compression.powersgd)
    for ranked in ("hierarchical_powersgd", "powersgd"):
        under_adam = pl.estimate(ranked, _cluster(), adam)
        assert under_adam.rank == 32
        assert under_adam.as_dict() == pl.estimate(ranked, _cluster(), sgd, rank=32).as_dict()
        assert pl.estimate(ranked, _cluster(), adam, rank=8).as_dict() == \
            pl.estimate(ranked, _cluster(), sgd, rank=8).as_dict()
    with pytest.raises(ValueError, match="optimizer"):
        pl.Workload(params=1e6, optimizer="rmsprop")


def test_flat_methods_cost_the_flat_route():
    """A flat hook is flat: onebit, int8 and int4 exchange over every rank, so on whole nodes of
    several ranks they send more inter-node bytes than their hierarchical hooks (whose exact node
    sum leaves one exchanging rank per node's shard), under SGD and Adam alike (at least 1.3x:
    eight flat ranks in two phases against four nodes' one phase of 1 bit)."""
    for workload in (pl.Workload(params=1e6), pl.Workload(params=1e6, optimizer="adam")):
        for nodes in (2, 4):
            for method in ("onebit", "int8", "int4"):
                flat = pl.estimate(method, _cluster(nodes=nodes), workload)
                hier = pl.estimate(f"hierarchical_{method.replace('onebit', '1bit')}",
                                   _cluster(nodes=nodes), workload)
                assert flat.inter_node_bytes_per_node > 1.25 * hier.inter_node_bytes_per_node, \
                    (method, nodes, workload.optimizer)
    # one node: the flat exchange is compressed, the hierarchical hook's is the exact ring
    one_node = pl.estimate("onebit", _cluster(nodes=1, gpus=4), pl.Workload(params=1e6))
    assert one_node.as_dict()["intra_node_bytes_per_gpu"] < pl.estimate(
        "hierarchical_1bit", _cluster(nodes=1, gpus=4),
        pl.Workload(params=1e6)).as_dict()["intra_node_bytes_per_gpu"] / 10


def test_the_adaptive_optimizer_option_costs_the_codec_it_names():
    """--adaptive-optimizer: the 1-bit states' adaptive_optimizer; int8 sends 8 bits and a scale,
    int4 4 bits and a scale, "same" 1-bit's own bytes (its values counted, as under SGD); the
    default is auto's."""
    def inter(method, **kw):
        return pl.estimate(method, _cluster(), pl.Workload(params=1e6, **kw)).inter_node_bytes_per_node

    for method in ("hierarchical_1bit", "fsdp_hierarchical_1bit"):
        assert inter(method, optimizer="adam", adaptive_optimizer="int4") == pytest.approx(
            1e6 * (4 / 8 + 4 / 256)), method
        assert inter(method, optimizer="adam", adaptive_optimizer="int8") == pytest.approx(
            inter(method.replace("1bit", "int8"))), method
        # the default, auto, is costed at its first rung, int4
        assert inter(method, optimizer="adam", adaptive_optimizer="int4") == pytest.approx(
            inter(method, optimizer="adam")) == pytest.approx(
            inter(method, optimizer="adam", adaptive_optimizer="auto")) == pytest.approx(
            inter(method.replace("1bit", "int4"))), method
        assert inter(method, optimizer="adam", adaptive_optimizer="same") == pytest.approx(
            inter(method)), method
    # only the methods that have an adaptive codec change
    assert inter("hierarchical_powersgd", optimizer="adam", adaptive_optimizer="int8") == \
        inter("hierarchical_powersgd", optimizer="adam")
    with pytest.raises(ValueError, match="adaptive_optimizer"):
        pl.Workload(params=1e6, optimizer="adam", adaptive_optimizer="onebit")


def test_the_adaptive_codecs_bytes_are_what_they_pack():
    """ciuicflow.formats, which plan costs (registry.adaptive_bytes_per_element), against the bytes
    each codec of the 1-bit compressor really packs (payload plus float32 scales) for whole chunks:
    256 elements, or the codec's own chunk where it has one (and the compressor gives it that one),
    and for a trimmed last chunk."""
    import torch
    from ciuicflow import formats
    from ciuicflow.compression import policy, registry
    from ciuicflow.compression.onebit import OneBitCompressor

    assert set(OneBitCompressor.adaptive_codecs) == set(registry.ADAPTIVE_CODECS)
    assert policy.ADAPTIVE_OPTIMIZER_POLICIES[-1] == "same"
    chunks = 7
    for name, codec in OneBitCompressor.adaptive_codecs.items():
        payload_bytes, granule = formats.FORMATS[name]
        assert codec.granule % granule == 0, name
        chunk = OneBitCompressor().chunk_size
        assert chunk == 256, name
        for numel in (chunks * chunk, chunks * chunk - 5):  # whole chunks, and a trimmed last one
            x = torch.randn(numel)
            payload, scales = codec.pack(x, torch.zeros_like(x), chunk)
            assert payload.numel() * payload.element_size() == payload_bytes(numel, chunk), name
            assert scales.numel() == chunks, name
        sent = payload_bytes(chunks * chunk, chunk) + formats.SCALE_BYTES * chunks
        assert sent == round(registry.adaptive_bytes_per_element(name, 256) * chunks * chunk), name
        if name in registry.FAMILIES:  # a codec that is a method of its own costs the same there
            assert formats.bytes_per_element(name, chunk) == \
                registry.FAMILIES[name].cost.payload_bits / 8 + 4 / chunk


def test_fsdp_strategies_follow_fsdp2_and_the_registry():
    from ciuicflow.compression import registry

    assert pl.HSDP_STRATEGIES[0] == "fsdp_hsdp" and set(pl.HSDP_STRATEGIES) <= set(pl.FSDP_STRATEGIES)
    assert {s.removeprefix("fsdp_") for s in pl.HSDP_STRATEGIES[1:]} == {
        n for n in registry.compressed_methods() if registry.method(n).hierarchical}
    w = pl.Workload(params=1e6)
    d = 4e6
    hsdp = pl.estimate("fsdp_hsdp", _cluster(), w)
    # per node: each of G ranks all-reduces its 1/G shard over N nodes: 2 (N-1)/N of the tensor
    assert hsdp.inter_node_bytes_per_node == pytest.approx(d)
    # per GPU inside the node: two parameter all-gathers and a gradient reduce-scatter
    assert hsdp.intra_node_bytes_per_gpu == pytest.approx(3 * d / 2)
    one = pl.estimate("fsdp_hierarchical_1bit", _cluster(), w)
    # signs, a scale and, at most, 4 values (3 bytes each) per 256-element chunk (HSDP's replicas
    # send them where a window is concentrated, as DDP's hooks)
    assert one.inter_node_bytes_per_node == pytest.approx(1e6 * (1 / 8 + (4 + 12) / 256))
    assert one.comm_seconds < hsdp.comm_seconds
    square = pl.Workload(params=1e6, matrix_shapes=[(1000, 1000)])
    ps = pl.estimate("fsdp_hierarchical_powersgd", _cluster(), square, rank=4)
    # a shard is a 500 x 1000 matrix: per rank P 500x4 and Q 1000x4, all-reduced over 2 nodes
    assert ps.inter_node_bytes_per_node == pytest.approx(2 * (500 + 1000) * 4 * 4)
    with pytest.raises(ValueError, match="unknown strategy"):
        pl.estimate("fsdp_powersgd", _cluster(), w)  # its factors do not reduce-scatter


def test_fsdp_over_every_rank():
    from ciuicflow.fsdp.state import scatter_methods

    # the methods ciuicflow.fsdp takes with a 1-D mesh, found without importing the compressors
    assert pl.ONE_DIM_STRATEGIES == ("fsdp",) + tuple("fsdp_" + m for m in scatter_methods())
    assert set(pl.ONE_DIM_STRATEGIES) <= set(pl.FSDP_STRATEGIES) and "fsdp" in pl.EXACT_STRATEGIES
    w = pl.Workload(params=1e6)
    d = 4e6
    # two parameter all-gathers and a gradient reduce-scatter, each a ring over the 4 ranks in node
    # order: (p-1)/p of the tensor over each node's link
    exact = pl.estimate("fsdp", _cluster(), w)
    assert exact.inter_node_bytes_per_node == pytest.approx(3 * 3 / 4 * d)
    assert exact.parts["grad_reduce_scatter"] == pytest.approx(exact.parts["param_all_gather"] / 2)
    gloo = pl.ClusterSpec(2, 2, 10e9, 1e9, 0.0, 0.0, backend="gloo")  # its reduce-scatter: an all-reduce
    assert pl.estimate("fsdp", gloo, w).inter_node_bytes_per_node == pytest.approx(4 * 3 / 4 * d)
    for method, bits in (("onebit", 1), ("int8", 8)):
        packed = 1e6 * (bits / 8 + 4 / 256)
        e = pl.estimate("fsdp_" + method, gloo, w)  # the same whatever the backend
        # the all-gathers, and one all-to-all of packed rows: G ranks x (p-G)/p of them per node
        assert e.inter_node_bytes_per_node == pytest.approx(2 * 3 / 4 * d + 2 * 2 / 4 * packed)
        assert e.compress_seconds == pytest.approx(1e6 * w.local_seconds_per_element)
        assert e.inter_node_bytes_per_node < exact.inter_node_bytes_per_node
    # one node: nothing crosses
    assert pl.estimate("fsdp_onebit", _cluster(nodes=1, gpus=4), w).inter_node_bytes_per_node == 0
    with pytest.raises(ValueError, match="backend"):
        pl.ClusterSpec(2, 2, 1e9, 1e9, backend="mpi")


# python -m bench.fsdp --smoke (MLP 4 x Linear(224), 201600 parameters, 2 nodes x 2 ranks, gloo,
# 1 Gbit/s): inter-node bytes per step, all nodes, from the node links' counters (TCP/IP headers
# included), and ciuicflow's own count of its compressed reduce-scatter's (state.stats())
SMOKE_LINK_BYTES = {"hsdp": 1641216, "fsdp": 4921562, "fsdp:onebit": 2533557, "fsdp:int8": 2884264}
SMOKE_CIUICFLOW_BYTES = {"fsdp:onebit": 57984, "fsdp:int8": 409984}


def test_fsdp_bytes_match_the_bench():
    shape = {"params": 201600, "width": 224, "layers": 4}
    records = [{"method": m, "step_seconds": 1.0, "inter_node_bytes_per_step": b, **shape}
               for m, b in SMOKE_LINK_BYTES.items()]
    records.append({"method": "no_comm", "step_seconds": 0.004, "shaped": True, "rate_bps": 1e9, **shape})
    machine = {"nodes": 2, "ranks_per_node": 2, "alpha": 3e-4}  # bytes do not depend on the probe
    rows = {r["method"]: r for r in cal.calibrate_fsdp(records, machine)}
    assert set(rows) == set(SMOKE_LINK_BYTES)
    for method, row in rows.items():  # the links also carry headers and the barriers' bytes
        assert -0.03 < row["bytes_error"] <= 0, (method, row)
    # gloo: two all-gathers of 3/4 of the parameters per node, and the exact reduce-scatter as many
    gathers = 2 * 2 * 3 / 4 * 201600 * 4
    assert rows["fsdp"]["predicted_inter_node_bytes"] == pytest.approx(2 * gathers)
    for method, nbytes in SMOKE_CIUICFLOW_BYTES.items():  # the all-to-all alone (rows padded to
        # whole chunks and three float32 of flags each: 2% more than the model's bytes per element)
        assert rows[method]["predicted_inter_node_bytes"] - gathers == pytest.approx(nbytes, rel=0.03)


def test_fsdp_compute_is_fitted_on_the_probed_shard_reductions():
    """The FSDP calibration reads the 1-bit cost per element and PowerSGD's rate off the probe's own
    inter-node reductions of a shard: timings made by the model from known values give those values back,
    and the predictions use them."""
    machine = {"nodes": 2, "ranks_per_node": 2, "alpha": 2e-4, "intra_bw": 3e8, "intra_alpha": 2e-3,
               "matmul_flops": 3e9, "shard_cols": 500, "powersgd_rank": 8}
    cluster = cal.machine_cluster(machine, 1e9)
    numel, local, flops = 300 * 500, 6e-9, 2e10
    bare = pl.Workload(params=numel * 2, matrix_shapes=[(600, 500)], local_seconds_per_element=0.0,
                       matmul_flops=float("inf"), bucket_bytes=float("inf"))

    def inter(strategy):
        return sum(v for k, v in pl.estimate(strategy, cluster, bare, 8).parts.items() if "inter" in k)

    machine["sizes"] = {str(numel): {
        "cross_node_1bit": inter("fsdp_hierarchical_1bit") + numel * local,
        "cross_node_powersgd": inter("fsdp_hierarchical_powersgd") + numel * local + 6 * 8 * numel / flops}}
    shape = {"params": 4 * (1000 * 1000 + 1000), "width": 1000, "layers": 4}
    records = [{"method": m, "step_seconds": 1.0, "inter_node_bytes_per_step": 1, **shape}
               for m in ("hierarchical_1bit", "hierarchical_powersgd")]
    records.append({"method": "no_comm", "step_seconds": 0.2, "shaped": True, "rate_bps": 1e9, **shape})
    rows = {r["method"]: r for r in cal.calibrate_fsdp(records, machine)}
    for row in rows.values():
        assert row["local_seconds_per_element"] == pytest.approx(local, rel=1e-6)
        assert row["matmul_flops"] == pytest.approx(flops, rel=1e-6)
    w = pl.Workload(params=shape["params"], compute_seconds=0.2, matrix_shapes=[(1000, 1000)] * 4,
                    local_seconds_per_element=local, matmul_flops=flops, bucket_bytes=shape["params"])
    expected = pl.estimate("fsdp_hierarchical_powersgd", cluster, w).step_seconds
    assert rows["hierarchical_powersgd"]["predicted_step_seconds"] == pytest.approx(expected)
    # without the shard probe: the probed matmul rate, as before
    del machine["shard_cols"]
    assert cal.calibrate_fsdp(records, machine)[0]["matmul_flops"] == 3e9


def test_fsdp_calibration_costs_what_the_run_sent_under_adam():
    """bench/fsdp trains with Adam: PowerSGD's default sends those groups at its adaptive rank
    (twice the rank), and its 1-bit rows send their own codec (adaptive_optimizer='same'); the
    planner's rows must cost that, not SGD's rank 16 (they predicted half the bytes measured)."""
    shape = {"params": 4 * (1000 * 1000 + 1000), "width": 1000, "layers": 4}
    machine = {"nodes": 2, "ranks_per_node": 2, "alpha": 3e-4}
    no_comm = {"method": "no_comm", "step_seconds": 0.2, "shaped": True, "rate_bps": 1e9, **shape}

    def predicted(**run):
        records = [{"method": m, "step_seconds": 1.0, "inter_node_bytes_per_step": 1, **shape, **run}
                   for m in ("hsdp", "hierarchical_1bit", "hierarchical_powersgd")]
        return {r["method"]: r["predicted_inter_node_bytes"]
                for r in cal.calibrate_fsdp(records + [no_comm], machine)}

    sgd, adam = predicted(), predicted(optimizer="adam", adaptive_optimizer="same")
    # (the biases go uncompressed: a little under twice)
    assert adam["hierarchical_powersgd"] == pytest.approx(2 * sgd["hierarchical_powersgd"], rel=0.02)
    assert adam["hierarchical_1bit"] == sgd["hierarchical_1bit"]  # its own codec: 1 bit
    assert adam["hsdp"] == sgd["hsdp"]
    # the 1-bit default under Adam sends another codec: more bytes than 1 bit
    assert predicted(optimizer="adam")["hierarchical_1bit"] > 1.5 * sgd["hierarchical_1bit"]


def test_time_model_and_recommendation():
    w = pl.Workload(params=25e6, compute_seconds=0.4)
    c = _cluster(inter=125e6)
    flat = pl.estimate("flat_ring", c, w)
    assert flat.comm_seconds == pytest.approx(2 * 3 / 4 * 100e6 / 125e6, rel=0.02)
    assert flat.step_seconds == pytest.approx(0.4 + flat.comm_seconds)
    # more accumulation: the same communication over more compute
    accum = pl.estimate("flat_ring", c, pl.Workload(params=25e6, compute_seconds=0.4, accum=4))
    assert accum.comm_seconds == pytest.approx(flat.comm_seconds) and accum.step_seconds > flat.step_seconds
    # latency matters for a flat ring over many ranks, much less for the hierarchical one
    big = pl.ClusterSpec(128, 8, 600e9, 25e9, 5e-6, 15e-6)
    tiny = pl.Workload(params=1e3)
    assert pl.estimate("flat_ring", big, tiny).comm_seconds > 5 * pl.estimate("hierarchical", big, tiny).comm_seconds
    best, why = pl.recommend(pl.plan(c, w))
    assert best.strategy not in pl.EXACT_STRATEGIES and "faster" in why  # a slow link: compress
    # with a fast network nothing is worth compressing
    fast = _cluster(inter=1e12, intra=1e12)
    best, why = pl.recommend(pl.plan(fast, w))
    assert best.strategy in pl.EXACT_STRATEGIES, (best.name, why)
    # only compressed strategies asked for: the fastest of them, never called exact
    best, why = pl.recommend(pl.plan(c, w, strategies=["hierarchical_1bit", "hierarchical_int8"]))
    assert best.strategy == "hierarchical_1bit" and "exact" not in why.replace("none of them exact", "")
    with pytest.raises(ValueError):
        pl.estimate("carrier_pigeon", c, w)
    with pytest.raises(ValueError):
        pl.ClusterSpec(0, 8, 1e9, 1e9)


def test_cli(tmp_path, capsys):
    parser = argparse.ArgumentParser()
    pl.add_arguments(parser)
    out = tmp_path / "plan.json"
    rc = pl.run(parser.parse_args(["--model", "7B", "--nodes", "16", "--gpus-per-node", "8", "--json", str(out)]))
    text = capsys.readouterr().out
    assert rc == 0 and "Recommended:" in text and "| flat_ring |" in text
    data = json.loads(out.read_text())
    assert data["recommended"] in {e["name"] for e in data["estimates"]}
    assert data["cluster"]["inter_bw"] == 25e9
    rc = pl.run(parser.parse_args(["--model", "7B", "--nodes", "16", "--fsdp", "--backend", "gloo"]))
    text = capsys.readouterr().out
    assert rc == 0 and "vs fsdp_hsdp" in text  # FSDP over every rank beside HSDP
    assert all(f"| {s} |" in text for s in pl.FSDP_STRATEGIES if s not in pl.RANKED)
    # the share of 1-bit chunks that send values: the upper bound by default, 0 the plain bytes
    one = ["--model", "7B", "--nodes", "4", "--strategies", "hierarchical_1bit", "--json", str(out)]
    sent = []
    for extra in ([], ["--values-share", "0"]):
        assert pl.run(parser.parse_args(one + extra)) == 0
        sent.append(json.loads(out.read_text())["estimates"][0]["inter_node_bytes_per_node"])
    assert sent[1] / sent[0] == pytest.approx((1 / 8 + 4 / 256) / (1 / 8 + 16 / 256))
    rc = pl.run(parser.parse_args(one + ["--values-share", "2"]))
    assert rc == 2 and "values_share" in capsys.readouterr().err
    rc = pl.run(parser.parse_args(["--model", "lots", "--nodes", "2"]))
    assert rc == 2 and "cannot parse" in capsys.readouterr().err
    # the adaptive optimizer's codec: said, costed, and refused without --optimizer adam
    adam = ["--model", "7B", "--nodes", "4", "--strategies", "hierarchical,hierarchical_1bit", "--optimizer", "adam"]
    rc = pl.run(parser.parse_args(adam + ["--adaptive-optimizer", "same", "--json", str(out)]))
    text = capsys.readouterr().out
    assert rc == 0 and "as same" in text and "OneBitAdam" in text
    assert json.loads(out.read_text())["workload"]["adaptive_optimizer"] == "same"
    rc = pl.run(parser.parse_args(adam))
    assert rc == 0 and "their default, auto: int4, a bucket raised to int8" in capsys.readouterr().out
    rc = pl.run(parser.parse_args(adam[:-2] + ["--adaptive-optimizer", "int8"]))
    assert rc == 2 and "--optimizer adam" in capsys.readouterr().err


# ------------------------------------------------------------------------------------ measured

FIT_NUMEL = NUMEL // 2  # the 1-bit local work per element is fitted here and predicted at NUMEL


def _worker():
    import torch
    import torch.distributed as dist

    from bench.comm.probe import probe_machine

    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    machine = probe_machine([FIT_NUMEL, NUMEL])
    if dist.get_rank() == 0:
        sys.stdout.write("RESULT " + json.dumps(machine) + "\n")  # one write: other ranks share the pipe
        sys.stdout.flush()
    dist.barrier()
    dist.destroy_process_group()


def _measure():
    from ciuicflow.testing.cluster import SimCluster, netns_available
    ok, why = netns_available()
    if not ok:
        pytest.skip(f"needs network namespaces to shape a link ({why})")
    with SimCluster(nodes=2, ranks_per_node=2, rate=RATE_BPS, require_netns=True) as cluster:
        run = cluster.torchrun(["-m", "tests.plan.test_plan"], timeout=300)
    assert run.ok, "\n".join(run.outputs)
    line = next(ln for out in run.outputs for ln in out.splitlines() if ln.startswith("RESULT "))
    return json.loads(line[7:])


def _predicted_against(m: dict) -> tuple:
    """(report, largest |error|) of the model's times against one measurement ``m``. Exact strategies:
    predicted from the shaped rate, the probed latency and intra-node bandwidth alone. 1-bit: its
    local work per element and the share of its chunks that send values (the data's) are fitted on
    a tensor half the size, then the full size is predicted: its time and (asserted here) its bytes."""
    # a ciuicflow collective that failed is a failure, not an expected one
    assert "ciuicflow_error" not in m, m["ciuicflow_error"]
    cluster = cal.machine_cluster(m, RATE_BPS)
    measured = m["sizes"][str(NUMEL)]
    assert "flat_ring" in measured and "hierarchical_1bit" in measured, measured
    fit = cal.probed_workload(m, cluster, FIT_NUMEL)
    share = fit.values_share
    local = cal.fit_local_seconds_per_element(m["sizes"][str(FIT_NUMEL)]["hierarchical_1bit"],
                                             "hierarchical_1bit", cluster, fit)
    predicted = pl.estimate("hierarchical_1bit", cluster, pl.Workload(params=NUMEL, values_share=share))
    sent = m["inter_bytes"][str(NUMEL)]["hierarchical_1bit"] * cluster.gpus_per_node
    assert predicted.inter_node_bytes_per_node == pytest.approx(sent, rel=0.02), \
        (share, cal.probed_workload(m, cluster, NUMEL).values_share, m["inter_bytes"])
    workload = pl.Workload(params=NUMEL, local_seconds_per_element=local, values_share=share)
    checked = {}
    for strategy, seconds in measured.items():
        predicted = pl.estimate(strategy, cluster, workload).comm_seconds
        checked[strategy] = (predicted, seconds, predicted / seconds - 1)
    report = "\n".join(f"{s}: predicted {p:.3f} s, measured {q:.3f} s ({e:+.0%})" for s, (p, q, e) in
                       checked.items())
    report += (f"\nmachine: alpha {m['alpha'] * 1e6:.0f} us, intra {m['intra_bw'] / 1e9:.2f} GB/s "
               f"+ {m.get('intra_alpha', 0) * 1e6:.0f} us, "
               f"1-bit local work {local * 1e9:.1f} ns/element, chunks sending values {share:.0%}")
    return report, max(abs(e) for _, _, e in checked.values())


@pytest.mark.timeout(600)
def test_prediction_within_25_percent_of_the_simulated_cluster():
    """Every strategy's predicted time within 25% of the measured one (``_predicted_against``). The
    1-bit all-reduce takes ~40 ms, where the load of a shared machine moved one measurement by 25%
    (in CI): a second measurement on a fresh cluster is taken after a miss, and the model
    must hold on it. A wrong model misses both."""
    reports = []
    for _ in range(2):
        report, worst = _predicted_against(_measure())
        print(report)
        reports.append(report)
        if worst <= TOLERANCE:
            return
    pytest.fail("\n---\n".join(reports))


if __name__ == "__main__":
    _worker()


def test_powersgd_ranks_default_to_the_accurate_one(capsys):
    """The planner costs PowerSGD at its default rank (lower ranks lost accuracy in
    bench/convergence); a lower rank a user asks for is recommended with a caution."""
    w = pl.Workload(params=7e9, hidden=4096)
    c = pl.ClusterSpec(128, 8, 600e9, 25e9, 5e-6, 15e-6)
    ranked = {e.rank for e in pl.plan(c, w) if e.rank is not None}
    assert ranked == {pl.POWERSGD_RANK} == {16}
    adam = pl.Workload(params=7e9, hidden=4096, optimizer="adam")
    assert {e.rank for e in pl.plan(c, adam) if e.rank is not None} == {32}
    low = [e for e in pl.plan(c, w, ranks=(1,)) if e.strategy == "hierarchical_powersgd"][0]
    _, why = pl.recommend([low, pl.estimate("flat_ring", c, w)])
    assert "below PowerSGD's default (16)" in why
    default = [e for e in pl.plan(c, w) if e.strategy == "hierarchical_powersgd"][0]
    _, why = pl.recommend([default, pl.estimate("flat_ring", c, w)])
    assert "below" not in why
    parser = argparse.ArgumentParser()
    pl.add_arguments(parser)
    for bad in ("1,x", "0", ","):
        assert pl.run(parser.parse_args(["--model", "7B", "--nodes", "4", "--ranks", bad])) == 2
        assert "--ranks must be comma-separated positive integers" in capsys.readouterr().err
