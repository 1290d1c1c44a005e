"""The KV-cache write (`reshape_and_cache`) and the pool layout the CUDA kernels read.

Layout of one layer's pool, `kv_cache_shape(num_blocks, block_size, num_kv_heads, head_dim)`:
`(num_blocks, num_kv_heads, block_size, head_dim)`. One kv head's part of a block is one contiguous
`block_size * head_dim` run (2 KiB for 16 x 64 in bf16), so an attention tile of consecutive positions
in a block is one contiguous load; the CPU path's `(num_blocks, block_size, num_kv_heads, head_dim)`
interleaves the heads instead. A block is still the unit on dimension 0 (prefix caching and copies
move whole `pool[block]`s).

Contract of `reshape_and_cache(key, value, k_cache, v_cache, slot_mapping)`: token i's K/V
`(num_kv_heads, head_dim)` go to flat slot `slot_mapping[i] = block * block_size + offset`, i.e.
`k_cache[block, :, offset, :]`; slot -1 skips the token (padding rows of a CUDA-graph batch).
Grid: one program per token, moving its whole `(KVH, D)` tile for both K and V.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from troupe.kernels.cuda.checks import check, check_float, check_index, check_rows, check_same_device


def kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int) -> tuple[int, ...]:
    """Shape of one layer's K (or V) pool for these kernels."""
    return (num_blocks, num_kv_heads, block_size, head_dim)


@triton.jit
def reshape_and_cache_kernel(
    key,  # (T, KVH, D)
    value,  # (T, KVH, D)
    k_cache,  # (NB, KVH, BS, D)
    v_cache,  # (NB, KVH, BS, D)
    slot_mapping,  # (T,)
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cb,
    stride_ch,
    stride_ct,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    KVH_PAD: tl.constexpr,
    D_PAD: tl.constexpr,
):
    i = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping + i).to(tl.int64)
    if slot < 0:  # a padding token
        return
    h = tl.arange(0, KVH_PAD)
    d = tl.arange(0, D_PAD)
    mask = (h[:, None] < NUM_KV_HEADS) & (d[None, :] < HEAD_DIM)
    dst = (slot // BLOCK_SIZE) * stride_cb + h[:, None] * stride_ch + (slot % BLOCK_SIZE) * stride_ct + d[None, :]
    k = tl.load(key + i * stride_kt + h[:, None] * stride_kh + d[None, :], mask=mask)  # (KVH_PAD, D_PAD)
    v = tl.load(value + i * stride_vt + h[:, None] * stride_vh + d[None, :], mask=mask)
    tl.store(k_cache + dst, k, mask=mask)
    tl.store(v_cache + dst, v, mask=mask)


def reshape_and_cache_meta(num_kv_heads: int, head_dim: int, block_size: int) -> dict[str, int]:
    """Constexprs and launch options of `reshape_and_cache_kernel` (shared with the AOT check)."""
    return dict(NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, BLOCK_SIZE=block_size,
                KVH_PAD=triton.next_power_of_2(num_kv_heads), D_PAD=triton.next_power_of_2(head_dim),
                num_warps=4 if num_kv_heads * head_dim >= 1024 else 1)


def reshape_and_cache(
    key: torch.Tensor,  # (T, KVH, D)
    value: torch.Tensor,  # (T, KVH, D)
    k_cache: torch.Tensor,  # (NB, KVH, BS, D)
    v_cache: torch.Tensor,  # (NB, KVH, BS, D)
    slot_mapping: torch.Tensor,  # (T,) int64 (or int32); -1 skips the token
) -> None:
    """Write each token's K/V into the pool at its slot (in place)."""
    check_rows("key", key, 3)
    check_rows("value", value, 3)
    check_rows("k_cache", k_cache, 4)
    check_rows("v_cache", v_cache, 4)
    check_float("key", key)
    check_index("slot_mapping", slot_mapping)
    check_same_device(key=key, value=value, k_cache=k_cache, v_cache=v_cache, slot_mapping=slot_mapping)
    T, KVH, D = key.shape
    NB, _, BS, _ = k_cache.shape
    check(value.shape == key.shape, f"value: shape must be {tuple(key.shape)} (key's), got {tuple(value.shape)}")
    check(k_cache.shape[1] == KVH and k_cache.shape[3] == D,
          f"k_cache: shape must be (num_blocks, {KVH}, block_size, {D}), i.e. (num_blocks, num_kv_heads, "
          f"block_size, head_dim), got {tuple(k_cache.shape)}")
    check(v_cache.shape == k_cache.shape and v_cache.stride() == k_cache.stride(),
          f"v_cache: shape and strides must match k_cache's {tuple(k_cache.shape)} / {k_cache.stride()}")
    check(k_cache.dtype == v_cache.dtype == key.dtype == value.dtype,
          f"key, value, k_cache, v_cache: one dtype expected, got {key.dtype}, {value.dtype}, "
          f"{k_cache.dtype}, {v_cache.dtype}")
    check(slot_mapping.shape == (T,), f"slot_mapping: shape must be ({T},), got {tuple(slot_mapping.shape)}")
    if T == 0:
        return
    reshape_and_cache_kernel[(T,)](
        key, value, k_cache, v_cache, slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        **reshape_and_cache_meta(KVH, D, BS),
    )


def reshape_and_cache_reference(
    key: torch.Tensor,  # (T, KVH, D)
    value: torch.Tensor,  # (T, KVH, D)
    k_cache: torch.Tensor,  # (NB, KVH, BS, D)
    v_cache: torch.Tensor,  # (NB, KVH, BS, D)
    slot_mapping: torch.Tensor,  # (T,)
) -> None:
    """Same contract in plain torch, one token at a time."""
    BS = k_cache.shape[2]
    for i, slot in enumerate(slot_mapping.tolist()):
        if slot >= 0:
            k_cache[slot // BS, :, slot % BS] = key[i]
            v_cache[slot // BS, :, slot % BS] = value[i]
