"""The node sum of CPU tensors through shared memory: the intra-node step without the network.

Gloo moves CPU tensors between the ranks of one node over TCP, through the kernel, which costs
more than the arithmetic (an all-reduce of 26 MB over 2 ranks took 40 ms here, its reduce-scatter
77 ms). Ranks of one host can instead read each other's tensors in a shared segment, as GPUs of one
node do over NVLink:

1. every local rank copies its tensor into its own slot, all but its own shard, which no other
   rank reads;
2. barrier; local rank i sums shard i of every slot (its own from its tensor), in slot order,
   into the output area, divided by L for a mean, in one native pass (``ops.node_sum_into``) that
   also tells whether the shard holds inf/NaN; where the caller needs that flag for the whole
   node, one 4-byte all-reduce agrees on it;
3. (the caller runs the inter-node step on that shard, in place)
4. barrier; every rank copies the whole output area back into its tensor.

Inputs and output live in separate areas, so two barriers per call are enough: a rank writes the
output area only after the next call's first barrier, by which time every rank has copied the last
output out. Sums run in a fixed order, so every rank ends with the same bits.

A caller that names its tensor (``keep``: a DDP bucket's key, unique to its state and bucket) gets
an output area of its own and, in step 4, a view of it instead of a copy: DDP copies a hook's result
into the gradients anyway, so the copy back into the bucket (the whole tensor, per rank) is saved.
That area is rewritten only by the next call with the same key, after its first barrier, when every
rank of the node has moved on to that call (for DDP: the next backward pass of that model, its
gradients long copied out). Keys are this process's own: at the first barrier the local ranks agree
(the barrier's all-reduce carries it) whether this call keeps its output and whether a new area is
made, so ranks whose keys differ never disagree on a collective. Kept areas hold at most
``KEEP_BYTES`` (one copy per node: the ranks map the same areas); past that, outputs are copied
as above.

``all_gather`` uses the output area for an all-gather instead (DiLoCo's gather of a node's
shards): a barrier before a rank writes its piece (every rank has copied the last call's out),
one after (every piece is in), then each rank copies the others' pieces out.

The segment is a file in /dev/shm, created by local rank 0 and unlinked as soon as every local
rank has mapped it (nothing is left behind if a process dies). A random token written into it
proves that the ranks which the topology puts on one node really share memory; if any of them
cannot map it, the node falls back to gloo's collectives, with a warning.
"""
from __future__ import annotations

import functools
import mmap
import os
import secrets
import warnings

import torch
import torch.distributed as dist

from ciuicflow.collectives.primitives import nonfinite_flag

_ALIGN = 64
_TOKEN_BYTES = 16
_NAME_BYTES = 256
_SHM_DIR = "/dev/shm"

_NODES: dict = {}  # intra-node group -> NodeSegment, or None where shared memory is unusable
KEEP_BYTES = 1 << 30  # kept output areas per node (a model's gradients, for DDP's buckets)


