"""When do OneBitAdam and ZeroOneAdam freeze their variance, and what does it cost? A freeze sweep.

A small regression (a student MLP 32-128-128-8 fitting a tanh teacher plus noise, 10,000 rows, MSE
on 2,000 held-out rows), trained with Adam (lr 3e-4, 32 rows per rank per step) for --steps steps
on 2 simulated nodes x 2 ranks (gloo on loopback, ciuicflow.testing.run_distributed), by:

  adam                   torch.optim.Adam on the exact mean gradient (ciuicflow's exact all-reduce)
  onebit_adam            OneBitAdam with its default, freeze_steps="auto"
  onebit_adam@N          OneBitAdam(freeze_steps=N): held until the variance is stable
  onebit_adam@N!         OneBitAdam(freeze_steps=N, hold_until_stable=False): frozen at N as asked
  zero_one_adam[@N[!]]   the same for ZeroOneAdam's var_freeze_step

Same data, initial weights and batches for every method of a seed. For each run: the final test
MSE, its gap to Adam's, the step the variance froze after, and the inter-node bytes against an exact
all-reduce's over the whole run (the optimizers' own model of them).

    python -m bench.onebit.freeze --seeds 0,1,2                # 800 steps, freezes 80,160,240
    python -m bench.onebit.freeze --smoke                      # CI: 60 steps, one seed
"""
import argparse
import json
import math
import os
import sys
import time


TASK = dict(inputs=32, teacher=64, outputs=8, hidden=128, rows=10_000, test=2_000, noise=0.02,
            lr=3e-4, batch=32)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--steps", type=int, default=800)
    p.add_argument("--seeds", default="0", help="comma-separated: initial weights and batch order")
    p.add_argument("--freezes", default="80,160,240", help="explicit freeze steps to try")
    p.add_argument("--forced", action="store_true",
                   help="also the explicit freezes with hold_until_stable=False (frozen as asked)")
    p.add_argument("--optimizers", default="onebit_adam,zero_one_adam")
    p.add_argument("--smoke", action="store_true", help="60 steps, freezes 20,40, seed 0")
    p.add_argument("--json", metavar="PATH", default="out/onebit_freeze/onebit_freeze.json",
                   help="JSON output; the markdown table goes next to it (.md)")
    args = p.parse_args(argv)
    if args.smoke:
        args.steps, args.seeds, args.freezes = 60, "0", "20,40"
    args.seed_list = [int(s) for s in args.seeds.split(",") if s.strip()]
    freezes = [int(s) for s in args.freezes.split(",") if s.strip()]
    args.methods = ["adam"]
    for name in filter(None, args.optimizers.split(",")):
        args.methods += [name] + [f"{name}@{n}" for n in freezes]
        args.methods += [f"{name}@{n}!" for n in freezes] if args.forced else []
    return args


def _data():
    import torch

    g = torch.Generator().manual_seed(1)
    w1 = torch.randn(TASK["inputs"], TASK["teacher"], generator=g) / math.sqrt(TASK["inputs"])
    w2 = torch.randn(TASK["teacher"], TASK["outputs"], generator=g) / math.sqrt(TASK["teacher"])
    x = torch.randn(TASK["rows"] + TASK["test"], TASK["inputs"], generator=g)
    y = torch.tanh(x @ w1) @ w2 + TASK["noise"] * torch.randn(x.shape[0], TASK["outputs"], generator=g)
    return x[:TASK["rows"]], y[:TASK["rows"]], x[TASK["rows"]:], y[TASK["rows"]:]


def _model(seed):
    import torch

    torch.manual_seed(100 + seed)
    h = TASK["hidden"]
    return torch.nn.Sequential(torch.nn.Linear(TASK["inputs"], h), torch.nn.ReLU(), torch.nn.Linear(h, h),
                               torch.nn.ReLU(), torch.nn.Linear(h, TASK["outputs"]))


def _optimizer(method, params):
    """(optimizer, whether the caller averages the gradients exactly)."""
    import torch
    from ciuicflow.optim import OneBitAdam, ZeroOneAdam

    if method == "adam":
        return torch.optim.Adam(params, lr=TASK["lr"]), True
    name, _, freeze = method.partition("@")
    forced = freeze.endswith("!")
    freeze = int(freeze.rstrip("!")) if freeze else "auto"
    if name == "onebit_adam":
        return OneBitAdam(params, lr=TASK["lr"], freeze_steps=freeze, hold_until_stable=not forced), False
    return ZeroOneAdam(params, lr=TASK["lr"], var_freeze_step=freeze, hold_until_stable=not forced), False


