"""Integrations with training frameworks, each optional and imported only on demand.

- ``ciuicflow.integrations.deepspeed``: ciuicflow's 1-bit optimizers inside DeepSpeed's engine, and
  a DeepSpeed config planned for a model size and a cluster. Needs ``pip install ciuicflow[deepspeed]``
  for the engine part; it is loaded automatically when a 1-bit optimizer is built in a process that
  has imported deepspeed.

Nothing here is imported by ``import ciuicflow``.
"""
