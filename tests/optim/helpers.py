"""What the 1-bit optimizer tests share with tests/integrations: counting the bytes handed to each
collective, a small MLP with its data, and a check that every rank holds the same tensors."""
import inspect
import sys

import torch
import torch.distributed as dist


class CollectiveBytes:
    """Bytes each call to a torch.distributed collective was given, with its group.

    ``with CollectiveBytes() as log: ...`` wraps the collectives of torch.distributed (and the two
    aliases ciuicflow.collectives took at import); the wrapped call runs unchanged."""

    # collective -> the argument holding what this rank contributes
    SENT = {"all_reduce": "tensor", "all_to_all_single": "input", "broadcast": "tensor",
            "reduce_scatter_tensor": "input", "reduce_scatter_single": "input",
            "all_gather_into_tensor": "input_tensor", "all_gather_single": "input",
            "all_gather": "tensor", "all_reduce_coalesced": "tensors", "reduce_scatter": "input_list"}

    def __init__(self):
        self.records = []  # (collective, group, bytes)
        self._undo = []

    def __enter__(self):
        import ciuicflow.collectives  # noqa: F401  (loaded, so that its aliases are found below)

        originals = {name: getattr(dist, name) for name in self.SENT if hasattr(dist, name)}
        # ciuicflow's modules may hold a collective under another name (taken at import)
        holders = [m for name, m in list(sys.modules.items())
                   if m is not None and (name == "ciuicflow" or name.startswith("ciuicflow."))]
        for name, original in originals.items():
            wrapped = self._wrap(name, original)
            self._patch(dist, name, wrapped)
            for module in holders:
                for attribute, value in list(vars(module).items()):
                    if value is original:
                        self._patch(module, attribute, wrapped)
        return self

    def __exit__(self, *exc):
        for owner, name, value in reversed(self._undo):
            setattr(owner, name, value)
        self._undo.clear()

    def _patch(self, owner, name, value):
        self._undo.append((owner, name, getattr(owner, name)))
        setattr(owner, name, value)

    def _wrap(self, name, original):
        signature = inspect.signature(original)
        argument = self.SENT[name]
        if argument not in signature.parameters:  # older spellings (all_gather_into_tensor)
            argument = [p for p in signature.parameters if "input" in p or p == "tensor"][0]

        def counted(*args, **kwargs):
            bound = signature.bind(*args, **kwargs)
            sent = bound.arguments[argument]
            tensors = sent if isinstance(sent, (list, tuple)) else [sent]
            nbytes = sum(t.numel() * t.element_size() for t in tensors)
            self.records.append((name, bound.arguments.get("group"), nbytes))
            return original(*args, **kwargs)
        return counted

    def total(self, since: int = 0, group=None) -> int:
        return sum(b for _, g, b in self.records[since:] if group is None or g is group)


def _mlp(seed, sizes=(16, 32, 4)):
    torch.manual_seed(seed)
    layers = []
    for i, (a, b) in enumerate(zip(sizes, sizes[1:])):
        layers += [torch.nn.Linear(a, b)] + ([torch.nn.Tanh()] if i < len(sizes) - 2 else [])
    return torch.nn.Sequential(*layers)


def _batch(rank, step, inputs=16, classes=4, n=8):
    g = torch.Generator().manual_seed(rank * 10_000 + step)
    return torch.randn(n, inputs, generator=g), torch.randint(0, classes, (n,), generator=g)


def _loss(model, batch):
    return torch.nn.functional.cross_entropy(model(batch[0]), batch[1])


def _same_on_every_rank(tensors) -> bool:
    flat = torch.cat([t.detach().reshape(-1) for t in tensors])
    gathered = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, flat)
    return all(torch.equal(flat, other) for other in gathered)
