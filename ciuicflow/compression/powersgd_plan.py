"""Which parameters of a tensor PowerSGD compresses, as which matrices, and where their factors
live.

A tensor laid out as segments ((offset, shape) per parameter) is planned once per layout: each
compressed parameter is a batch of ``count`` matrices rows x cols (``count`` 1 for a plain matrix,
E for E stacked experts), whose factors P (count x rows x r) and Q (count x cols x r) sit one
after the other in two flat buffers; everything else is sent exactly. The plan also says how many
elements each parameter group holds and sends, for ``stats()``.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

# the parameter groups stats() reports: stacked matrices (experts), single matrices, exact values
EXPERT_STACKS, MATRICES, EXACT_VALUES = "expert_stacks", "matrices", "exact"
GROUPS = (EXPERT_STACKS, MATRICES, EXACT_VALUES)


@dataclass(frozen=True)
class Matrices:
    """``count`` matrices rows x cols at ``offset``, compressed at ``rank``."""

    offset: int
    count: int
    rows: int
    cols: int
    rank: int
    p_offset: int
    q_offset: int

    @property
    def group(self) -> str:
        return EXPERT_STACKS if self.count > 1 else MATRICES


@dataclass(frozen=True)
class Plan:
    matrices: tuple[Matrices, ...]
    exact_index: torch.Tensor | None  # positions all-reduced uncompressed
    p_numel: int
    q_numel: int
    numel: int
    # group -> (elements in the tensor, elements of P or exact values, elements of Q)
    groups: dict


def _numel(shape) -> int:
    size = 1
    for dim in shape:
        size *= dim
    return size


def _sent(count: int, rows: int, cols: int, rank: int, min_compression_rate: float):
    """(count, rows, cols, r) and the elements P and Q hold, or None where it does not pay."""
    r = min(rank, rows, cols)
    if (rows + cols) * r * min_compression_rate >= rows * cols:
        return None
    return (count, rows, cols, r), count * (rows + cols) * r


def matrix_view(shape, rank: int, min_compression_rate: float):
    """(count, rows, cols, r): the batch of matrices a parameter of ``shape`` is compressed as, or
    None (sent exactly).

    [n, m] is one n x m matrix, and so is [n, ...] viewed as [n, -1] (a conv weight); a tensor of
    3+ dims [E, a, ...] is E matrices a x (...) when that sends fewer elements than [E, -1] does
    (stacked experts: E matrices of their own; a conv weight's [in, kh*kw] slices never are)."""
    size = _numel(shape)
    if len(shape) < 2 or size == 0:
        return None
    views = [_sent(1, shape[0], size // shape[0], rank, min_compression_rate)]
    if len(shape) >= 3:
        views.append(_sent(shape[0], shape[1], size // (shape[0] * shape[1]), rank,
                           min_compression_rate))
    views = [v for v in views if v is not None]
    return min(views, key=lambda v: v[1])[0] if views else None  # a tie keeps [n, -1]


def plan_compression(numel: int, segments, rank: int, min_compression_rate: float,
                     exact_mask: torch.Tensor | None, device) -> Plan:
    """Which segments ((offset, shape) pairs) are compressed, and where their factors live."""
    matrices, p_numel, q_numel = [], 0, 0
    groups = {name: [0, 0, 0] for name in GROUPS}
    covered = torch.zeros(numel, dtype=torch.bool)
    for offset, shape in segments:
        view = matrix_view(shape, rank, min_compression_rate)
        size = _numel(shape)
        excluded = exact_mask is not None and bool(exact_mask[offset:offset + size].any())
        if view is None or excluded:
            continue
        m = Matrices(offset, *view, p_numel, q_numel)
        matrices.append(m)
        covered[offset:offset + size] = True
        p_size, q_size = m.count * m.rows * m.rank, m.count * m.cols * m.rank
        p_numel, q_numel = p_numel + p_size, q_numel + q_size
        counts = groups[m.group]
        counts[0], counts[1], counts[2] = counts[0] + size, counts[1] + p_size, counts[2] + q_size
    exact = numel - int(covered.sum())
    groups[EXACT_VALUES] = [exact, exact, 0]
    exact_index = None if exact == 0 else (~covered).nonzero().view(-1).to(device)
    return Plan(tuple(matrices), exact_index, p_numel, q_numel, numel,
                {name: tuple(c) for name, c in groups.items() if c[0]})


def block(flat: torch.Tensor, m: Matrices) -> torch.Tensor:
    """The matrices themselves: [rows, cols], or [count, rows, cols]."""
    return _view(flat, m.offset, m.count, m.rows, m.cols)


def p_factor(ps: torch.Tensor, m: Matrices) -> torch.Tensor:
    return _view(ps, m.p_offset, m.count, m.rows, m.rank)


def q_factor(qs: torch.Tensor, m: Matrices) -> torch.Tensor:
    return _view(qs, m.q_offset, m.count, m.cols, m.rank)


def _view(flat: torch.Tensor, offset: int, count: int, rows: int, cols: int) -> torch.Tensor:
    part = flat[offset:offset + count * rows * cols]
    return part.view(rows, cols) if count == 1 else part.view(count, rows, cols)


def keep_zero_columns(new_q: torch.Tensor, old_q: torch.Tensor, plan: Plan) -> torch.Tensor:
    """``new_q`` with each all-zero column (a matrix that was all zero on every rank: an
    unrouted expert) replaced by ``old_q``'s: a zero Q would make every later P zero."""
    for m in plan.matrices:
        new, old = q_factor(new_q, m), q_factor(old_q, m)
        zero = new.abs().amax(dim=-2, keepdim=True) == 0
        new.copy_(torch.where(zero, old, new))
    return new_q


class GroupCounts:
    """Elements each parameter group held and sent (P, Q or exact values) over the exchanges."""

    def __init__(self):
        self.counts: dict[str, list[int]] = {}

    def add(self, plan: Plan, stage: str) -> None:
        """``stage``: "first" (P and the exact values), "second" (Q), or "exact" (every element
        sent uncompressed: a non-finite fallback or the guard's step)."""
        for name, (numel, first, second) in plan.groups.items():
            counts = self.counts.setdefault(name, [0, 0])
            if stage == "first":
                counts[0] += numel
                counts[1] += first
            else:
                counts[1] += second if stage == "second" else numel

    def stats(self) -> dict:
        return {name: {"elements_in": i, "elements_sent": s,
                       "compression_ratio": i / s if s else None}
                for name, (i, s) in self.counts.items()}

    def reset(self) -> None:
        self.counts = {}
