"""The `eager` kernel set: the model's heavy ops in plain torch on the CPU.

Always available, so it is the fallback when no faster set can run here. Projections are oneDNN-packed
float32 weights where the CPU supports it (`linear.Linear`; quantized GGUF weights are expanded to float32
when they are bound); rotary uses a (cos, sin) gather built once
per step; attention gathers blocks from the pool, or reads the decodes' contiguous rows
(`rows.DecodeRowCache`), see `attention`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from troupe.errors import InvalidInputError
from troupe.kernels.base import (
    ATTENTION_FEATURES,
    KernelSet,
    KVSpec,
    LayerKV,
    LinearOp,
    ScheduledSeq,
    StepBatch,
    flatten_step,
)
from troupe.kernels.eager.attention import EagerMetadata, paged_attention
from troupe.kernels.eager.linear import Linear
from troupe.kernels.eager.rows import ROW_CACHE_MIN_BYTES, DecodeRowCache
from troupe.kernels.quant import Weight, dense


class EagerKernels(KernelSet):
    """See the module docstring. `decode_row_cache_bytes`: the row cache's budget (None: twice the pool's
    bytes, at least `ROW_CACHE_MIN_BYTES`; 0: no row cache, decodes gather from the pool).
    `kv_cache_dtype` (`EngineConfig.kv_cache_dtype`): the pool is in the model's dtype, so only "auto" or
    that dtype's name is accepted; anything else is refused when the pool is sized."""

    name = "eager"
    attention_features = ATTENTION_FEATURES

    def __init__(self, decode_row_cache_bytes: int | None = None, kv_cache_dtype: str = "auto") -> None:
        super().__init__("cpu")
        self.decode_row_cache_bytes = decode_row_cache_bytes
        self.kv_dtype_option = kv_cache_dtype
        self.rows: DecodeRowCache | None = None

    def kv_cache_dtype(self, model_dtype: torch.dtype) -> torch.dtype:
        if self.kv_dtype_option not in ("auto", str(model_dtype).removeprefix("torch.")):
            raise InvalidInputError("kv_cache_dtype", f"the eager kernel set keeps the KV pool in the model's dtype "
                                    f"({model_dtype}): must be 'auto' or that, got {self.kv_dtype_option!r} "
                                    "(kernels='cpu' takes float16 / bfloat16 / float32 pools)")
        return model_dtype

    def linear(self, weight: Weight, bias: torch.Tensor | None = None) -> LinearOp:
        lin = Linear(dense(weight), bias)  # a quantized weight is expanded to float32 once, here
        lin.pack()
        return lin

    def allocate_kv(self, spec: KVSpec) -> list[LayerKV]:
        pools = super().allocate_kv(spec)
        pool_bytes = spec.num_blocks * spec.block_size * self.kv_bytes_per_token(spec)
        budget = self.decode_row_cache_bytes
        if budget is None:
            budget = max(2 * pool_bytes, ROW_CACHE_MIN_BYTES)
        self.rows = DecodeRowCache(spec, budget, self.kv_cache_dtype(spec.dtype)) if budget > 0 else None
        return pools

    def prepare(self, seqs: Sequence[ScheduledSeq], block_size: int) -> StepBatch:
        batch = flatten_step(seqs, block_size)
        m = batch.meta
        meta = EagerMetadata(m.slot_mapping, m.query_start_loc, m.seq_lens, m.block_tables,
                             m.max_query_len, m.max_seq_len)
        if self.rows is not None:
            meta.rows = self.rows.plan(seqs, m.seq_lens.tolist(), m.block_tables, m.query_start_loc)
        batch.meta = meta
        return batch

    def rope_and_cache(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       rope_cache: torch.Tensor, kv: LayerKV, meta: EagerMetadata,  # type: ignore[override]
                       ) -> tuple[torch.Tensor, torch.Tensor]:
        if meta.rope is None or meta.rope[0] is not rope_cache:  # gathered once per step and table (a model
            half = q.shape[-1] // 2  # may have two: Gemma 3's sliding layers have their own)
            table = rope_cache[positions].to(q.dtype)  # (T, D)
            meta.rope = (rope_cache, table[:, None, :half], table[:, None, half:])  # (T, 1, D/2) each
        _, cos, sin = meta.rope
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        _, _, KVH, D = kv[0].shape
        kv[0].view(-1, KVH, D).index_copy_(0, meta.slot_mapping, k)
        kv[1].view(-1, KVH, D).index_copy_(0, meta.slot_mapping, v)
        return q, k

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv: LayerKV,
                  meta: EagerMetadata, scale: float, layer: int, *,  # type: ignore[override]
                  sliding_window: int | None = None, softcap: float | None = None) -> torch.Tensor:
        return paged_attention(q, k, v, kv[0], kv[1], meta, scale, layer, sliding_window=sliding_window,
                               softcap=softcap)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half rotary (HF layout): x (T, n, D), cos/sin (T, 1, D/2)."""
    x1, x2 = x.chunk(2, dim=-1)  # (T, n, D/2) each
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)  # (T, n, D)
