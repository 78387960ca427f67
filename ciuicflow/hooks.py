"""DDP communication hooks: thin glue from a ``GradBucket`` to the collectives.

    state = ciuicflow.OneBitState(warmup_steps=10)
    ddp_model.register_comm_hook(state, ciuicflow.hierarchical_1bit)
    # or, binding parameter names (needed by exclude patterns and exact checkpoint resume):
    state = ciuicflow.register(ddp_model, "hierarchical_1bit", exclude=["*.bias", "*norm*"])

Hooks (``hook(state, bucket) -> Future[Tensor]``, the mean of the bucket over the group):

- ``hierarchical_allreduce`` (``AllReduceState``): exact, intra-node reduce-scatter / inter-node
  all-reduce / intra-node all-gather;
- ``hierarchical_1bit`` / ``onebit`` (``OneBitState``): 1-bit with error feedback on the inter-node
  step / on all traffic;
- ``hierarchical_powersgd`` / ``powersgd`` (``PowerSGDState``): PowerSGD whose all-reduces are
  hierarchical / flat.

Ordering: DDP calls the hook of each bucket in bucket order, the same on every rank, while
backward is still running. PyTorch's own ``powerSGD_hook`` issues its later collectives from future
callbacks, so on gloo they interleave across buckets differently on different ranks. Here, every
collective of a bucket is issued by one thread, in hook-call order: either inside the hook
(``overlap=False``) or on a single worker thread (``overlap=True``, the default: communication of
early buckets overlaps the rest of backward). The hook of the last bucket waits for the worker to
finish, so DDP's own collectives at the end of backward come after ours on every rank.
"""
import fnmatch
import hashlib
import os
import queue
import threading
import time
import warnings
from typing import Callable

import torch
import torch.distributed as dist

from ciuicflow.collectives import Traffic
from ciuicflow.collectives.hierarchical import flat_all_reduce, hierarchical_all_reduce
from ciuicflow.collectives.onebit import DEFAULT_CHUNK_SIZE, OneBitErrors, onebit_all_reduce
from ciuicflow.collectives.powersgd import PowerSGDMemory, powersgd_all_reduce
from ciuicflow.topology import Topology

DEFAULT_WARMUP_STEPS = 10
_STATE_VERSION = 1


# ------------------------------------------------------------------------------------------------
# What a hook reads from a GradBucket (in the hook's thread: the bucket object is not kept)


class _Bucket:
    __slots__ = ("index", "buffer", "is_last", "segments", "parameters")

    def __init__(self, index, buffer, is_last, segments, parameters):
        self.index, self.buffer, self.is_last = index, buffer, is_last
        self.segments, self.parameters = segments, parameters

    @classmethod
    def read(cls, bucket: dist.GradBucket) -> "_Bucket":
        buffer = bucket.buffer()
        base = buffer.storage_offset()
        segments = [(g.storage_offset() - base, tuple(g.shape)) for g in bucket.gradients()]
        return cls(bucket.index(), buffer, bucket.is_last(), segments, bucket.parameters())

    def key(self, hierarchical: bool) -> str:
        """Names this bucket's memory: same layout, same key (in every process, after resume)."""
        layout = repr((str(self.buffer.dtype), self.segments)).encode()
        digest = hashlib.sha1(layout).hexdigest()[:12]
        return f"{'h' if hierarchical else 'f'}{self.index}:{self.buffer.numel()}:{digest}"


# ------------------------------------------------------------------------------------------------
# The thread that issues collectives in hook-call order


class _OrderedWorker:
    def __init__(self):
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
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
                if ready is not None:
                    torch.cuda.set_device(device)
                    torch.cuda.current_stream(device).wait_event(ready)
                future.set_result(job())
            except BaseException as exc:  # the hook's caller sees it when it waits
                future.set_exception(exc)


_WORKER = None
_WORKER_PID = None
_WORKER_LOCK = threading.Lock()


def _worker() -> _OrderedWorker:
    """One worker per process, shared by all states, so all hooks' collectives stay in order."""
    global _WORKER, _WORKER_PID
    with _WORKER_LOCK:
        if _WORKER is None or _WORKER_PID != os.getpid():
            _WORKER, _WORKER_PID = _OrderedWorker(), os.getpid()
        return _WORKER


