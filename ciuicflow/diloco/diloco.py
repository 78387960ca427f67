"""DiLoCo: local SGD across nodes with an outer optimizer, in fragments, overlapped with compute.

Inside a node every inner step is what it is without DiLoCo (the user's DDP over the node's ranks,
with any ciuicflow hook, or FSDP2 over the node). Every ``sync_every`` inner steps each fragment's
pseudo-gradient (its parameters at the last sync minus now) is averaged across nodes
(``diloco.exchange``), and the fragment's outer optimizer (SGD; Nesterov momentum optional) steps its
anchor (the parameters at the last sync, the same on every rank) with that mean: the fragment's
parameters become the new anchor. The inner optimizer's state stays local; under Adam-family
optimizers its lr is scaled during each inner step (``inner_lr_scale``).

Anchors are bit-identical after each outer step: the mean is unpacked from the same bytes on every
rank, and anchors and outer optimizers start equal and step alike. So are the replicas, unless
``keep_local_progress`` adds each node's own steps taken while a sync was in flight.
"""
from __future__ import annotations

import io
import math
import time
import warnings
from concurrent.futures import Future, ThreadPoolExecutor

import torch
import torch.distributed as dist

from ciuicflow.collectives.primitives import Traffic, ring_all_reduce_bytes
from ciuicflow.compression.policy import outer_wire
from ciuicflow.diloco.exchange import NodeLayout, OuterExchange, make_compressor
from ciuicflow.diloco.layout import Fragment, Schedule, is_sharded, local_tensor, split

_STATE_VERSION = 2
# "auto": compression.policy.outer_wire, by the inner optimizer (docs/diloco.md, "Defaults")
DEFAULT_CODEC = "auto"
DEFAULT_SYNC_EVERY = "auto"
DEFAULT_FRAGMENTS = 1
DEFAULT_FRAGMENT_SYNC_DELAY = 0
# The outer step: the nodes' mean (lr 1, no momentum) under Adam-family inner optimizers (and when
# DiLoCo does not see the inner optimizer); under torch.optim.SGD a damped mean, lr 0.9 (Lookahead's
# slow step), as SGD's heavy-ball momentum compounds with any outer extrapolation (docs/diloco.md,
# "Outer step").
DEFAULT_OUTER_LR = 1.0
DEFAULT_SGD_OUTER_LR = 0.9
DEFAULT_OUTER_MOMENTUM = 0.0


def nesterov(lr: float = DEFAULT_OUTER_LR, momentum: float = DEFAULT_OUTER_MOMENTUM):
    """An outer optimizer's factory: SGD, with Nesterov momentum where ``momentum`` > 0 (DiLoCo's
    paper: ``nesterov(0.7, 0.9)``); lr 1 and no momentum averages the nodes."""
    factory = lambda params: torch.optim.SGD(params, lr=lr, momentum=momentum,  # noqa: E731
                                             nesterov=momentum > 0)
    factory.description = f"SGD lr {lr:g}" + (f", Nesterov momentum {momentum:g}" if momentum else
                                              " (no momentum)")
    return factory


def default_outer_optimizer(inner_optimizer=None):
    """The outer optimizer's factory DiLoCo uses without ``outer_optimizer``: ``nesterov(0.9, 0)``
    (a damped mean) when the inner optimizer is a ``torch.optim.SGD``, else ``nesterov(1, 0)``
    (the nodes' mean): Adam-family inner optimizers, or none given to DiLoCo."""
    if isinstance(inner_optimizer, torch.optim.SGD):
        return nesterov(DEFAULT_SGD_OUTER_LR, DEFAULT_OUTER_MOMENTUM)
    return nesterov(DEFAULT_OUTER_LR, DEFAULT_OUTER_MOMENTUM)


# Inner optimizers that divide each coordinate by the root of its running mean square.
ADAPTIVE_INNER = (torch.optim.Adam, torch.optim.AdamW, torch.optim.NAdam, torch.optim.RAdam,
                  torch.optim.RMSprop, torch.optim.Adagrad)


