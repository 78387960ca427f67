"""Benchmarks, one folder per family; run each from the repository root as a module
(``python -m bench.<family>[.<entry>] --help``). Each writes JSON, a markdown table and (most) a PNG,
and has a ``--smoke`` configuration that CI runs. What each compares: docs/benchmarks.md.

- ``kernels``: the native ops against pure torch and a bandwidth ceiling.
- ``comm``: DDP communication methods on the tc-shaped simulated cluster (``comm.allreduce_cost``:
  one compressed all-reduce alone; ``comm.plan_calibration``: the planner beside the measurements).
- ``fsdp``: FSDP2/HSDP with ciuicflow's reduction across nodes, on the same cluster.
- ``diloco``: DiLoCo beside the synchronous methods on the same cluster.
- ``convergence``: does compression keep accuracy (``convergence.appendix``, ``convergence.frontier``,
  ``convergence.codec_noise``: what is made from its runs).
- ``onebit``: the 1-bit Adam family (``onebit.adam``, ``onebit.error``, ``onebit.freeze``).
- ``monitor``: what ciuicflow.monitor costs a step.
- ``kvflow``: the KV-flow sidecar on a shaped link; ``soak``: sidecars under faults and attack
  (``soak.chaos``: discovery through etcd while nodes die).
- ``proxy``: the vLLM proxy's routing; ``vllm``: disaggregated vLLM serving over the sidecars.
- ``gpu``: the hooks on one GPU (bench/gpu_check.sh runs it with the CUDA tests).
- ``common``: what several families share (cluster options, launches, workers' loop, reports).
"""
