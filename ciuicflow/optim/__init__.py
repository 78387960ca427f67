"""Optimizers that do their own compressed communication (the 1-bit Adam family).

- ``OneBitAdam``: 1-bit Adam (Tang et al. 2021): exact Adam for ``freeze_steps`` steps, then a
  frozen variance and a momentum averaged with 1-bit compression and error feedback;
- ``ZeroOneAdam``: 0/1 Adam (Lu et al. 2022): 1-bit averages of the update direction from the start
  (the paper's 1-bit gradients on request) with sparse exact variance updates, then local steps
  synchronised by 1-bit averages of the accumulated update.

They run on any torch.distributed backend, without DDP (``step`` is collective), or inside
DeepSpeed's engine (``ciuicflow.integrations.deepspeed``). See docs/onebit_adam.md.
"""
from ciuicflow.optim.compressed_momentum import CompressedMomentumOptimizer
from ciuicflow.optim.onebit_adam import OneBitAdam
from ciuicflow.optim.zero_one_adam import ZeroOneAdam

__all__ = ["CompressedMomentumOptimizer", "OneBitAdam", "ZeroOneAdam"]
