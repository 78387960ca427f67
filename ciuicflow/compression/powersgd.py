"""PowerSGD: rank-r compression with error feedback and warm start (Vogels et al., 2019).

Each gradient matrix M (n x m: a parameter's gradient viewed as [shape[0], -1], or each expert of
a stack [E, n, m]: ``powersgd_plan.matrix_view``) is sent as two thin factors: P = M Q (n x r) is
summed over the ranks and orthonormalised (``orthogonalize_``, the native op), then Q = M^T P
(m x r) is summed, and every rank rebuilds M ~ P Q^T / W. The part of M that this drops stays in
the rank's error buffer and is added to the next step's gradient; Q is kept for the next step
(warm start), which makes one power iteration per step enough. A stack of E matrices has E pairs
of factors (batched matmuls); a matrix that is zero on every rank (an expert no token was routed
to) gives zero factors and keeps its last Q, which a zero Q would replace for good.
Vectors, small matrices and excluded parameters (``exact_mask``) go uncompressed, as in PyTorch's
PowerSGD: a matrix is compressed only when (n + m) r * min_compression_rate < n m.

The uncompressed values and a non-finite flag (read from P and those values: inf or NaN in M
reaches its row of P) share the all-reduce of P, so a step costs two all-reduces. When any rank
holds inf/NaN, the step becomes an exact all-reduce of the input and the error and warm-start
buffers are left as they were.

Hierarchical variant: P, Q and the exact values are summed with the hierarchical all-reduce, so
inter-node links carry 1/L of the compressed bytes. Because P = M Q and Q = M^T P are linear in M,
this is the same algorithm as averaging M inside each node exactly and running PowerSGD over the
nodes, and it also compresses the intra-node traffic. On a single node the all-reduce is exact.
"""
from __future__ import annotations

import torch

from ciuicflow.collectives.primitives import Traffic, check_reducible, nonfinite_flag
from ciuicflow.collectives.routes import EXACT, FlatRoute, HierarchicalRoute
from ciuicflow.compression.base import Compressor, Context, GuardedMemory, guard_due, \
    guard_payload, snapshot, update_guard
from ciuicflow.compression.powersgd_plan import GroupCounts, Plan, block, keep_zero_columns, \
    p_factor, plan_compression, q_factor
from ciuicflow.compression.registry import FAMILIES
from ciuicflow.topology import Topology


DEFAULT_RANK = FAMILIES["powersgd"].cost.rank
# an adaptive optimizer's tensors go at this multiple of the rank unless adaptive_rank is given
ADAPTIVE_RANK_FACTOR = FAMILIES["powersgd"].cost.adaptive_rank_factor
DEFAULT_GUARD_THRESHOLD = FAMILIES["powersgd"].cost.guard_threshold


class PowerSGDMemory(GuardedMemory):
    """Error-feedback and warm-start memory of one tensor's PowerSGD all-reduce (float32)."""

    def __init__(self):
        super().__init__()
        self.error: torch.Tensor | None = None
        self.q: torch.Tensor | None = None
        self._spare: torch.Tensor | None = None  # M = gradient + error is built here, then swapped
        self._plans: dict = {}
        # the accuracy guard's measure, learnt one step late (in the next step's first all-reduce)
        # (||error||, ||input||) of this rank's last step, a float32 tensor on the data's device
        self._local_norms: torch.Tensor | None = None

    def state_dict(self) -> dict:
        """Copies: the buffers themselves are reused and overwritten by later steps."""
        return {"error": snapshot(self.error), "q": snapshot(self.q)}

    def load_state_dict(self, state: dict) -> None:
        self.error, self.q = snapshot(state["error"]), snapshot(state["q"])
        self._spare = None



