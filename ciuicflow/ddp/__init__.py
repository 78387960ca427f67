"""DDP integration: communication hooks and their states, generated from the compression
registry (``ddp.hooks``); the generic state (``ddp.state``), bucket memories (``ddp.bucket``) and
the ordered communication thread (``ddp.worker``) behind them."""
from ciuicflow.ddp.hooks import *  # noqa: F401,F403
from ciuicflow.ddp.hooks import __all__  # noqa: F401
