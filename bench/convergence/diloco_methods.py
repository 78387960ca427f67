"""DiLoCo rows of bench/convergence: exact DDP inside each node, ``ciuicflow.diloco`` across.

    diloco[@...]                                   ciuicflow.DiLoCo's defaults ("auto": by optimizer)
    diloco_<codec>_h<H>[_f<F>][_d<D>[_k]][@outer_lr=..;outer_momentum=..;alpha=..]

Without ``outer_lr``/``outer_momentum`` the outer step is DiLoCo's default for the task's inner
optimizer (``ciuicflow.diloco.default_outer_optimizer``: lr 0.9 under SGD, the mean under Adam;
before the int4 / H = 8 defaults it was the mean on every task, and before that the paper's
Nesterov 0.7/0.9: docs/diloco.md); an option given alone takes the other's global default (lr 1,
momentum 0).

``codec``: "exact" or a quantising family of the registry ("int8", "int4", "onebit"); ``H``: inner
steps between two syncs of a fragment; ``F`` fragments (default 1), ``D`` inner steps of delay
(default 0), ``_k``: ``keep_local_progress`` (the steps taken during the delay are kept). The
last inner step is followed by ``DiLoCo.sync()`` (every fragment's outer step,
its bytes counted), so the final evaluation and the replica check see the global model.
"""
from __future__ import annotations

import re

_NAME = re.compile(r"^diloco_(?P<codec>[a-z0-9]+)_h(?P<h>\d+)(?:_f(?P<f>\d+))?(?:_d(?P<d>\d+)(?P<k>_k)?)?$")


def is_diloco(name: str) -> bool:
    return name == "diloco" or name.startswith("diloco_")


def parse(name: str, options: dict) -> dict:
    """The DiLoCo keyword arguments of a method name and its ``@`` options."""
    match = _NAME.match(name)
    if match is None and name != "diloco":
        raise ValueError(f"a DiLoCo method is diloco or diloco_<codec>_h<H>[_f<F>][_d<D>[_k]], got "
                         f"{name!r}")
    import ciuicflow.diloco as diloco

    options = dict(options)
    outer = None  # DiLoCo's default outer step (diloco.default_outer_optimizer: by inner optimizer)
    if "outer_lr" in options or "outer_momentum" in options:
        outer = diloco.nesterov(float(options.pop("outer_lr", diloco.DEFAULT_OUTER_LR)),
                                float(options.pop("outer_momentum", diloco.DEFAULT_OUTER_MOMENTUM)))
    kwargs = dict(outer_optimizer=outer, fragment_update_alpha=float(options.pop("alpha", 0.0)))
    if match is not None:
        kwargs.update(sync_every=int(match["h"]), fragments=int(match["f"] or 1),
                      fragment_sync_delay=int(match["d"] or 0), codec=match["codec"],
                      keep_local_progress=bool(match["k"]))
    if "inner_lr_scale" in options:
        kwargs["inner_lr_scale"] = float(options.pop("inner_lr_scale"))
    if options:
        kwargs["codec_options"] = options
    return kwargs


def default_name() -> str:
    """The method name of ``ciuicflow.DiLoCo``'s documented defaults."""
    return "diloco"


def setup(task, model, name: str, options: dict, make_optimizer):
    """(the DDP module inside the node, the inner optimizer, the DiLoCo object)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    import ciuicflow.diloco as diloco

    kwargs = parse(name, options)
    ddp = DDP(model, process_group=diloco.node_group(), bucket_cap_mb=task.bucket_cap_mb)
    optimizer = make_optimizer(task, ddp.parameters())
    outer = diloco.DiLoCo(ddp, optimizer, **kwargs)
    steps = [0]

    def last_step_syncs(*_):  # after DiLoCo's own hook (registered first)
        steps[0] += 1
        if steps[0] == task.steps:
            outer.sync()

    optimizer.register_step_post_hook(last_step_syncs)
    return ddp, optimizer, outer