def train(rank, world, method, seed, steps):
    import torch
    from ciuicflow.collectives.hierarchical import hierarchical_all_reduce

    x, y, x_test, y_test = _data()
    model = _model(seed)
    optimizer, average = _optimizer(method, model.parameters())
    batches = torch.Generator().manual_seed(seed * 1000 + 7)  # one global batch per step, split by rank
    for _ in range(steps):
        rows = torch.randint(0, x.shape[0], (world * TASK["batch"],), generator=batches)[rank::world]
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(x[rows]), y[rows]).backward()
        if average:
            grads = [p.grad for p in model.parameters()]
            flat = hierarchical_all_reduce(torch.cat([g.reshape(-1) for g in grads]), op="mean")
            torch._foreach_copy_(grads, [v.view_as(g) for v, g in
                                         zip(flat.split([g.numel() for g in grads]), grads)])
        optimizer.step()
    with torch.no_grad():
        mse = torch.nn.functional.mse_loss(model(x_test), y_test).item()
    record = {"method": method, "seed": seed, "mse": mse}
    if not average:
        traffic = optimizer.traffic
        record.update(frozen_at=optimizer.frozen_at, reason=optimizer.freeze_reason,
                      bytes_ratio=traffic.exact_inter_bytes / max(1.0, traffic.inter_bytes))
    return record


def _run_all(rank, world, methods, seeds, steps):
    import warnings

    records = []
    for seed in seeds:
        for method in methods:
            started = time.perf_counter()
            with warnings.catch_warnings(record=True) as caught:  # the holds' warnings, once
                warnings.simplefilter("always")
                record = train(rank, world, method, seed, steps)
            record["warnings"] = sorted({str(w.message) for w in caught})
            record["seconds"] = time.perf_counter() - started
            records.append(record)
            if rank == 0:
                print(f"[onebit_freeze] seed {seed} {method}: mse {record['mse']:.5f} frozen after "
                      f"{record.get('frozen_at', '-')} ({record['seconds']:.0f} s)", file=sys.stderr,
                      flush=True)
    return records


def markdown(records, steps):
    exact = {r["seed"]: r["mse"] for r in records if r["method"] == "adam"}
    lines = [f"Freeze sweep: regression, {steps} steps, 2 nodes x 2 ranks; final test MSE, gap to Adam, "
             "the step the variance froze after, bytes against exact over the run.", "",
             "| seed | method | test MSE | gap to Adam | frozen after | exact / sent bytes |",
             "|---:|---|---:|---:|---:|---:|"]
    for r in records:
        gap = r["mse"] / exact[r["seed"]] - 1
        frozen = r.get("frozen_at")
        ratio = f"{r['bytes_ratio']:.1f}x" if "bytes_ratio" in r else "1x"
        lines.append(f"| {r['seed']} | {r['method']} | {r['mse']:.5f} | {gap:+.2%} | "
                     f"{'-' if frozen is None and r['method'] == 'adam' else frozen} | {ratio} |")
    seeds = sorted(exact)
    if len(seeds) > 1:
        lines += ["", "| method | mean gap over seeds " + ",".join(map(str, seeds)) + " | worst |",
                  "|---|---:|---:|"]
        for method in dict.fromkeys(r["method"] for r in records):
            gaps = [r["mse"] / exact[r["seed"]] - 1 for r in records if r["method"] == method]
            lines.append(f"| {method} | {sum(gaps) / len(gaps):+.2%} | {max(gaps):+.2%} |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    args = parse_args(argv)
    from ciuicflow.testing.processes import run_distributed

    started = time.monotonic()
    records = run_distributed(_run_all, 4, nodes=2, args=(args.methods, args.seed_list, args.steps),
                              timeout=600 + 30 * args.steps * len(args.seed_list))[0]
    table = markdown(records, args.steps)
    out = os.path.abspath(args.json)
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out, "w") as f:
        json.dump({"task": TASK, "steps": args.steps, "records": records,
                   "seconds": time.monotonic() - started}, f, indent=1)
    with open(os.path.splitext(out)[0] + ".md", "w") as f:
        f.write(table)
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
