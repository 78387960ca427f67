"""One rank of bench/monitor: the same DDP loop in blocks with and without monitoring (a function
in a module of its own: multiprocessing's spawn imports it by name, and cannot from a __main__)."""

import datetime
import os
import time


def rank_main(rank, world, port, args, run_dir, results):
    import torch
    import torch.distributed as dist

    try:
        os.environ.update(GLOO_SOCKET_IFNAME="lo", CIUICFLOW_LOCAL_WORLD_SIZE="1")
        torch.set_num_threads(1)
        store = dist.TCPStore("127.0.0.1", port, is_master=False,
                              timeout=datetime.timedelta(seconds=args.timeout))
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=args.timeout))
        results.put((rank, True, _train(rank, world, args, run_dir)))
        dist.destroy_process_group()
    except BaseException:
        import traceback

        results.put((rank, False, traceback.format_exc()))


def _train(rank, world, args, run_dir):
    import torch

    import ciuicflow
    from ciuicflow.monitor import Monitor

    torch.manual_seed(0)
    layers = []
    for _ in range(args.layers):
        layers += [torch.nn.Linear(args.hidden, args.hidden), torch.nn.ReLU()]
    model = torch.nn.Sequential(*layers[:-1])
    ddp = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=1)
    state = ciuicflow.register(ddp, "hierarchical_1bit", warmup_steps=2)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=1e-3)
    generator = torch.Generator().manual_seed(rank)
    batches = [torch.randn(args.batch, args.hidden, generator=generator) for _ in range(4)]

    def train_step(i):
        loss = ddp(batches[i % len(batches)]).square().mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss

    mon = Monitor(run_dir, [state], prometheus_port=0, straggler_every=args.straggler_every,
                  hang_timeout_s=120)
    for i in range(args.warmup):  # monitored: the monitor's first-use costs stay out of the blocks
        with mon.step():
            train_step(i)
    times = {"off": [], "on": []}
    cpu_times = {"off": [], "on": []}
    for block in range(args.blocks):
        arm = "on" if block % 2 else "off"
        block_times, block_cpu = [], []
        for i in range(args.block_steps):
            start, start_cpu = time.perf_counter(), time.thread_time()
            if arm == "on":
                with mon.step():
                    with mon.phase("forward+backward"):
                        loss = train_step(i)
                    mon.add_metrics(loss=loss.detach())
            else:
                loss = train_step(i)
                loss.detach().item()  # the monitored arm reads the loss too
            block_times.append(time.perf_counter() - start)
            block_cpu.append(time.thread_time() - start_cpu)
        times[arm].append(block_times)
        cpu_times[arm].append(block_cpu)
    gather_s, overhead_s = mon.gather_s, mon.overhead_s
    mon.close()
    return {"times": times, "cpu_times": cpu_times, "overhead_s": overhead_s, "gather_s": gather_s,
            "params": sum(p.numel() for p in model.parameters()),
            "compression_ratio": state.stats()["compression_ratio"]}