def _completed(value: torch.Tensor) -> torch.futures.Future:
    future = torch.futures.Future(devices=[value.device]) if value.is_cuda else \
        torch.futures.Future()
    future.set_result(value)
    return future


# ------------------------------------------------------------------------------------------------
# Per-bucket memory (error feedback, warm start), across bucket rebuilds and resumes


class _Memories:
    """Memory objects by bucket key, with the layout each was made for.

    DDP rebuilds its buckets after its first step (its first step uses one bucket holding every
    parameter), so right after a resume the buckets differ from the checkpoint's for one step.
    Such a bucket is cut into the checkpoint's buckets (found by parameter name) and each piece is
    reduced with its own memory, in the checkpoint's order: the resumed run then computes what
    the uninterrupted run did. Without names (no ``register``/``bind_model``), or when the pieces
    do not fit, the bucket is all-reduced exactly that step and the memory kept for later.
    """

    def __init__(self, make: Callable[[], object]):
        self._make = make
        self.entries: dict[str, tuple[dict, object]] = {}  # key -> (layout, memory)
        self.pending: set[str] = set()  # loaded from a checkpoint, not used since
        self._seen: set[str] = set()    # used during the current step
        self._steps_since_load = 0

    def get(self, bucket: _Bucket, hierarchical: bool, names):
        """The bucket's memory, a new one, or None when a checkpoint's memory is still pending."""
        key = bucket.key(hierarchical)
        entry = self.entries.get(key)
        if entry is None:
            if self.pending:
                return None
            layout = {"index": bucket.index, "numel": bucket.buffer.numel(),
                      "dtype": str(bucket.buffer.dtype), "segments": bucket.segments,
                      "params": names, "hierarchical": hierarchical}
            entry = self.entries[key] = (layout, self._make())
        self.pending.discard(key)
        self._seen.add(key)
        return entry[1]

    def pieces(self, bucket: _Bucket, hierarchical: bool, names):
        """Pending checkpoint buckets that exactly tile ``bucket``: [(key, layout, memory)]."""
        if names is None:
            return None
        where = {}
        for name, (offset, shape) in zip(names, bucket.segments):
            where[name] = (offset, shape)
        pieces, covered = [], set()
        for key in self.pending:
            layout, memory = self.entries[key]
            params = layout["params"]
            if layout["hierarchical"] != hierarchical or not params \
                    or layout["dtype"] != str(bucket.buffer.dtype) \
                    or not all(p in where for p in params):
                continue
            shapes = [tuple(shape) for _, shape in layout["segments"]]
            if any(shape != where[p][1] for p, shape in zip(params, shapes)):
                continue
            pieces.append((key, layout, memory))
            covered.update(params)
        if covered != set(where) or sum(len(p[1]["params"]) for p in pieces) != len(where):
            return None
        return sorted(pieces, key=lambda p: p[1]["index"])

    def mark_used(self, key: str) -> None:
        self.pending.discard(key)
        self._seen.add(key)

    def end_of_step(self, warn: Callable[[str, str], None]) -> None:
        self._steps_since_load += 1
        if self.pending and self._steps_since_load >= 2:
            warn("stale", "ciuicflow: the checkpoint's DDP buckets never came back; their "
                 "error-feedback memory is dropped")
            for key in self.pending:
                del self.entries[key]
            self.pending.clear()
        # memory of buckets that no longer exist (DDP rebuilt them) is dropped
        for key in [k for k in self.entries if k not in self._seen and k not in self.pending]:
            del self.entries[key]
        self._seen = set()

    def state_dict(self) -> dict:
        return {key: {"layout": layout, "tensors": memory.state_dict()}
                for key, (layout, memory) in self.entries.items()}

    def load_state_dict(self, state: dict) -> None:
        self.entries = {}
        for key, entry in state.items():
            memory = self._make()
            memory.load_state_dict(entry["tensors"])
            self.entries[key] = (entry["layout"], memory)
        self.pending = set(self.entries)
        self._seen = set()
        self._steps_since_load = 0


