"""int8's pure-torch reference (float64 arithmetic) and its inputs, shared by the int8 and int4 op tests."""
import math

import torch


DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def reference_pack(x, error, chunk, levels=127.0):
    """float32 arithmetic step by step, as the kernels do it: (values, scales, new error), values
    in [-levels, levels] (127: int8, 7: int4)."""
    y = x.float() + error.float()
    n, nchunks = y.numel(), math.ceil(y.numel() / chunk)
    rows = torch.zeros(nchunks * chunk)
    rows[:n] = y
    rows = rows.view(nchunks, chunk)
    scales = rows.abs().amax(1) / levels  # NaN propagates, inf stays inf
    usable = (scales > 0) & torch.isfinite(scales)
    q = torch.where(usable[:, None], torch.round(rows / scales[:, None]).clamp(-levels, levels),
                    torch.zeros(()))
    new_error = rows - q * scales[:, None]
    return q.view(-1)[:n].to(torch.int8), scales, new_error.view(-1)[:n]


def fresh(n, dtype, device, seed):
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(n, generator=gen) * torch.rand(n, generator=gen).pow(4) * 5).to(dtype)
    return x.to(device), (torch.randn(n, generator=gen) * 0.01).to(device)
