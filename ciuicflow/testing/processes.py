"""Run a function on N real processes (gloo on 127.0.0.1, or NCCL), with simulated nodes.

    results = run_distributed(check_something, world_size=4, nodes=2, args=(...,))

``fn(rank, world_size, *args)`` runs in every process after ``init_process_group("gloo")``; its
return values come back in rank order. Nodes are simulated with torchrun's variables
(``LOCAL_WORLD_SIZE``, ``GROUP_RANK``, ``LOCAL_RANK``), or ``CIUICFLOW_LOCAL_WORLD_SIZE``
(``node_env="override"``), or not at all (``node_env="none"``: every rank on this host's node).
``node_sizes=[3, 1]`` makes uneven nodes. ``backend="nccl"`` gives rank r the GPU r (modulo the
device count) and binds the default group to it (``device_id``), as NCCL users do. A rank that raises fails the call with its traceback and
the other ranks are killed; so does a run that outlasts ``timeout`` seconds.

The rendezvous store lives in the calling process on a port the OS picks (no port race), gloo
binds to the loopback interface, and children start from a forkserver that has torch (with
the parts DDP imports lazily) already imported.
"""
from __future__ import annotations

import datetime
import io
import multiprocessing
import os
import queue
import time
import traceback

import torch
import torch.distributed as dist

_CONTEXT = None


def _context():
    global _CONTEXT
    if _CONTEXT is None:
        _CONTEXT = multiprocessing.get_context("forkserver")
        # what every child would import anyway; DDP's constructor imports torch._dynamo
        _CONTEXT.set_forkserver_preload(["torch", "torch.distributed", "torch.nn.parallel",
                                         "torch._dynamo", "ciuicflow.ddp"])
    return _CONTEXT


def _node_env(rank: int, node_sizes: list[int], node_env: str) -> dict:
    if node_env == "none":
        return {}
    starts = [sum(node_sizes[:i]) for i in range(len(node_sizes))]
    node = max(i for i, s in enumerate(starts) if s <= rank)
    if node_env == "override":
        if len(set(node_sizes)) != 1:
            raise ValueError("CIUICFLOW_LOCAL_WORLD_SIZE describes equal nodes only")
        return {"CIUICFLOW_LOCAL_WORLD_SIZE": str(node_sizes[0])}
    if node_env == "torchrun":
        return {"LOCAL_WORLD_SIZE": str(node_sizes[node]), "GROUP_RANK": str(node),
                "LOCAL_RANK": str(rank - starts[node])}
    raise ValueError(f"node_env must be torchrun, override or none, got {node_env!r}")


def _child(rank, world_size, port, fn, args, env, timeout, results, backend):
    try:
        for name in ("CIUICFLOW_LOCAL_WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "LOCAL_RANK"):
            os.environ.pop(name, None)
        os.environ.update(env)
        torch.set_num_threads(1)
        store = dist.TCPStore("127.0.0.1", port, is_master=False,
                              timeout=datetime.timedelta(seconds=timeout))
        device_id = None
        if backend == "nccl":
            device_id = torch.device("cuda", rank % torch.cuda.device_count())
            torch.cuda.set_device(device_id)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=timeout), device_id=device_id)
        dist.barrier()  # every pair connected before anyone can finish and hang up
        value = fn(rank, world_size, *args)
        dist.barrier()
        dist.destroy_process_group()
        # as bytes: tensors sent through a queue would be shared memory owned by this process
        payload = io.BytesIO()
        torch.save(value, payload)
        results.put((rank, True, payload.getvalue()))
    except BaseException:  # report everything, KeyboardInterrupt included, then die
        results.put((rank, False, traceback.format_exc()))


def run_distributed(fn, world_size: int = 4, *, nodes: int | None = 2,
                    node_sizes: list[int] | None = None, node_env: str = "torchrun",
                    args: tuple = (), env: dict | None = None, timeout: float = 120.0,
                    backend: str = "gloo") -> list:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` processes; return the results."""
    if node_sizes is None:
        nodes = nodes or 1
        if world_size % nodes:
            raise ValueError(f"{world_size} ranks do not split into {nodes} equal nodes")
        node_sizes = [world_size // nodes] * nodes
    if sum(node_sizes) != world_size:
        raise ValueError(f"node_sizes {node_sizes} do not add up to {world_size}")
    ctx = _context()
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=timeout))
    results = ctx.Queue()
    base_env = {"GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1", "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(store.port), "WORLD_SIZE": str(world_size)}
    processes = []
    for rank in range(world_size):
        child_env = dict(base_env, RANK=str(rank), **_node_env(rank, node_sizes, node_env),
                         **(env or {}))
        process = ctx.Process(target=_child, daemon=True,
                              args=(rank, world_size, store.port, fn, args, child_env, timeout,
                                    results, backend))
        process.start()
        processes.append(process)

    deadline = time.monotonic() + timeout
    values, failures = {}, {}
    try:
        while len(values) + len(failures) < world_size:
            try:
                rank, ok, value = results.get(timeout=0.2)
            except queue.Empty:
                dead = [r for r, p in enumerate(processes)
                        if not p.is_alive() and r not in values and r not in failures]
                if dead and results.empty():
                    time.sleep(0.5)  # a result may still be in the pipe
                    if results.empty():
                        for r in dead:
                            failures[r] = (f"exited with code {processes[r].exitcode} "
                                           "without a result")
                if failures:
                    break
                if time.monotonic() > deadline:
                    missing = sorted(set(range(world_size)) - set(values) - set(failures))
                    raise TimeoutError(f"ranks {missing} did not finish within {timeout:.0f} s")
                continue
            if ok:
                values[rank] = torch.load(io.BytesIO(value), weights_only=False)
            else:
                failures[rank] = value
            if failures:
                break
    finally:
        if failures or len(values) < world_size:
            for p in processes:
                if p.is_alive():
                    p.kill()
        for p in processes:
            p.join(timeout=10)
        del store
    if failures:
        first = min(failures)
        raise AssertionError(f"rank {first} failed:\n{failures[first]}"
                             + (f"\n(and ranks {sorted(set(failures) - {first})})"
                                if len(failures) > 1 else ""))
    return [values[r] for r in range(world_size)]