# ------------------------------------------------------------------------------------------------
# States


class AllReduceState:
    """State of ``hierarchical_allreduce``: the group, its topology, statistics.

    Args:
        process_group: the group to reduce over (default: the default group, at first use).
        topology: a ``Topology`` of that group (default: ``Topology.detect``, at first use).
        overlap: issue collectives on the ordered worker thread (True) or inside the hook.
        model: the (DDP) model, to learn parameter names; ``register`` passes it.
    """

    algorithm = "allreduce"
    guard = "off"  # the compressing states' accuracy guard (see OneBitState)
    guard_threshold = None
    _config_fields = ("overlap",)
    _layout_fields: tuple = ()  # config that must match to load a checkpoint's memory

    def __init__(self, process_group=None, topology: Topology | None = None, *,
                 overlap: bool = True, model: torch.nn.Module | None = None):
        if topology is not None and process_group is not None \
                and topology.group is not process_group:
            raise ValueError("topology was detected on a different process group")
        self.process_group = process_group if process_group is not None else \
            (topology.group if topology is not None else None)
        self.topology = topology
        self.overlap = bool(overlap)
        self.warmup_steps = 0
        self.exclude: tuple[str, ...] = ()
        self.iter = 0  # synchronised steps seen by the hook (no_sync steps do not count)
        self._memories = _Memories(self._new_memory)
        self._names: dict[int, str] = {}
        self._masks: dict[str, torch.Tensor | None] = {}
        self._warned: set[str] = set()
        self.reset_stats()
        if model is not None:
            self.bind_model(model)

    # -- public ------------------------------------------------------------------------------

    def bind_model(self, model: torch.nn.Module) -> "AllReduceState":
        """Learn parameter names (for ``exclude`` patterns and resume); ``register`` does this."""
        module = getattr(model, "module", model)
        self._names = {id(param): name for name, param in module.named_parameters()}
        self._masks.clear()
        return self

    def reset_stats(self) -> None:
        self._traffic = Traffic()             # every step
        self._compressed_traffic = Traffic()  # steps past warm-up
        self._time_s = 0.0
        self._stats_steps = 0
        self._compressed_steps = 0
        self._buckets = 0
        self._relative_errors: dict[int, float] = {}  # bucket index -> the guard's last measure
        self._guard_alerts = 0

    def stats(self) -> dict:
        """Communication statistics of this rank since the last ``reset_stats()``.

        Bytes follow the model of ``ciuicflow.collectives`` (bytes this rank sends); the
        ``exact_*`` figures are what exact all-reduces along the same path would send.
        ``compression_ratio`` = exact / actual inter-node bytes over the steps past warm-up
        (``overall_compression_ratio``: over all steps). ``time_s``: time spent in the hook's
        compression and communication."""
        t, c = self._traffic, self._compressed_traffic
        steps = self._stats_steps
        return {
            "algorithm": self.algorithm,
            "topology": self.topology.describe() if self.topology is not None else None,
            "steps": steps,
            "compressed_steps": self._compressed_steps,
            "buckets": self._buckets,
            "intra_node_bytes": int(round(t.intra_bytes)),
            "inter_node_bytes": int(round(t.inter_bytes)),
            "exact_intra_node_bytes": int(round(t.exact_intra_bytes)),
            "exact_inter_node_bytes": int(round(t.exact_inter_bytes)),
            "inter_node_bytes_per_step": t.inter_bytes / steps if steps else 0.0,
            "compression_ratio": _ratio(c.exact_inter_bytes, c.inter_bytes),
            "overall_compression_ratio": _ratio(t.exact_inter_bytes, t.inter_bytes),
            "nonfinite_fallbacks": t.nonfinite_fallbacks,
            # the accuracy guard: ||error-feedback memory|| / ||gradient|| per bucket, last step
            "relative_error": max(self._relative_errors.values()) if self._relative_errors
            else None,
            "relative_errors": dict(self._relative_errors),
            "guard_alerts": self._guard_alerts,
            "guard_exact_steps": t.guard_exact_steps,
            "time_s": self._time_s,
            "time_per_step_s": self._time_s / steps if steps else 0.0,
        }

    def state_dict(self) -> dict:
        """Everything a resumed run needs to continue exactly (no process group)."""
        return {
            "version": _STATE_VERSION,
            "algorithm": self.algorithm,
            "config": self._config(),
            "iter": self.iter,
            "memory": self._memories.state_dict(),
            "stats": {"traffic": self._traffic.as_dict(),
                      "compressed_traffic": self._compressed_traffic.as_dict(),
                      "time_s": self._time_s, "steps": self._stats_steps,
                      "compressed_steps": self._compressed_steps, "buckets": self._buckets},
        }

    def load_state_dict(self, state: dict) -> None:
        if state.get("algorithm") != self.algorithm:
            raise ValueError(f"checkpoint is for {state.get('algorithm')!r} hooks, "
                             f"this state is {self.algorithm!r}")
        if state.get("version") != _STATE_VERSION:
            raise ValueError(f"unknown checkpoint version {state.get('version')!r}")
        for name in self._layout_fields:
            if state["config"].get(name) != getattr(self, name):
                raise ValueError(f"checkpoint has {name}={state['config'].get(name)!r}, this state "
                                 f"{getattr(self, name)!r}: its memory does not fit")
        self.iter = int(state["iter"])
        self._memories.load_state_dict(state["memory"])
        stats = state.get("stats", {})
        self._traffic = Traffic(**stats.get("traffic", {}))
        self._compressed_traffic = Traffic(**stats.get("compressed_traffic", {}))
        self._time_s = stats.get("time_s", 0.0)
        self._stats_steps = stats.get("steps", 0)
        self._compressed_steps = stats.get("compressed_steps", 0)
        self._buckets = stats.get("buckets", 0)

    def __getstate__(self) -> dict:
        # The process group, the topology (it holds groups) and parameter identities stay behind.
        return {"config": self._config(), "state": self.state_dict()}

    def __setstate__(self, pickled: dict) -> None:
        self.__init__(**pickled["config"])
        self.load_state_dict(pickled["state"])

    # -- what hooks call ---------------------------------------------------------------------

    def _config(self) -> dict:
        return {name: getattr(self, name) for name in self._config_fields}

    def _resolve(self) -> Topology:
        """The topology, detected on first use (collective: runs in hook order on every rank)."""
        if self.topology is None:
            self.topology = Topology.detect(self.process_group)
            self.process_group = self.topology.group
        return self.topology

    def _hook(self, bucket: dist.GradBucket, hierarchical: bool) -> torch.futures.Future:
        info = _Bucket.read(bucket)
        step = self.iter
        if info.is_last:
            self.iter += 1
        job = lambda: self._reduce_bucket(info, step, hierarchical)  # noqa: E731
        if not self.overlap:
            return _completed(job())
        future = _worker().submit(job, info.buffer)
        if info.is_last:
            future.wait()  # the worker is idle again before DDP issues its own collectives
        return future

    def _reduce_bucket(self, info: _Bucket, step: int, hierarchical: bool) -> torch.Tensor:
        start = time.perf_counter()
        topology = self._resolve()
        traffic = Traffic()
        past_warmup = self._compresses() and step >= self.warmup_steps
        if info.buffer.numel() and topology.world_size > 1:
            if not (past_warmup and self._reduce_compressed(info, hierarchical, step, traffic)):
                exact = hierarchical_all_reduce if hierarchical else flat_all_reduce
                exact(info.buffer, topology, traffic=traffic)
        self._traffic.merge(traffic)
        if past_warmup:
            self._compressed_traffic.merge(traffic)
        self._buckets += 1
        if info.is_last:
            self._stats_steps += 1
            if past_warmup:
                self._compressed_steps += 1
                self._memories.end_of_step(self._warn_once)
        self._time_s += time.perf_counter() - start
        return info.buffer

    def _reduce_compressed(self, info: _Bucket, hierarchical: bool, step: int,
                           traffic: Traffic) -> bool:
        """Compress this bucket if its memory is at hand; False: reduce it exactly this step."""
        names = self._param_names(info)
        memory = self._memories.get(info, hierarchical, names)
        if memory is not None:
            self._compress(info, memory, hierarchical, step, traffic)
            return True
        pieces = self._memories.pieces(info, hierarchical, names)
        if pieces is None:
            self._warn_once("layout", "ciuicflow: a DDP bucket does not match the checkpoint's "
                            "buckets and parameter names are unknown (use ciuicflow.register or "
                            "state.bind_model); it is all-reduced exactly until they match")
            return False
        where = {name: offset for name, (offset, _) in zip(names, info.segments)}
        by_name = dict(zip(names, info.parameters))
        for key, layout, memory in pieces:
            # the checkpoint's bucket, rebuilt from this bucket's gradients
            sizes = [torch.Size(shape).numel() for _, shape in layout["segments"]]
            buffer = torch.cat([info.buffer[where[p]:where[p] + n]
                                for p, n in zip(layout["params"], sizes)])
            piece = _Bucket(layout["index"], buffer, False, layout["segments"],
                            [by_name[p] for p in layout["params"]])
            self._compress(piece, memory, hierarchical, step, traffic)
            self._memories.mark_used(key)
            for p, n, (offset, _) in zip(layout["params"], sizes, layout["segments"]):
                info.buffer[where[p]:where[p] + n].copy_(buffer[offset:offset + n])
        return True

    def _param_names(self, info: _Bucket):
        if not self._names:
            return None
        names = [self._names.get(id(p)) for p in info.parameters]
        return None if None in names else names

    def _compresses(self) -> bool:
        return False

    def _new_memory(self):
        return None

    def _compress(self, info, memory, hierarchical, step, traffic):
        raise NotImplementedError

    def _exact_mask(self, info: _Bucket, hierarchical: bool) -> torch.Tensor | None:
        """True where the bucket holds a parameter matching an ``exclude`` pattern."""
        if not self.exclude:
            return None
        key = info.key(hierarchical)
        if key in self._masks:
            return self._masks[key]
        names = self._param_names(info)
        if names is None:
            raise RuntimeError(
                "exclude patterns need parameter names: use ciuicflow.register(model, ...) "
                "or state.bind_model(model) (also after unpickling a state)")
        mask = torch.zeros(info.buffer.numel(), dtype=torch.bool, device=info.buffer.device)
        for name, (offset, shape) in zip(names, info.segments):
            if any(fnmatch.fnmatchcase(name, pattern) for pattern in self.exclude):
                mask[offset:offset + torch.Size(shape).numel()] = True
        self._masks[key] = mask if bool(mask.any()) else None
        return self._masks[key]

    def _check_guard(self, info: _Bucket, relative_error: float | None) -> None:
        """Record the bucket's relative error; above the threshold, warn (once per bucket)."""
        if relative_error is None or self.guard == "off":
            return
        self._relative_errors[info.index] = relative_error
        if relative_error > self.guard_threshold:
            self._guard_alerts += 1
            action = ("its next step is exact" if self.guard == "exact" else
                      "pass guard='exact' to send such buckets exactly, or reduce the learning "
                      "rate, the momentum, or raise the rank/lower the chunk size")
            self._warn_once(f"guard{info.index}", (
                f"ciuicflow {self.algorithm}: bucket {info.index}'s error-feedback memory is "
                f"{relative_error:.1f}x its gradient (threshold {self.guard_threshold}): "
                f"compression is falling behind and may cost accuracy; {action}"))

    def _warn_once(self, tag: str, message: str) -> None:
        if tag not in self._warned:
            self._warned.add(tag)
            warnings.warn(message, RuntimeWarning, stacklevel=2)


