"""Triton kernels for the CUDA path, one op per module, each with its launcher and a torch reference.

- `cache_write`: `reshape_and_cache` (the KV write) and `kv_cache_shape` (the pool layout);
- `rotary`: `rotary_embedding` (in place, neox or GPT-J pairs);
- `norm`: `rms_norm`, `fused_add_rms_norm`;
- `activation`: `silu_and_mul`;
- `attention`: `paged_attention` over `attention_prefill` (tiled, causal, chunks after cached context)
  and `attention_decode` (GQA-grouped split-K with a reduce kernel);
- `moe`: `fused_moe` (expert-sorted block-aligned pairs, grouped GEMMs for gate/up + SiLU and down);

Launchers check metadata only (no host sync) and run on CUDA tensors, or on CPU tensors under
`TRITON_INTERPRET=1` (how CI checks them; it must be set before this package is imported).
Sampling on CUDA logits is troupe's one batched torch sampler (`troupe.core.sampler`), which runs on
any device. See docs/kernels.md, "Triton kernels (CUDA)".
"""

from __future__ import annotations

from troupe.kernels.cuda.activation import silu_and_mul
from troupe.kernels.cuda.attention import decode_splits, paged_attention
from troupe.kernels.cuda.cache_write import kv_cache_shape, reshape_and_cache
from troupe.kernels.cuda.checks import KernelArgumentError
from troupe.kernels.cuda.norm import fused_add_rms_norm, rms_norm
from troupe.kernels.cuda.rotary import cos_sin_table, rotary_embedding

__all__ = [
    "KernelArgumentError",
    "cos_sin_table",
    "decode_splits",
    "fused_add_rms_norm",
    "kv_cache_shape",
    "paged_attention",
    "reshape_and_cache",
    "rms_norm",
    "rotary_embedding",
    "silu_and_mul",
]