def resolve_inner_lr_scale(scale, inner_optimizer, nodes: int) -> float:
    """``"auto"``: sqrt(nodes) under an ``ADAPTIVE_INNER`` optimizer, else 1. Each node's Adam
    divides by the mean square of a gradient averaged over 1/nodes of the batch; where the
    gradient's noise dominates that is nodes times the whole batch's, so the nodes' mean step is
    1/sqrt(nodes) of Adam's on the whole batch (docs/diloco.md, "Defaults", the inner lr)."""
    _check_inner_lr_scale(scale, inner_optimizer)
    if scale == "auto":
        return math.sqrt(nodes) if isinstance(inner_optimizer, ADAPTIVE_INNER) else 1.0
    return float(scale)


def _check_inner_lr_scale(scale, inner_optimizer) -> None:
    if isinstance(scale, str) and scale == "auto":
        return
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) \
            or not math.isfinite(scale) or scale <= 0:
        raise ValueError(f"inner_lr_scale must be a positive number or 'auto', got {scale!r}")
    if scale != 1 and inner_optimizer is None:
        raise ValueError("inner_lr_scale needs the inner_optimizer: DiLoCo scales its lr "
                         "during each of its steps")


class _Pending:
    """A fragment's sync in flight: sent after one inner step, applied after ``apply_at``."""

    __slots__ = ("apply_at", "future", "mean", "done", "since")

    def __init__(self, apply_at: int, future: Future | None = None, mean=None, done=False,
                 since=None):
        self.apply_at, self.future, self.mean, self.done = apply_at, future, mean, done
        self.since = since  # keep_local_progress: the fragment's values when it was sent