class PowerSGDCompressor(Compressor):
    """``hierarchical_powersgd`` / ``powersgd``.

    Options:
        rank: rank of the approximation (PyTorch's ``matrix_approximation_rank``).
        adaptive_rank: the rank of the tensors an adaptive optimizer (Adam, AdamW, ...: anything
            but SGD; ``compression.optimizer_watch``) steps; default (None) twice ``rank``.
        min_compression_rate: compress a matrix only when it shrinks at least this much.
        error_feedback, warm_start: as in PyTorch's PowerSGD (both on by default).
        orthogonalization_eps: added to column norms in the orthogonalisation.
        guard, guard_threshold: the accuracy guard (see ``QuantizedCompressor``); the measure is
            the ranks' mean ||error|| after the step before over the running mean of their ||input||.

    Defaults (docs/hooks.md, "Defaults, and why"): rank 16, where momentum SGD at a constant
    learning rate matched exact accuracy and lower ranks lost it; under an adaptive optimizer
    rank 32, as Adam divides each element by the RMS of what it receives, which error feedback's
    late release of the dropped part inflates: at rank 16 Adam-trained language models ended up
    to 1.9% above exact loss, at 32 within 0.8% (docs/history/convergence-notebook.md); the guard's threshold 200, as
    PowerSGD's memory holds the gradient noise no low rank captures and its measure does not tell
    a good rank from a bad one: it only catches a memory that runs away.
    """

    name = "powersgd"
    option_names = ("rank", "adaptive_rank", "min_compression_rate", "error_feedback", "warm_start",
                    "orthogonalization_eps", "guard", "guard_threshold")
    layout_options = ("rank",)  # adaptive_rank too, but a warm start of another size is redrawn

    def __init__(self, *, rank: int = DEFAULT_RANK, adaptive_rank: int | None = None,
                 min_compression_rate: float = 2.0,
                 error_feedback: bool = True, warm_start: bool = True,
                 orthogonalization_eps: float = 0.0, guard: str = "warn",
                 guard_threshold: float = DEFAULT_GUARD_THRESHOLD):
        if int(rank) < 1:
            raise ValueError(f"rank must be >= 1, got {rank}")
        self.rank = int(rank)
        if adaptive_rank is not None and int(adaptive_rank) < 1:
            raise ValueError(f"adaptive_rank must be >= 1 (or None: {ADAPTIVE_RANK_FACTOR}x rank), "
                             f"got {adaptive_rank}")
        self.adaptive_rank = ADAPTIVE_RANK_FACTOR * self.rank if adaptive_rank is None \
            else int(adaptive_rank)
        self.min_compression_rate = float(min_compression_rate)
        self.error_feedback = bool(error_feedback)
        self.warm_start = bool(warm_start)
        self.orthogonalization_eps = float(orthogonalization_eps)
        self._set_guard(guard, guard_threshold)
        self.sent = GroupCounts()  # elements in and sent per parameter group, for stats()

    def group_stats(self) -> dict:
        """Per parameter group (``expert_stacks``, ``matrices``, ``exact``): the elements that
        went through the exchanges, those sent, and their ratio."""
        return self.sent.stats()

    def reset_group_stats(self) -> None:
        self.sent.reset()

    def new_memory(self) -> "PowerSGDMemory":
        return PowerSGDMemory()

    def exchange(self, flat, memory, route, context: Context, traffic) -> None:
        """P = M Q summed with the exact values and the non-finite flag, Q = M^T P summed, M ~ P Q^T
        (the module's docstring)."""
        world = route.topology.world_size
        if world == 1 or flat.numel() == 0:
            return
        if route.name == "hierarchical" and not route.crosses_nodes:
            route.reduce(flat, EXACT, traffic)  # nothing crosses a node: exact is cheapest
            return

        def sum_over_ranks(values: torch.Tensor) -> torch.Tensor:
            return route.sum(values, traffic)

        rank = self.adaptive_rank if context.adaptive else self.rank
        if traffic is not None and rank != self.rank:
            traffic.adaptive_codec_reductions += 1
        min_compression_rate = self.min_compression_rate
        error_feedback, warm_start, eps = self.error_feedback, self.warm_start, \
            self.orthogonalization_eps
        guard_threshold, measure = self.exact_step_threshold, self.measure
        exact_mask, step, key, seed = context.exact_mask, context.step, context.key, \
            context.seed
        segments = context.segments or [(0, (flat.numel(),))]
        plan_key = (tuple((o, tuple(s)) for o, s in segments), rank, min_compression_rate,
                    None if exact_mask is None else exact_mask.data_ptr())
        plan = memory._plans.get(plan_key)
        if plan is None:
            plan = plan_compression(flat.numel(), segments, rank, min_compression_rate, exact_mask,
                                    flat.device)
            memory._plans[plan_key] = plan

        # M = gradient + error, in float32, in a reused buffer (a fresh one costs page faults); the
        # input and the error stay intact for an exact fallback.
        work = _work_buffer(memory, flat)
        if error_feedback and memory.error is not None:
            if memory.error.numel() != flat.numel():
                raise RuntimeError(f"PowerSGD error buffer holds {memory.error.numel()} elements, "
                                   f"the tensor {flat.numel()}: one memory serves one tensor")
            torch.add(flat, memory.error.to(work.device), out=work)
        else:
            work.copy_(flat)
        q = _initial_q(plan, memory, warm_start, (seed, key, step), flat.device)
        ps = torch.empty(plan.p_numel, device=flat.device)
        for m in plan.matrices:
            q_m = q_factor(q, m)
            _orthogonalize(q_m, eps)
            torch.matmul(block(work, m), q_m, out=p_factor(ps, m))

        exact_values = flat[plan.exact_index] if plan.exact_index is not None else flat[:0]
        # inf/NaN anywhere in a matrix reaches every entry of its row of P (NaN * 0 is NaN too), so
        # P and the exact values together tell whether the input held one, without reading it again.
        nonfinite = torch.maximum(nonfinite_flag(ps), nonfinite_flag(exact_values)).to(flat.dtype)
        input_norm = torch.linalg.vector_norm(flat, dtype=torch.float32) if measure else None
        norms = memory._local_norms if memory._local_norms is not None else \
            flat.new_zeros(2, dtype=torch.float32)
        first = torch.cat([ps.to(flat.dtype), exact_values, norms.to(flat.dtype), nonfinite])
        sum_over_ranks(first)
        self.sent.add(plan, "first")
        # The one host read of the exchange (a device sync on GPUs; with overlap=True it happens on
        # the hooks' worker thread, not in backward): the flag picks the path, the norms the guard.
        error_sum, input_sum, flag = first[-3:].tolist()
        if flag > 0:  # a rank holds inf/NaN: exact this step, memory untouched
            if traffic is not None:
                traffic.nonfinite_fallbacks += 1
            self.sent.add(plan, "exact")
            flat.div_(world)
            sum_over_ranks(flat)
            return
        if memory._local_norms is not None:  # the ranks' mean norms of the step before
            update_guard(memory, error_sum / world, input_sum / world)
        if measure and error_feedback and guard_due(memory, guard_threshold):
            # the guard's exact step: the input and everything the error held, averaged exactly
            # (in float16 with guard="fp16": what its rounding drops is the new error)
            work.div_(world)
            sent, left = guard_payload(work, world, self.guard_half)
            sum_over_ranks(sent)
            self.sent.add(plan, "exact")
            flat.copy_(sent)
            if memory.error is not None and left is not None:
                memory.error.copy_(left.mul_(world))
            elif memory.error is not None:
                memory.error.zero_()
            memory._local_norms, memory._guard_stale = None, True
            if traffic is not None:
                traffic.guard_exact_steps += 1
            return

        ps = first[:plan.p_numel].to(torch.float32)
        new_q = torch.empty_like(q)  # q, this step's start, stays for keep_zero_columns
        for m in plan.matrices:
            p_m = p_factor(ps, m)
            _orthogonalize(p_m, eps)
            torch.matmul(block(work, m).transpose(-2, -1), p_m, out=q_factor(new_q, m))
        second = new_q.to(flat.dtype)
        sum_over_ranks(second)
        self.sent.add(plan, "second")
        new_q = second.to(torch.float32).div_(world)

        # The result P Q^T is written straight into the tensor (float32) or a float32 copy of it.
        approx = flat if flat.dtype == torch.float32 else torch.empty_like(work)
        for m in plan.matrices:
            torch.matmul(p_factor(ps, m), q_factor(new_q, m).transpose(-2, -1),
                         out=block(approx, m))
        if plan.exact_index is not None:
            approx[plan.exact_index] = first[plan.p_numel:-3].div_(world).to(approx.dtype)
        if approx is not flat:
            flat.copy_(approx)
        if error_feedback:
            work.sub_(approx)
            if plan.exact_index is not None:
                work[plan.exact_index] = 0.0  # exact values leave nothing behind
            memory.error, memory._spare = work, memory.error
            # for the guard's measure: how far the memory (what is owed) is behind the gradient
            if measure:
                memory._local_norms = torch.stack([torch.linalg.vector_norm(work), input_norm])
        if warm_start:
            memory.q = keep_zero_columns(new_q, q, plan)
        return


