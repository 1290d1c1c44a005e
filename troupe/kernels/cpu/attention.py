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
    def build(cls, q: torch.Tensor, k_pool: torch.Tensor, meta: AttentionMetadata) -> AttnPlan:
        T, H, D = q.shape
        KVH = k_pool.shape[1]  # K (NB, KVH, D, BS)
        items, merges, threads = torch.ops.troupe_attention.plan(
            meta.query_start_loc, meta.seq_lens, H, KVH, torch.get_num_threads(), MIN_SPLIT, MIN_PARALLEL)
        slots = int(merges[-1, 2] + merges[-1, 3]) if merges.shape[0] else 0
        padded = -(-D // 16) * 16  # the kernels' padded row (a multiple of the vector width) fits in this
        scratch = torch.empty(slots * (H // KVH) * (padded + 2), dtype=torch.float32)
        return cls(items, merges, threads, scratch, torch.empty_like(q, memory_format=torch.contiguous_format))


@dataclass(slots=True)
class CpuMetadata(AttentionMetadata):
    """The step's metadata plus the attention plan its first layer builds."""

    plan: AttnPlan | None = field(default=None, repr=False)

    @classmethod
    def of(cls, m: AttentionMetadata) -> CpuMetadata:
        return cls(m.slot_mapping, m.query_start_loc, m.seq_lens, m.block_tables, m.max_query_len, m.max_seq_len)


def step_plan(meta: CpuMetadata, q: torch.Tensor, k_pool: torch.Tensor) -> AttnPlan:
    """The step's attention plan, built by the first call for queries shaped as `q` (T, H, D) and kept."""
    if meta.plan is None:
        meta.plan = AttnPlan.build(q, k_pool, meta)
    return meta.plan


def paged_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, meta: CpuMetadata,
                    scale: float) -> torch.Tensor:
    """Causal attention of the step's new tokens q (T, H, D) over the pool (which already holds them);
    returns (T, H, D) in q's dtype, the step's buffer (see the module docstring)."""
    plan = step_plan(meta, q, k_pool)
    torch.ops.troupe_attention.paged_attention(
        q, k_pool, v_pool, meta.block_tables, meta.seq_lens, meta.query_start_loc, plan.items, plan.merges,
        plan.scratch, plan.out, scale, plan.threads)
    return plan.out