def _ratio(exact: float, actual: float):
    return exact / actual if actual else None


class _CompressingState(AllReduceState):
    _config_fields = ("overlap", "warmup_steps", "exclude", "seed")

    def __init__(self, process_group=None, topology=None, *,
                 warmup_steps: int = DEFAULT_WARMUP_STEPS, exclude=(), seed: int = 0,
                 overlap: bool = True, model=None):
        super().__init__(process_group, topology, overlap=overlap, model=model)
        if int(warmup_steps) < 0:
            raise ValueError(f"warmup_steps must be >= 0, got {warmup_steps}")
        if isinstance(exclude, str):
            exclude = (exclude,)
        self.warmup_steps = int(warmup_steps)
        self.exclude = tuple(exclude)
        self.seed = int(seed)

    def _compresses(self) -> bool:
        return True


# Defaults of the 1-bit hooks, chosen on bench/convergence.py (docs/hooks.md, "Defaults"):
# - 256 elements per scale (collectives.onebit.DEFAULT_CHUNK_SIZE says why);
# - half of the error carried over: the carried error is gradient sent late, and the optimizer's
#   momentum turns late gradient at a constant learning rate into oscillation (accuracy collapsed
#   with all of it carried); half bounds the delay to about two steps.
# - one phase where the exchange has two ranks (two nodes): the same bytes as two phases, without
#   the server's second compression.
ONEBIT_CHUNK_SIZE = DEFAULT_CHUNK_SIZE
ONEBIT_ERROR_DECAY = 0.5
GUARD_THRESHOLD = 4.0
_GUARDS = ("warn", "exact", "off")


