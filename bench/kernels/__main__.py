"""Native ops against their pure-torch equivalents and a bandwidth ceiling, in one run.

For each op and dtype it times: the ciuicflow kernel (impl "ciuicflow"), the same op written in
plain torch ops (impl "torch"), and a copy that moves the same number of bytes (impl "copy",
the ceiling). bytes_moved counts each byte the op must read or write once. The unpack ops write into a reused
buffer (``out=``), as the collectives do: a fresh 256 MB allocation costs more than the op itself
(first-touch page faults), and the copy ceiling does not pay it either. The ceiling is torch's own copy,
whose stores read each destination line before writing it; the CPU unpack writes outputs of 8 MiB and
more with streaming stores that skip that read, so it can exceed 100% of the ceiling.

``onebit_pack_ef`` is also timed against what the hooks ran before it (impl "unfused": a multiply
into the spare buffer, ``onebit_pack`` and two norms).

``orthogonalize_`` is also timed against ``torch.linalg.qr`` of the same float32 matrix (impl
"linalg.qr"), a tall [numel / 4, 4] one: PowerSGD's P of a large layer.

    python -m bench.kernels                      # 64M elements, CPU
    python -m bench.kernels --numel 1000000 --json out/kernels.json
    python -m bench.kernels --device cuda        # on a GPU build
"""
import argparse
import json
import math
import os
import statistics
import sys
import time

import torch

import ciuicflow.ops as ops

CHUNK = ops.DEFAULT_CHUNK_SIZE  # the 1-bit hooks' default
INT8_CHUNK = 256
WORLD = 4  # vectors averaged by the unpack_mean ops
RANK = 4  # columns orthogonalised


# --- the same ops in plain torch (float32, as fast as plain torch gets) -------------------------
def torch_pack(x, error, chunk):
    n = x.numel()
    y = x.float() + error
    nchunks = math.ceil(n / chunk)
    padded = torch.nn.functional.pad(y.abs(), (0, nchunks * chunk - n))
    counts = torch.full((nchunks,), float(chunk), device=x.device)
    counts[-1] = n - (nchunks - 1) * chunk
    scales = padded.view(nchunks, chunk).sum(1) / counts
    per_elem = scales.repeat_interleave(chunk)[:n]
    positive = y >= 0
    error.copy_(y - torch.where(positive, per_elem, -per_elem))
    bits = torch.nn.functional.pad(positive.to(torch.uint8), (0, -n % 8)).view(-1, 8)
    shifts = torch.arange(8, device=x.device, dtype=torch.uint8)
    packed = (bits << shifts).sum(1, dtype=torch.uint8)
    return packed, scales


def torch_pack_ef(x, error, decay, error_out, chunk):
    torch.mul(error, decay, out=error_out)
    packed, scales = torch_pack(x, error_out, chunk)
    return packed, scales, torch.stack([error_out.double().square().sum(),
                                        x.double().square().sum()])


def unfused_pack_ef(x, error, decay, error_out, chunk):
    """What the hooks ran before onebit_pack_ef: a multiply into the spare buffer, the native pack,
    and the accuracy guard's two norms."""
    torch.mul(error, decay, out=error_out)
    packed, scales = ops.onebit_pack(x, error_out, chunk)
    return packed, scales, torch.stack([torch.linalg.vector_norm(error_out),
                                        torch.linalg.vector_norm(x, dtype=torch.float32)])


def torch_unpack(packed, scales, numel, chunk):
    shifts = torch.arange(8, device=packed.device, dtype=torch.uint8)
    bits = ((packed.unsqueeze(-1) >> shifts) & 1).flatten(-2)[..., :numel]
    per_elem = scales.repeat_interleave(chunk, dim=-1)[..., :numel]
    return torch.where(bits.bool(), per_elem, -per_elem)


def torch_unpack_mean(packed, scales, numel, chunk):
    return torch_unpack(packed, scales, numel, chunk).mean(0)


