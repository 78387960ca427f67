"""ciuicflow's 1-bit optimizers inside DeepSpeed's engine, and DeepSpeed configs from the planner.

    import deepspeed
    from ciuicflow.optim import OneBitAdam
    engine, optimizer, _, _ = deepspeed.initialize(
        model=model, optimizer=OneBitAdam(model.parameters(), lr=1e-3),
        config={"train_micro_batch_size_per_gpu": 8, "bf16": {"enabled": True}})

Building a ciuicflow 1-bit optimizer in a process that has imported deepspeed calls ``install()``,
which teaches ``DeepSpeedEngine`` (0.19.x) to drive it: when the engine configures its optimizer it
checks the config against the table below (an ``UnsupportedDeepSpeedConfig`` names every conflict),
and then ``attach``es the optimizer:

- on the steps the optimizer needs exact gradients (1-bit Adam's warm-up, 0/1 Adam's variance
  steps) the engine all-reduces them as usual and the optimizer uses them as they are; on every
  other step ``engine.enable_backward_allreduce`` is off (the switch DeepSpeed's removed 1-bit
  optimizers used; its fp16/bf16 wrapper then also agrees on overflow across ranks), so gradients
  are never sent twice;
- DeepSpeed's fp16/bf16 wrapper runs one step with zero gradients when it is built, to allocate
  optimizer state: that step is skipped, so step counts and results match a run without DeepSpeed;
- ``engine.save_checkpoint`` / ``engine.load_checkpoint`` also write and read each rank's
  error-feedback buffers (``<dir>/<tag>/ciuicflow_onebit_rank<R>.pt``): DeepSpeed itself saves
  only rank 0's optimizer state for ZeRO stage 0, and errors differ per rank.

| DeepSpeed feature | with ciuicflow's 1-bit optimizers |
|---|---|
| ZeRO stage 0 | yes |
| ZeRO stages 1, 2, 3 (and their CPU/NVMe offload) | refused: they partition optimizer state and reduce-scatter gradients themselves; 1-bit Adam needs the whole momentum on every rank |
| fp32 | yes |
| bf16 (`bf16.enabled`, bf16 gradients) | yes |
| fp16 (`fp16.enabled`, dynamic or static loss scale) | yes: same wrapper as bf16, overflow agreed over all ranks (not tested: DeepSpeed refuses fp16 on a CPU without fp16 support) |
| gradient accumulation (`gradient_accumulation_steps`) | yes |
| LR schedulers | yes |
| gradient clipping (`gradient_clipping`, 1.0 by default) | yes, with a warning: on steps without the engine's all-reduce DeepSpeed clips each rank's *local* gradient, by the mean of the ranks' local norms (fp32) or by its own norm (bf16/fp16), not by the norm of the mean gradient, which no rank has (DeepSpeed's removed 1-bit Adam did the same). Set it to 0 for Adam's exact semantics |
| `torch_autocast` | refused: its GradScaler decides to skip a step on each rank's local gradients |
| pipeline, tensor, sequence or expert parallelism | refused: the optimizer averages over the whole world, not a data-parallel subgroup |
| `gradient_allreduce_op` other than mean, DeepCompile, unmanaged gradient accumulation | refused |

``deepspeed_config(...)`` (no deepspeed import needed) writes a DeepSpeed config for a model size and
a cluster: the lowest ZeRO stage and offload that fit the GPU memory (a memory model of mixed-
precision Adam, ZeRO paper Sec. 3-5), and the gradient accumulation that keeps communication under a
share of the step (the alpha-beta model of ``ciuicflow.plan``).
"""
from __future__ import annotations

import functools
import json
import math
import os
import warnings
from dataclasses import asdict, dataclass, field

from ciuicflow.plan import ClusterSpec, Workload, estimate

_INSTALLED_MARK = "_ciuicflow_onebit_installed"
_ERRORS_FILE = "ciuicflow_onebit_rank{rank:05d}.pt"


class UnsupportedDeepSpeedConfig(ValueError):
    """The DeepSpeed config uses a feature that ciuicflow's 1-bit optimizers cannot run with."""


# ------------------------------------------------------------------------------------------------
# The engine side