class OneBitState(_CompressingState):
    """State of ``hierarchical_1bit`` and ``onebit``: 1-bit compression with error feedback.

    Args:
        process_group, topology, overlap, model: as for ``AllReduceState``.
        warmup_steps: synchronised steps all-reduced exactly before compression starts.
        chunk_size: elements that share one scale (a positive multiple of 8).
        error_decay: share of the error-feedback memory carried into the next step, in [0, 1]
            (1: classic error feedback).
        phases: 2 (each rank serves a segment, compresses its mean again: 2(W-1)/W of the
            compressed bytes), 1 (every rank gathers all compressed tensors: (W-1)), or "auto":
            1 when the exchange has two ranks (the same bytes), else 2.
        guard: the accuracy guard: "warn" (a RuntimeWarning when a bucket's relative error,
            ||error-feedback memory|| / ||gradient||, exceeds ``guard_threshold``), "exact" (such
            a bucket's next step is exact and sends what the memory held) or "off".
        exclude: parameter-name patterns (``fnmatch``, e.g. ``"*.bias"``, ``"*norm*"``) reduced
            exactly; names come from ``register(model, ...)`` or ``bind_model(model)``.
        seed: recorded for reproducibility (1-bit compression itself is deterministic).
    """

    algorithm = "onebit"
    _config_fields = _CompressingState._config_fields + (
        "chunk_size", "error_decay", "phases", "guard", "guard_threshold")
    _layout_fields = ("chunk_size", "phases")

    def __init__(self, process_group=None, topology=None, *,
                 warmup_steps: int = DEFAULT_WARMUP_STEPS, chunk_size: int = ONEBIT_CHUNK_SIZE,
                 error_decay: float = ONEBIT_ERROR_DECAY, phases="auto", guard: str = "warn",
                 guard_threshold: float = GUARD_THRESHOLD, exclude=(), seed: int = 0,
                 overlap: bool = True, model=None):
        if int(chunk_size) <= 0 or int(chunk_size) % 8:
            raise ValueError(f"chunk_size must be a positive multiple of 8, got {chunk_size}")
        if not 0.0 <= float(error_decay) <= 1.0:
            raise ValueError(f"error_decay must be in [0, 1], got {error_decay}")
        if phases not in ("auto", 1, 2):
            raise ValueError(f"phases must be 1, 2 or 'auto', got {phases!r}")
        _validate_guard(guard, guard_threshold)
        self.chunk_size = int(chunk_size)
        self.error_decay = float(error_decay)
        self.phases = phases
        self.guard = guard
        self.guard_threshold = float(guard_threshold)
        super().__init__(process_group, topology, warmup_steps=warmup_steps, exclude=exclude,
                         seed=seed, overlap=overlap, model=model)

    def _new_memory(self) -> OneBitErrors:
        return OneBitErrors()

    def _compress(self, info, memory, hierarchical, step, traffic):
        topology = self.topology
        ranks = (topology.num_nodes if hierarchical and topology.hierarchical
                 else topology.world_size)
        server = self.phases == 2 or (self.phases == "auto" and ranks > 2)
        onebit_all_reduce(info.buffer, memory, topology, hierarchical=hierarchical,
                          chunk_size=self.chunk_size, error_decay=self.error_decay,
                          server=server,
                          guard_threshold=self.guard_threshold if self.guard == "exact" else None,
                          measure=self.guard != "off",
                          exact_mask=self._exact_mask(info, hierarchical), traffic=traffic)
        self._check_guard(info, memory.relative_error)


