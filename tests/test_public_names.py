"""Every public name of ``ciuicflow`` is defined in source, where a reader (and go-to-definition)
finds it: a ``class`` or ``def`` statement of that name in the module that owns it."""
import inspect
import re

import ciuicflow


def test_every_public_class_and_function_is_defined_in_source():
    checked = 0
    for name in ciuicflow.__all__:
        if name.startswith("__"):
            continue
        value = getattr(ciuicflow, name)
        if inspect.ismodule(value) or not (inspect.isclass(value) or inspect.isfunction(value)):
            continue
        source = inspect.getsource(inspect.getmodule(value))
        assert re.search(rf"^(class|def) {re.escape(value.__name__)}\b", source, re.M), name
        assert value.__name__ == name, (name, value.__name__)
        checked += 1
    # the hooks and states of every registry method, and the rest
    from ciuicflow.compression import registry
    assert checked >= len(registry.METHODS) + len(registry.ENTRIES), checked
