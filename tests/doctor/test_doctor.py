"""ciuicflow doctor on recorded `nvidia-smi topo -m` outputs and a fake /sys tree."""
import json
import os

import pytest

from ciuicflow import cli, doctor
from ciuicflow.doctor import detect_interconnect, diagnose, parse_topo_matrix

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures", "nvidia_smi_topo")
NDR = "400 Gb/sec (4X NDR)"
HDR = "200 Gb/sec (4X HDR)"


def topo(name: str) -> str:
    with open(os.path.join(FIXTURES, name), encoding="utf-8") as handle:
        return handle.read()


def make_sys(root, rdma=(), nets=(), peermem=False) -> str:
    """A /sys stand-in: rdma = (device, port, state, rate, link_layer); nets = (name, state, mbit)."""
    for device, port, state, rate, layer in rdma:
        where = root / "class" / "infiniband" / device / "ports" / str(port)
        where.mkdir(parents=True)
        (where / "state").write_text({"ACTIVE": "4: ACTIVE", "DOWN": "1: DOWN"}[state] + "\n")
        (where / "rate").write_text(rate + "\n")
        (where / "link_layer").write_text(layer + "\n")
    for name, state, mbit in nets:
        where = root / "class" / "net" / name
        where.mkdir(parents=True)
        (where / "operstate").write_text(state + "\n")
        (where / "speed").write_text(f"{mbit}\n")
    if peermem:
        (root / "module" / "nvidia_peermem").mkdir(parents=True)
    return str(root)


SOFTWARE = {"torch": "2.13.0", "torch_cuda": "12.8", "cuda_available": False, "cuda_devices": 0,
            "gloo": True, "nccl": None, "ciuicflow": "0.1.0", "extension": True,
            "cuda_kernels": True}


def run_doctor(name, sys_root, env=None, nodes=None, software=SOFTWARE):
    return diagnose(topo(name) if name else "", sys_root=sys_root, environ=env or {},
                    nodes=nodes, software_info=software, topology_source=name)


def codes(d, level=None):
    return {f.code for f in d.findings if level is None or f.level == level}


def hooks(d):
    return [r.hook for r in d.recommendations if r.title.startswith("hook")]


# -- parsing ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name, gpus, islands, per_island, nvlinks, worst, local, nics", [
    ("dgx_a100_8x_nv12.txt", 8, [list(range(8))], 8, 12, "NV", None, 10),
    ("dgx_h100_8x_nv18.txt", 8, [list(range(8))], 8, 18, "NV", None, 8),
    ("pcie_4x_single_socket.txt", 4, [[0], [1], [2], [3]], 1, None, "PXB", None, 0),
    ("pcie_8x_l40s_2socket_switches.txt", 8, [[i] for i in range(8)], 1, None, "SYS", 4, 2),
    ("pcie_8x_a100_2socket_node_sys.txt", 8, [[i] for i in range(8)], 1, None, "SYS", 4, 2),
    ("pcie_4x_a6000_nvlink_pairs.txt", 4, [[0, 1], [2, 3]], 2, 4, "NODE", 2, 0),
])
def test_fixtures_parse_into_the_machine_shape(name, gpus, islands, per_island, nvlinks, worst,
                                               local, nics):
    ic = detect_interconnect(topo(name))
    assert ic.gpus == gpus
    assert ic.nvlink_islands == islands and ic.gpus_per_nvlink_island == per_island
    assert ic.min_nvlinks == nvlinks and ic.worst_gpu_link == worst
    assert ic.suggested_local_world_size == local
    assert len(ic.nics) == nics


def test_nic_names_affinity_and_nearest_nic():
    h100 = detect_interconnect(topo("dgx_h100_8x_nv18.txt"))  # NIC0.. rows + NIC Legend
    assert h100.nics == [f"mlx5_{i}" for i in range(8)]
    assert h100.nearest_nic[5] == {"nics": ["mlx5_5"], "link": "PIX"}
    assert h100.numa_of_gpu == {i: "0" if i < 4 else "1" for i in range(8)}
    assert h100.intra_node_gbps == 450.0
    a100 = detect_interconnect(topo("dgx_a100_8x_nv12.txt"))  # mlx5_N rows, no NIC Legend
    assert a100.nearest_nic[3] == {"nics": ["mlx5_2", "mlx5_3"], "link": "PXB"}
    assert a100.numa_of_gpu[0] == "3" and a100.intra_node_gbps == 300.0
    matrix = parse_topo_matrix(topo("dgx_a100_8x_nv12.txt"))
    assert matrix.cpu_affinity[6] == "80-95,208-223"
    assert matrix.links[("GPU0", "mlx5_8")] == "SYS" and matrix.links[("mlx5_8", "mlx5_9")] == "PIX"


