"""The eager kernel set's paged attention (and its rotary + KV write) against the plain references on
irregular shapes."""

from __future__ import annotations

import pytest
import torch
from factories import random_block_tables

from troupe.kernels import reference
from troupe.kernels.eager import EagerKernels, attention
from troupe.kernels.eager.attention import DecodeRows, EagerMetadata, paged_attention

torch.set_num_threads(1)

# (tokens already cached, new tokens) per sequence: whole prompts, a one-token prompt, decodes,
# chunks after cached context, a chunk that ends exactly on a block boundary
MIXED = [(0, 7), (5, 1), (13, 4), (0, 1), (30, 1), (2, 9), (16, 16), (3, 1)]


def make_batch(seqs, block_size, num_kv_heads, num_heads, head_dim, dtype, seed=0):
    """Random q/k/v for the new tokens, a pool whose cached part is already filled and which holds the
    new tokens (as `rope_and_cache` leaves it), and the metadata.

    Each sequence gets randomly chosen, non-contiguous blocks; the pool has spare blocks holding
    garbage so a wrong gather shows.
    """
    g = torch.Generator().manual_seed(seed)
    tables, num_blocks = random_block_tables(seqs, block_size, g)
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
    meta = EagerMetadata(
        slot_mapping=torch.tensor(slots),
        query_start_loc=torch.tensor([0] + [n for _, n in seqs]).cumsum(0),
        seq_lens=torch.tensor([c + n for c, n in seqs]),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables]),
    )
    reference.write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
    return q, k, v, k_cache, v_cache, meta


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
    ref = reference.paged_attention(q, kc, vc, meta, scale)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    assert torch.equal(kc, kc_ref) and torch.equal(vc, vc_ref)  # attention reads the pool, never writes it


def test_plan_is_reused_across_layers():
    """The metadata caches its gather plan on the first call; later layers (other pools, other
    q/k/v) still get exact results from it."""
    q, k, v, kc, vc, meta = make_batch(MIXED, 4, 2, 4, 8, torch.float32, seed=1)
    paged_attention(q, k, v, kc, vc, meta, 0.3)
    assert meta.plan is not None
    q2, k2, v2, kc2, vc2, _ = make_batch(MIXED, 4, 2, 4, 8, torch.float32, seed=2)
    reference.write_kv(k2, v2, kc2, vc2, meta.slot_mapping)  # this layer's new tokens, at the step's slots
    out = paged_attention(q2, k2, v2, kc2, vc2, meta, 0.3)
    ref = reference.paged_attention(q2, kc2, vc2, meta, 0.3)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("seqs", [[(0, 1)], [(40, 1), (3, 1), (17, 1)], [(0, 33)], [(64, 5)]])
def test_decode_only_and_prefill_only_batches(seqs):
    """Batches with only decodes, or only one prefill chunk, take one branch alone and stay exact."""
    q, k, v, kc, vc, meta = make_batch(seqs, 16, 3, 9, 64, torch.float32, seed=3)
    out = paged_attention(q, k, v, kc, vc, meta, 0.125)
    ref = reference.paged_attention(q, kc, vc, meta, 0.125)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_bfloat16_matches_reference_within_bf16_precision():
    """In bfloat16 (SDPA for every chunk) the fast path stays within bf16 rounding of the reference."""
    q, k, v, kc, vc, meta = make_batch(MIXED, 4, 2, 6, 32, torch.bfloat16, seed=4)
    out = paged_attention(q, k, v, kc, vc, meta, 32**-0.5)
    ref = reference.paged_attention(q, kc, vc, meta, 32**-0.5)
    torch.testing.assert_close(out.float(), ref.float(), atol=3e-2, rtol=2e-2)


