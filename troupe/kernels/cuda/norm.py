"""RMSNorm, alone and fused with the residual add, over the rows of a flattened batch.

Contracts (x, residual: (T, h); weight: (h,); one dtype):
- `rms_norm(x, weight, eps) -> out`: `out = x / sqrt(mean(x^2) + eps) * weight`;
- `fused_add_rms_norm(x, residual, weight, eps)`, in place: `residual += x`, then
  `x = rms_norm(residual) * weight` (vLLM's semantics). The sum is rounded to the dtype first, so the
  norm reads exactly the residual that is stored, as the unfused `x = x + h; rms_norm(x)` would.
Both compute in float32 and cast back once, like HF's LlamaRMSNorm and `F.rms_norm` on upcast values.
Grid: one program per row, the whole row in one tile (h <= 16384).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from troupe.kernels.cuda.checks import check, check_float, check_rows, check_same_device

MAX_HIDDEN = 16384


@triton.jit
def rms_norm_kernel(
    x,  # (T, h)
    residual,  # (T, h), only read and written when FUSED_ADD
    weight,  # (h,)
    out,  # (T, h)
    stride_x,
    stride_r,
    stride_o,
    eps,
    HIDDEN: tl.constexpr,
    BLOCK: tl.constexpr,
    FUSED_ADD: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, BLOCK)
    mask = c < HIDDEN
    v = tl.load(x + row * stride_x + c, mask=mask, other=0.0).to(tl.float32)  # (BLOCK,)
    if FUSED_ADD:
        r = tl.load(residual + row * stride_r + c, mask=mask, other=0.0).to(tl.float32)
        s = (v + r).to(residual.dtype.element_ty)
        tl.store(residual + row * stride_r + c, s, mask=mask)
        v = s.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(v * v, axis=0) / HIDDEN + eps)
    w = tl.load(weight + c, mask=mask, other=0.0).to(tl.float32)
    tl.store(out + row * stride_o + c, (v * rstd * w).to(out.dtype.element_ty), mask=mask)


def _check(x: torch.Tensor, weight: torch.Tensor) -> None:
    check_rows("x", x, 2)
    check_float("x", x)
    check(weight.shape == (x.shape[1],), f"weight: shape must be ({x.shape[1]},), got {tuple(weight.shape)}")
    check(weight.dtype == x.dtype, f"weight: dtype must be x's {x.dtype}, got {weight.dtype}")
    check(weight.is_contiguous(), "weight: must be contiguous")
    check(0 < x.shape[1] <= MAX_HIDDEN, f"x: hidden size must be in [1, {MAX_HIDDEN}], got {x.shape[1]}")


def rms_norm_meta(hidden: int, fused_add: bool) -> dict[str, int]:
    """Constexprs and launch options of `rms_norm_kernel` (shared with the AOT check)."""
    block = triton.next_power_of_2(hidden)
    return dict(HIDDEN=hidden, BLOCK=block, FUSED_ADD=fused_add, num_warps=min(16, max(1, block // 256)))


def _launch(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, out: torch.Tensor,
            eps: float) -> None:
    T, h = x.shape
    if T == 0:
        return
    rms_norm_kernel[(T,)](
        x, x if residual is None else residual, weight, out,
        x.stride(0), 0 if residual is None else residual.stride(0), out.stride(0), eps,
        **rms_norm_meta(h, residual is not None),
    )


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`x` (T, h) -> a new (T, h) tensor, each row normalised and scaled by `weight`."""
    _check(x, weight)
    check_same_device(x=x, weight=weight)
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    _launch(x, None, weight, out, eps)
    return out


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> None:
    """In place: `residual += x`, then `x = rms_norm(residual) * weight`."""
    _check(x, weight)
    check_rows("residual", residual, 2)
    check(residual.shape == x.shape, f"residual: shape must be {tuple(x.shape)}, got {tuple(residual.shape)}")
    check(residual.dtype == x.dtype, f"residual: dtype must be x's {x.dtype}, got {residual.dtype}")
    check_same_device(x=x, residual=residual, weight=weight)
    _launch(x, residual, weight, x, eps)


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return torch.nn.functional.rms_norm(x.float(), (x.shape[-1],), weight.float(), eps).to(x.dtype)


def fused_add_rms_norm_reference(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> None:
    residual.add_(x)
    x.copy_(rms_norm_reference(residual, weight, eps))