def install() -> None:
    """Make ``DeepSpeedEngine`` recognise ciuicflow's 1-bit optimizers (idempotent)."""
    from deepspeed.runtime.engine import DeepSpeedEngine

    original = DeepSpeedEngine._configure_optimizer
    if getattr(original, _INSTALLED_MARK, False):
        return

    @functools.wraps(original)
    def _configure_optimizer(engine, client_optimizer, model_parameters):
        if _is_onebit(client_optimizer):
            _prepare(engine, client_optimizer)
        elif callable(client_optimizer) and not _is_torch_optimizer(client_optimizer):
            client_optimizer = _preparing_factory(engine, client_optimizer)
        original(engine, client_optimizer, model_parameters)
        if _is_onebit(engine.basic_optimizer):
            engine.basic_optimizer._skip_next_steps = 0  # only the wrapper's allocation step
            attach(engine, engine.basic_optimizer)

    setattr(_configure_optimizer, _INSTALLED_MARK, True)
    DeepSpeedEngine._configure_optimizer = _configure_optimizer


def _is_onebit(optimizer) -> bool:
    from ciuicflow.optim.compressed_momentum import CompressedMomentumOptimizer
    return isinstance(optimizer, CompressedMomentumOptimizer)


def _is_torch_optimizer(obj) -> bool:
    import torch
    return isinstance(obj, torch.optim.Optimizer)


def _preparing_factory(engine, factory):
    """A client optimizer given as ``callable(params)``: check the config once it is built."""
    @functools.wraps(factory)
    def build(params):
        optimizer = factory(params)
        if _is_onebit(optimizer):
            _prepare(engine, optimizer)
        return optimizer
    return build


def _prepare(engine, optimizer) -> None:
    check_engine_config(engine, optimizer)
    # DeepSpeed's fp16/bf16 wrapper steps once with zero gradients while it is built
    optimizer._skip_next_steps = 1


def unsupported_features(engine, optimizer) -> list[str]:
    """Why this engine cannot drive ``optimizer`` (empty when it can)."""
    import torch.distributed as dist

    problems = []
    name = type(optimizer).__name__
    stage = int(engine.zero_optimization_stage())
    if stage != 0:
        problems.append(f"ZeRO stage {stage}: {name} runs with ZeRO stage 0 only (stages 1-3 partition "
                        "optimizer state and reduce-scatter gradients themselves; 1-bit Adam needs the "
                        "whole momentum on every rank). Set zero_optimization.stage to 0.")
    if engine.torch_autocast_enabled():
        problems.append("torch_autocast: its GradScaler skips steps on each rank's local gradients, "
                        "so ranks would disagree. Use bf16.enabled or fp16.enabled instead.")
    if engine.pipeline_parallelism:
        problems.append("pipeline parallelism (PipelineModule) is not supported.")
    world = dist.get_world_size(optimizer.group) if optimizer.group is not None else dist.get_world_size()
    if engine.mp_world_size != 1 or engine.seq_dp_world_size != world \
            or getattr(engine, "sequence_parallel_size", 1) != 1:
        problems.append(f"model/sequence parallelism: the data-parallel group has "
                        f"{engine.seq_dp_world_size} ranks but {name} averages over {world}; only pure "
                        "data parallelism is supported.")
    if engine.has_moe_layers:
        problems.append("mixture-of-experts layers (expert parallelism) are not supported.")
    if not engine.gradient_average:
        problems.append("gradient_allreduce_op must be the mean: the compressed phase averages.")
    if engine.is_deepcompile_enabled():
        problems.append("DeepCompile reduces gradients on its own: disable compile.deepcompile.")
    if not engine.managed_gradient_accumulation():
        problems.append("managed_gradient_accumulation=false is not supported.")
    return problems


def check_engine_config(engine, optimizer) -> None:
    """Raise ``UnsupportedDeepSpeedConfig`` listing every feature that cannot combine."""
    problems = unsupported_features(engine, optimizer)
    if problems:
        raise UnsupportedDeepSpeedConfig(
            f"{type(optimizer).__name__} cannot run with this DeepSpeed config:\n"
            + "\n".join(f"  - {p}" for p in problems)
            + "\nSupported: ZeRO stage 0 with fp32, bf16 or fp16, gradient accumulation, gradient "
              "clipping, LR schedulers (see ciuicflow.integrations.deepspeed).")


