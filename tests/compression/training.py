"""A short DDP training run under a hook and an optimizer, on the DDP tests' network, for the compression tests."""
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from tests.ddp.nets import Net, _batch, _flat_params


def _train(hook, optimizer, steps=12, **options):
    import ciuicflow

    model = Net()
    ddp = DDP(model, bucket_cap_mb=0.0001)
    state = ciuicflow.register(ddp, hook, warmup_steps=2, **options) if hook else None
    opt = (torch.optim.AdamW(ddp.parameters(), lr=1e-2) if optimizer == "adamw"
           else torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9))
    for step in range(steps):
        x, y = _batch(dist.get_rank(), step)
        loss = torch.nn.functional.cross_entropy(ddp(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return _flat_params(model), state