def torch_int8_pack(x, error, chunk):
    n = x.numel()
    y = x.float() + error
    nchunks = math.ceil(n / chunk)
    rows = torch.nn.functional.pad(y, (0, nchunks * chunk - n)).view(nchunks, chunk)
    scales = rows.abs().amax(1) / 127.0
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))
    q = torch.round(rows / safe[:, None]).clamp_(-127, 127)
    error.copy_((rows - q * scales[:, None]).view(-1)[:n])
    return q.view(-1)[:n].to(torch.int8), scales


def torch_int8_unpack_mean(values, scales, numel, chunk):
    per_elem = scales.repeat_interleave(chunk, dim=-1)[..., :numel]
    return (values.float() * per_elem).mean(0)


def torch_orthogonalize(m, eps=0.0):
    """PyTorch's PowerSGD Gram-Schmidt (ddp_comm_hooks/powerSGD_hook.py), float32."""
    for i in range(m.shape[-1]):
        col = m[:, i : i + 1]
        col /= torch.norm(col, dim=0, keepdim=True) + eps
        rest = m[:, i + 1 :]
        rest -= torch.sum(col * rest, dim=0, keepdim=True) * col
    return m


# --- measurement -------------------------------------------------------------------------------
def timed(fn, device, repeats):
    """Median seconds of fn() over `repeats` runs after one warm-up."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    fn()
    sync()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        sync()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def copy_ceiling(nbytes, device, repeats):
    """A copy whose reads plus writes equal nbytes: the most any op moving nbytes could reach."""
    half = max(1, nbytes // 2)
    src = torch.ones(half, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return timed(lambda: dst.copy_(src), device, repeats)


def cases(numel, dtype, device):
    """(op, bytes_moved, ciuicflow fn, {impl: fn} of what it is compared with) for each op at
    this size and dtype."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(numel, generator=gen).to(dtype).to(device)
    error = torch.zeros(numel, device=device)
    nbytes, nchunks = math.ceil(numel / 8), math.ceil(numel / CHUNK)
    packed, scales = ops.onebit_pack(x, error.clone(), CHUNK)
    unpacked = torch.empty(numel, device=device)  # reused, as the collectives reuse buckets
    packed_w = packed.repeat(WORLD, 1)
    scales_w = scales.repeat(WORLD, 1)
    rows = numel // RANK
    matrix = torch.randn(rows, RANK, generator=gen).to(dtype).to(device)
    matrix32 = matrix.float()
    itemsize = x.element_size()
    int8_chunks = math.ceil(numel / INT8_CHUNK)
    values, int8_scales = ops.int8_pack(x, error.clone(), INT8_CHUNK)
    values_w, int8_scales_w = values.repeat(WORLD, 1), int8_scales.repeat(WORLD, 1)
    yield (
        "onebit_pack",
        numel * itemsize + 8 * numel + nbytes + 4 * nchunks,
        lambda: ops.onebit_pack(x, error, CHUNK),
        {"torch": lambda: torch_pack(x, error, CHUNK)},
    )
    spare = torch.empty(numel, device=device)
    yield (
        "onebit_pack_ef",
        numel * itemsize + 8 * numel + nbytes + 4 * nchunks,
        lambda: ops.onebit_pack_ef(x, error, 0.5, spare, CHUNK),
        {"torch": lambda: torch_pack_ef(x, error, 0.5, spare, CHUNK),
         "unfused": lambda: unfused_pack_ef(x, error, 0.5, spare, CHUNK)},
    )
    yield (
        "int8_pack",
        numel * itemsize + 8 * numel + numel + 4 * int8_chunks,
        lambda: ops.int8_pack(x, error, INT8_CHUNK),
        {"torch": lambda: torch_int8_pack(x, error, INT8_CHUNK)},
    )
    if dtype != torch.float32:
        return  # the other ops take or produce float32 only; measured once
    yield (
        "onebit_unpack",
        nbytes + 4 * nchunks + 4 * numel,
        lambda: ops.onebit_unpack(packed, scales, numel, CHUNK, out=unpacked),
        {"torch": lambda: torch_unpack(packed, scales, numel, CHUNK)},
    )
    yield (
        "onebit_unpack_mean",
        WORLD * (nbytes + 4 * nchunks) + 4 * numel,
        lambda: ops.onebit_unpack_mean(packed_w, scales_w, numel, CHUNK, out=unpacked),
        {"torch": lambda: torch_unpack_mean(packed_w, scales_w, numel, CHUNK)},
    )
    yield (
        "int8_unpack_mean",
        WORLD * (numel + 4 * int8_chunks) + 4 * numel,
        lambda: ops.int8_unpack_mean(values_w, int8_scales_w, numel, INT8_CHUNK, out=unpacked),
        {"torch": lambda: torch_int8_unpack_mean(values_w, int8_scales_w, numel, INT8_CHUNK)},
    )
    yield (
        f"orthogonalize_[{rows}x{RANK}]",
        2 * rows * RANK * itemsize,
        lambda: ops.orthogonalize_(matrix),
        {"torch": lambda: torch_orthogonalize(matrix32),
         "linalg.qr": lambda: torch.linalg.qr(matrix32)},
    )


