"""`Linear`: y = x @ W.T + b with the weight pre-packed for oneDNN when that is faster (float32 on CPU).

Contract: `Linear(weight (N, K), bias (N,) | None)`; calling it on x (M, K) returns (M, N) in x's dtype,
the same as `F.linear(x, weight, bias)` up to float32 summation order (about 1e-6 relative). `pack()`
replaces the dense weight by a oneDNN blocked copy (`torch.ops.mkldnn._reorder_linear_weight`, the
same packing PyTorch's own CPU compiler uses) and drops the dense one, so memory stays one copy; after
that the weight can no longer be read as a tensor. A weight that cannot be packed (bfloat16 on a CPU
without avx512 / avx_ne_convert, a build without oneDNN) stays dense and keeps `F.linear`.

Why: at decode batch sizes (a few to a few dozen rows) MKL's sgemm behind `F.linear` runs the wide
matrices (the LM head, gate/up) well below the machine's peak, and oneDNN's packed kernel runs them
much faster; at prefill sizes the two are level (`python -m troupe.bench.kernels` compares them).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F


@functools.cache
def packing_supported(dtype: torch.dtype) -> bool:
    """Whether oneDNN can pack a `dtype` weight on this CPU and gives `F.linear`'s answer with it."""
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        g = torch.Generator().manual_seed(0)
        w = torch.randn(24, 16, generator=g).to(dtype)  # (N, K)
        x = torch.randn(5, 16, generator=g).to(dtype)  # (M, K)
        b = torch.randn(24, generator=g).to(dtype)
        packed = torch.ops.mkldnn._reorder_linear_weight(w)
        y = torch.ops.mkldnn._linear_pointwise(x, packed, b, "none", [], "")  # (M, N)
    except (RuntimeError, AttributeError):
        return False
    return bool(torch.allclose(y.float(), F.linear(x, w, b).float(), rtol=1e-2, atol=1e-2))


class Linear:
    """One projection; see the module docstring. Not an `nn.Module`: the owning module keeps the
    `nn.Parameter`s that weight loading fills, and packs them once loaded."""

    __slots__ = ("weight", "bias", "packed")

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        self.weight = weight  # (N, K), dense until `pack()`
        self.bias = bias  # (N,) or None
        self.packed: torch.Tensor | None = None  # oneDNN's blocked copy of the weight

    def pack(self) -> bool:
        """Pack the weight if this dtype and CPU support it; returns whether it did. The dense
        weight's storage is released (the `nn.Parameter` object stays, empty)."""
        if self.packed is not None or self.weight.device.type != "cpu" or not packing_supported(self.weight.dtype):
            return self.packed is not None
        self.packed = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach())
        self.weight.data = self.weight.data.new_empty(0)
        return True

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # (M, K) -> (M, N)
        if self.packed is None:
            return F.linear(x, self.weight, self.bias)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
