"""Paged attention kernels (prefill tiles, split-K decode) against the float64 torch reference.

On CPU these run under the Triton interpreter (tests/kernels/conftest.py): shapes are tiny and
irregular, covering GQA groups 3 (not a power of 2), 4 and 1, head_dim 64 and 32, block sizes 16 and 32,
contexts of 1, 15, 16, 17 and past several blocks, chunks after cached context, mixed batches.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from cuda_cases import Batch, assert_close, make_batch

from troupe.kernels import reference as cpu_reference
from troupe.kernels.base import AttentionMetadata
from troupe.kernels.cuda.attention import (
    MAX_SPLITS,
    decode_splits,
    paged_attention,
    paged_attention_reference,
)
from troupe.kernels.cuda.cache_write import reshape_and_cache
from troupe.kernels.cuda.checks import KernelArgumentError

# (H, KVH, D, BS, dtype)
GEOMETRIES = [
    (9, 3, 64, 16, torch.float32),  # the default model: G = 3
    (4, 1, 32, 32, torch.float16),  # G = 4, one kv head, block size 32
    (8, 8, 32, 16, torch.float32),  # G = 1 (MHA)
    (9, 3, 64, 16, torch.bfloat16),  # loose tolerance: see cuda_cases.TOLERANCE
]
GEOMETRY_IDS = ["9-3-d64-bs16-f32", "4-1-d32-bs32-f16", "8-8-d32-bs16-f32", "9-3-d64-bs16-bf16"]


def run(batch: Batch, device: torch.device, num_splits: int | None = None,
        **features: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """(kernel output, reference output), both on CPU; `features`: sliding_window / softcap for both."""
    b = batch.to(device)
    out = torch.full_like(b.q, float("nan"))
    paged_attention(b.q, b.k_cache, b.v_cache, out, b.query_start_loc, b.seq_lens, b.block_tables, b.scale,
                    b.max_query_len, b.max_seq_len, num_splits=num_splits, **features)
    ref = paged_attention_reference(batch.q, batch.k_cache, batch.v_cache, batch.query_start_loc,
                                    batch.seq_lens, batch.block_tables, batch.scale, **features)
    return out.cpu(), ref


@pytest.mark.parametrize("H,KVH,D,BS,dtype", GEOMETRIES, ids=GEOMETRY_IDS)
def test_mixed_prefill_chunks_and_decodes(device: torch.device, H: int, KVH: int, D: int, BS: int,
                                          dtype: torch.dtype) -> None:
    """One batch of whole prompts (15, 16, 17 tokens), chunks after cached context (6 new tokens at
    context 70, 20 at 33) and decodes (contexts 1 and 40) matches the reference token for token."""
    specs = [(15, 15), (1, 1), (70, 6), (16, 16), (40, 1), (33, 20), (17, 17)]
    out, ref = run(make_batch(specs, H, KVH, D, BS, dtype), device)
    assert_close(out, ref)


@pytest.mark.parametrize("H,KVH,D,BS,dtype", GEOMETRIES, ids=GEOMETRY_IDS)
@pytest.mark.parametrize("splits", [1, 3, None])
def test_decode_batch(device: torch.device, H: int, KVH: int, D: int, BS: int, dtype: torch.dtype,
                      splits: int | None) -> None:
    """Decode-only batches (contexts 1, 15, 16, 17, 130) through the split-K kernel: one split
    (direct write), 3 splits (some empty for short contexts, merged by the reduce kernel) and the
    heuristic's choice all match the reference."""
    specs = [(1, 1), (15, 1), (16, 1), (17, 1), (130, 1)]
    out, ref = run(make_batch(specs, H, KVH, D, BS, dtype, seed=1), device, num_splits=splits)
    assert_close(out, ref)


def test_decode_64_sequences(device: torch.device) -> None:
    """64 decodes with contexts 1..64 (GQA 4/1) in one launch."""
    specs = [(1 + (s * 37) % 64, 1) for s in range(64)]
    out, ref = run(make_batch(specs, 4, 1, 32, 16, torch.float16, seed=2), device)
    assert_close(out, ref)


def test_prefill_64_sequences(device: torch.device) -> None:
    """64 short prompts and chunks (1..5 new tokens) in one launch: the q-tile search over 64 sequences."""
    specs = [(1 + s % 5 + s % 11, 1 + s % 5) for s in range(64)]
    out, ref = run(make_batch(specs, 4, 1, 32, 16, torch.float16, seed=3), device)
    assert_close(out, ref)


@pytest.mark.parametrize("specs", [[(100, 100)], [(200, 1)], [(90, 30)]], ids=["prompt", "decode", "chunk"])
def test_single_sequence(device: torch.device, specs: list[tuple[int, int]]) -> None:
    """A batch of one: a 100-token prompt (several q-tiles), a decode at context 200 (split by the
    heuristic), a 30-token chunk after 60 cached positions."""
    out, ref = run(make_batch(specs, 9, 3, 64, 16, torch.float32, seed=4), device)
    assert_close(out, ref)