def run(numel, dtypes, device, repeats):
    records = []
    for dtype in dtypes:
        for op, nbytes, ours, others in cases(numel, dtype, device):
            for impl, fn in (("ciuicflow", ours), *others.items(), ("copy", None)):
                seconds = copy_ceiling(nbytes, device, repeats) if fn is None else timed(fn, device, repeats)
                records.append(
                    dict(op=op, impl=impl, numel=numel, dtype=str(dtype).replace("torch.", ""),
                         device=device.type, threads=torch.get_num_threads(), seconds=seconds,
                         bytes_moved=nbytes, **{"GB/s": nbytes / seconds / 1e9})
                )
                print(f"  {op:28s} {records[-1]['dtype']:9s} {impl:10s} {seconds * 1e3:9.2f} ms",
                      file=sys.stderr, flush=True)
    return records


def table(records):
    """Markdown: per op and dtype, our GB/s, share of the copy ceiling, speed-up over plain torch."""
    by_key = {}
    for r in records:
        by_key.setdefault((r["op"], r["dtype"]), {})[r["impl"]] = r
    lines = [
        "| op | dtype | ciuicflow ms | torch ms | copy GB/s | ciuicflow GB/s | of ceiling | vs torch "
        "| also against | its ms | vs it |",
        "|---|---|---:|---:|---:|---:|---:|---:|---|---:|---:|",
    ]
    for (op, dtype), impls in by_key.items():
        ours, ref, copy = impls["ciuicflow"], impls.get("torch"), impls["copy"]
        # a third implementation where there is one: linalg.qr, or the unfused hook path
        also = [(name, r) for name, r in impls.items() if name not in ("ciuicflow", "torch", "copy")]
        qr_cells = (f"{also[0][0]} | {also[0][1]['seconds'] * 1e3:.2f} | "
                    f"{also[0][1]['seconds'] / ours['seconds']:.2f}x" if also else "- | - | -")
        ref_ms, vs_ref = (f"{ref['seconds'] * 1e3:.2f}", f"{ref['seconds'] / ours['seconds']:.1f}x") \
            if ref else ("-", "-")
        lines.append(
            f"| {op} | {dtype} | {ours['seconds'] * 1e3:.2f} | {ref_ms} | "
            f"{copy['GB/s']:.2f} | {ours['GB/s']:.2f} | {ours['GB/s'] / copy['GB/s']:.0%} | "
            f"{vs_ref} | {qr_cells} |"
        )
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m bench.kernels", description=__doc__.split("\n")[0])
    parser.add_argument("--numel", type=int, default=64 * 2**20, help="elements per vector (default 64M)")
    parser.add_argument("--dtypes", default="float32,float16,bfloat16")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", metavar="PATH", help="write one record per measurement")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not ops.has_cuda_kernels():
        parser.error("this build of ciuicflow has no CUDA kernels (rebuild with CIUICFLOW_CUDA=1)")
    dtypes = [getattr(torch, name) for name in args.dtypes.split(",")]
    print(f"ciuicflow kernels: numel={args.numel} device={device} threads={torch.get_num_threads()}",
          file=sys.stderr)
    records = run(args.numel, dtypes, device, args.repeats)
    print(table(records))
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(records, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
