"""The DDP hooks under their first module name: ``ciuicflow.hooks`` is ``ciuicflow.ddp``."""
from ciuicflow.ddp.hooks import *  # noqa: F401,F403
from ciuicflow.ddp.hooks import __all__  # noqa: F401
