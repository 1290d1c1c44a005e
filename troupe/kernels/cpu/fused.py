"""Fused per-layer elementwise ops of the `cpu` kernel set (`csrc/fused.cpp`), one compiled call each.

Contracts: `troupe.kernels.base.KernelSet` (`rms_norm`, `add_rms_norm`, `silu_and_mul`, `rope_and_cache`),
references in `troupe.kernels.reference`. Float32 math on float32 or bfloat16 activations.

- `add_rms_norm` works in place: the residual becomes `residual + x` and x becomes its RMSNorm (the
  contract allows either input to be overwritten), so the residual stream allocates nothing.
- `rope_and_cache` rotates q and k in place (HF rotate-half, from the model's `(max_pos, D)` float32
  cos | sin table) and writes the rotated k and v of each token to its pool slot (`-1`: skipped) in the
  set's layout (K `(num_blocks, KVH, D, block_size)`, V `(num_blocks, KVH, block_size, D)`) and the pool's
  dtype (float16 saturates at +-65504).
"""

from __future__ import annotations

import torch

from troupe.kernels.base import LayerKV


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """(T, h) -> a new (T, h): `x / rms(x) * weight`."""
    return torch.ops.troupe_fused.rms_norm(x, weight, eps)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """(normed, summed), written into (x, residual)."""
    torch.ops.troupe_fused.add_rms_norm_(x, residual, weight, eps)
    return x, residual


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """(T, 2f) -> a new (T, f): `silu(x[:, :f]) * x[:, f:]`."""
    return torch.ops.troupe_fused.silu_and_mul(x)


def rope_and_cache(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   rope_cache: torch.Tensor, kv: LayerKV, slot_mapping: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q (T, H, D) and k (T, KVH, D) in place, write k and v at `slot_mapping`; returns (q, k)."""
    torch.ops.troupe_fused.rope_and_cache(positions, q, k, v, rope_cache, kv[0], kv[1], slot_mapping)
    return q, k