def powersgd_all_reduce(tensor: torch.Tensor, memory: PowerSGDMemory,
                        topology: Topology | None = None, *, segments=None,
                        hierarchical: bool = True, exact_mask: torch.Tensor | None = None,
                        seed: int = 0, step: int = 0, key: int = 0,
                        traffic: Traffic | None = None, **options) -> torch.Tensor:
    """Average ``tensor`` in place over the topology's group with PowerSGD; return it.

    ``segments``: the matrices laid out in the flattened tensor, as ``(offset, shape)`` pairs (a
    DDP bucket's gradients); default: the tensor itself, viewed as [shape[0], -1]. ``memory``
    persists between calls for the same tensor. ``seed``, ``key`` and ``step`` seed the random
    initial Q, the same on every rank. ``hierarchical=False`` runs flat over the group.
    ``options``: ``PowerSGDCompressor``'s (``rank``, ``guard``, ...).
    """
    check_reducible(tensor)
    compressor = PowerSGDCompressor(**options)
    topology = topology if topology is not None else Topology.detect()
    route = (HierarchicalRoute if hierarchical else FlatRoute)(topology)
    flat = tensor.view(-1)
    route.add_exact(traffic, flat)
    if segments is None:
        segments = [(0, tuple(tensor.shape))]
    context = Context(tuple((o, tuple(sh)) for o, sh in segments), exact_mask, step, key, seed)
    compressor.exchange(flat, memory, route, context, traffic)
    return tensor