def _rows_for(meta: EagerMetadata, kc, vc, rows: list[int], prefilled: list[bool], length: int, seed: int,
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
    q, k, v, kc, vc, meta = make_batch(MIXED, 4, 3, 9, 16, dtype, seed=5)
    meta.rows = _rows_for(meta, kc, vc, rows, prefilled, length=40, seed=6, group=group)
    if group == 2:  # decode contexts 6, 1, 31, 4 (MIXED) at `rows`: each group up to its own longest
        expected = {(0, 1, 2, 3): [(0, 2, 6), (2, 4, 31)], (5, 0, 3, 2): [(0, 2, 1), (2, 4, 31), (4, 6, 6)],
                    (7, 0, 1, 6): [(0, 2, 31), (6, 8, 6)]}[tuple(rows)]  # rows 2..5 unused: skipped
        assert [(r0, r1, bias.shape[-1]) for r0, r1, bias in meta.rows.groups] == expected
    meta.rows.k[1], meta.rows.v[1] = meta.rows.k[1].to(dtype), meta.rows.v[1].to(dtype)
    out = paged_attention(q, k, v, kc, vc, meta, 0.25, layer=1)
    ref = reference.paged_attention(q, kc, vc, meta, 0.25)
    tol = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 3e-2, "rtol": 2e-2}
    torch.testing.assert_close(out.float(), ref.float(), **tol)
    starts, lens = meta.query_start_loc.tolist(), meta.seq_lens.tolist()
    dec = [s for s in range(len(lens)) if starts[s + 1] - starts[s] == 1]
    for s, row in zip(dec, rows, strict=True):
        ctx = kc[meta.block_tables[s]].view(-1, 3, 16)[: lens[s]].transpose(0, 1)  # (KVH, ctx, D)
        assert torch.equal(meta.rows.k[1][row, :, : lens[s]], ctx)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_and_cache_matches_reference(dtype):
    """`EagerKernels.rope_and_cache` rotates q and k like the float64 reference and writes the rotated k
    and v at their slots (and nowhere else), for a mixed batch over non-contiguous blocks; the (cos, sin)
    gather is built once per step and reused by the next layer."""
    q, k, v, kc, vc, meta = make_batch(MIXED, 4, 2, 6, 32, dtype, seed=8)
    positions = torch.cat([torch.arange(c, c + n) for c, n in MIXED])
    inv_freq = 1.0 / 10000.0 ** (torch.arange(0, 32, 2, dtype=torch.float64) / 32)
    table = reference.rope_cache(inv_freq, 64)
    kc_ref, vc_ref = kc.clone(), vc.clone()
    rq, rk = EagerKernels().rope_and_cache(positions, q, k, v, table, (kc, vc), meta)
    eq, ek = reference.rope(positions, q, table), reference.rope(positions, k, table)
    reference.write_kv(ek, v, kc_ref, vc_ref, meta.slot_mapping)
    tol = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 3e-2, "rtol": 2e-2}
    torch.testing.assert_close(rq.float(), eq.float(), **tol)
    torch.testing.assert_close(rk.float(), ek.float(), **tol)
    torch.testing.assert_close(kc.float(), kc_ref.float(), **tol)
    assert torch.equal(vc, vc_ref)
    assert meta.rope is not None
    cached = meta.rope
    EagerKernels().rope_and_cache(positions, q, k, v, table, (kc, vc), meta)
    assert meta.rope is cached


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_norms_and_silu_match_reference(dtype):
    """The eager set's rms_norm, add_rms_norm (residual + x, then the norm) and silu_and_mul agree with the
    float32 references on an irregular shape."""
    g = torch.Generator().manual_seed(9)
    x, res = torch.randn(7, 24, generator=g).to(dtype), torch.randn(7, 24, generator=g).to(dtype)
    w, gu = torch.randn(24, generator=g).to(dtype), torch.randn(7, 10, generator=g).to(dtype)
    ops = EagerKernels()
    tol = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 3e-2, "rtol": 2e-2}
    torch.testing.assert_close(ops.rms_norm(x, w, 1e-6).float(), reference.rms_norm(x, w, 1e-6).float(), **tol)
    normed, summed = ops.add_rms_norm(x, res, w, 1e-5)
    torch.testing.assert_close(summed.float(), (x.float() + res.float()), **tol)
    torch.testing.assert_close(normed.float(), reference.rms_norm(summed, w, 1e-5).float(), **tol)
    torch.testing.assert_close(ops.silu_and_mul(gu).float(), reference.silu_and_mul(gu).float(), **tol)


# Sliding window and soft-capping. Contexts 7, 6, 17, 1, 31, 11, 32, 4, 40, 49: windows of 1, 7 (equal to the
# first prompt's context), 32 (equal to the chunk (16, 16)'s) and 64 (larger than every context).
FEATURE_SEQS = [*MIXED, (39, 1), (37, 12)]
WINDOWS = [1, 7, 32, 64]


@pytest.mark.parametrize("softcap", [None, 2.0])
@pytest.mark.parametrize("window", [None, *WINDOWS])
@pytest.mark.parametrize(("block_size", "num_heads", "num_kv_heads", "math_limit"),
                         [(1, 4, 4, attention._MATH_MAX_SCORES), (4, 6, 2, 0), (16, 8, 1, attention._MATH_MAX_SCORES)])
