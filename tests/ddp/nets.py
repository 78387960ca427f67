"""A small network with awkward shapes and its data, for the DDP tests here and in other folders."""
import torch
import torch.distributed as dist


class Net(torch.nn.Module):
    """Odd sizes (uneven shards and chunks), a norm layer, an empty parameter (an empty slice)."""

    def __init__(self, dtype=torch.float32):
        super().__init__()
        torch.manual_seed(0)
        self.inp = torch.nn.Linear(13, 61)
        self.norm = torch.nn.LayerNorm(61)
        self.hidden = torch.nn.Linear(61, 37)
        self.out = torch.nn.Linear(37, 5)
        self.nothing = torch.nn.Parameter(torch.zeros(0))
        self.to(dtype)

    def forward(self, x):
        h = torch.relu(self.norm(self.inp(x)))
        return self.out(torch.relu(self.hidden(h))) + self.nothing.sum()


def _batch(rank, step, dtype=torch.float32):
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(8, 13, generator=g).to(dtype), torch.randint(0, 5, (8,), generator=g)


def _step(ddp, optimizer, rank, step, dtype=torch.float32):
    x, y = _batch(rank, step, dtype)
    loss = torch.nn.functional.cross_entropy(ddp(x).float(), y)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()


def _flat_params(model):
    return torch.cat([p.detach().float().reshape(-1) for p in model.parameters()])


def _replicas_equal(tensor):
    gathered = [torch.empty_like(tensor) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, tensor)
    return all(torch.equal(g, tensor) for g in gathered)
