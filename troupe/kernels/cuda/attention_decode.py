"""Paged attention for decode batches (one new token per sequence): GQA-aware split-K (flash-decoding).

Work split: one program per (sequence, kv head, split). It holds the whole query-head group of its kv
head as one (G_PAD, D) tile (G_PAD = G rounded up to a power of 2, at least 16 for `tl.dot`), so each
K/V tile is read from the pool once for all G heads. The sequence's context is cut into `num_splits`
ranges of whole BLOCK_N tiles (`ceil(ceil(seq_len / num_splits) / BLOCK_N) * BLOCK_N` positions each,
from its own length, so short sequences leave trailing splits empty); each program runs online softmax
over its range. With one split it writes the output directly; otherwise it writes its normalised
partial output and log2-sum-exp to float32 workspaces and `decode_reduce_kernel`, one program per
(sequence, query head), merges the splits with weights `2^(lse_i - max lse)`.

Grid `(S, KVH, num_splits)` and `(S, H)`: from tensor shapes and the split count only, so a decode step
captured in a CUDA graph replays for any context lengths up to the `max_seq_len` it was captured with.
A sequence with `seq_len` 0 (a padding row) writes zeros.

Attention features, as in `attention_prefill`: with WINDOW the splits cut only the window
`[max(0, seq_len - window), seq_len)`, so keys out of it are never read; with SOFTCAP the scores are
soft-capped (`_scores`).
"""

from __future__ import annotations

import triton
import triton.language as tl

from troupe.kernels.cuda.attention_prefill import _dot, _scores


@triton.jit
def decode_attention_kernel(
    q,  # (S, H, D)
    k_cache,  # (NB, KVH, BS, D)
    v_cache,  # (NB, KVH, BS, D)
    out,  # (S, H, D), written when DIRECT
    part_out,  # (S, H, num_splits, D) float32, written unless DIRECT
    part_lse,  # (S, H, num_splits) float32
    seq_lens,  # (S,)
    block_tables,  # (S, W)
    scale_log2,  # softmax scale * log2(e); with SOFTCAP scale / softcap
    cap_log2,  # softcap * log2(e) (SOFTCAP only)
    window,  # sliding window in positions (WINDOW only)
    num_splits,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_cb,  # k_cache and v_cache share strides
    stride_ch,
    stride_ct,
    stride_bt,
    G: tl.constexpr,
    G_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
    F32: tl.constexpr,
    DIRECT: tl.constexpr,  # num_splits == 1: normalise and write `out`
    WINDOW: tl.constexpr = False,
    SOFTCAP: tl.constexpr = False,
):
    s = tl.program_id(0).to(tl.int64)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens + s).to(tl.int32)
    first = 0  # the first position the query sees
    if WINDOW:
        first = tl.maximum(0, seq_len - window)
    split_len = tl.cdiv(tl.cdiv(seq_len - first, num_splits), BLOCK_N) * BLOCK_N
    lo = first + split * split_len
    hi = tl.minimum(seq_len, lo + split_len)

    g = tl.arange(0, G_PAD)
    head = kvh * G + g
    d = tl.arange(0, D_PAD)
    d_ok = d < HEAD_DIM
    qmask = (g < G)[:, None] & d_ok[None, :]
    qt = tl.load(q + s * stride_qt + head[:, None] * stride_qh + d[None, :], mask=qmask, other=0.0)

    m_i = tl.full((G_PAD,), float("-inf"), tl.float32)
    l_i = tl.zeros((G_PAD,), tl.float32)
    acc = tl.zeros((G_PAD, D_PAD), tl.float32)
    table = block_tables + s * stride_bt
    for start in range(lo, hi, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        n_ok = n < hi
        blk = tl.load(table + n // BLOCK_SIZE, mask=n_ok, other=0).to(tl.int64)
        row = blk * stride_cb + kvh * stride_ch + (n % BLOCK_SIZE) * stride_ct  # (BLOCK_N,)
        kvmask = n_ok[:, None] & d_ok[None, :]
        kt = tl.load(k_cache + row[:, None] + d[None, :], mask=kvmask, other=0.0)  # (BLOCK_N, D_PAD)
        scores = _scores(qt, kt, scale_log2, cap_log2, F32, SOFTCAP)  # (G_PAD, BLOCK_N)
        scores = tl.where(n_ok[None, :], scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        p = tl.exp2(scores - m_new[:, None])  # the range is non-empty inside the loop: m_new is finite
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        vt = tl.load(v_cache + row[:, None] + d[None, :], mask=kvmask, other=0.0)
        acc = acc * alpha[:, None] + _dot(p.to(vt.dtype), vt, F32)
        m_i = m_new
    o = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]  # (G_PAD, D_PAD)
    if DIRECT:
        tl.store(out + s * stride_ot + head[:, None] * stride_oh + d[None, :], o.to(out.dtype.element_ty),
                 mask=qmask)
    else:
        H = tl.num_programs(1) * G
        part = (s * H + head) * num_splits + split  # (G_PAD,) index into (S, H, num_splits)
        tl.store(part_out + part[:, None] * HEAD_DIM + d[None, :], o, mask=qmask)
        lse = tl.where(l_i > 0.0, m_i + tl.log2(tl.where(l_i > 0.0, l_i, 1.0)), float("-inf"))
        tl.store(part_lse + part, lse, mask=g < G)


@triton.jit
def decode_reduce_kernel(
    out,  # (S, H, D)
    part_out,  # (S, H, num_splits, D) float32
    part_lse,  # (S, H, num_splits) float32
    num_splits,
    stride_ot,
    stride_oh,
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
):
    s = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    H = tl.num_programs(1)
    i = tl.arange(0, SPLITS_PAD)
    i_ok = i < num_splits
    d = tl.arange(0, D_PAD)
    d_ok = d < HEAD_DIM
    base = (s * H + h) * num_splits
    lse = tl.load(part_lse + base + i, mask=i_ok, other=float("-inf"))  # (SPLITS_PAD,)
    top = tl.max(lse, axis=0)
    top = tl.where(top == float("-inf"), 0.0, top)
    w = tl.exp2(lse - top)  # empty splits: 0
    po = tl.load(part_out + (base + i)[:, None] * HEAD_DIM + d[None, :], mask=i_ok[:, None] & d_ok[None, :],
                 other=0.0)  # (SPLITS_PAD, D_PAD)
    total = tl.sum(w, axis=0)
    o = tl.sum(w[:, None] * po, axis=0) / tl.where(total > 0.0, total, 1.0)
    tl.store(out + s * stride_ot + h * stride_oh + d, o.to(out.dtype.element_ty), mask=d_ok)