class DiLoCo:
    """Hierarchical local SGD / (Streaming) DiLoCo over the nodes of the default process group.

    Call ``step()`` after every inner ``optimizer.step()`` (or pass ``inner_optimizer``: a hook of
    its ``step`` does it), and ``close()`` at the end (or use it as a context manager).

    Args:
        model: the model (a DDP model's ``module`` is read; FSDP2 shards are read locally).
        inner_optimizer: optional; its ``step`` then calls ``self.step()`` after it.
        sync_every: inner steps between two syncs of a fragment (H); ``"auto"``: the codec's
            bits over ``OUTER_BITS_PER_STEP`` (``compression.policy.outer_wire``).
        fragments: the model is cut into this many fragments, each synced at its own step,
            staggered over the period (Streaming DiLoCo); 1: the whole model at once.
        fragment_sync_delay: inner steps between a fragment's send and its update (its exchange
            runs on a worker thread meanwhile); 0: wait for it at once.
        fragment_update_alpha: the fragment becomes alpha x local + (1 - alpha) x global; 0 keeps
            the replicas bit-identical.
        keep_local_progress: with a delay, the fragment becomes the global one plus what this
            node's inner steps moved it while its sync was in flight (instead of dropping those
            steps); the anchors stay bit-identical, the replicas then differ by those steps until
            the next ``sync()``. Holds one more float32 copy of the model.
        codec: the registry compressor of the outer exchange ("int8", "int4", "onebit") or
            "exact"; ``"auto"``: 1 bit under ``torch.optim.SGD``, else int4
            (``compression.policy.outer_wire``); ``codec_options``: its options (``chunk_size``, ...).
        outer_optimizer: a factory ``params -> torch.optim.Optimizer`` (default:
            ``default_outer_optimizer(inner_optimizer)``: lr 0.9 without momentum under
            ``torch.optim.SGD``, else the nodes' mean); each fragment gets its own, over one flat
            float32 tensor.
        ranks_per_node: nodes of this many consecutive ranks (default: ``Topology.detect()``).
        inner_lr_scale: the inner optimizer's lr is multiplied by this during each of its steps
            (and given back after it, so schedulers see the user's lr). ``"auto"``: the square
            root of the number of nodes under an optimizer that divides by a running mean square
            (``ADAPTIVE_INNER``), else 1 (``resolve_inner_lr_scale``).
    """

    def __init__(self, model: torch.nn.Module, inner_optimizer=None, *,
                 sync_every: int | str = DEFAULT_SYNC_EVERY, fragments: int = DEFAULT_FRAGMENTS,
                 fragment_sync_delay: int = DEFAULT_FRAGMENT_SYNC_DELAY,
                 fragment_update_alpha: float = 0.0, keep_local_progress: bool = False,
                 codec: str = DEFAULT_CODEC, codec_options: dict | None = None,
                 outer_optimizer=None, ranks_per_node: int | None = None,
                 inner_lr_scale: float | str = "auto"):
        module = getattr(model, "module", model)
        params = [p for p in module.parameters() if p.requires_grad]
        _check_inner_lr_scale(inner_lr_scale, inner_optimizer)
        codec, sync_every, self.wire_reason = outer_wire(
            codec, sync_every, isinstance(inner_optimizer, torch.optim.SGD),
            type(inner_optimizer).__name__ if inner_optimizer is not None else "")
        _check_options(params, sync_every, fragments, fragment_sync_delay, fragment_update_alpha,
                       outer_optimizer, keep_local_progress)
        self.sync_every, self.alpha = int(sync_every), float(fragment_update_alpha)
        self.keep_local_progress = keep_local_progress
        self.schedule = Schedule(self.sync_every, int(fragments), int(fragment_sync_delay))
        self.codec = codec
        compressor = make_compressor(codec, codec_options)  # before any collective: fail alike
        self.layout = NodeLayout(ranks_per_node)
        self.inner_lr_scale = resolve_inner_lr_scale(inner_lr_scale, inner_optimizer,
                                                     self.layout.nodes)
        self.sharded = is_sharded(params)
        self.fragments = _cut(params, int(fragments), self.sharded)
        self._exchange = OuterExchange(self.layout, compressor, len(self.fragments), self.sharded)
        self._broadcast_initial(params)
        factory = outer_optimizer or default_outer_optimizer(inner_optimizer)
        self.outer_description = getattr(factory, "description", None) or "user's outer_optimizer"
        self.anchors = [torch.nn.Parameter(f.read(), requires_grad=False) for f in self.fragments]
        self.outer = [factory([a]) for a in self.anchors]
        self.inner_steps = 0
        self.fragment_syncs = 0  # fragments' outer steps applied
        self.skipped = 0         # fragments' outer steps skipped (non-finite pseudo-gradient)
        self._traffic = Traffic()
        self._pending: dict[int, _Pending] = {}
        self._snapshots: list[torch.Tensor | None] = [None] * len(self.fragments)
        self._wait = self._wall = 0.0
        self._counted_from = 0  # inner steps before the last reset_stats()
        self.algorithm = "diloco"  # ciuicflow.monitor's name for this source
        self._last_time: float | None = None
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="ciuicflow-diloco") \
            if self.schedule.delay else None
        self._saved_lrs: list | None = None
        self._hooks = []
        if inner_optimizer is not None:
            if self.inner_lr_scale != 1.0:
                self._hooks.append(inner_optimizer.register_step_pre_hook(
                    lambda opt, *_: self._scale_lrs(opt)))
            self._hooks.append(inner_optimizer.register_step_post_hook(
                lambda opt, *_: self._after_inner_step(opt)))
        self._closed = False

    # -- the training loop's calls -------------------------------------------------------------

    def _scale_lrs(self, optimizer) -> None:
        self._give_back_lrs(optimizer)  # a step that raised never reached the post-hook
        self._saved_lrs = [group["lr"] for group in optimizer.param_groups]
        for group in optimizer.param_groups:
            group["lr"] = group["lr"] * self.inner_lr_scale

    def _give_back_lrs(self, optimizer) -> None:
        if self._saved_lrs is not None:  # the user's (or the scheduler's) lr, as it was
            for group, lr in zip(optimizer.param_groups, self._saved_lrs):
                group["lr"] = lr
            self._saved_lrs = None

    def _after_inner_step(self, optimizer) -> None:
        self._give_back_lrs(optimizer)
        self.step()

    def step(self) -> None:
        """After an inner optimizer step: send the fragments due, apply those whose delay is up."""
        self._check_open()
        now = time.perf_counter()
        if self._last_time is not None:
            self._wall += now - self._last_time
        self._last_time = now
        self.inner_steps += 1
        for k in self.schedule.sends_at(self.inner_steps):
            self._send(k, self.inner_steps + self.schedule.delay)
        for k in sorted(self._pending, key=lambda k: self._pending[k].apply_at):
            if self._pending[k].apply_at <= self.inner_steps:
                self._apply(k)

    def sync(self) -> None:
        """An outer step of every fragment now (those in flight first): the replicas are then equal
        (with ``fragment_update_alpha`` 0), e.g. before evaluating or saving the final model."""
        self._check_open()
        for k in sorted(self._pending, key=lambda k: self._pending[k].apply_at):
            self._apply(k)
        for k in range(len(self.fragments)):
            self._send(k, self.inner_steps)
            self._apply(k)

    def close(self) -> None:
        """Wait for syncs in flight (kept, applied at their step if training goes on elsewhere:
        they are in ``state_dict``), stop the worker and remove the optimizer hook."""
        if self._closed:
            return
        for k in list(self._pending):
            self._resolve(k)
        if self._executor is not None:
            self._executor.shutdown(wait=True)
        for hook in self._hooks:
            hook.remove()
        self._closed = True

    def __enter__(self) -> "DiLoCo":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- statistics ------------------------------------------------------------------------------

    def stats(self) -> dict:
        """This rank's counters: inner steps, outer steps, bytes, the share of time waiting."""
        t, layout = self._traffic, self.layout
        outer_steps = self.fragment_syncs / len(self.fragments)
        numel = sum(f.numel for f in self.fragments)
        world = layout.nodes * layout.local
        # what exact DDP over all ranks would put on inter-node links per step (a flat ring
        # all-reduce of float32 gradients, its share of peers on other nodes)
        exact_ddp = ring_all_reduce_bytes(numel * 4, world) * (world - layout.local) \
            / max(1, world - 1) if not self.sharded else float("nan")
        steps = self.inner_steps - self._counted_from  # since the last reset_stats()
        per_step = t.inter_bytes / steps if steps else 0.0
        plan = self._exchange.wire_plan()
        return {
            "method": "diloco", "codec": self.codec, "wire_reason": self.wire_reason,
            "wire_plan": plan.summary() if plan is not None else self.codec,
            "outer_optimizer": self.outer_description, "inner_lr_scale": self.inner_lr_scale,
            "topology": layout.describe(), "sync_every": self.sync_every,
            "fragments": len(self.fragments), "fragment_sync_delay": self.schedule.delay,
            "keep_local_progress": self.keep_local_progress,
            "inner_steps": self.inner_steps, "outer_steps": outer_steps,
            "fragment_syncs": self.fragment_syncs, "skipped_outer_steps": self.skipped,
            "inter_node_bytes": t.inter_bytes, "intra_node_bytes": t.intra_bytes,
            "inter_node_bytes_per_step": per_step,
            "inter_node_bytes_per_outer_step": t.inter_bytes / outer_steps if outer_steps else 0.0,
            "exact_outer_inter_node_bytes": t.exact_inter_bytes,
            # the codec's share alone, as the hooks' stats() give it: exact outer exchange / sent
            "compression_ratio": t.exact_inter_bytes / t.inter_bytes if t.inter_bytes else None,
            "exact_ddp_inter_node_bytes_per_step": exact_ddp,
            "reduction_vs_exact_ddp": exact_ddp / per_step if per_step else None,
            "network_wait_seconds": self._wait, "wall_seconds": self._wall,
            "network_wait_share": self._wait / self._wall if self._wall else 0.0,
            # ciuicflow.monitor's keys (monitor/sources.py): counters since reset_stats(); "exact"
            # is what exact DDP would have sent every inner step, so the monitor's compression
            # ratio is DiLoCo's reduction against exact DDP
            "exact_inter_node_bytes": None if self.sharded else exact_ddp * steps,
            "time_s": self._wait,
        }

    def reset_stats(self) -> None:
        self._traffic, self._wait, self._wall = Traffic(), 0.0, 0.0
        self._counted_from = self.inner_steps

    # -- checkpoints -----------------------------------------------------------------------------

    @property
    def node_key(self) -> str:
        """``"node<n>"``, this rank's node: the key to save the model and the inner optimizer under
        in a DCP checkpoint. Between outer steps each node's model is its own, and its inner
        optimizer's state always is; under one key for all nodes (plain tensors, or DTensors over
        the node's mesh) DCP keeps one copy of each, so the other nodes would resume with it."""
        return f"node{self.layout.node}"

    def state_dict(self) -> dict:
        """Everything a resumed run needs besides the model and the inner optimizer: step counter,
        anchors, outer optimizers, error-feedback memories, syncs in flight (waited for, their
        results kept). Collective over nothing; every rank calls it at the same step.

        Laid out for ``torch.distributed.checkpoint`` (``dcp.save`` / ``dcp.load`` into a fresh
        DiLoCo's ``state_dict()``, then ``load_state_dict``) as well as for a per-rank
        ``torch.save``. DCP keeps one copy of a key that several ranks hold, so each entry's key
        names who shares it:

        - ``version``, ``config``, the counters: the same on every rank;
        - ``replica`` (DDP: every rank's) or ``shard<i>`` (FSDP2: local rank ``i``'s of every
          node): ``anchors``, one float32 tensor per fragment, and ``outer``, the outer
          optimizers' state and the syncs in flight as ``torch.save`` bytes (their tensors appear
          with an optimizer's first step and with the schedule, and DCP loads tensors only into
          tensors the loading state dict already holds: a fresh DiLoCo has none of them);
        - ``rank<R>``: this rank's own, as bytes: its error-feedback memories (its compression
          error, unlike any other rank's) and the bytes it sent.
        """
        for k in list(self._pending):
            self._resolve(k)
        outer = {"numel": [f.numel for f in self.fragments],
                 "optimizers": [o.state_dict() for o in self.outer],
                 # a mean may be a view of a reused buffer: saved alone, not with the buffer
                 "pending": {k: {"apply_at": p.apply_at,
                                 "mean": None if p.mean is None else p.mean.clone()}
                             for k, p in self._pending.items()}}
        mine = {"memory": self._exchange.state_dict(), "traffic": self._traffic.as_dict(),
                # this node's values at each send in flight: unlike the other nodes'
                "since": {k: p.since.clone() for k, p in self._pending.items()
                          if p.since is not None}}
        return {
            "version": _STATE_VERSION, "config": self._config(),
            "inner_steps": self.inner_steps, "fragment_syncs": self.fragment_syncs,
            "skipped": self.skipped,
            self._replica_key(): {"anchors": [a.detach().clone() for a in self.anchors],
                                  "outer": _to_bytes(outer)},
            self._rank_key(): _to_bytes(mine),
        }

    def load_state_dict(self, state: dict) -> None:
        if state.get("version") != _STATE_VERSION:
            raise ValueError(f"unknown DiLoCo checkpoint version {state.get('version')!r}")
        if state["config"] != self._config():
            raise ValueError(f"checkpoint's DiLoCo config {state['config']} differs from this "
                             f"one's {self._config()}")
        replica, rank = state.get(self._replica_key()), self._rank_key()
        if replica is None or state.get(rank) is None:
            raise ValueError(f"the checkpoint holds no DiLoCo state for {self._replica_key()!r} "
                             f"and {rank!r} (saved by another rank's torch.save, or another "
                             f"layout?); it has {sorted(state)}")
        outer, mine = _from_bytes(replica["outer"]), _from_bytes(state[rank])
        if outer["numel"] != [f.numel for f in self.fragments]:
            raise ValueError(f"checkpoint's fragments hold {outer['numel']} elements on this "
                             f"rank, this DiLoCo's {[f.numel for f in self.fragments]}")
        for k in list(self._pending):
            self._resolve(k)
        self.inner_steps = int(state["inner_steps"])
        self.fragment_syncs, self.skipped = int(state["fragment_syncs"]), int(state["skipped"])
        with torch.no_grad():
            for anchor, saved in zip(self.anchors, replica["anchors"]):
                anchor.copy_(saved)
        for optimizer, saved in zip(self.outer, outer["optimizers"]):
            optimizer.load_state_dict(saved)
        self._exchange.load_state_dict(mine["memory"])
        since = mine.get("since", {})
        self._pending = {int(k): _Pending(p["apply_at"], done=True, mean=None if p["mean"] is None
                                          else p["mean"].to(self.anchors[int(k)].device),
                                          since=self._snapshot_from(int(k), since.get(k)))
                         for k, p in outer["pending"].items()}
        self._traffic = Traffic(**mine["traffic"])
        self._counted_from = 0  # the checkpoint's traffic covers the run from its start

    # -- inside --------------------------------------------------------------------------------

    def _config(self) -> dict:
        """The same on every rank: fragments by their whole parameters' elements (a DTensor's
        ``numel`` is its global one)."""
        config = {"sync_every": self.sync_every,
                  "fragments": [sum(p.numel() for p in f.params) for f in self.fragments],
                  "delay": self.schedule.delay, "codec": self.codec,
                  "nodes": self.layout.nodes, "ranks_per_node": self.layout.local,
                  "sharded": self.sharded}
        if self.keep_local_progress:  # absent otherwise: checkpoints from before it still load
            config["keep_local_progress"] = True
        return config

    def _replica_key(self) -> str:
        """The key of the state this rank shares with others: every rank's under DDP, the same
        local rank's of every node under FSDP2."""
        return f"shard{self.layout.local_rank}" if self.sharded else "replica"

    def _rank_key(self) -> str:
        return f"rank{dist.get_rank()}"

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("this DiLoCo is closed")

    def _broadcast_initial(self, params) -> None:
        """Every node starts from the same parameters: node 0's (each shard from its holder)."""
        layout = self.layout
        group = layout.peer_group if self.sharded else layout.world_group
        source = min(layout.peers) if self.sharded else layout.members[0][0]
        with torch.no_grad():
            for p in params:
                dist.broadcast(local_tensor(p).data, source, group=group)

    def _snapshot(self, k: int) -> torch.Tensor:
        """Fragment ``k``'s buffer for its values at a send (``keep_local_progress``), reused: a
        fragment's next send comes after its apply (delay < sync_every)."""
        if self._snapshots[k] is None:
            self._snapshots[k] = torch.empty_like(self.anchors[k].detach())
        return self._snapshots[k]

    def _snapshot_from(self, k: int, saved):
        """Fragment ``k``'s snapshot buffer holding ``saved`` (None: None)."""
        return None if saved is None else self._snapshot(k).copy_(saved)

    def _send(self, k: int, apply_at: int) -> None:
        anchor = self.anchors[k].detach()
        since = self._snapshot(k) if self.keep_local_progress and apply_at > self.inner_steps \
            else None
        delta = self.fragments[k].delta(anchor, self._exchange.delta_buffer(k, anchor.numel(),
                                                                            anchor.device), since)
        outer_step = self.fragment_syncs + self.skipped + len(self._pending)
        job = (lambda: self._exchange.run(k, delta, outer_step))
        if self._executor is None:
            future: Future = Future()
            start = time.perf_counter()
            future.set_result(job())
            self._wait += time.perf_counter() - start
        else:
            future = self._executor.submit(job)
        self._pending[k] = _Pending(apply_at, future, since=since)

    def _resolve(self, k: int) -> None:
        pending = self._pending[k]
        if pending.done:
            return
        start = time.perf_counter()
        pending.mean, traffic = pending.future.result()
        self._wait += time.perf_counter() - start
        self._traffic.merge(traffic)
        pending.future, pending.done = None, True

    def _apply(self, k: int) -> None:
        self._resolve(k)
        pending = self._pending.pop(k)
        mean = pending.mean
        anchor, fragment = self.anchors[k], self.fragments[k]
        if mean is None:  # some rank's pseudo-gradient is inf/NaN: every rank drops this round
            self.skipped += 1
            warnings.warn(f"ciuicflow.diloco: a non-finite pseudo-gradient in fragment {k} after "
                          f"inner step {self.inner_steps}: its outer step is skipped on every "
                          f"rank ({self.skipped} so far) and its parameters go back to the last "
                          f"sync's; the inner optimizer's state is left as it is",
                          RuntimeWarning, stacklevel=3)
            fragment.write(anchor.detach())
            return
        anchor.grad = mean.view_as(anchor)
        self.outer[k].step()
        anchor.grad = None
        self.fragment_syncs += 1
        if pending.since is not None:
            fragment.write_with_progress(anchor.detach(), pending.since)
        else:
            fragment.write(anchor.detach(), self.alpha)


