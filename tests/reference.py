"""Pure-torch references of the native ops, computed in float64 where it helps."""
import torch


def onebit_pack(x, error, chunk_size):
    """Returns (packed, scales, new_error) without touching the inputs."""
    y = x.double() + error.double()
    n = y.numel()
    nchunks = -(-n // chunk_size)
    padded = torch.zeros(nchunks * chunk_size, dtype=torch.float64)
    padded[:n] = y.abs()
    counts = torch.full((nchunks,), float(chunk_size), dtype=torch.float64)
    if n % chunk_size:
        counts[-1] = n % chunk_size
    scales = padded.view(nchunks, chunk_size).sum(1) / counts
    positive = y >= 0
    per_elem = scales.repeat_interleave(chunk_size)[:n]
    new_error = y - torch.where(positive, per_elem, -per_elem)
    bits = torch.zeros(-(-n // 8) * 8, dtype=torch.uint8)
    bits[:n] = positive.to(torch.uint8)
    weights = (2 ** torch.arange(8, dtype=torch.int32)).to(torch.uint8)
    packed = (bits.view(-1, 8) * weights).sum(1, dtype=torch.int32).to(torch.uint8)
    return packed, scales.float(), new_error.float()


def onebit_unpack(packed, scales, numel, chunk_size):
    bits = ((packed.long().unsqueeze(-1) >> torch.arange(8)) & 1).flatten()[:numel]
    per_elem = scales.double().repeat_interleave(chunk_size)[:numel]
    return torch.where(bits.bool(), per_elem, -per_elem)


def onebit_unpack_mean(packed, scales, numel, chunk_size):
    rows = [onebit_unpack(packed[w], scales[w], numel, chunk_size) for w in range(packed.shape[0])]
    return torch.stack(rows).mean(0)


def orthogonalize(m, eps=0.0):
    """Modified Gram-Schmidt in float64, as PyTorch's PowerSGD does it."""
    out = m.double().clone()
    batched = out if out.dim() == 3 else out.unsqueeze(0)
    for i in range(batched.shape[2]):
        col = batched[:, :, i : i + 1]
        denom = col.norm(dim=1, keepdim=True) + eps
        col.copy_(torch.where(denom == 0, col, col / denom))
        rest = batched[:, :, i + 1 :]
        rest -= (col * rest).sum(dim=1, keepdim=True) * col
    return out