def _work_buffer(memory: PowerSGDMemory, flat: torch.Tensor) -> torch.Tensor:
    spare = memory._spare
    if spare is None or spare.numel() != flat.numel() or spare.device != flat.device \
            or spare is memory.error:
        spare = memory._spare = torch.empty(flat.numel(), device=flat.device)
    return spare


def _orthogonalize(matrix: torch.Tensor, eps: float) -> None:
    from ciuicflow import ops  # loaded on first use, as in compression.onebit

    ops.orthogonalize_(matrix, eps)


def _initial_q(plan: Plan, memory: PowerSGDMemory, warm_start: bool, seed_parts,
               device) -> torch.Tensor:
    """Q for this step: last step's (warm start) or fresh Gaussian, identical on every rank."""
    if warm_start and memory.q is not None and memory.q.numel() == plan.q_numel:
        return memory.q.to(device, copy=True)
    generator = torch.Generator().manual_seed(_mix(seed_parts))
    return torch.randn(plan.q_numel, generator=generator).to(device)


def _mix(parts) -> int:
    """A 63-bit seed from a few integers, the same in every process (unlike hash() of a str)."""
    value = 0x9E3779B97F4A7C15
    for part in parts:
        value = (value ^ (int(part) & 0xFFFFFFFFFFFFFFFF)) * 0xBF58476D1CE4E5B9 % (1 << 64)
    return value % (1 << 63)
