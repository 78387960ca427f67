"""The servers' codec of 1 bit's two phases, 1 bit with int4 where 1 bit errs most
(compression.refined), against a float64 reference written from its rule, on fresh random inputs,
odd sizes and every input dtype."""
import pytest
import torch

from ciuicflow.compression.refined import RefinedOneBitCodec, refined_count

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def reference(y, chunk, share):
    """(decoded, refined chunks) of y (float64) by the rule, chunk by chunk: scale x sign with the
    mean |y| as scale; the round(share x chunks) chunks with the largest squared error of that
    sent instead as int4 (step max|y| / 7, levels 0..7 of |y| with y's sign)."""
    n = y.numel()
    nchunks = -(-n // chunk)
    plain, wrong = [], torch.zeros(nchunks, dtype=torch.float64)
    for c in range(nchunks):
        part = y[c * chunk:min((c + 1) * chunk, n)]
        scale = part.abs().mean()
        q = torch.where(part >= 0, scale, -scale)
        plain.append(q)
        wrong[c] = (part - q).square().sum()
    count = int(share * nchunks + 0.5)
    refined = torch.zeros(nchunks, dtype=torch.bool)
    refined[wrong.argsort(descending=True)[:count]] = True
    decoded = torch.cat(plain)
    for c in torch.nonzero(refined).view(-1).tolist():
        part = y[c * chunk:min((c + 1) * chunk, n)]
        step = part.abs().max() / 7
        levels = (part.abs() / step).round().clamp(0, 7) if step > 0 else torch.zeros_like(part)
        decoded[c * chunk:c * chunk + part.numel()] = torch.where(part >= 0, 1.0, -1.0) * levels * step
    return decoded, refined


def spread(n, seed):
    """Gaussian values whose size varies by chunk region (so that the largest 1-bit errors are
    not ties), with a few spikes."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=gen) * (1 + 3 * torch.rand(n, generator=gen).pow(4))
    x[::131] *= 20
    return x


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n, chunk", [(1, 8), (7, 8), (300, 64), (2560, 256), (2565, 256),
                                      (40 * 248 + 13, 248), (10_001, 128)])
def test_pack_decodes_as_the_rule_and_keeps_what_it_did_not_send(dtype, n, chunk):
    codec = RefinedOneBitCodec(plain_decay=0.5)
    x = spread(n, n + chunk).to(dtype)
    error = torch.randn(n, generator=torch.Generator().manual_seed(7)) * 0.3
    y = x.double() + 0.5 * error.double()
    error_out = torch.empty(n)
    payload, scales, sums = codec.pack_ef(x, error, 0.5, error_out, chunk)
    nchunks = -(-n // chunk)
    count = refined_count(nchunks)
    assert int(torch.signbit(scales).sum()) == count
    assert payload.numel() == codec.payload_bytes(n, chunk) + count * codec.side_bytes
    out = torch.empty(n)
    codec.unpack(payload, scales, n, chunk, out)
    expected, refined = reference(y, chunk, codec.share)
    assert torch.equal(torch.signbit(scales), refined)
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)
    # the memory: all of a refined chunk's error, half of a plain chunk's
    per_element = torch.repeat_interleave(refined, chunk)[:n]
    kept = torch.where(per_element, 1.0, 0.5).double()
    torch.testing.assert_close(error_out.double(), (y - expected) * kept, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(sums[0], error_out.double().square().sum(), rtol=1e-4, atol=1e-6)


def test_in_place_memory_and_the_mean_of_rows():
    """The servers pack with the memory as both input and output; the mean of rows is the mean of
    each row's decoding (rows with and without refined chunks)."""
    codec, chunk, n = RefinedOneBitCodec(), 64, 64 * 30 + 5
    rows, scales, sides, decoded = [], [], [], []
    for seed in range(3):
        x = spread(n, seed)
        memory = torch.randn(n, generator=torch.Generator().manual_seed(100 + seed))
        y = x.double() + memory.double()
        payload, s, _ = codec.pack_ef(x, memory, 1.0, memory, chunk, measure=False)
        expected, refined = reference(y, chunk, codec.share)
        kept = torch.where(torch.repeat_interleave(refined, chunk)[:n], 1.0, 0.5).double()
        torch.testing.assert_close(memory.double(), (y - expected) * kept, rtol=1e-5, atol=1e-5)
        fixed = codec.payload_bytes(n, chunk)
        rows.append(payload[:fixed])
        sides.append(payload[fixed:])
        scales.append(s)
        decoded.append(expected)
    out = torch.empty(n)
    codec.unpack_mean(torch.stack(rows), torch.stack(scales), n, chunk, out, side=sides)
    torch.testing.assert_close(out.double(), sum(decoded) / 3, rtol=1e-5, atol=1e-5)


def test_no_chunk_refined_below_its_share_and_chunks_too_long_refused():
    codec = RefinedOneBitCodec()
    x = spread(4 * 64, 0)
    payload, scales, _ = codec.pack_ef(x, torch.zeros(256), 1.0, torch.zeros(256), 64)
    assert refined_count(4) == 0 and not bool(torch.signbit(scales).any())
    assert payload.numel() == 32
    with pytest.raises(ValueError, match="at most 256"):
        codec.pack_ef(x, torch.zeros(256), 1.0, torch.zeros(256), 512)
    with pytest.raises(ValueError, match="plain_decay"):
        RefinedOneBitCodec(plain_decay=1.5)
