"""`silu_and_mul`: the gated MLP activation of Llama-style models on a fused gate/up projection.

Contract: `x` (T, 2f) holding `[gate | up]` per row -> `(T, f)`, `silu(gate) * up`, computed in float32
and cast back once. Grid: (rows, column tiles of BLOCK).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from troupe.kernels.cuda.checks import check, check_float, check_rows

BLOCK = 1024


@triton.jit
def silu_and_mul_kernel(
    x,  # (T, 2f)
    out,  # (T, f)
    stride_x,
    stride_o,
    F: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = c < F
    gate = tl.load(x + row * stride_x + c, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x + row * stride_x + F + c, mask=mask, other=0.0).to(tl.float32)
    y = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(out + row * stride_o + c, y.to(out.dtype.element_ty), mask=mask)


def silu_and_mul_meta(f: int) -> dict[str, int]:
    """Constexprs and launch options of `silu_and_mul_kernel` (shared with the AOT check)."""
    block = min(BLOCK, triton.next_power_of_2(f))
    return dict(F=f, BLOCK=block, num_warps=4 if block >= 512 else 1)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """`x` (T, 2f) -> a new (T, f) tensor."""
    check_rows("x", x, 2)
    check_float("x", x)
    T, two_f = x.shape
    check(two_f % 2 == 0, f"x: last dimension must be even (gate | up), got {two_f}")
    f = two_f // 2
    out = x.new_empty((T, f))
    if T == 0 or f == 0:
        return out
    meta = silu_and_mul_meta(f)
    silu_and_mul_kernel[(T, triton.cdiv(f, meta["BLOCK"]))](x, out, x.stride(0), out.stride(0), **meta)
    return out


def silu_and_mul_reference(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.float().chunk(2, dim=-1)
    return (torch.nn.functional.silu(gate) * up).to(x.dtype)
