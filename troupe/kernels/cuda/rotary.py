"""Rotary position embedding applied in place to the query and key of a flattened batch.

Contract of `rotary_embedding(positions, query, key, cos_sin_cache, is_neox=True)`:
- `positions` (T,) int; `query` (T, H, D), `key` (T, KVH, D), rotated in place (strided row views of a
  fused qkv projection are fine: only the last dimension must be contiguous);
- `cos_sin_cache` (max_pos, R) float32, R <= D even: row p is `[cos(p * f_0..f_{R/2-1}), sin(...)]`;
  the first R dims of each head rotate, the rest pass through;
- `is_neox=True`: HF rotate-half pairs (j, j + R/2), what `troupe.models.llama.apply_rope` does;
  `is_neox=False`: GPT-J interleaved pairs (2j, 2j + 1).
Pair (x1, x2) becomes (x1 cos - x2 sin, x2 cos + x1 sin), computed in float32 and cast back once.
Grid: one program per token, rotating all its query and key heads as (heads, R/2) tiles.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from troupe.kernels.cuda.checks import check, check_float, check_index, check_rows, check_same_device


@triton.jit
def _rotate(x, row, cos, sin, stride_t, stride_h, j, j_ok,
            NUM_HEADS: tl.constexpr, HEADS_PAD: tl.constexpr, HALF: tl.constexpr, IS_NEOX: tl.constexpr):
    h = tl.arange(0, HEADS_PAD)
    mask = (h[:, None] < NUM_HEADS) & j_ok[None, :]
    base = x + row * stride_t + h[:, None] * stride_h
    if IS_NEOX:
        p1 = base + j[None, :]
        p2 = base + HALF + j[None, :]
    else:
        p1 = base + 2 * j[None, :]
        p2 = base + 2 * j[None, :] + 1
    x1 = tl.load(p1, mask=mask).to(tl.float32)  # (HEADS_PAD, HALF_PAD)
    x2 = tl.load(p2, mask=mask).to(tl.float32)
    tl.store(p1, (x1 * cos[None, :] - x2 * sin[None, :]).to(x.dtype.element_ty), mask=mask)
    tl.store(p2, (x2 * cos[None, :] + x1 * sin[None, :]).to(x.dtype.element_ty), mask=mask)


@triton.jit
def rotary_embedding_kernel(
    positions,  # (T,)
    query,  # (T, H, D)
    key,  # (T, KVH, D)
    cos_sin_cache,  # (max_pos, R) float32
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_cache,
    NUM_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    H_PAD: tl.constexpr,
    KVH_PAD: tl.constexpr,
    HALF: tl.constexpr,  # R / 2
    HALF_PAD: tl.constexpr,
    IS_NEOX: tl.constexpr,
):
    i = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions + i).to(tl.int64)
    j = tl.arange(0, HALF_PAD)
    j_ok = j < HALF
    cos = tl.load(cos_sin_cache + pos * stride_cache + j, mask=j_ok)  # (HALF_PAD,)
    sin = tl.load(cos_sin_cache + pos * stride_cache + HALF + j, mask=j_ok)
    _rotate(query, i, cos, sin, stride_qt, stride_qh, j, j_ok, NUM_HEADS, H_PAD, HALF, IS_NEOX)
    _rotate(key, i, cos, sin, stride_kt, stride_kh, j, j_ok, NUM_KV_HEADS, KVH_PAD, HALF, IS_NEOX)


def rotary_embedding_meta(num_heads: int, num_kv_heads: int, rotary_dim: int, is_neox: bool) -> dict[str, int]:
    """Constexprs and launch options of `rotary_embedding_kernel` (shared with the AOT check)."""
    return dict(NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, H_PAD=triton.next_power_of_2(num_heads),
                KVH_PAD=triton.next_power_of_2(num_kv_heads), HALF=rotary_dim // 2,
                HALF_PAD=triton.next_power_of_2(rotary_dim // 2), IS_NEOX=is_neox,
                num_warps=4 if num_heads * rotary_dim >= 2048 else 1)


def rotary_embedding(
    positions: torch.Tensor,  # (T,) int
    query: torch.Tensor,  # (T, H, D), rotated in place
    key: torch.Tensor,  # (T, KVH, D), rotated in place
    cos_sin_cache: torch.Tensor,  # (max_pos, R) float32
    is_neox: bool = True,
) -> None:
    """Rotate the first R dims of every query and key head by its token's position (in place)."""
    check_index("positions", positions)
    check_rows("query", query, 3)
    check_rows("key", key, 3)
    check_rows("cos_sin_cache", cos_sin_cache, 2)
    check_float("query", query)
    check_same_device(positions=positions, query=query, key=key, cos_sin_cache=cos_sin_cache)
    T, H, D = query.shape
    R = cos_sin_cache.shape[1]
    check(key.shape[0] == T and key.shape[2] == D,
          f"key: shape must be ({T}, num_kv_heads, {D}), got {tuple(key.shape)}")
    check(key.dtype == query.dtype, f"key: dtype must be query's {query.dtype}, got {key.dtype}")
    check(positions.shape == (T,), f"positions: shape must be ({T},), got {tuple(positions.shape)}")
    check(cos_sin_cache.dtype == torch.float32, f"cos_sin_cache: dtype must be float32, got {cos_sin_cache.dtype}")
    check(R % 2 == 0 and 0 < R <= D, f"cos_sin_cache: rotary dim {R} must be even and in (0, {D}]")
    if T == 0:
        return
    KVH = key.shape[1]
    rotary_embedding_kernel[(T,)](
        positions, query, key, cos_sin_cache,
        query.stride(0), query.stride(1), key.stride(0), key.stride(1), cos_sin_cache.stride(0),
        **rotary_embedding_meta(H, KVH, R, is_neox),
    )


def cos_sin_table(inv_freq: torch.Tensor, max_positions: int) -> torch.Tensor:
    """(max_positions, R) float32 `[cos | sin]` table from (R/2,) inverse frequencies (in float64)."""
    angles = torch.arange(max_positions, dtype=torch.float64)[:, None] * inv_freq.double()[None, :]  # (P, R/2)
    return torch.cat((angles.cos(), angles.sin()), dim=-1).float()


def rotary_embedding_reference(
    positions: torch.Tensor,  # (T,)
    query: torch.Tensor,  # (T, H, D)
    key: torch.Tensor,  # (T, KVH, D)
    cos_sin_cache: torch.Tensor,  # (max_pos, R)
    is_neox: bool = True,
) -> None:
    """Same contract in plain torch (float32 math, one cast back)."""
    R = cos_sin_cache.shape[1]
    cos, sin = cos_sin_cache[positions].chunk(2, dim=-1)  # (T, R/2) each
    cos, sin = cos[:, None, :], sin[:, None, :]
    for x in (query, key):
        rot = x[..., :R].float()  # (T, n, R)
        if is_neox:
            x1, x2 = rot.chunk(2, dim=-1)
            x[..., :R] = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)
        else:
            x1, x2 = rot[..., 0::2], rot[..., 1::2]
            x[..., :R] = torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2).to(x.dtype)