def _validate_guard(guard, threshold) -> None:
    if guard not in _GUARDS:
        raise ValueError(f"guard must be one of {_GUARDS}, got {guard!r}")
    if not float(threshold) > 0 or float(threshold) != float(threshold):
        raise ValueError(f"guard_threshold must be a positive number, got {threshold!r}")


# Rank 16 by default: with momentum SGD at a constant learning rate (bench/convergence.py's
# mlp_sgd_constant) rank 1 lost 45 points of accuracy, rank 4 six and rank 8 1.5 (PyTorch's hook
# as much at the same rank); rank 16 matched exact and still sends a 512 x 512 layer's gradient
# in 1/16 of its bytes.
POWERSGD_RANK = 16
# PowerSGD's memory holds the gradient noise no low rank captures: the guard's measure was 23-99 in
# runs of bench/convergence.py that kept exact accuracy (23-27 on mlp_sgd_constant at ranks 4 to 32,
# whether accuracy held or not), so it does not tell a good rank from a bad one and its threshold
# only catches a memory that runs away (docs/hooks.md, "The accuracy guard").
POWERSGD_GUARD_THRESHOLD = 200.0


class PowerSGDState(_CompressingState):
    """State of ``hierarchical_powersgd`` and ``powersgd``.

    Args:
        process_group, topology, overlap, model: as for ``AllReduceState``.
        rank: rank of the approximation (PyTorch's ``matrix_approximation_rank``).
        warmup_steps: synchronised steps all-reduced exactly first (``start_powerSGD_iter``).
        min_compression_rate: compress a matrix only when it shrinks at least this much.
        error_feedback, warm_start: as in PyTorch's PowerSGD (both on by default).
        orthogonalization_eps: added to column norms in the orthogonalisation.
        guard, guard_threshold: the accuracy guard (see ``OneBitState``); the measure is the
            ranks' mean of ||error|| / ||gradient||.
        exclude: parameter-name patterns reduced exactly (see ``OneBitState``).
        seed: seeds the random initial Q (the same on every rank).
    """

    algorithm = "powersgd"
    _config_fields = _CompressingState._config_fields + (
        "rank", "min_compression_rate", "error_feedback", "warm_start", "orthogonalization_eps",
        "guard", "guard_threshold")
    _layout_fields = ("rank",)

    def __init__(self, process_group=None, topology=None, *, rank: int = POWERSGD_RANK,
                 warmup_steps: int = DEFAULT_WARMUP_STEPS, min_compression_rate: float = 2.0,
                 error_feedback: bool = True, warm_start: bool = True,
                 orthogonalization_eps: float = 0.0, guard: str = "warn",
                 guard_threshold: float = POWERSGD_GUARD_THRESHOLD, exclude=(), seed: int = 0,
                 overlap: bool = True, model=None):
        if int(rank) < 1:
            raise ValueError(f"rank must be >= 1, got {rank}")
        _validate_guard(guard, guard_threshold)
        self.guard = guard
        self.guard_threshold = float(guard_threshold)
        self.rank = int(rank)
        self.min_compression_rate = float(min_compression_rate)
        self.error_feedback = bool(error_feedback)
        self.warm_start = bool(warm_start)
        self.orthogonalization_eps = float(orthogonalization_eps)
        super().__init__(process_group, topology, warmup_steps=warmup_steps, exclude=exclude,
                         seed=seed, overlap=overlap, model=model)

    def _new_memory(self) -> PowerSGDMemory:
        return PowerSGDMemory()

    def _compress(self, info, memory, hierarchical, step, traffic):
        powersgd_all_reduce(info.buffer, memory, self.topology, segments=info.segments,
                            rank=self.rank, hierarchical=hierarchical,
                            min_compression_rate=self.min_compression_rate,
                            exact_mask=self._exact_mask(info, hierarchical),
                            error_feedback=self.error_feedback, warm_start=self.warm_start,
                            seed=self.seed, step=step, key=info.index,
                            eps=self.orthogonalization_eps,
                            guard_threshold=self.guard_threshold if self.guard == "exact" else None,
                            measure=self.guard != "off", traffic=traffic)
        self._check_guard(info, memory.relative_error)


