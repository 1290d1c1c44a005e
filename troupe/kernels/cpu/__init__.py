"""The `cpu` kernel set: the model's heavy ops as compiled C++ kernels (`csrc/`, built by `build`).

Projections and the embedding lookup compute on GGUF blocks (`linear`). Work in progress: ops without a
compiled kernel yet fall back to the eager set's (this class extends `EagerKernels`), so the set is
complete at every stage and each compiled op replaces one method.
`kernels="cpu"` selects it (an error if the kernels cannot be built here); `kernels="auto"` keeps the
eager set until this one is the faster.
"""

from __future__ import annotations

import torch

from troupe.kernels.base import EmbeddingOp, LinearOp
from troupe.kernels.cpu import linear as qlinear
from troupe.kernels.cpu.build import BuildError, load_ops
from troupe.kernels.eager import EagerKernels
from troupe.kernels.quant import Weight

EXTENSIONS: dict[str, tuple[str, ...]] = {  # extension name -> its csrc/ sources
    "probe": ("probe.cpp",),
    "qmm": qlinear.SOURCES,
}


def available() -> bool:
    """Whether every compiled extension of the set builds and loads here (built once, then cached)."""
    return all(load_ops(name, sources) for name, sources in EXTENSIONS.items())


class CpuKernels(EagerKernels):
    """See the module docstring."""

    name = "cpu"

    def __init__(self, decode_row_cache_bytes: int | None = None, quantize_activations: bool = False) -> None:
        if not available():
            raise BuildError("the compiled CPU kernels cannot be built here (see the warning logged above)")
        super().__init__(decode_row_cache_bytes)
        self.quantize_activations = quantize_activations  # "gguf-q8": 8-bit activations for quantized weights

    def linear(self, weight: Weight, bias: torch.Tensor | None = None) -> LinearOp:
        return qlinear.linear(weight, bias, self.quantize_activations)

    def embedding(self, table: Weight) -> EmbeddingOp:
        return qlinear.embedding(table)
