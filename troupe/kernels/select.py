"""`select_kernels`: which kernel set runs a model, decided once when it loads.

`EngineConfig.kernels` names the set: "auto" takes the best one this machine can run, a name forces
that one (an error if it cannot run here):

- "cpu": compiled CPU kernels (troupe.kernels.cpu; needs a C++ compiler and AVX2/FMA/F16C);
- "eager": plain torch on the CPU (always available).

"auto" is "cpu" where its kernels build and load here (compiled once, then cached), else "eager" after one
warning naming the reason (`troupe.kernels.cpu.build.load_ops`). Each new set adds its name to
`troupe.config.KERNEL_SETS` and itself to the "auto" order below once it is the better choice.
"""

from __future__ import annotations

from troupe.config import KERNEL_SETS, EngineConfig
from troupe.errors import InvalidInputError
from troupe.kernels.base import KernelSet


def select_kernels(config: EngineConfig) -> KernelSet:
    """The kernel set for `config` (see the module docstring)."""
    name = config.kernels
    if name not in KERNEL_SETS:
        raise InvalidInputError("kernels", f"must be one of {list(KERNEL_SETS)}, got {name!r}")
    if name in ("cpu", "auto"):
        from troupe.kernels.cpu import CpuKernels, available
        from troupe.kernels.cpu.build import BuildError

        if name == "cpu" or available():
            try:
                return CpuKernels(kv_cache_dtype=config.kv_cache_dtype)
            except BuildError as exc:
                raise InvalidInputError("kernels", f"'cpu' cannot run here: {exc}") from exc
    from troupe.kernels.eager import EagerKernels

    return EagerKernels(decode_row_cache_bytes=config.decode_row_cache_bytes, kv_cache_dtype=config.kv_cache_dtype)