def _to_bytes(value) -> bytes:
    """``value`` serialised now: a copy of buffers that later steps overwrite, opaque to DCP (which
    saves bytes whole and loads them back whole, whatever tensors they hold)."""
    blob = io.BytesIO()
    torch.save(value, blob)
    return blob.getvalue()


def _from_bytes(blob: bytes):
    """``_to_bytes``' value, its tensors on the CPU: where each goes is its loader's to say (an
    optimizer's ``load_state_dict`` puts its state by its parameter, leaving a ``step`` on the CPU
    where it belongs there; the compressor's memory moves to the device of its first use). Tensors,
    numbers and containers only (``weights_only``): a checkpoint cannot run code on load."""
    return torch.load(io.BytesIO(blob), map_location="cpu", weights_only=True)


def _cut(params: list, fragments: int, sharded: bool) -> list[Fragment]:
    """``split``'s fragments, cut where the whole parameters' sizes put them: FSDP2's shards of a
    parameter differ in size between a node's ranks where its rows do not divide evenly, and cut
    by those the ranks of a node would end a fragment at different parameters (a fragment would
    then hold part of a parameter's rows on the node, and the ranks' fragments could not be named
    alike). Each fragment counts this rank's elements of its parameters."""
    if not sharded:
        return split(params, fragments)
    whole = [torch.empty(p.shape, device="meta") for p in params]  # a DTensor's shape: global
    position = {id(w): i for i, w in enumerate(whole)}
    cut = []
    for f in split(whole, fragments):
        members = [params[position[id(w)]] for w in f.params]
        cut.append(Fragment(f.index, members, sum(local_tensor(p).numel() for p in members)))
    return cut