def test_spaces_instead_of_tabs_parse_the_same():
    text = topo("dgx_h100_8x_nv18.txt")
    assert "\x1b[4m" in text  # the recorded header is underlined, as nvidia-smi prints it
    spaced = text.replace("\x1b[4m", "").replace("\x1b[0m", "").expandtabs(8)
    assert detect_interconnect(spaced) == detect_interconnect(text)


@pytest.mark.parametrize("text, message", [
    ("no GPU here\n", "no nvidia-smi topo -m matrix"),
    ("\tGPU0\tGPU1\nGPU0\t X \tNV2\nGPU1\tQQ\t X \n", "unknown link"),
    ("\tGPU0\tGPU1\nGPU0\t X \tPIX\n", "rows missing"),
    ("\tGPU0\tGPU1\nGPU0\tPIX\tPIX\nGPU1\tPIX\t X \n", "X on the diagonal"),
])
def test_bad_matrices_are_rejected(text, message):
    with pytest.raises(ValueError, match=message):
        parse_topo_matrix(text)


# -- recommendations -------------------------------------------------------------------------------------


def test_dgx_h100_with_ndr_infiniband_keeps_exact_reduction(tmp_path):
    sys_root = make_sys(tmp_path, rdma=[(f"mlx5_{i}", 1, "ACTIVE", NDR, "InfiniBand")
                                        for i in range(8)], peermem=True)
    d = run_doctor("dgx_h100_8x_nv18.txt", sys_root, nodes=16)
    assert hooks(d) == ["hierarchical_allreduce"]  # 3200 Gbit/s per node = 50 GB/s per GPU
    assert not codes(d, "warn") and not codes(d, "error") and d.exit_code == 0
    plan = next(r.command for r in d.recommendations if r.command)
    assert plan == ("ciuicflow plan --model 7B --nodes 16 --gpus-per-node 8 --intra-bw 450GB/s "
                    "--inter-bw 3200Gbit/s")


def test_storage_nics_do_not_count_as_gradient_bandwidth(tmp_path):
    sys_root = make_sys(tmp_path, rdma=[(f"mlx5_{i}", 1, "ACTIVE", HDR, "InfiniBand")
                                        for i in range(10)], peermem=True)
    d = run_doctor("dgx_a100_8x_nv12.txt", sys_root, nodes=4)
    plan = next(r.command for r in d.recommendations if r.command)
    assert "--inter-bw 1600Gbit/s" in plan  # mlx5_8/9 are nearest to no GPU
    assert hooks(d) == ["hierarchical_allreduce"]


def test_a_single_roce_port_calls_for_compression(tmp_path):
    sys_root = make_sys(tmp_path, rdma=[("mlx5_0", 1, "ACTIVE", "100 Gb/sec (4X EDR)", "Ethernet"),
                                        ("mlx5_1", 1, "DOWN", "100 Gb/sec (4X EDR)", "Ethernet")])
    d = run_doctor("pcie_8x_l40s_2socket_switches.txt", sys_root, nodes=4)
    assert hooks(d) == ["hierarchical_powersgd"]  # 100 Gbit/s shared by 8 GPUs
    assert {"rdma-port-down", "no-peermem"} <= codes(d, "warn")
    assert {"roce-gid", "nic-distance"} <= codes(d, "info")
    # GPUs 4-7 reach the NIC only across the socket link: beyond NCCL's default GDR level
    gdr = next(f for f in d.findings if f.code == "gdr-level")
    assert gdr.level == "info" and "[4, 5, 6, 7]" in gdr.message


def test_two_infiniband_ports_for_eight_gpus_call_for_1bit(tmp_path):
    sys_root = make_sys(tmp_path, rdma=[(f"mlx5_{i}", 1, "ACTIVE", HDR, "InfiniBand")
                                        for i in range(2)], peermem=True)
    d = run_doctor("pcie_8x_a100_2socket_node_sys.txt", sys_root, nodes=2)
    assert hooks(d) == ["hierarchical_1bit"]  # 400 Gbit/s / 8 GPUs = 6.25 GB/s per GPU