def attach(engine, optimizer) -> None:
    """Let ``engine`` average the gradients of the steps the optimizer needs exact (1-bit Adam's
    warm-up, 0/1 Adam's variance steps) and no others, and checkpoint every rank's errors."""
    if engine.gradient_clipping() > 0:
        warnings.warn(
            f"gradient_clipping={engine.gradient_clipping()} with {type(optimizer).__name__}: on "
            "steps whose gradients the engine does not all-reduce (after 1-bit Adam's warm-up, "
            "most of 0/1 Adam's) DeepSpeed clips each rank's local gradient (by the mean of the "
            "local norms in fp32, by each rank's own norm in bf16/fp16), not the mean gradient. "
            'Set "gradient_clipping": 0 for exact Adam semantics.', RuntimeWarning, stacklevel=2)
    optimizer.caller_averages_grads = True  # the engine's own all-reduce, when the optimizer asks
    optimizer.add_exact_step_listener(functools.partial(_set_engine_allreduce, engine))
    engine.save_checkpoint = functools.partial(_save_checkpoint, engine, engine.save_checkpoint,
                                               optimizer)
    engine.load_checkpoint = functools.partial(_load_checkpoint, engine.load_checkpoint, optimizer)


def _set_engine_allreduce(engine, exact: bool) -> None:
    engine.enable_backward_allreduce = exact


def _errors_path(directory: str, rank: int) -> str:
    return os.path.join(directory, _ERRORS_FILE.format(rank=rank))


def _save_checkpoint(engine, save, optimizer, save_dir, tag=None, *args, **kwargs):
    import torch
    import torch.distributed as dist

    tag = f"global_step{engine.global_steps}" if tag is None else str(tag)  # DeepSpeed's default
    result = save(save_dir, tag, *args, **kwargs)
    torch.save(optimizer.rank_state_dict(), _errors_path(os.path.join(save_dir, tag), dist.get_rank()))
    dist.barrier()  # every rank's file is written before anyone reads the checkpoint
    return result


def _load_checkpoint(load, optimizer, load_dir, *args, **kwargs):
    import torch
    import torch.distributed as dist

    optimizer.quiet_foreign_errors = True  # DeepSpeed loads rank 0's state dict on every rank
    try:
        load_path, client_state = load(load_dir, *args, **kwargs)
    finally:
        optimizer.quiet_foreign_errors = False
    if load_path is not None:
        path = _errors_path(os.path.dirname(load_path), dist.get_rank())
        if os.path.exists(path):
            optimizer.load_rank_state(torch.load(path, map_location="cpu", weights_only=True))
        else:
            warnings.warn(f"{path} is missing (a checkpoint saved without ciuicflow's integration?): "
                          "this rank's 1-bit error feedback restarts from zero", RuntimeWarning)
            optimizer.load_rank_state({**optimizer.rank_state_dict(), "errors": []})
    return load_path, client_state


# ------------------------------------------------------------------------------------------------
# Planning a config


# (zero stage, offload optimizer state, offload parameters), fastest first (DeepSpeed's guidance)
_LADDER = ((0, False, False), (1, False, False), (2, False, False), (2, True, False),
           (3, False, False), (3, True, False), (3, True, True))
_PRECISIONS = {"bf16": 2, "fp16": 2, "fp32": 4}


@dataclass
class MemoryPerGPU:
    """Bytes one GPU holds for model states (and CPU bytes it offloads), ZeRO paper's accounting."""

    params: float
    grads: float
    optimizer_states: float
    error_feedback: float
    activations: float
    offloaded_to_cpu: float

    @property
    def gpu_total(self) -> float:
        return self.params + self.grads + self.optimizer_states + self.error_feedback + self.activations


@dataclass
class DeepSpeedPlan:
    """A DeepSpeed config and why: ``config`` is what ``deepspeed.initialize(config=...)`` takes."""

    config: dict
    zero_stage: int
    offload_optimizer: bool
    offload_param: bool
    gradient_accumulation_steps: int
    memory: MemoryPerGPU
    comm_seconds_per_step: float | None
    notes: list = field(default_factory=list)

    def write(self, path: str) -> None:
        with open(path, "w") as f:
            json.dump(self.config, f, indent=2)

    def as_dict(self) -> dict:
        return asdict(self)


