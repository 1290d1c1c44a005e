"""Kernel sets: the model's heavy ops, one interface (`base.KernelSet`) with one implementation per kind
of machine, chosen once when the model loads (`select.select_kernels`).

- `base`: the `KernelSet` contract, `StepBatch` / `AttentionMetadata` (one step's inputs), `KVSpec`.
- `reference`: plain-torch references of every op, the oracle of the kernel tests.
- `eager`: the eager torch set (CPU; always available, the fallback).
- `cpu`: compiled CPU kernels; `cuda`: Triton kernels on the GPU (`cuda.kernel_set.CudaKernels`).
- `select`: `resolve_device` (`EngineConfig.device`) and `select_kernels` (`EngineConfig.kernels`).
"""

from troupe.kernels.base import AttentionMetadata, KernelSet, KVSpec, StepBatch
from troupe.kernels.select import KERNEL_SETS, resolve_device, select_kernels

__all__ = ["KERNEL_SETS", "AttentionMetadata", "KVSpec", "KernelSet", "StepBatch", "resolve_device",
           "select_kernels"]