# ------------------------------------------------------------------------------------------------
# Hooks


# hook name -> (default process group it was built in, state)
_DEFAULT_STATES: dict[str, tuple[object, AllReduceState]] = {}


def default_state(hook_name: str) -> AllReduceState | None:
    """The state that a hook registered with ``state=None`` built on first use (per process;
    one per hook, so two models using the same hook with ``state=None`` would share it)."""
    entry = _DEFAULT_STATES.get(hook_name)
    return entry[1] if entry else None


def _state_for(state, cls, hook_name: str):
    if state is None:
        world = dist.distributed_c10d._get_default_group()
        entry = _DEFAULT_STATES.get(hook_name)
        if entry is None or entry[0] is not world:  # a new init_process_group: a new state
            entry = _DEFAULT_STATES[hook_name] = (world, cls())
        return entry[1]
    if not isinstance(state, cls):
        raise TypeError(f"{hook_name} needs a {cls.__name__} (or None), got {type(state).__name__}")
    return state


def hierarchical_allreduce(state: AllReduceState | None,
                           bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Exact mean: intra-node reduce-scatter, inter-node all-reduce, intra-node all-gather."""
    return _state_for(state, AllReduceState, "hierarchical_allreduce")._hook(bucket, True)


def hierarchical_1bit(state: OneBitState | None,
                      bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Exact inside nodes, 1-bit with error feedback between nodes."""
    return _state_for(state, OneBitState, "hierarchical_1bit")._hook(bucket, True)


def hierarchical_powersgd(state: PowerSGDState | None,
                          bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """PowerSGD whose all-reduces are hierarchical (inter-node links carry 1/L of the factors)."""
    return _state_for(state, PowerSGDState, "hierarchical_powersgd")._hook(bucket, True)


def onebit(state: OneBitState | None,
           bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """1-bit with error feedback over the whole group (no topology)."""
    return _state_for(state, OneBitState, "onebit")._hook(bucket, False)


def powersgd(state: PowerSGDState | None,
             bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """PowerSGD over the whole group (no topology), safe with several buckets in flight."""
    return _state_for(state, PowerSGDState, "powersgd")._hook(bucket, False)


HOOKS: dict[str, tuple[Callable, type]] = {
    "hierarchical_allreduce": (hierarchical_allreduce, AllReduceState),
    "hierarchical_1bit": (hierarchical_1bit, OneBitState),
    "hierarchical_powersgd": (hierarchical_powersgd, PowerSGDState),
    "onebit": (onebit, OneBitState),
    "powersgd": (powersgd, PowerSGDState),
}


def register(model: torch.nn.parallel.DistributedDataParallel, hook: str = "hierarchical_1bit",
             **options) -> AllReduceState:
    """Build the hook's state (bound to the model's parameter names), register it, return it.

    ``options`` go to the state's constructor, e.g. ``register(ddp, "hierarchical_powersgd",
    rank=4, warmup_steps=100, exclude=["*norm*"])``.
    """
    if not isinstance(model, torch.nn.parallel.DistributedDataParallel):
        raise TypeError(f"register needs a DistributedDataParallel model, got "
                        f"{type(model).__name__}")
    if hook not in HOOKS:
        raise ValueError(f"unknown hook {hook!r}; choose one of {sorted(HOOKS)}")
    function, cls = HOOKS[hook]
    options.setdefault("process_group", model.process_group)
    state = cls(model=model, **options)
    model.register_comm_hook(state, function)
    return state


__all__ = ["AllReduceState", "OneBitState", "PowerSGDState", "hierarchical_allreduce",
           "hierarchical_1bit", "hierarchical_powersgd", "onebit", "powersgd", "register",
           "default_state", "HOOKS"]