def model_state_memory(params: float, world: int, zero_stage: int, offload_optimizer: bool,
                       offload_param: bool, precision: str = "bf16", onebit: bool = False,
                       ranks_per_node: int = 1, activation_bytes: float = 0.0) -> MemoryPerGPU:
    """Per-GPU memory of Adam training ``params`` parameters over ``world`` data-parallel ranks.

    Mixed precision (bf16/fp16): 2-byte weights and gradients, fp32 master weights, momentum and
    variance (12 bytes); fp32: 4-byte weights and gradients, 8 bytes of moments. ZeRO 1 partitions
    optimizer state, 2 also gradients, 3 also weights. 1-bit Adam (ZeRO 0) adds its float32 error
    buffers: the worker error of the compressed tensor and the server error of one segment of it
    (hierarchical: the tensor is this rank's 1/L shard of the node's sum)."""
    if precision not in _PRECISIONS:
        raise ValueError(f"precision must be one of {sorted(_PRECISIONS)}, got {precision!r}")
    if params <= 0 or world < 1:
        raise ValueError("params must be positive and world >= 1")
    low = _PRECISIONS[precision]
    states_per_param = 12.0 if low == 2 else 8.0
    weights, grads, states = low * params, low * params, states_per_param * params
    if zero_stage >= 1:
        states /= world
    if zero_stage >= 2:
        grads /= world
    if zero_stage >= 3:
        weights /= world
    offloaded = 0.0
    if offload_optimizer:
        offloaded += states
        states = 0.0
    if offload_param:
        offloaded += weights
        weights = 0.0
    errors = 0.0
    if onebit:
        nodes = max(1, world // max(1, ranks_per_node))
        compressed = params / ranks_per_node if nodes > 1 and ranks_per_node > 1 else params
        peers = nodes if nodes > 1 and ranks_per_node > 1 else world
        errors = 4.0 * compressed * (1 + 1 / peers)
    return MemoryPerGPU(weights, grads, states, errors, float(activation_bytes), offloaded)


def deepspeed_config(params: float, cluster: ClusterSpec, *, gpu_memory: float,
                     micro_batch: int = 1, activation_bytes: float = 0.0,
                     precision: str = "bf16", onebit: bool = False,
                     global_batch: int | None = None, compute_seconds: float | None = None,
                     max_comm_share: float = 0.1, max_accumulation: int = 64,
                     cpu_memory_per_node: float | None = None, headroom: float = 0.9,
                     optimizer: dict | None = None, gradient_clipping: float | None = None,
                     path: str | None = None) -> DeepSpeedPlan:
    """Plan a DeepSpeed config for ``params`` parameters on ``cluster`` (a ``ciuicflow.plan.ClusterSpec``).

    ZeRO stage and offload: the first of stage 0, 1, 2, 2 + optimizer offload, 3, 3 + optimizer
    offload, 3 + optimizer and parameter offload whose per-GPU memory (``model_state_memory`` plus
    ``activation_bytes`` per micro-batch) fits ``headroom * gpu_memory`` bytes (and whose offloaded
    bytes fit ``headroom * cpu_memory_per_node``, when given). ``onebit=True`` plans for ciuicflow's
    OneBitAdam: ZeRO stage 0 only, its error buffers counted, 1-bit communication after warm-up.

    Accumulation: ``global_batch / (micro_batch * world)`` when ``global_batch`` is given; else,
    with ``compute_seconds`` (forward + backward of one micro-batch), the fewest accumulation steps
    whose step spends at most ``max_comm_share`` of its time communicating, per the planner's
    estimate of the all-reduce (ZeRO 3 gathers parameters too: 1.5x); else 1.

    ``optimizer``: a DeepSpeed ``optimizer`` section to include (not with ``onebit``: pass
    ``optimizer=OneBitAdam(...)`` to ``deepspeed.initialize``). ``path``: also write the JSON there.
    """
    if micro_batch < 1 or max_accumulation < 1:
        raise ValueError("micro_batch and max_accumulation must be >= 1")
    if not 0 < headroom <= 1 or not 0 < max_comm_share < 1:
        raise ValueError("headroom must be within (0, 1] and max_comm_share within (0, 1)")
    if gpu_memory <= 0:
        raise ValueError("gpu_memory must be positive (bytes)")
    if onebit and optimizer is not None:
        raise ValueError("with onebit=True pass optimizer=OneBitAdam(...) to deepspeed.initialize, "
                         "not an optimizer section")
    world, local = cluster.world, cluster.gpus_per_node
    notes = []

    choice = memory = None
    for stage, off_opt, off_param in (_LADDER[:1] if onebit else _LADDER):
        candidate = model_state_memory(params, world, stage, off_opt, off_param, precision, onebit,
                                       local, activation_bytes)
        cpu_ok = cpu_memory_per_node is None or \
            candidate.offloaded_to_cpu * local <= headroom * cpu_memory_per_node
        if candidate.gpu_total <= headroom * gpu_memory and cpu_ok:
            choice, memory = (stage, off_opt, off_param), candidate
            break
    if choice is None:
        smallest = model_state_memory(params, world, *(_LADDER[0] if onebit else _LADDER[-1]),
                                      precision, onebit, local, activation_bytes)
        what = "OneBitAdam needs ZeRO stage 0, and even that" if onebit else \
            "even ZeRO stage 3 with optimizer and parameter offload"
        raise ValueError(f"{params:.3g} parameters do not fit: {what} needs "
                         f"{smallest.gpu_total / 2**30:.1f} GiB per GPU "
                         f"(and {smallest.offloaded_to_cpu * local / 2**30:.1f} GiB of CPU memory per "
                         f"node) against {headroom:.0%} of {gpu_memory / 2**30:.1f} GiB")
    stage, off_opt, off_param = choice
    notes.append(f"ZeRO stage {stage}" + (" + optimizer offload" if off_opt else "")
                 + (" + parameter offload" if off_param else "")
                 + f": {memory.gpu_total / 2**30:.2f} GiB per GPU of {gpu_memory / 2**30:.1f} GiB")

    comm_seconds = None
    if global_batch is not None:
        if global_batch % (micro_batch * world):
            raise ValueError(f"global_batch {global_batch} is not a multiple of micro_batch x world "
                             f"= {micro_batch} x {world}")
        accumulation = global_batch // (micro_batch * world)
        if accumulation < 1:
            raise ValueError("global_batch is smaller than micro_batch x world")
    elif compute_seconds is not None:
        strategy = "hierarchical_1bit" if onebit else "hierarchical"
        grad_bytes = 4 if precision == "fp32" else 2
        comm_seconds = estimate(strategy, cluster, Workload(params, 0.0, grad_bytes=grad_bytes)).comm_seconds
        if stage == 3:
            comm_seconds *= 1.5  # parameters are all-gathered in forward and backward
        # comm / (accum * compute + comm) <= share  <=>  accum >= comm (1 - share) / (share compute)
        needed = comm_seconds * (1 - max_comm_share) / (max_comm_share * max(compute_seconds, 1e-12))
        accumulation = max(1, min(max_accumulation, math.ceil(needed - 1e-9)))
        notes.append(f"communication {comm_seconds * 1e3:.3g} ms per optimizer step ({strategy}"
                     + (", after warm-up" if onebit else "") + f"), compute {compute_seconds * 1e3:.3g}"
                     f" ms per micro-batch: {accumulation} accumulation step(s) keep communication "
                     f"at {comm_seconds / (accumulation * compute_seconds + comm_seconds):.0%} of "
                     "the step")
        if accumulation == max_accumulation and needed > max_accumulation:
            notes.append(f"capped at max_accumulation={max_accumulation}")
    else:
        accumulation = 1

    config = {
        "train_micro_batch_size_per_gpu": micro_batch,
        "gradient_accumulation_steps": accumulation,
        "train_batch_size": micro_batch * accumulation * world,
        "zero_optimization": {"stage": stage},
    }
    if off_opt:
        config["zero_optimization"]["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    if off_param:
        config["zero_optimization"]["offload_param"] = {"device": "cpu", "pin_memory": True}
    if precision == "bf16":
        config["bf16"] = {"enabled": True}
    elif precision == "fp16":
        config["fp16"] = {"enabled": True, "loss_scale": 0}
    if optimizer is not None:
        config["optimizer"] = optimizer
    # explicit, as DeepSpeed otherwise clips at 1.0 (which 1-bit Adam applies to local gradients)
    config["gradient_clipping"] = float(gradient_clipping or 0.0)
    if onebit:
        notes.append("pass optimizer=ciuicflow.optim.OneBitAdam(model.parameters(), ...) to "
                     "deepspeed.initialize")
    plan = DeepSpeedPlan(config, stage, off_opt, off_param, accumulation, memory, comm_seconds, notes)
    if path is not None:
        plan.write(path)
    return plan