def _round_up(value: int, multiple: int = _ALIGN) -> int:
    return -(-value // multiple) * multiple


class NodeSegment:
    """A shared segment among the ranks of one node (one per intra-node process group)."""

    def __init__(self, group, local_rank: int, local_size: int):
        self.group = group
        self.local_rank = local_rank
        self.local_size = local_size
        self.root = dist.get_global_rank(group, 0)
        self._map: mmap.mmap | None = None
        self._bytes: torch.Tensor | None = None
        self._token = torch.zeros(4)  # the barriers' all-reduce; the first one carries a vote
        self._header = _round_up(_TOKEN_BYTES)  # the token
        self._slot = 0  # bytes per area (input slot or output) in the current mapping
        self._kept: dict = {}  # key -> (its output area: uint8 over a shared mapping, serial)
        self._areas_made = 0  # kept areas made so far: the same count on every local rank
        self._output_kept: torch.Tensor | None = None  # the current call's, if kept
        self._keep_failed = False  # a kept area could not be made: outputs are copied

    # -- the collective operations -----------------------------------------------------------

    def node_sum(self, flat: torch.Tensor, shard_len: int, with_flag: bool, keep=None,
                 divisor: float = 1.0):
        """Step 1-2 for ``flat``: return (this rank's shard of the node sum divided by
        ``divisor``, a view into the segment; the node's non-finite flag or None). ``keep``: a
        key (this process's) for an output area of its own (module docstring), or None."""
        padded, numel, me = shard_len * self.local_size, flat.numel(), self.local_rank
        inputs, output = self._areas(flat.dtype, padded)
        start, end = me * shard_len, (me + 1) * shard_len
        # The other ranks read only their own shards of this slot: this rank's shard is summed
        # straight from flat (where flat holds all of it), which saves 1/L of the copy.
        own_in_place = end <= numel
        mine = inputs[me]
        if own_in_place:
            mine[:start].copy_(flat[:start])
            mine[end:numel].copy_(flat[end:])
        else:
            mine[:numel].copy_(flat)
        mine[numel:].zero_()
        self._output_kept = self._kept_area(keep, flat.dtype, padded)  # holds the first barrier
        if self._output_kept is not None:
            output = self._output_kept
        terms = [flat[start:end] if slot == me and own_in_place else inputs[slot, start:end]
                 for slot in range(self.local_size)]
        shard = output[start:end]
        # in slot order: the same bits on every run; a non-finite sum means a non-finite input
        # (or an overflow, which compressing would not survive either)
        flag = _sum_into(terms, divisor, shard)
        if with_flag:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
            return shard, flag
        return shard, None

    def gather(self, flat: torch.Tensor, shard_len: int) -> torch.Tensor:
        """Step 4 (after ``node_sum`` of the same): every rank's shard, back into ``flat``, which
        is returned; or, where ``node_sum`` kept the output, a view of it (``flat`` untouched)."""
        self._barrier()
        if self._output_kept is not None:
            return self._output_kept[:flat.numel()]
        _, output = self._areas(flat.dtype, shard_len * self.local_size)
        flat.copy_(output[:flat.numel()])
        return flat

    def all_gather(self, out: torch.Tensor, piece: torch.Tensor) -> torch.Tensor:
        """``out`` = every local rank's ``piece`` (all of one length and dtype), in local-rank
        order: an all-gather through the output area. Where ``out`` holds this rank's piece in its
        slot already (``piece`` is that view), it is not copied back. Returns ``out``."""
        length, me = piece.numel(), self.local_rank
        _, area = self._areas(piece.dtype, length * self.local_size)
        self._barrier()  # every rank has copied the last call's pieces out of the area
        area[me * length:(me + 1) * length].copy_(piece)
        self._barrier()  # every piece is in
        for rank in range(self.local_size):
            slot = out[rank * length:(rank + 1) * length]
            if rank != me or slot.data_ptr() != piece.data_ptr():
                slot.copy_(area[rank * length:(rank + 1) * length])
        return out

    def _barrier(self, vote=(0.0, 0.0, 0.0, 0.0)) -> torch.Tensor:
        """Returns once every local rank is here, with the sum of their votes."""
        self._token.copy_(torch.tensor(vote, dtype=self._token.dtype))
        dist.all_reduce(self._token, group=self.group)
        return self._token

    # -- the segment -------------------------------------------------------------------------

    def _areas(self, dtype: torch.dtype, padded: int):
        """[L, padded] inputs and the [padded] output, growing the segment (a
        collective, which every local rank reaches for the same tensor size) when needed.

        Each area starts at the same place whatever the size of the tensor: a rank that has moved
        on to the next call writes only its input slot, never the output another rank may still
        be copying out."""
        nbytes = padded * torch.empty(0, dtype=dtype).element_size()
        if self._bytes is None or self._slot < nbytes:
            self._remap(self._header + (self.local_size + 1) * _round_up(nbytes))
        data = self._bytes[self._header:self._header + (self.local_size + 1) * self._slot]
        data = data.view(self.local_size + 1, self._slot)[:, :nbytes].view(dtype)
        return data[:self.local_size], data[self.local_size]

    def _kept_area(self, key, dtype: torch.dtype, padded: int) -> torch.Tensor | None:
        """Step 1's barrier, with the local ranks' vote on ``key``'s output area ([padded] of
        dtype): the area, made (a collective) where any rank lacks one large enough, or None
        where any rank has no key, is over budget or could not make one."""
        nbytes = _round_up(padded * torch.empty(0, dtype=dtype).element_size())
        area, serial = self._kept.get(key, (None, 0)) if key is not None else (None, 0)
        fits = area is not None and area.numel() >= nbytes
        held = sum(a.numel() for k, (a, _) in self._kept.items() if k != key)
        refuse = key is None or self._keep_failed or (not fits and held + nbytes > KEEP_BYTES)
        votes = self._barrier((float(refuse), float(not fits), float(serial), float(serial) ** 2))
        if votes[0] > 0:
            return None
        # one area on every rank: all fit, with the same serial (equal serials are the only ones
        # whose sum squared is L times the sum of their squares)
        same = float(votes[2]) ** 2 == self.local_size * float(votes[3])
        if votes[1] > 0 or not same:  # every rank makes a new one together
            try:
                mapping = self._share(nbytes)
            except Unavailable as exc:  # raised on every local rank alike: keep no more
                warnings.warn(f"ciuicflow: outputs are copied, not kept, from now on ({exc})",
                              RuntimeWarning)
                self._keep_failed = True
                self._kept.pop(key, None)
                return None
            self._areas_made += 1
            area = torch.frombuffer(mapping, dtype=torch.uint8)
            self._kept[key] = (area, self._areas_made)
        return area[:nbytes].view(dtype)[:padded]

    def _remap(self, nbytes: int) -> None:
        nbytes = max(nbytes, 2 * (self._bytes.numel() if self._bytes is not None else 0), 1 << 20)
        mapping = self._share(nbytes)
        self._map = mapping
        self._bytes = torch.frombuffer(mapping, dtype=torch.uint8)
        self._slot = (nbytes - self._header) // (self.local_size + 1) // _ALIGN * _ALIGN

    def _share(self, nbytes: int) -> mmap.mmap:
        """A new mapping of ``nbytes`` that every local rank shares (a collective); its first bytes
        hold a random token, which each rank checks."""
        mapping, created = None, None
        try:
            name = torch.zeros(_NAME_BYTES, dtype=torch.uint8)
            if self.local_rank == 0:
                try:
                    mapping, created = _create(nbytes)
                    token = secrets.token_bytes(_TOKEN_BYTES)
                    mapping[:_TOKEN_BYTES] = token
                    encoded = (created + "\0" + token.hex()).encode()
                    name[:len(encoded)] = torch.tensor(list(encoded), dtype=torch.uint8)
                except OSError as exc:  # the others learn of it from the empty name
                    warnings.warn(f"ciuicflow: cannot create a shared segment: {exc}",
                                  RuntimeWarning)
            dist.broadcast(name, src=self.root, group=self.group)
            text = bytes(name.tolist()).rstrip(b"\0").decode()
            path, _, token_hex = text.partition("\0")
            ok = torch.ones(1) if text else torch.zeros(1)
            if self.local_rank != 0 and text:
                try:
                    mapping = _attach(path, nbytes)
                    if mapping[:_TOKEN_BYTES] != bytes.fromhex(token_hex):
                        ok.zero_()
                except (OSError, ValueError):
                    ok.zero_()
            dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=self.group)
        finally:
            if created is not None:  # every local rank has mapped it, or given up
                os.unlink(created)
        if not bool(ok.item()):
            raise Unavailable(f"segment {path or '(not created)'} not shared by every local rank")
        return mapping


