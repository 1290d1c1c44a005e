"""Fused mixture-of-experts: a layer's routed experts as two grouped GEMMs over expert-sorted tokens.

Contract (`troupe.kernels.moe`): `fused_moe(x (T, h), ids (T, k) int64, weights (T, k) float32, w13, w2)
-> (T, h)` with `out[t] = sum_j weights[t, j] * w2[e] (silu(gate_e x[t]) * up_e x[t])`, `e = ids[t, j]`,
`w13` (E, 2f, h) holding each expert's `[gate | up]` rows and `w2` (E, h, f), both in x's dtype.

Steps (vLLM's `fused_moe`):

1. `moe_align_block_size` (torch, on the device, no host sync): the T*k (token, slot) pairs, numbered
   `t * k + j`, are sorted by expert (stable: token order within one) and each expert's group is padded
   to a multiple of BLOCK_M with the pad id `T * k`; `expert_ids[b]` is the expert of block b and
   `num_padded` (1,) the used length. The buffers have a fixed capacity from the shapes
   (`T*k + min(E, T*k) * (BLOCK_M - 1)` rounded up to BLOCK_M), so the grid needs no host data
   and the blocks past `num_padded` return at once. An expert without a token owns no block.
2. `fused_moe_kernel` with GATED: each program takes one block of BLOCK_M pairs (all one expert) and
   BLOCK_N columns of f; it gathers the pairs' token rows of x, multiplies them by the expert's gate
   rows and up rows (two float32 accumulators over K = h in BLOCK_K steps) and stores
   `silu(gate) * up` into `inter` (T*k, f) in x's dtype, row = pair id: the gate/up activation is
   fused, no (T*k, 2f) intermediate.
3. `fused_moe_kernel` with MUL_WEIGHT: the same grouped GEMM of `inter` rows by `w2[e]` (K = f),
   scaled by the pair's routing weight, into a float32 (T*k, h) buffer.
4. The sum over the k slots, `view(T, k, h).sum(1)` in float32, cast to x's dtype once.

Pad rows (pair id `T * k`) are masked on load and store. `tl.dot` runs in float32 (IEEE) for float32
inputs and under the CPU interpreter (`checks.dot_in_float32`), else bf16/fp16 on the tensor cores
with float32 accumulation. Tiles (`fused_moe_meta`): BLOCK_M 16 when experts see few pairs each (decode),
32 or 64 as the average group grows; BLOCK_N 64, BLOCK_K 32-64.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import triton
import triton.language as tl

from troupe.kernels.cuda.checks import check, check_float, check_rows, check_same_device, dot_in_float32


@triton.jit
def fused_moe_kernel(
    a,  # (rows, K): x (rows = T, pair p reads row p // TOP_K) or inter (rows = T * k, TOP_K = 1)
    b,  # (E, N or 2N, K): w13 (GATED: gate rows 0..N-1, up rows N..2N-1) or w2
    c,  # (T * k, N): row = pair id
    topk_weights,  # (T * k,) float32, read with MUL_WEIGHT
    sorted_token_ids,  # (capacity,) int32: pair ids grouped by expert, pad id = num_pairs
    expert_ids,  # (capacity // BLOCK_M,) int32
    num_padded,  # (1,) int32: the used length of sorted_token_ids
    N,
    K,
    num_pairs,
    stride_am,
    stride_be,
    stride_bn,
    stride_cm,
    TOP_K: tl.constexpr,
    GATED: tl.constexpr,
    MUL_WEIGHT: tl.constexpr,
    F32: tl.constexpr,  # dots in float32 (float32 inputs, or the CPU interpreter)
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    if pid_m * BLOCK_M >= tl.load(num_padded):
        return  # a spare block past the padded groups
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pairs = tl.load(sorted_token_ids + offs_m).to(tl.int64)  # (BLOCK_M,)
    row_ok = pairs < num_pairs
    expert = tl.load(expert_ids + pid_m).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    a_rows = a + (pairs // TOP_K)[:, None] * stride_am  # (BLOCK_M, 1)
    b_cols = b + expert * stride_be + offs_n[None, :].to(tl.int64) * stride_bn  # (1, BLOCK_N)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, tl.cdiv(K, BLOCK_K)):
        kk = k0 * BLOCK_K + offs_k
        k_ok = kk < K
        at = tl.load(a_rows + kk[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)  # (BM, BK)
        b_mask = k_ok[:, None] & col_ok[None, :]
        bt = tl.load(b_cols + kk[:, None], mask=b_mask, other=0.0)  # (BK, BN)
        if F32:
            acc += tl.dot(at.to(tl.float32), bt.to(tl.float32), input_precision="ieee")
        else:
            acc += tl.dot(at, bt)
        if GATED:
            ut = tl.load(b_cols + N * stride_bn + kk[:, None], mask=b_mask, other=0.0)  # (BK, BN)
            if F32:
                acc_up += tl.dot(at.to(tl.float32), ut.to(tl.float32), input_precision="ieee")
            else:
                acc_up += tl.dot(at, ut)
    if GATED:
        acc = acc / (1.0 + tl.exp(-acc)) * acc_up  # silu(gate) * up
    if MUL_WEIGHT:
        acc = acc * tl.load(topk_weights + pairs, mask=row_ok, other=0.0)[:, None]
    c_ptrs = c + pairs[:, None] * stride_cm + offs_n[None, :]
    tl.store(c_ptrs, acc.to(c.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


def fused_moe_meta(num_pairs: int, num_experts: int, K: int, f32: bool, *, top_k: int, gated: bool,
                   mul_weight: bool) -> dict[str, int | bool]:
    """Constexprs and launch options of `fused_moe_kernel` (shared with the AOT check): BLOCK_M from the
    average pairs per expert (16 for decode-sized steps), BLOCK_N 64, BLOCK_K 64 (32 for float32 dots,
    which run on the FMA units)."""
    per_expert = num_pairs / max(num_experts, 1)
    block_m = 16 if per_expert <= 16 else 32 if per_expert <= 48 or f32 else 64
    block_k = 32 if f32 else min(64, max(16, triton.next_power_of_2(K)))
    return dict(TOP_K=top_k, GATED=gated, MUL_WEIGHT=mul_weight, F32=f32, BLOCK_M=block_m, BLOCK_N=64,
                BLOCK_K=block_k, num_warps=4, num_stages=2 if block_m < 64 else 3)


def moe_align_block_size(ids: torch.Tensor, num_experts: int,
                         block_m: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`ids` (T, k) -> (sorted_token_ids (capacity,) int32, expert_ids (capacity // block_m,) int32,
    num_padded (1,) int32): see step 1 of the module docstring. Torch ops only, no host sync."""
    flat = ids.reshape(-1)  # (n,) pair p = t * k + j
    n, dev = flat.numel(), flat.device
    counts = torch.zeros(num_experts, dtype=torch.int64, device=dev).scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m  # (E,)
    ends = padded.cumsum(0)  # (E,) end of each expert's padded group
    order = torch.argsort(flat, stable=True)  # (n,) pairs by expert, token order within one
    expert_of = flat[order]  # (n,)
    rank = torch.arange(n, device=dev) - (counts.cumsum(0) - counts)[expert_of]  # place within its group
    capacity = -(-(n + min(num_experts, n) * (block_m - 1)) // block_m) * block_m
    sorted_ids = torch.full((capacity,), n, dtype=torch.int32, device=dev)
    sorted_ids[(ends - padded)[expert_of] + rank] = order.to(torch.int32)
    block_starts = torch.arange(0, capacity, block_m, device=dev)
    expert_ids = torch.searchsorted(ends, block_starts, right=True).clamp_(max=num_experts - 1).to(torch.int32)
    return sorted_ids, expert_ids, ends[-1:].to(torch.int32)


def _launch(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, weights: torch.Tensor, sorted_ids: torch.Tensor,
            expert_ids: torch.Tensor, num_padded: torch.Tensor, N: int, meta: dict[str, int | bool]) -> None:
    grid = (sorted_ids.numel() // int(meta["BLOCK_M"]), triton.cdiv(N, int(meta["BLOCK_N"])))
    fused_moe_kernel[grid](a, b, c, weights, sorted_ids, expert_ids, num_padded, N, a.shape[1], c.shape[0],
                           a.stride(0), b.stride(0), b.stride(1), c.stride(0), **meta)


def fused_moe(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w13: torch.Tensor,
              w2: torch.Tensor) -> torch.Tensor:
    """`x` (T, h), `ids` (T, k) int32/int64 in [0, E), `weights` (T, k) float32, `w13` (E, 2f, h), `w2`
    (E, h, f) -> a new (T, h) tensor in x's dtype. Expert ids out of range are the caller's contract."""
    check_rows("x", x, 2)
    check_float("x", x)
    check(ids.dtype in (torch.int32, torch.int64), f"ids: dtype must be int32 or int64, got {ids.dtype}")
    check(ids.dim() == 2 and ids.shape[0] == x.shape[0],
          f"ids: shape must be (T={x.shape[0]}, k), got {tuple(ids.shape)}")
    check(weights.dtype == torch.float32 and weights.shape == ids.shape,
          f"weights: must be float32 of shape {tuple(ids.shape)}, got {weights.dtype} {tuple(weights.shape)}")
    T, h = x.shape
    check(w13.dim() == 3 and w13.shape[2] == h and w13.shape[1] % 2 == 0,
          f"w13: shape must be (E, 2f, h={h}), got {tuple(w13.shape)}")
    E, f = w13.shape[0], w13.shape[1] // 2
    check(tuple(w2.shape) == (E, h, f), f"w2: shape must be (E={E}, h={h}, f={f}), got {tuple(w2.shape)}")
    for name, w in (("w13", w13), ("w2", w2)):
        check(w.dtype == x.dtype, f"{name}: dtype must be x's {x.dtype}, got {w.dtype}")
        check(w.stride(2) == 1, f"{name}: the last dimension must be contiguous, got strides {w.stride()}")
    check_same_device(x=x, ids=ids, weights=weights, w13=w13, w2=w2)
    k = ids.shape[1]
    n = T * k
    if n == 0 or h == 0:
        return x.new_zeros((T, h))
    f32 = dot_in_float32(x)
    up_meta = fused_moe_meta(n, E, h, f32, top_k=k, gated=True, mul_weight=False)
    down_meta = fused_moe_meta(n, E, f, f32, top_k=1, gated=False, mul_weight=True)
    sorted_ids, expert_ids, num_padded = moe_align_block_size(ids, E, int(up_meta["BLOCK_M"]))
    flat_w = weights.reshape(-1).contiguous()  # (n,)
    inter = x.new_empty((n, f))  # silu(gate) * up per pair
    _launch(x, w13, inter, flat_w, sorted_ids, expert_ids, num_padded, f, up_meta)
    out = torch.empty((n, h), dtype=torch.float32, device=x.device)  # weighted expert output per pair
    _launch(inter, w2, out, flat_w, sorted_ids, expert_ids, num_padded, h, down_meta)
    return out.view(T, k, h).sum(1).to(x.dtype)


def stack_experts(weights: Iterable[torch.Tensor], num_experts: int, device: torch.device,
                  dtype: torch.dtype | None) -> torch.Tensor:
    """Per-expert (rows, cols) float tensors -> one contiguous (E, rows, cols) tensor on `device` in `dtype`
    (None: expert 0's), what `fused_moe` takes; each expert is copied in as it comes (one expert extra
    in memory at a time)."""
    out: torch.Tensor | None = None
    count = 0
    for e, w in enumerate(weights):
        if out is None:
            check(num_experts > 0, "experts: at least one expert is needed")
            out = torch.empty((num_experts, *w.shape), dtype=dtype or w.dtype, device=device)
        check(e < num_experts, f"experts: more than the {num_experts} expected")
        check(w.shape == out.shape[1:],
              f"experts[{e}]: shape must be {tuple(out.shape[1:])} like expert 0, got {tuple(w.shape)}")
        out[e].copy_(w)
        count += 1
    check(out is not None and count == num_experts, f"experts: expected {num_experts}, got {count}")
    assert out is not None
    return out


def fused_moe_reference(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w13: torch.Tensor,
                        w2: torch.Tensor) -> torch.Tensor:
    """Plain torch, per (token, slot), float32."""
    f = w2.shape[2]
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            gu = w13[e].float() @ x[t].float()  # (2f,)
            out[t] += float(weights[t, j]) * (w2[e].float() @ (torch.nn.functional.silu(gu[:f]) * gu[f:]))
    return out.to(x.dtype)
