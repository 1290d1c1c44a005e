"""Paged attention of the `cpu` kernel set: one compiled call per layer for the whole mixed batch.

Contract: `troupe.kernels.base.KernelSet.attention`, semantics of `troupe.kernels.reference.paged_attention`.
The pool is read in place (no gather, no row cache) in the set's layout: K `(num_blocks, KVH, D, block_size)`
(each block's keys transposed), V `(num_blocks, KVH, block_size, D)`, in float32, float16 or bfloat16; q and
the output are (T, H, D) in the model's dtype.

Per step (`AttnPlan`, built by the first layer's call and kept on the step's `CpuMetadata`): the compiled
`plan` lists the work items (one per decoding sequence and kv head, one per prefill chunk, kv head and
tile of query tokens), splits decodes over their context when the step is too small to occupy the threads
(split-K, `MIN_SPLIT` keys a piece at least), and sorts them by cost; the output buffer and the split-K
scratch are allocated once for the step. Every layer then makes one call (`csrc/attention*.cpp` has the
kernel design). The returned tensor is that per-step buffer: the next layer's call overwrites it, so a
caller that keeps a layer's attention output must copy it.

Sliding window and soft-capping (`troupe.kernels.base`, "Attention features") are computed natively by
the same kernels: a window changes the work (a decode item covers only its window, a prefill item skips
the KV tiles before its first token's window), so the step keeps one plan per window (`CpuMetadata.plans`,
each with its own output buffer); a cap is an argument of the layer's call (the scores are capped in
registers, `csrc/vec_attn.h` `vsoftcap`, a rational tanh within 3.5e-7 of tanh).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from troupe.kernels.base import AttentionMetadata

# Parallel split (docs/kernels.md, "Split-K", has the measured rates): below MIN_PARALLEL query x key pairs
# per layer the work is worth less than opening a parallel region, so the step stays on the calling
# thread; split-K pieces cover at least MIN_SPLIT context positions.
MIN_SPLIT = 128
MIN_PARALLEL = 4096


@dataclass(slots=True)
class AttnPlan:
    """One step's attention work, shared by every layer (see the module docstring)."""

    items: torch.Tensor  # (n, 6) int64 work items
    merges: torch.Tensor  # (m, 4) int64 split-K merges
    threads: int
    scratch: torch.Tensor  # float32 split-K partial results
    out: torch.Tensor  # (T, H, D) the output buffer

    @classmethod
    def build(cls, q: torch.Tensor, k_pool: torch.Tensor, meta: AttentionMetadata, window: int = 0) -> AttnPlan:
        """The plan for queries shaped as `q` (T, H, D), with a sliding window of `window` positions (0: none)."""
        T, H, D = q.shape
        KVH = k_pool.shape[1]  # K (NB, KVH, D, BS)
        items, merges, threads = torch.ops.troupe_attention.plan(
            meta.query_start_loc, meta.seq_lens, H, KVH, torch.get_num_threads(), MIN_SPLIT, MIN_PARALLEL, window)
        slots = int(merges[-1, 2] + merges[-1, 3]) if merges.shape[0] else 0
        padded = -(-D // 16) * 16  # the kernels' padded row (a multiple of the vector width) fits in this
        scratch = torch.empty(slots * (H // KVH) * (padded + 2), dtype=torch.float32)
        return cls(items, merges, threads, scratch, torch.empty_like(q, memory_format=torch.contiguous_format))


@dataclass(slots=True)
class CpuMetadata(AttentionMetadata):
    """The step's metadata plus the attention plan its first layer builds."""

    plan: AttnPlan | None = field(default=None, repr=False)
    plans: dict[int, AttnPlan] = field(default_factory=dict, repr=False)  # the same per sliding window

    @classmethod
    def of(cls, m: AttentionMetadata) -> CpuMetadata:
        return cls(m.slot_mapping, m.query_start_loc, m.seq_lens, m.block_tables, m.max_query_len, m.max_seq_len)


def step_plan(meta: CpuMetadata, q: torch.Tensor, k_pool: torch.Tensor, window: int | None = None) -> AttnPlan:
    """The step's attention plan for `window` (None: none), built by the first call for queries shaped as
    `q` (T, H, D) and kept."""
    if window is not None:
        if window not in meta.plans:
            meta.plans[window] = AttnPlan.build(q, k_pool, meta, window)
        return meta.plans[window]
    if meta.plan is None:
        meta.plan = AttnPlan.build(q, k_pool, meta)
    return meta.plan


def paged_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, meta: CpuMetadata,
                    scale: float, *, sliding_window: int | None = None, softcap: float | None = None) -> torch.Tensor:
    """Causal attention of the step's new tokens q (T, H, D) over the pool (which already holds them);
    returns (T, H, D) in q's dtype, the step's buffer (see the module docstring). `sliding_window`,
    `softcap`: see `troupe.kernels.reference.paged_attention`."""
    plan = step_plan(meta, q, k_pool, sliding_window)
    torch.ops.troupe_attention.paged_attention(
        q, k_pool, v_pool, meta.block_tables, meta.seq_lens, meta.query_start_loc, plan.items, plan.merges,
        plan.scratch, plan.out, scale, plan.threads, sliding_window or 0, softcap or 0.0)
    return plan.out
