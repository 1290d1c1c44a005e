"""Paged attention: the torch fast path against the plain per-token reference on irregular shapes."""

from __future__ import annotations

import pytest
import torch

from troupe.kernels import attention
from troupe.kernels.attention import AttentionMetadata, DecodeRows, paged_attention, paged_attention_reference

torch.set_num_threads(1)

# (tokens already cached, new tokens) per sequence: whole prompts, a one-token prompt, decodes,
# chunks after cached context, a chunk that ends exactly on a block boundary
MIXED = [(0, 7), (5, 1), (13, 4), (0, 1), (30, 1), (2, 9), (16, 16), (3, 1)]


def make_batch(seqs, block_size, num_kv_heads, num_heads, head_dim, dtype, seed=0):
    """Random q/k/v for the new tokens, a pool whose cached part is already filled, and the metadata.

    Each sequence gets randomly chosen, non-contiguous blocks; the pool has spare blocks holding
    garbage so a wrong gather shows.
    """
    g = torch.Generator().manual_seed(seed)
    need = [-(-(c + n) // block_size) for c, n in seqs]
    num_blocks = sum(need) + 3
    perm = torch.randperm(num_blocks, generator=g).tolist()
    tables, i = [], 0
    for n in need:
        tables.append(perm[i : i + n])
        i += n
    pool = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(pool, generator=g).to(dtype)
    v_cache = torch.randn(pool, generator=g).to(dtype)
    slots = []
    for (cached, n), table in zip(seqs, tables, strict=True):
        slots += [table[p // block_size] * block_size + p % block_size for p in range(cached, cached + n)]
    T = sum(n for _, n in seqs)
    q = torch.randn(T, num_heads, head_dim, generator=g).to(dtype)
    k = torch.randn(T, num_kv_heads, head_dim, generator=g).to(dtype)
    v = torch.randn(T, num_kv_heads, head_dim, generator=g).to(dtype)
    width = max(len(t) for t in tables)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots),
        query_start_loc=torch.tensor([0] + [n for _, n in seqs]).cumsum(0),
        seq_lens=torch.tensor([c + n for c, n in seqs]),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables]),
    )
    return q, k, v, k_cache, v_cache, meta


def clone_meta(meta: AttentionMetadata) -> AttentionMetadata:
    return AttentionMetadata(meta.slot_mapping, meta.query_start_loc, meta.seq_lens, meta.block_tables)


@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(4, 4), (4, 2), (6, 2), (8, 1)])
@pytest.mark.parametrize("math_limit", [attention._MATH_MAX_SCORES, 0])
def test_fast_path_matches_reference(block_size, num_heads, num_kv_heads, math_limit, monkeypatch):
    """A mixed batch of prefills, chunks after cached context and decodes gives the reference's
    outputs and pool contents, for block sizes 1/4/16, MHA/GQA/MQA, and both chunk code paths
    (bmm + softmax, and SDPA)."""
    monkeypatch.setattr(attention, "_MATH_MAX_SCORES", math_limit)
    q, k, v, kc, vc, meta = make_batch(MIXED, block_size, num_kv_heads, num_heads, 16, torch.float32)
    kc_ref, vc_ref = kc.clone(), vc.clone()
    scale = 16**-0.5
    out = paged_attention(q, k, v, kc, vc, meta, scale)
    ref = paged_attention_reference(q, k, v, kc_ref, vc_ref, clone_meta(meta), scale)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    assert torch.equal(kc, kc_ref) and torch.equal(vc, vc_ref)


def test_plan_is_reused_across_layers():
    """The metadata caches its gather plan on the first call; later layers (other pools, other
    q/k/v) still get exact results from it."""
    q, k, v, kc, vc, meta = make_batch(MIXED, 4, 2, 4, 8, torch.float32, seed=1)
    paged_attention(q, k, v, kc, vc, meta, 0.3)
    assert meta.plan is not None
    q2, k2, v2, kc2, vc2, _ = make_batch(MIXED, 4, 2, 4, 8, torch.float32, seed=2)
    kc2_ref, vc2_ref = kc2.clone(), vc2.clone()
    out = paged_attention(q2, k2, v2, kc2, vc2, meta, 0.3)
    ref = paged_attention_reference(q2, k2, v2, kc2_ref, vc2_ref, clone_meta(meta), 0.3)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("seqs", [[(0, 1)], [(40, 1), (3, 1), (17, 1)], [(0, 33)], [(64, 5)]])