def _check_options(params, sync_every, fragments, delay, alpha, outer_optimizer,
                   keep_local_progress) -> None:
    def integer(name, value, low, other=""):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"{name} must be an integer >= {low}{other}, got {value!r}")

    integer("sync_every", sync_every, 1, " or 'auto'")
    integer("fragments", fragments, 1)
    integer("fragment_sync_delay", delay, 0)
    if not params:
        raise ValueError("the model has no trainable parameters")
    if fragments > len(params):
        raise ValueError(f"fragments={fragments} is more than the model's {len(params)} "
                         f"trainable parameters (a fragment is a run of whole parameters)")
    if fragments > sync_every:
        raise ValueError(f"fragments={fragments} must be <= sync_every={sync_every}: each "
                         f"fragment syncs at its own inner step of the period")
    if delay >= sync_every:
        raise ValueError(f"fragment_sync_delay={delay} must be < sync_every={sync_every}: a "
                         f"fragment's sync must land before its next one is sent")
    if not 0.0 <= float(alpha) < 1.0:
        raise ValueError(f"fragment_update_alpha must be in [0, 1), got {alpha!r}")
    if not isinstance(keep_local_progress, bool):
        raise ValueError(f"keep_local_progress must be True or False, got {keep_local_progress!r}")
    if keep_local_progress and alpha:
        raise ValueError("keep_local_progress and fragment_update_alpha are two ways to keep "
                         "local steps: give one")
    if outer_optimizer is not None and not callable(outer_optimizer):
        raise ValueError("outer_optimizer must be a factory: params -> torch.optim.Optimizer")
