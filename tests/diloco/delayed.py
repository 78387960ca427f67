"""A shared run of the keep_local_progress tests (DDP and FSDP2 inside the node)."""


def one_delayed_sync(diloco, inner_step, read, period):
    """``period + 1`` inner steps of a DiLoCo whose sync lands one step after it is sent: (the
    model when the sync was sent, just before it landed, and after)."""
    for step in range(1, period + 2):
        inner_step(step)
        if step == period:
            at_send = read()
        if step == period + 1:
            before_apply = read()
        diloco.step()
    return at_send, before_apply, read()