def test_decode_only_and_prefill_only_batches(seqs):
    """Batches with only decodes, or only one prefill chunk, take one branch alone and stay exact."""
    q, k, v, kc, vc, meta = make_batch(seqs, 16, 3, 9, 64, torch.float32, seed=3)
    kc_ref, vc_ref = kc.clone(), vc.clone()
    out = paged_attention(q, k, v, kc, vc, meta, 0.125)
    ref = paged_attention_reference(q, k, v, kc_ref, vc_ref, clone_meta(meta), 0.125)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_bfloat16_matches_reference_within_bf16_precision():
    """In bfloat16 (SDPA for every chunk) the fast path stays within bf16 rounding of the reference."""
    q, k, v, kc, vc, meta = make_batch(MIXED, 4, 2, 6, 32, torch.bfloat16, seed=4)
    kc_ref, vc_ref = kc.clone(), vc.clone()
    out = paged_attention(q, k, v, kc, vc, meta, 32**-0.5)
    ref = paged_attention_reference(q, k, v, kc_ref, vc_ref, clone_meta(meta), 32**-0.5)
    torch.testing.assert_close(out.float(), ref.float(), atol=3e-2, rtol=2e-2)
    assert torch.equal(kc, kc_ref)


def _rows_for(meta: AttentionMetadata, kc, vc, rows: list[int], prefilled: list[bool], length: int, seed: int,
              group: int = 8):
    """A row cache of 2 layers (random garbage, so a wrong read shows) holding the decodes of `meta` at
    `rows`; a decode marked prefilled already holds its context but its new token, the others are refilled."""
    g = torch.Generator().manual_seed(seed)
    _, BS, KVH, D = kc.shape
    shape = (max(rows) + 2, KVH, length, D)
    k_rows = [torch.randn(shape, generator=g) for _ in range(2)]
    v_rows = [torch.randn(shape, generator=g) for _ in range(2)]
    starts, lens = meta.query_start_loc.tolist(), meta.seq_lens.tolist()
    dec = [s for s in range(len(lens)) if starts[s + 1] - starts[s] == 1]
    dec_lens, refills = [lens[s] for s in dec], []
    for s, row, pre, n in zip(dec, rows, prefilled, dec_lens, strict=True):
        blocks = meta.block_tables[s, : -(-n // BS)]
        if pre:
            for cache, pool in ((k_rows[1], kc), (v_rows[1], vc)):
                cache[row, :, : n - 1] = pool[blocks].view(-1, KVH, D)[: n - 1].transpose(0, 1)
        else:
            refills.append((row, blocks, n))
    return DecodeRows.build(k_rows, v_rows, meta.query_start_loc[dec], rows, dec_lens, refills, group)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("group", [8, 2])
@pytest.mark.parametrize(("rows", "prefilled"), [([0, 1, 2, 3], [False] * 4), ([5, 0, 3, 2], [True, False, True, True]),
                                               ([7, 0, 1, 6], [False, True, False, True])])
def test_decode_rows_match_reference(rows, prefilled, group, dtype):
    """With a row cache, decodes read their context from their rows (refilled from the pool when new,
    holding all but the new token otherwise; unused rows hold garbage), in groups of `group` rows each read
    up to its own longest context (a group without a decode skipped), and give the reference's outputs;
    afterwards each row holds the decode's whole context, as the pool does."""
    q, k, v, kc, vc, meta = make_batch(MIXED, 4, 3, 9, 16, torch.float32, seed=5)
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    kc, vc = kc.to(dtype), vc.to(dtype)
    meta.rows = _rows_for(meta, kc, vc, rows, prefilled, length=40, seed=6, group=group)
    if group == 2:  # decode contexts 6, 1, 31, 4 (MIXED) at `rows`: each group up to its own longest
        expected = {(0, 1, 2, 3): [(0, 2, 6), (2, 4, 31)], (5, 0, 3, 2): [(0, 2, 1), (2, 4, 31), (4, 6, 6)],
                    (7, 0, 1, 6): [(0, 2, 31), (6, 8, 6)]}[tuple(rows)]  # rows 2..5 unused: skipped
        assert [(r0, r1, bias.shape[-1]) for r0, r1, bias in meta.rows.groups] == expected
    meta.rows.k[1], meta.rows.v[1] = meta.rows.k[1].to(dtype), meta.rows.v[1].to(dtype)
    kc_ref, vc_ref = kc.clone(), vc.clone()
    out = paged_attention(q, k, v, kc, vc, meta, 0.25, layer=1)
    ref = paged_attention_reference(q, k, v, kc_ref, vc_ref, clone_meta(meta), 0.25)
    tol = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 3e-2, "rtol": 2e-2}
    torch.testing.assert_close(out.float(), ref.float(), **tol)
    assert torch.equal(kc, kc_ref) and torch.equal(vc, vc_ref)
    starts, lens = meta.query_start_loc.tolist(), meta.seq_lens.tolist()
    dec = [s for s in range(len(lens)) if starts[s + 1] - starts[s] == 1]
    for s, row in zip(dec, rows, strict=True):
        ctx = kc[meta.block_tables[s]].view(-1, 3, 16)[: lens[s]].transpose(0, 1)  # (KVH, ctx, D)
        assert torch.equal(meta.rows.k[1][row, :, : lens[s]], ctx)
