"""The CUDA path end to end, where a GPU exists (skipped with the reason elsewhere).

- One GPU is enough: 4 processes share it, gloo moves CUDA tensors, and every DDP hook (the
  ordered worker's stream, events, futures with devices, the CUDA kernels inside the collectives)
  and the 1-bit optimizers train the same model as on the CPU; the two runs must agree.
- Several GPUs: the same over NCCL with the default group bound to each rank's device (the
  hierarchical subgroups must then be built by every rank).
"""
import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from tests.devices import CUDA_SKIP_REASON, needs_cuda
from tests.dist_utils import run_distributed
from tests.ddp.nets import Net, _batch, _flat_params, _replicas_equal

STEPS, WARMUP = 8, 2


def _hooks():
    from ciuicflow.compression.registry import METHODS

    return sorted(METHODS)  # every hook of every compressor, exact ones included


def _device(rank):
    return torch.device("cuda", rank % torch.cuda.device_count())


def _train_hook(hook, device):
    import ciuicflow

    model = Net().to(device)
    ddp = DDP(model, device_ids=[device] if device.type == "cuda" else None, bucket_cap_mb=0.0001)
    options = {} if hook == "hierarchical_allreduce" else {"warmup_steps": WARMUP}
    if "powersgd" in hook:
        options["rank"] = 2  # the default (16) leaves this small model's matrices exact
    state = ciuicflow.register(ddp, hook, **options)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    for step in range(STEPS):
        x, y = _batch(dist.get_rank(), step)
        loss = torch.nn.functional.cross_entropy(ddp(x.to(device)), y.to(device))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    params = _flat_params(model)
    return params.cpu(), _replicas_equal(params), state.stats()


def _train_optimizer(kind, device):
    from ciuicflow.optim import OneBitAdam, ZeroOneAdam

    model = Net().to(device)
    # frozen at step 3 as asked (not held until the variance is stable): the 1-bit path on a GPU
    optimizer = OneBitAdam(model.parameters(), lr=1e-2, freeze_steps=3, hold_until_stable=False) \
        if kind == "onebit_adam" else ZeroOneAdam(model.parameters(), lr=1e-2, var_freeze_step=3,
                                                  hold_until_stable=False, warmup_steps=0)
    for step in range(STEPS):
        x, y = _batch(dist.get_rank(), step)
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(x.to(device)), y.to(device)).backward()
        optimizer.step()
    params = _flat_params(model)
    return params.cpu(), _replicas_equal(params), None


def _every_method(rank, world, device_type):
    device = _device(rank) if device_type == "cuda" else torch.device("cpu")
    out = {hook: _train_hook(hook, device) for hook in _hooks()}
    for kind in ("onebit_adam", "zero_one_adam"):
        out[kind] = _train_optimizer(kind, device)
    if device.type == "cuda":
        torch.cuda.synchronize()
    return out


def _compare(gpu, cpu):
    initial = _flat_params(Net())
    for name, (params, replicas_equal, stats) in gpu.items():
        want = cpu[name][0]
        assert replicas_equal, name
        assert torch.isfinite(params).all(), name
        moved = (want - initial).norm()
        # Only the order of float sums differs (and so a few signs of near-zero values). On the
        # CPU, inputs perturbed by 1e-7 / 1e-5 relative moved the results by at most 3.5e-3 /
        # 1.2e-2 of `moved` (int8, the 1-bit optimizers); 1-bit compression itself instead of an
        # exact all-reduce moves them by 0.5 of it (tests/ddp/test_hooks.py): a wrong kernel or a
        # stream race lands far above 0.05.
        gap = (params - want).norm()
        assert gap < 0.05 * moved, (name, float(gap), float(moved))
        if stats is not None:
            assert stats["steps"] == STEPS and stats["time_s"] > 0, name
            assert stats["inter_node_bytes"] == cpu[name][2]["inter_node_bytes"], name


@needs_cuda
def test_every_hook_and_optimizer_on_one_gpu_matches_the_cpu():
    cpu = run_distributed(_every_method, 4, nodes=2, args=("cpu",), timeout=300)
    gpu = run_distributed(_every_method, 4, nodes=2, args=("cuda",), timeout=300)
    for cpu_rank, gpu_rank in zip(cpu, gpu):
        _compare(gpu_rank, cpu_rank)


NCCL_SKIP_REASON = CUDA_SKIP_REASON or (
    None if torch.cuda.device_count() >= 2 and dist.is_nccl_available()
    else f"NCCL needs 2 or more GPUs, this machine has {torch.cuda.device_count()}")


@pytest.mark.skipif(NCCL_SKIP_REASON is not None, reason=NCCL_SKIP_REASON or "")
def test_every_hook_over_nccl_with_a_device_bound_default_group():
    world = 4 if torch.cuda.device_count() >= 4 else 2
    cpu = run_distributed(_every_method, world, nodes=2, args=("cpu",), timeout=300)
    gpu = run_distributed(_every_method, world, nodes=2, args=("cuda",), timeout=300,
                          backend="nccl")
    for cpu_rank, gpu_rank in zip(cpu, gpu):
        _compare(gpu_rank, cpu_rank)