def test_tcp_only_two_socket_box(tmp_path):
    sys_root = make_sys(tmp_path, nets=[("eth0", "up", 25000), ("eth1", "up", 10000),
                                        ("docker0", "up", 10000), ("lo", "unknown", -1)])
    d = run_doctor("pcie_8x_a100_2socket_node_sys.txt", sys_root)  # nodes unknown: both cases
    assert hooks(d) == ["hierarchical_powersgd", "hierarchical_1bit"]
    single = d.recommendations[1]
    assert single.env == {"CIUICFLOW_LOCAL_WORLD_SIZE": "4"}  # a node per socket
    env = next(r.env for r in d.recommendations if r.title == "environment")
    assert env["NCCL_SOCKET_IFNAME"] == "eth0" and env["GLOO_SOCKET_IFNAME"] == "eth0"
    assert env["NCCL_DEBUG"] == "INFO"
    assert "no-rdma" in codes(d, "info")


@pytest.mark.parametrize("name, hook, env", [
    ("pcie_4x_a6000_nvlink_pairs.txt", "hierarchical_1bit", {"CIUICFLOW_LOCAL_WORLD_SIZE": "2"}),
    ("pcie_4x_single_socket.txt", None, {}),
    ("dgx_h100_8x_nv18.txt", None, {}),
    ("pcie_8x_l40s_2socket_switches.txt", "hierarchical_1bit", {"CIUICFLOW_LOCAL_WORLD_SIZE": "4"}),
])
def test_single_node_advice(tmp_path, name, hook, env):
    d = run_doctor(name, make_sys(tmp_path), nodes=1)
    hook_advice = [r for r in d.recommendations if r.title.startswith("hook")]
    assert [(r.title, r.hook, r.env) for r in hook_advice] == [("hook within one node", hook, env)]


# -- NCCL settings ----------------------------------------------------------------------------------------


@pytest.fixture
def h100_sys(tmp_path):
    return make_sys(tmp_path, rdma=[(f"mlx5_{i}", 1, "ACTIVE", NDR, "InfiniBand") for i in range(8)],
                    nets=[("eth0", "up", 100000), ("lo", "unknown", -1)], peermem=True)


def test_ib_disabled_with_active_ports_is_flagged(h100_sys):
    d = run_doctor("dgx_h100_8x_nv18.txt", h100_sys, {"NCCL_IB_DISABLE": "1"}, nodes=2)
    assert "ib-disabled" in codes(d, "warn")
    env = next(r.env for r in d.recommendations if r.title == "environment")
    assert env["NCCL_IB_DISABLE"] == "(unset)"
    # what NCCL would really use is then the 100 GbE interface
    assert hooks(d) == ["hierarchical_powersgd"]


def test_p2p_disabled_with_nvlink_is_flagged(h100_sys):
    d = run_doctor("dgx_h100_8x_nv18.txt", h100_sys, {"NCCL_P2P_DISABLE": "1"})
    assert "p2p-disabled" in codes(d, "warn")


@pytest.mark.parametrize("value, level", [
    ("eth9", "error"), ("=eth", "error"), ("lo", "warn"), ("eth", "ok"), ("^docker,lo", "ok"),
    ("=eth0", "ok"),
])
def test_socket_ifname(h100_sys, value, level):
    d = run_doctor("dgx_h100_8x_nv18.txt", h100_sys, {"NCCL_SOCKET_IFNAME": value})
    finding = next(f for f in d.findings if f.code == "socket-ifname")
    assert finding.level == level
    assert d.exit_code == (1 if level == "error" else 0)


@pytest.mark.parametrize("value, level", [
    ("mlx5_9", "error"), ("=mlx5_0:1,mlx5_1:1", "ok"), ("^mlx5", "warn"), ("mlx5", "ok"),
])
def test_ib_hca(h100_sys, value, level):
    d = run_doctor("dgx_h100_8x_nv18.txt", h100_sys, {"NCCL_IB_HCA": value})
    assert next(f for f in d.findings if f.code == "ib-hca").level == level


