"""Compressed gradient reduction across nodes for FSDP2 (HSDP with ciuicflow doing the inter-node half).

    mesh = init_device_mesh("cuda", (nodes, gpus_per_node), mesh_dim_names=("replicate", "shard"))
    for layer in model.layers:
        fully_shard(layer, mesh=mesh["shard"])          # shard inside a node only
    fully_shard(model, mesh=mesh["shard"])
    state = ciuicflow.fsdp.register(model, "hierarchical_1bit", mesh=mesh)

FSDP2 reduce-scatters each parameter group's gradients inside the node as usual; ciuicflow then
averages each rank's shard over ``mesh["replicate"]`` with the method's compressor (the same
compressors, options and defaults as the DDP hooks).

FSDP over every rank (a 1-D mesh, no HSDP): the reduce-scatter itself crosses nodes, and
``register(model, "onebit", mesh=mesh)`` replaces it with a compressed one (1-bit or int8, error
feedback per parameter group). See docs/fsdp.md.
"""
from __future__ import annotations

from ciuicflow.fsdp.state import FSDPState

__all__ = ["FSDPState", "register"]


def register(model, method: str, *, mesh, **options) -> FSDPState:
    """Set the all-reduce hook of every ``fully_shard``-ed module of ``model`` (sharded over
    ``mesh["shard"]``) to reduce its shard across nodes with ``method``; return the state. With a
    1-D ``mesh`` (the model sharded over all of it), set each module's reduce-scatter instead.

    ``options``: ``warmup_steps``, ``exclude``, ``seed`` and the compressor's options, as for
    ``ciuicflow.register`` on a DDP model."""
    from torch.distributed.fsdp import FSDPModule

    state = FSDPState(method, mesh, **options)
    shard_group = mesh.get_group() if state.scatter else mesh["shard"].get_group()
    names = {module: name for name, module in model.named_modules()}
    for module in model.modules():
        if not isinstance(module, FSDPModule):
            continue
        groups = module._get_fsdp_state()._fsdp_param_groups
        if not groups:  # a module without parameters of its own (often the root)
            continue
        if len(groups) > 1:
            raise ValueError(f"ciuicflow.fsdp: module {names[module]!r} has several parameter "
                             "groups (shard_placement_fn with several meshes): not supported")
        group = groups[0]
        if state.scatter:
            if group._is_hsdp or group.mesh_info.shard_process_group is not shard_group:
                raise ValueError(f"ciuicflow.fsdp: module {names[module]!r} must be fully_shard-ed "
                                 "over the 1-D mesh given to register")
            module.set_custom_reduce_scatter(state.add_scatter_group(names[module], group))
            continue
        if group._is_hsdp or group.mesh_info.shard_process_group is not shard_group:
            raise ValueError(f"ciuicflow.fsdp: module {names[module]!r} must be fully_shard-ed over "
                             "mesh['shard'] alone (not the 2-D mesh: that is FSDP's own HSDP, whose "
                             "all-reduce would run before ciuicflow's)")
        module.set_all_reduce_hook(state.add_group(names[module], group))
    if not state.groups:
        raise ValueError("ciuicflow.fsdp.register: no fully_shard-ed module with parameters in the "
                         "model (call fully_shard(module, mesh=mesh['shard']), or mesh=mesh for a "
                         "1-D mesh, first)")
    return state
