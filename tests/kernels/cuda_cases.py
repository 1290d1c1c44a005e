"""Test helpers for the CUDA kernels: tolerances per dtype and paged-attention batches."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from troupe.kernels.cuda.cache_write import kv_cache_shape

# (atol, rtol) against a float32 / float64 reference. bf16: the interpreter truncates float32 -> bf16
# casts instead of rounding (shared/reference/cpu-feasibility.md §1), i.e. up to 1 ulp = 2^-7 relative.
TOLERANCE = {torch.float32: (2e-5, 1e-5), torch.float16: (2e-3, 2e-3), torch.bfloat16: (2e-2, 2e-2)}


def assert_close(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """Assert within the dtype's tolerance; returns the max abs error (for the report)."""
    atol, rtol = TOLERANCE[expected.dtype]
    torch.testing.assert_close(actual.cpu(), expected.cpu(), atol=atol, rtol=rtol)
    return float((actual.cpu().double() - expected.cpu().double()).abs().max()) if actual.numel() else 0.0


@dataclass
class Batch:
    q: torch.Tensor  # (T, H, D)
    k_cache: torch.Tensor  # (NB, KVH, BS, D)
    v_cache: torch.Tensor
    query_start_loc: torch.Tensor  # (S + 1,)
    seq_lens: torch.Tensor  # (S,)
    block_tables: torch.Tensor  # (S, W)
    max_query_len: int
    max_seq_len: int
    scale: float

    def to(self, device: torch.device) -> Batch:
        return Batch(self.q.to(device), self.k_cache.to(device), self.v_cache.to(device),
                     self.query_start_loc.to(device), self.seq_lens.to(device), self.block_tables.to(device),
                     self.max_query_len, self.max_seq_len, self.scale)


def make_batch(
    specs: list[tuple[int, int]],  # (context length after the step, new tokens) per sequence
    H: int, KVH: int, D: int, BS: int, dtype: torch.dtype, seed: int = 0,
    index_dtype: torch.dtype = torch.int64,
) -> Batch:
    """Random q and pool; each sequence's blocks scattered over the pool, table rows padded with 0."""
    g = torch.Generator().manual_seed(seed)
    need = [-(-ctx // BS) for ctx, _ in specs]
    W = max(max(need), 1)
    NB = sum(need) + 3  # a few blocks nobody owns
    perm = torch.randperm(NB, generator=g)
    tables = torch.zeros(len(specs), W, dtype=torch.int64)
    used = 0
    for s, n in enumerate(need):
        tables[s, :n] = perm[used : used + n]
        used += n
    qlens = [n for _, n in specs]
    T = sum(qlens)
    shape = kv_cache_shape(NB, BS, KVH, D)
    return Batch(
        q=torch.randn(T, H, D, generator=g).to(dtype),
        k_cache=torch.randn(shape, generator=g).to(dtype),
        v_cache=torch.randn(shape, generator=g).to(dtype),
        query_start_loc=torch.tensor([0, *torch.tensor(qlens).cumsum(0).tolist()], dtype=index_dtype),
        seq_lens=torch.tensor([ctx for ctx, _ in specs], dtype=index_dtype),
        block_tables=tables.to(index_dtype),
        max_query_len=max(qlens),
        max_seq_len=max(ctx for ctx, _ in specs),
        scale=D**-0.5,
    )