def test_window_and_softcap_match_reference(block_size, num_heads, num_kv_heads, math_limit, window, softcap,
                                            monkeypatch):
    """With a sliding window (of 1, smaller than, equal to and larger than the contexts) and/or soft-capping,
    a mixed batch of prompts, chunks after cached context and decodes gives the reference's outputs through
    the set's `attention`, for block sizes 1/4/16, MHA/GQA/MQA and both chunk paths."""
    monkeypatch.setattr(attention, "_MATH_MAX_SCORES", math_limit)
    q, k, v, kc, vc, meta = make_batch(FEATURE_SEQS, block_size, num_kv_heads, num_heads, 16, torch.float32, seed=10)
    out = EagerKernels(decode_row_cache_bytes=0).attention(q, k, v, (kc, vc), meta, 0.5, 0, sliding_window=window,
                                                          softcap=softcap)
    ref = reference.paged_attention(q, kc, vc, meta, 0.5, sliding_window=window, softcap=softcap)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_window_plans_are_kept_per_window():
    """Layers with different windows in one step (Gemma's interleaved local / global layers) each get their
    own plan, built once; a window longer than every context gives the plain result bit for bit; a decode
    with a short window gathers only the blocks its window touches."""
    q, k, v, kc, vc, meta = make_batch(FEATURE_SEQS, 4, 2, 6, 16, torch.float32, seed=11)
    plain = paged_attention(q, k, v, kc, vc, meta, 0.25)
    local = paged_attention(q, k, v, kc, vc, meta, 0.25, sliding_window=5)
    assert meta.plan is not None and set(meta.plans) == {5}
    plan5 = meta.plans[5]
    assert torch.equal(paged_attention(q, k, v, kc, vc, meta, 0.25, sliding_window=5), local)
    assert meta.plans[5] is plan5
    assert torch.equal(paged_attention(q, k, v, kc, vc, meta, 0.25, sliding_window=64), plain)
    torch.testing.assert_close(local, reference.paged_attention(q, kc, vc, meta, 0.25, sliding_window=5),
                               atol=1e-5, rtol=1e-5)
    assert plan5.decodes is not None and meta.plan.decodes is not None
    # 5 positions over blocks of 4 lie in at most 2 blocks, against 10 for the longest decode context (40)
    assert plan5.decodes.mask.shape[-1] <= 2 * 4 and meta.plan.decodes.mask.shape[-1] == 10 * 4


@pytest.mark.parametrize("window", [None, 3, 64])
def test_bfloat16_window_and_softcap(window):
    """In bfloat16 (SDPA for the uncapped chunks, the float32 capped path otherwise) a window and a cap
    stay within bf16 rounding of the reference."""
    q, k, v, kc, vc, meta = make_batch(FEATURE_SEQS, 4, 2, 6, 32, torch.bfloat16, seed=12)
    for softcap in (None, 3.0):
        out = paged_attention(q, k, v, kc, vc, meta, 32**-0.5, sliding_window=window, softcap=softcap)
        ref = reference.paged_attention(q, kc, vc, meta, 32**-0.5, sliding_window=window, softcap=softcap)
        torch.testing.assert_close(out.float(), ref.float(), atol=3e-2, rtol=2e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("window", "softcap"), [(1, None), (5, None), (20, 2.0), (None, 2.0), (64, None)])
def test_decode_rows_with_window_and_softcap(window, softcap, dtype):
    """Decodes read from a row cache (groups of 2 rows, some refilled) with a sliding window (each group read
    from its rows' earliest window start) and / or a cap give the reference's outputs, and the rows still
    take the new token (the row cache stays right for the next step whatever the layer's window)."""
    q, k, v, kc, vc, meta = make_batch(MIXED, 4, 3, 9, 16, dtype, seed=13)
    rows = [5, 0, 3, 2]
    meta.rows = _rows_for(meta, kc, vc, rows, [True, False, True, True], length=40, seed=14, group=2)
    meta.rows.k[1], meta.rows.v[1] = meta.rows.k[1].to(dtype), meta.rows.v[1].to(dtype)
    out = paged_attention(q, k, v, kc, vc, meta, 0.25, layer=1, sliding_window=window, softcap=softcap)
    ref = reference.paged_attention(q, kc, vc, meta, 0.25, sliding_window=window, softcap=softcap)
    tol = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 3e-2, "rtol": 2e-2}
    torch.testing.assert_close(out.float(), ref.float(), **tol)
    starts, lens = meta.query_start_loc.tolist(), meta.seq_lens.tolist()
    dec = [s for s in range(len(lens)) if starts[s + 1] - starts[s] == 1]
    for s, row in zip(dec, rows, strict=True):
        ctx = kc[meta.block_tables[s]].view(-1, 3, 16)[: lens[s]].transpose(0, 1)  # (KVH, ctx, D)
        assert torch.equal(meta.rows.k[1][row, :, : lens[s]], ctx)