def test_padding_sequence_writes_zeros(device: torch.device) -> None:
    """A decode row with context 0 (a CUDA-graph padding row) gets zeros; the others are unaffected."""
    batch = make_batch([(20, 1), (1, 1), (33, 1)], 9, 3, 64, 16, torch.float32, seed=5)
    batch.seq_lens[1] = 0
    for splits in (1, 2):
        out, ref = run(batch, device, num_splits=splits)
        assert torch.equal(out[1], torch.zeros_like(out[1]))
        assert_close(out, ref)


def test_int32_indices_and_strided_queries(device: torch.device) -> None:
    """int32 index tensors, and q / out as strided views (q from a fused qkv row, out inside a wider buffer)."""
    batch = make_batch([(15, 15), (40, 1), (50, 9)], 9, 3, 64, 16, torch.float32, seed=6, index_dtype=torch.int32)
    T, H, D = batch.q.shape
    qkv = torch.randn(T, H + 6, D)  # q heads, then 3 k and 3 v heads
    qkv[:, :H] = batch.q
    wide = torch.full((T, H + 2, D), float("nan"), device=device)
    b = batch.to(device)
    q_view, out_view = qkv.to(device)[:, :H], wide[:, 1 : H + 1]
    paged_attention(q_view, b.k_cache, b.v_cache, out_view, b.query_start_loc, b.seq_lens, b.block_tables,
                    b.scale, b.max_query_len, b.max_seq_len)
    ref = paged_attention_reference(batch.q, batch.k_cache, batch.v_cache, batch.query_start_loc,
                                    batch.seq_lens, batch.block_tables, batch.scale)
    assert_close(out_view.cpu(), ref)
    assert torch.isnan(wide[:, 0]).all() and torch.isnan(wide[:, -1]).all()  # nothing written outside