@functools.cache
def _summer():
    """``ops.node_sum_into`` (one pass), or the same in torch ops where the native build is
    missing (exact reductions work without it); looked up once, not on every call."""
    try:
        from ciuicflow import ops
    except ImportError:
        return _sum_into_torch
    return ops.node_sum_into


def _sum_into(terms, divisor: float, out: torch.Tensor) -> torch.Tensor:
    return _summer()(terms, divisor, out)


def _sum_into_torch(terms, divisor: float, out: torch.Tensor) -> torch.Tensor:
    """``ops.node_sum_into``'s sum, bit for bit, in torch ops (three passes or more); its flag
    also fires where finite values sum past float32's range (``nonfinite_flag``)."""
    if len(terms) == 1:
        out.copy_(terms[0])
    else:
        torch.add(terms[0], terms[1], out=out)
    for term in terms[2:]:
        out.add_(term)
    if divisor != 1:
        out.div_(divisor)
    return nonfinite_flag(out)


def _attach(path: str, nbytes: int) -> mmap.mmap:
    fd = os.open(path, os.O_RDWR)
    try:
        return mmap.mmap(fd, nbytes)
    finally:
        os.close(fd)


def _create(nbytes: int):
    """A new file of ``nbytes`` in /dev/shm, mapped: (mapping, path)."""
    path = os.path.join(_SHM_DIR, f"ciuicflow-{os.getpid()}-{secrets.token_hex(6)}")
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        # Reserve the pages now: a tmpfs too small for the segment (Docker's default /dev/shm is
        # 64 MB) then fails here, and the node falls back to gloo, instead of a SIGBUS on first touch.
        os.posix_fallocate(fd, 0, nbytes)
        return mmap.mmap(fd, nbytes), path
    except BaseException:
        os.unlink(path)
        raise
    finally:
        os.close(fd)


class Unavailable(RuntimeError):
    """The ranks of a node cannot share a segment (of the size needed)."""


def node_segment(topology) -> NodeSegment | None:
    """The shared segment of this rank's node, or None where the node's ranks cannot share memory
    (a collective over the node the first time it is called for a topology)."""
    return group_segment(topology.intra_group, topology.local_rank, topology.local_world_size)


def group_segment(group, local_rank: int, local_size: int) -> NodeSegment | None:
    """``node_segment`` for a group of one node's ranks that is not a topology's (DiLoCo's own)."""
    if group in _NODES:
        return _NODES[group]
    segment = NodeSegment(group, local_rank, local_size)
    try:
        segment._areas(torch.float32, 1)
    except Unavailable as exc:
        disable_group(group, exc, stacklevel=4)
        return None
    _NODES[group] = segment
    return segment


def disable(topology, reason) -> None:
    """From now on, this node's CPU tensors use gloo's collectives (every local rank calls this
    at the same point: after the same failed collective)."""
    disable_group(topology.intra_group, reason, stacklevel=4)


def disable_group(group, reason, stacklevel: int = 3) -> None:
    """``disable`` for ``group_segment``'s groups."""
    warnings.warn(f"ciuicflow: the ranks of this node cannot share memory ({reason}); the "
                  "intra-node step of CPU tensors uses gloo's collectives instead",
                  RuntimeWarning, stacklevel=stacklevel)
    _NODES[group] = None
