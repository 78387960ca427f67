"""The thread that issues every hook's collectives, in hook-call order.

PyTorch's own ``powerSGD_hook`` issues its later collectives from future callbacks, so on gloo they
interleave across buckets differently on different ranks. Here, every collective of a bucket is
issued by one thread, in hook-call order: either inside the hook (``overlap=False``) or on this
single worker thread (``overlap=True``: communication of early buckets overlaps the rest of
backward). On CUDA the worker's kernels run on a stream of its own, which waits for each bucket's
gradients (an event recorded where the hook ran), so they overlap backward's kernels too; the
future's devices make DDP's stream wait for that stream in turn.
"""
from __future__ import annotations

import os
import queue
import threading
from typing import Callable

import torch


class OrderedWorker:
    def __init__(self):
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict = {}  # device -> the worker's CUDA stream there
        self._thread = threading.Thread(target=self._loop, name="ciuicflow-comm", daemon=True)
        self._thread.start()

    def submit(self, job: Callable[[], torch.Tensor], buffer: torch.Tensor) -> torch.futures.Future:
        ready = None
        if buffer.is_cuda:  # the worker's stream waits for the gradients of this bucket
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(buffer.device))
            future = torch.futures.Future(devices=[buffer.device])
        else:
            future = torch.futures.Future()
        self._jobs.put((job, future, ready, buffer.device))
        return future

    def _loop(self):
        while True:
            job, future, ready, device = self._jobs.get()
            try:
                if ready is None:
                    future.set_result(job())
                    continue
                torch.cuda.set_device(device)
                stream = self._streams.get(device)
                if stream is None:
                    stream = self._streams[device] = torch.cuda.Stream(device)
                stream.wait_event(ready)
                with torch.cuda.stream(stream):
                    # set inside the stream's context: the future records its event here
                    future.set_result(job())
            except BaseException as exc:  # the hook's caller sees it when it waits
                future.set_exception(exc)
            finally:  # the last job would otherwise keep its bucket's parameters (and model) alive
                job = future = ready = None


_WORKER = None
_WORKER_PID = None
_WORKER_LOCK = threading.Lock()


def ordered_worker() -> OrderedWorker:
    """One worker per process, shared by all states, so all hooks' collectives stay in order."""
    global _WORKER, _WORKER_PID
    with _WORKER_LOCK:
        if _WORKER is None or _WORKER_PID != os.getpid():
            _WORKER, _WORKER_PID = OrderedWorker(), os.getpid()
        return _WORKER


def completed(value: torch.Tensor) -> torch.futures.Future:
    future = torch.futures.Future(devices=[value.device]) if value.is_cuda else \
        torch.futures.Future()
    future.set_result(value)
    return future
