"""PowerSGD on stacked experts ([E, rows, cols] parameters, as MoE models fuse them): each expert a
matrix of its own, unrouted (all-zero) experts, and the per-group statistics, on real gloo
processes."""
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from tests import reference
from tests.dist_utils import run_distributed

EXPERTS, ROWS, COLS, RANK = 4, 24, 40, 4
STEPS = 5


def test_stacked_experts_are_batches_and_conv_weights_keep_their_matrix():
    from ciuicflow.compression.powersgd_plan import matrix_view

    # [E, a, b]: E matrices a x b (one [8, 131072] matrix would not clear min_compression_rate)
    assert matrix_view((8, 256, 512), 32, 2.0) == (8, 256, 512, 32)
    assert matrix_view((8, 512, 256), 16, 2.0) == (8, 512, 256, 16)
    assert matrix_view((1, 256, 512), 32, 2.0) == (1, 256, 512, 32)
    # conv weights stay [out, in*kh*kw], as before: their per-channel slices do not pay
    for shape in ((64, 64, 3, 3), (32, 16, 3, 3), (16, 1, 3, 3), (128, 64, 5), (256, 256, 1, 1)):
        out, size = shape[0], torch.Size(shape).numel()
        r = min(16, out, size // out)
        expected = (1, out, size // out, r) if (out + size // out) * r * 2 < size else None
        assert matrix_view(shape, 16, 2.0) == expected, shape
    assert matrix_view((4, 3, 2), 16, 2.0) is None
    assert matrix_view((300, 200), 16, 2.0) == (1, 300, 200, 16)
    assert matrix_view((7,), 16, 2.0) is None


def _gradient(rank, step, zero):
    """This rank's [E, ROWS, COLS] gradient; experts in ``zero`` are zero on every rank (no token
    was routed to them), expert 1 only on rank 0."""
    g = torch.randn(EXPERTS, ROWS, COLS,
                    generator=torch.Generator().manual_seed(1000 * step + rank))
    g[list(zero)] = 0.0
    if rank == 0:
        g[1] = 0.0
    return g


def _initial_q():
    return torch.randn(EXPERTS, COLS, RANK, generator=torch.Generator().manual_seed(7))


def _zero_experts(step):
    # expert 2 gets no token in the first steps, then does; expert 3 never does
    return (2, 3) if step < 3 else (3,)


def _batched_and_separate(rank, world):
    from ciuicflow.compression.powersgd import PowerSGDMemory, powersgd_all_reduce

    options = dict(rank=RANK, hierarchical=False)
    stack, experts = PowerSGDMemory(), [PowerSGDMemory() for _ in range(EXPERTS)]
    q = _initial_q()
    stack.load_state_dict({"error": None, "q": q.reshape(-1)})
    for e, memory in enumerate(experts):
        memory.load_state_dict({"error": None, "q": q[e].reshape(-1)})
    batched, separate = [], []
    for step in range(STEPS):
        g = _gradient(rank, step, _zero_experts(step))
        out = powersgd_all_reduce(g.clone(), stack, step=step, **options)
        batched.append(out)
        separate.append(torch.stack([powersgd_all_reduce(g[e].clone(), experts[e], step=step,
                                                         **options) for e in range(EXPERTS)]))
    return {"batched": torch.stack(batched), "separate": torch.stack(separate),
            "error": stack.error.clone(), "q": stack.q.view(EXPERTS, COLS, RANK).clone()}


def _reference(world):
    """PowerSGD of each expert in float64 over every rank's gradients (pure torch)."""
    q = _initial_q().double()
    error = torch.zeros(world, EXPERTS, ROWS, COLS, dtype=torch.float64)
    outputs = []
    for step in range(STEPS):
        m = torch.stack([_gradient(r, step, _zero_experts(step)) for r in range(world)]).double()
        m = m + error
        q = reference.orthogonalize(q)
        p = reference.orthogonalize(torch.einsum("wern,enk->erk", m, q).contiguous())
        new_q = torch.einsum("wern,erk->enk", m, p) / world
        approx = p @ new_q.transpose(1, 2)
        error = m - approx
        zero = new_q.abs().amax(dim=1, keepdim=True) == 0
        q = torch.where(zero, q, new_q)
        outputs.append(approx)
    return torch.stack(outputs)


def test_batched_experts_equal_powersgd_of_each_expert_and_a_float64_reference():
    """Each expert of a stack gets its own P, Q, error feedback and warm start: the same as PowerSGD
    run on each expert matrix alone, and as a float64 reference; unrouted experts stay finite."""
    world = 2
    results = run_distributed(_batched_and_separate, world, nodes=1, node_env="none")
    expected = _reference(world)
    for result in results:
        batched, separate = result["batched"], result["separate"]
        assert torch.isfinite(batched).all() and torch.isfinite(result["error"]).all()
        assert torch.allclose(batched, separate, atol=1e-5), (batched - separate).abs().max()
        assert torch.allclose(batched.double(), expected, atol=1e-4), \
            (batched.double() - expected).abs().max()
        # expert 2: zero while unrouted, then compressed like the others (its Q was kept)
        assert batched[:3, 2].abs().max() == 0
        assert batched[3:, 2].abs().max() > 0.1
        assert (batched[:, 3] == 0).all() and result["q"][3].abs().max() > 0  # warm start kept
    assert torch.equal(results[0]["batched"], results[1]["batched"])


def _unrouted_from_the_start(rank, world):
    from ciuicflow.compression.powersgd import PowerSGDMemory, powersgd_all_reduce

    memory, outputs = PowerSGDMemory(), []
    for step in range(4):
        g = torch.randn(EXPERTS, ROWS, COLS,
                        generator=torch.Generator().manual_seed(step + 9 * rank))
        if step < 2:  # no token reaches expert 0 in the first two steps, on any rank
            g[0] = 0.0
        exact = g.clone()
        dist.all_reduce(exact)
        out = powersgd_all_reduce(g, memory, rank=RANK, hierarchical=False, step=step)
        outputs.append((out[0].clone(), exact[0] / world))
    return {"outputs": outputs, "finite": all(torch.isfinite(t).all() for t in
                                              (memory.error, memory.q, *[o for o, _ in outputs]))}


def test_an_expert_unrouted_from_the_first_step_is_compressed_once_routed():
    """All-zero experts (with no error yet) give zero factors: finite output and memory, and the
    warm start keeps its random Q, so the expert is sent once tokens reach it."""
    for result in run_distributed(_unrouted_from_the_start, 2, nodes=1, node_env="none"):
        assert result["finite"]
        (first, _), (second, _), (third, exact) = result["outputs"][:3]
        assert first.abs().max() == 0 and second.abs().max() == 0
        # rank 4 of a 24 x 40 Gaussian: a good share of it, not zero
        cosine = torch.nn.functional.cosine_similarity(third.flatten(), exact.flatten(), dim=0)
        assert cosine > 0.3, cosine


class MoE(torch.nn.Module):
    """A token-routed layer: top-1 of 4 experts fused as [4, 128, 256] and [4, 256, 128]; the
    router never picks expert 3, whose gradient is zero on every rank."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.router = torch.nn.Linear(128, 4)
        with torch.no_grad():
            self.router.bias[3] = -100.0
        self.w_in = torch.nn.Parameter(torch.randn(4, 128, 256) / 128 ** 0.5)
        self.w_out = torch.nn.Parameter(torch.randn(4, 256, 128) / 256 ** 0.5)
        self.head = torch.nn.Linear(128, 5)

    def forward(self, x):
        choice = self.router(x).argmax(-1)
        gate = torch.softmax(self.router(x), -1).gather(1, choice[:, None])
        h = torch.zeros_like(x)
        for e in range(4):
            rows = (choice == e).nonzero().view(-1)
            h[rows] = torch.relu(x[rows] @ self.w_in[e]) @ self.w_out[e]
        return self.head(x + gate * h)


def _train_moe(rank, world):
    import ciuicflow

    model = MoE()
    ddp = DDP(model, bucket_cap_mb=0.5)
    state = ciuicflow.register(ddp, "hierarchical_powersgd", warmup_steps=2)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    unrouted = 0
    for step in range(8):
        g = torch.Generator().manual_seed(100 * step + rank)
        x, y = torch.randn(6, 128, generator=g), torch.randint(0, 5, (6,), generator=g)
        loss = torch.nn.functional.cross_entropy(ddp(x), y)
        optimizer.zero_grad()
        loss.backward()
        unrouted += int((model.w_in.grad.flatten(1).abs().amax(1) == 0).sum())  # the mean's
        optimizer.step()
    params = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    gathered = [torch.empty_like(params) for _ in range(world)]
    dist.all_gather(gathered, params)
    return {"stats": state.stats(), "finite": bool(torch.isfinite(params).all()),
            "equal": all(torch.equal(p, params) for p in gathered), "unrouted": unrouted}


def test_ddp_on_two_nodes_compresses_expert_stacks_per_expert():
    """2 nodes x 2 ranks train a model with 3-D expert parameters under the default state: the
    expert stacks go as E pairs of rank-16 factors (5.3x), reported per group in stats()."""
    results = run_distributed(_train_moe, 4, nodes=2, timeout=300)
    assert all(r["finite"] and r["equal"] for r in results)
    assert all(r["unrouted"] >= 8 for r in results)  # expert 3 at every step
    groups = results[0]["stats"]["groups"]
    experts, compressed_steps = groups["expert_stacks"], 6
    per_step_in = 2 * 4 * 128 * 256
    assert experts["elements_in"] == compressed_steps * per_step_in
    assert experts["elements_sent"] == compressed_steps * 2 * 4 * (128 + 256) * 16
    assert experts["compression_ratio"] >= 4.0
    # the router and head weights (5 x 128, 4 x 128) are too small to pay: exact, with the biases
    assert set(groups) == {"expert_stacks", "exact"}
    assert groups["exact"]["compression_ratio"] == 1.0


def _train_moe_fsdp(rank, world):
    import ciuicflow.fsdp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    model = MoE()
    fully_shard(model, mesh=mesh["shard"])
    state = ciuicflow.fsdp.register(model, "hierarchical_powersgd", mesh=mesh, warmup_steps=2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    for step in range(5):
        g = torch.Generator().manual_seed(100 * step + rank)
        x, y = torch.randn(6, 128, generator=g), torch.randint(0, 5, (6,), generator=g)
        torch.nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
    full = torch.cat([p.full_tensor().detach().reshape(-1) for p in model.parameters()])
    gathered = [torch.empty_like(full) for _ in range(world)]
    dist.all_gather(gathered, full)
    return {"groups": state.compressor.group_stats(), "finite": bool(torch.isfinite(full).all()),
            "equal": all(torch.equal(g, full) for g in gathered)}


def test_fsdp_shards_of_expert_stacks_are_compressed_per_expert():
    """FSDP2 inside the node shards [4, 128, 256] into [2, 128, 256]: each rank's shard is a stack
    of two experts, compressed per expert across the nodes."""
    results = run_distributed(_train_moe_fsdp, 4, nodes=2, timeout=300)
    assert all(r["finite"] and r["equal"] for r in results)
    experts = results[0]["groups"]["expert_stacks"]
    assert experts["elements_in"] == 3 * 2 * 2 * 128 * 256  # 3 steps past warm-up, 2 shards
    assert experts["elements_sent"] == 3 * 2 * 2 * (128 + 256) * 16