def test_write_then_attend_matches_cpu_path(device: torch.device) -> None:
    """The whole layer step against the kernel-set reference (`troupe.kernels.reference`, other layout,
    other code): reshape_and_cache writes the new K/V into the (NB, KVH, BS, D) pool, then
    paged_attention attends; same outputs as the reference writing and attending over (NB, BS, KVH, D)."""
    g = torch.Generator().manual_seed(7)
    H, KVH, D, BS, NB = 9, 3, 64, 16, 12
    specs = [(30, 30), (21, 1), (40, 8)]  # a prompt, a decode, a chunk after 32 cached positions
    tables = torch.randperm(NB, generator=g)[:9].view(3, 3)
    qlens = [n for _, n in specs]
    starts = torch.tensor([0, *torch.tensor(qlens).cumsum(0).tolist()])
    seq_lens = torch.tensor([c for c, _ in specs])
    slots = torch.cat([tables[s, torch.arange(c - n, c) // BS] * BS + torch.arange(c - n, c) % BS
                       for s, (c, n) in enumerate(specs)])
    T = int(starts[-1])
    q, k, v = torch.randn(T, H, D, generator=g), torch.randn(T, KVH, D, generator=g), torch.randn(T, KVH, D, generator=g)
    pool_k = torch.randn(NB, BS, KVH, D, generator=g)  # the CPU layout, earlier context included
    pool_v = torch.randn(NB, BS, KVH, D, generator=g)
    k_cache = pool_k.transpose(1, 2).contiguous().to(device)  # the same pool in the CUDA layout
    v_cache = pool_v.transpose(1, 2).contiguous().to(device)
    meta = AttentionMetadata(slot_mapping=slots, query_start_loc=starts, seq_lens=seq_lens, block_tables=tables)
    cpu_reference.write_kv(k, v, pool_k, pool_v, slots)
    expected = cpu_reference.paged_attention(q, pool_k, pool_v, meta, D**-0.5)
    reshape_and_cache(k.to(device), v.to(device), k_cache, v_cache, slots.to(device))
    out = torch.empty(T, H, D, device=device)
    paged_attention(q.to(device), k_cache, v_cache, out, starts.to(device), seq_lens.to(device),
                    tables.to(device), D**-0.5, max(qlens), 40)
    assert_close(out.cpu(), expected)
    assert torch.equal(k_cache.cpu(), pool_k.transpose(1, 2))  # the reference wrote the same slots


# Sliding window and soft-capping. Contexts 15, 1, 70, 16, 40, 33, 17, 130: windows of 1, 16 (equal to a
# context, and to a pool block), 40 (smaller than the long contexts) and 200 (larger than all)
FEATURE_SPECS = [(15, 15), (1, 1), (70, 6), (16, 16), (40, 1), (33, 20), (17, 17), (130, 1)]


@pytest.mark.parametrize("geometry,window,softcap", [
    (0, 1, None), (0, 16, 2.0), (0, 200, 2.0), (1, 40, None), (1, None, 2.0),
], ids=["w1-f32", "w16-cap-f32", "w200-cap-f32", "w40-f16", "cap-f16"])
def test_mixed_batch_with_window_and_softcap(device: torch.device, geometry: int, window: int | None,
                                             softcap: float | None) -> None:
    """A mixed batch (prompts, chunks after cached context, decodes) through the prefill kernel with a
    sliding window smaller than, equal to and larger than the contexts and / or a cap matches the reference
    (GQA 9/3 in float32 with blocks of 16, MQA 4/1 in float16 with blocks of 32)."""
    H, KVH, D, BS, dtype = GEOMETRIES[geometry]
    out, ref = run(make_batch(FEATURE_SPECS, H, KVH, D, BS, dtype, seed=8), device, sliding_window=window,
                   softcap=softcap)
    assert_close(out, ref)


@pytest.mark.parametrize("splits,window,softcap", [(3, 20, 3.0), (None, 129, None)])
def test_decode_batch_with_window_and_softcap(device: torch.device, splits: int | None, window: int,
                                              softcap: float | None) -> None:
    """Decodes through the split-K kernel with a window (and a cap): the splits cut the window only (some of
    them empty for the short contexts), merged by the reduce kernel, as the reference."""
    specs = [(1, 1), (15, 1), (16, 1), (17, 1), (130, 1), (300, 1)]
    out, ref = run(make_batch(specs, 9, 3, 64, 16, torch.float32, seed=9), device, num_splits=splits,
                   sliding_window=window, softcap=softcap)
    assert_close(out, ref)


def test_window_and_softcap_against_the_kernel_set_reference(device: torch.device) -> None:
    """The CUDA set's `attention` with a window and a cap against `troupe.kernels.reference` (other layout,
    other code) on a mixed step."""
    from troupe.kernels.cuda.kernel_set import CudaKernels
    from troupe.kernels.cuda.step_buffers import CudaMetadata

    batch = make_batch([(30, 30), (21, 1), (40, 8)], 9, 3, 64, 16, torch.float32, seed=10)
    b = batch.to(device)
    meta = CudaMetadata(torch.zeros(0, dtype=torch.long, device=device), b.query_start_loc, b.seq_lens,
                        b.block_tables, max_query_len=b.max_query_len, max_seq_len=b.max_seq_len, num_seqs=3)
    out = CudaKernels(device).attention(b.q, b.q, b.q, (b.k_cache, b.v_cache), meta, b.scale, 0, sliding_window=9,
                                        softcap=4.0)
    pool = (batch.k_cache.transpose(1, 2), batch.v_cache.transpose(1, 2))  # the reference layout (NB, BS, KVH, D)
    cpu_meta = AttentionMetadata(torch.zeros(0, dtype=torch.long), batch.query_start_loc, batch.seq_lens,
                                 batch.block_tables)
    expected = cpu_reference.paged_attention(batch.q, *pool, cpu_meta, batch.scale, sliding_window=9, softcap=4.0)
    assert_close(out.cpu(), expected)


def test_decode_splits_heuristic() -> None:
    """Splits are powers of 2 in [1, MAX_SPLITS]: one for short contexts and for batches that already
    fill the GPU, more for a lone long context, never fewer than two 64-position tiles per split."""
    assert decode_splits(1, 3, 100) == 1  # under two tiles
    assert decode_splits(256, 8, 8192) == 1  # 2048 programs already
    assert decode_splits(1, 3, 1000) == 8  # 16 tiles of 64 positions: 8 splits of 2 tiles
    assert decode_splits(1, 8, 32768) == MAX_SPLITS
    for S, KVH, L in [(1, 3, 4000), (8, 3, 2000), (64, 3, 500), (3, 1, 130)]:
        n = decode_splits(S, KVH, L)
        assert 1 <= n <= MAX_SPLITS and n & (n - 1) == 0
        assert n == 1 or -(-L // 64) // n >= 2  # whole tiles per split


@pytest.mark.parametrize("field,change,message", [
    ("q", lambda b: b.q.to(torch.float64), "q: dtype"),
    ("k_cache", lambda b: b.k_cache[..., :32], "k_cache: head_dim"),
    ("k_cache", lambda b: b.k_cache.transpose(1, 2), "q: num_heads 9 must be a multiple"),
    ("query_start_loc", lambda b: b.query_start_loc[:-1], "query_start_loc: shape"),
    ("block_tables", lambda b: b.block_tables.float(), "block_tables: dtype"),
    ("seq_lens", lambda b: b.seq_lens[:, None], "seq_lens: must have 1"),
])
def test_bad_arguments_name_the_field(field: str, change: object, message: str) -> None:
    """A wrong dtype or shape is a KernelArgumentError that names the argument, before any launch."""
    batch = make_batch([(15, 15), (20, 1)], 9, 3, 64, 16, torch.float32)
    args = dict(q=batch.q, k_cache=batch.k_cache, v_cache=batch.v_cache, query_start_loc=batch.query_start_loc,
                seq_lens=batch.seq_lens, block_tables=batch.block_tables)
    args[field] = change(batch)  # type: ignore[operator]
    with pytest.raises(KernelArgumentError, match=message):
        paged_attention(args["q"], args["k_cache"], args["v_cache"], torch.empty_like(batch.q),
                        args["query_start_loc"], args["seq_lens"], args["block_tables"], 0.125, 15, 20)