def test_gdr_level(tmp_path):
    sys_root = make_sys(tmp_path, rdma=[(f"mlx5_{i}", 1, "ACTIVE", HDR, "InfiniBand")
                                        for i in range(8)], peermem=True)
    a100 = "dgx_a100_8x_nv12.txt"  # GPUs reach their NICs through PXB
    assert "gdr-level" not in codes(run_doctor(a100, sys_root))  # NCCL's default PXB covers it
    strict = run_doctor(a100, sys_root, {"NCCL_NET_GDR_LEVEL": "PIX"})
    assert next(f for f in strict.findings if f.code == "gdr-level").level == "warn"
    assert "gdr-level" not in codes(run_doctor(a100, sys_root, {"NCCL_NET_GDR_LEVEL": "2"}))
    bogus = run_doctor(a100, sys_root, {"NCCL_NET_GDR_LEVEL": "FAST"})
    assert "gdr-level" in codes(bogus, "error") and bogus.exit_code == 1


def test_tuning_overrides_and_debug(h100_sys):
    d = run_doctor("dgx_h100_8x_nv18.txt", h100_sys, {"NCCL_ALGO": "Ring", "NCCL_DEBUG": "INFO",
                                                       "NCCL_FOO": "1"})
    assert "nccl-tuning" in codes(d, "warn") and "nccl-debug" in codes(d, "info")
    assert d.environment == {"NCCL_ALGO": "Ring", "NCCL_DEBUG": "INFO", "NCCL_FOO": "1"}
    env = next((r.env for r in d.recommendations if r.title == "environment"), {})
    assert "NCCL_DEBUG" not in env


# -- software ---------------------------------------------------------------------------------------------


def test_missing_cuda_kernels_on_a_gpu_machine_is_an_error(tmp_path):
    gpu_machine = dict(SOFTWARE, cuda_available=True, cuda_devices=8, nccl="2.27.3",
                       cuda_kernels=False)
    d = diagnose(topo("dgx_h100_8x_nv18.txt"), sys_root=make_sys(tmp_path), environ={},
                 software_info=gpu_machine, topology_source="nvidia-smi topo -m")
    assert "no-cuda-kernels" in codes(d, "error") and d.exit_code == 1
    # the same topology read from a file, checked on a machine without GPUs: a warning
    d = run_doctor("dgx_h100_8x_nv18.txt", str(tmp_path), software=dict(SOFTWARE, cuda_kernels=False))
    assert "no-cuda-kernels" in codes(d, "warn") and d.exit_code == 0


def test_software_facts_of_this_machine():
    import torch

    from ciuicflow import ops

    info = doctor.software()
    assert info["torch"] == torch.__version__ and info["gloo"] is True
    assert info["cuda_kernels"] == ops.has_cuda_kernels()


# -- the command ------------------------------------------------------------------------------------------


def test_cli_text_and_json(tmp_path, capsys, h100_sys):
    path = os.path.join(FIXTURES, "dgx_h100_8x_nv18.txt")
    out = tmp_path / "doctor.json"
    assert cli.main(["doctor", "--topo-file", path, "--sys-root", h100_sys, "--nodes", "4",
                     "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "8 GPUs, all joined by NVLink" in text and "use hierarchical_allreduce" in text
    saved = json.loads(out.read_text())
    assert saved["interconnect"]["gpus_per_nvlink_island"] == 8
    assert saved["recommendations"][0]["hook"] == "hierarchical_allreduce"
    assert cli.main(["doctor", "--topo-file", path, "--sys-root", h100_sys, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["nodes"] is None


def test_cli_errors(tmp_path, capsys, monkeypatch):
    assert cli.main(["doctor", "--topo-file", str(tmp_path / "missing.txt")]) == 2
    assert "cannot read" in capsys.readouterr().err
    bad = tmp_path / "bad.txt"
    bad.write_text("nothing\n")
    assert cli.main(["doctor", "--topo-file", str(bad), "--sys-root", str(tmp_path)]) == 2
    assert "no nvidia-smi topo -m matrix" in capsys.readouterr().err
    monkeypatch.setenv("NCCL_SOCKET_IFNAME", "nonexistent0")
    path = os.path.join(FIXTURES, "pcie_4x_single_socket.txt")
    assert cli.main(["doctor", "--topo-file", path, "--sys-root", str(tmp_path)]) == 1
    assert "[error] NCCL_SOCKET_IFNAME=nonexistent0 matches no interface" in capsys.readouterr().out
