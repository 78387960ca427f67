"""What every quantising codec of the exchange must do, checked the same way for each
(tests/test_twobit.py, tests/test_topmark.py): inputs shaped like gradients, the mean of rows, and
zero padding after a payload."""
import torch


def fresh(n, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    # heavy-tailed values of mixed size, as gradients are, and a memory of a tenth of that
    x = (torch.randn(n, generator=g) * torch.rand(n, generator=g).pow(3) * 5).to(dtype)
    error = torch.randn(n, generator=g) * 0.1
    return x, error


def check_mean_of_rows(codec, n=1001, chunk=64, rows=3):
    """``unpack_mean`` is the row-order sum of the rows' ``unpack``, over W, to the bit."""
    packed = [codec.pack(*fresh(n, torch.float32, seed=s), chunk) for s in range(rows)]
    payload = torch.stack([p for p, _ in packed])
    scales = torch.stack([s for _, s in packed])
    mean = codec.unpack_mean(payload, scales, n, chunk, torch.empty(n))
    want = torch.zeros(n)
    for p, s in packed:
        want += codec.unpack(p, s, n, chunk, torch.empty(n))
    assert torch.equal(mean, want / rows)


def check_zero_padding(codec, n=300, chunk=64, chunks=7):
    """The exchange packs a segment's real elements and pads its bytes and scales with zeros up to
    the segment's size: the padded chunks must unpack to zeros, the real elements as they were
    (the tail of a trimmed chunk is never read: the exchange unpacks only real elements)."""
    whole = chunks * chunk
    x, error = fresh(n, torch.float32, seed=9)
    payload, scales = codec.pack(x, error, chunk)
    grown = torch.cat([payload, torch.zeros(codec.payload_bytes(whole, chunk) - payload.numel(),
                                            dtype=torch.uint8)])
    grown_scales = torch.cat([scales, torch.zeros(chunks - scales.numel())])
    out = codec.unpack(grown, grown_scales, whole, chunk, torch.empty(whole))
    real_chunks = -(-n // chunk)
    assert torch.equal(out[real_chunks * chunk:], torch.zeros((chunks - real_chunks) * chunk))
    assert torch.equal(out[:n], codec.unpack(payload, scales, n, chunk, torch.empty(n)))
