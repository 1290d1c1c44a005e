"""Paged attention for prefill chunks (and mixed batches): a flash-attention tiled kernel over the pool.

Work split: the queries of a sequence are cut into q-tiles of BLOCK_Q tokens; one program handles one
q-tile for one kv head, with all G = H / KVH query heads of that kv head packed into the M dimension
of its tiles (row m = token m // G, head m % G; BLOCK_M = BLOCK_Q * G rounded up to a power of 2, so
G need not be one), so each K/V tile read from the pool serves the whole group. The program walks the
context in tiles of BLOCK_N positions, `tl.dot` for Q K^T and P V, online softmax in float32 (exp2
with the scale folded in), and stops at the tile's last visible position (causal with the offset
`seq_len - q_len`: earlier context read from the pool, then the chunk itself).

Grid: `(T // BLOCK_Q + S, KVH)`, an upper bound on the q-tiles (sequence s owns programs
`query_start_loc[s] // BLOCK_Q + s` onwards, found by a binary search over `query_start_loc`); the
spare programs return at once. It depends only on tensor shapes: no host sync, graph-capturable.
A sequence with one token (a decode in a mixed batch) is one q-tile like any other.

Attention features (constexpr switches, so without them the kernel is the plain causal one): WINDOW, a
query at position p sees keys p - window < j <= p, and the walk starts at the BLOCK_N tile holding the
q-tile's first window start; SOFTCAP, scores `softcap * tanh(scale * q.k / softcap)`, computed as
`tanh(dot * scale_log2) * cap_log2` with the launcher passing `scale_log2 = scale / softcap` and
`cap_log2 = softcap * log2(e)` (`_tanh`: exp-based, within 1.2e-7 of tanh).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _find_sequence(query_start_loc, pid, num_seqs, BLOCK_Q: tl.constexpr):
    """The s with `qsl[s] // BLOCK_Q + s <= pid < qsl[s + 1] // BLOCK_Q + s + 1` (binary search)."""
    lo = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        first = tl.load(query_start_loc + mid).to(tl.int32) // BLOCK_Q + mid
        if first <= pid:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def _tanh(x):
    """tanh in float32 from one exp: (1 - e) / (1 + e), e = exp(-2|x|) in (0, 1] (no overflow)."""
    e = tl.exp(-2.0 * tl.abs(x))
    t = (1.0 - e) / (1.0 + e)
    return tl.where(x < 0.0, -t, t)


@triton.jit
def _scores(qt, kt, scale_log2, cap_log2, F32: tl.constexpr, SOFTCAP: tl.constexpr):
    """Q K^T of a (M, D) and a (N, D) tile in the log2 domain, soft-capped with SOFTCAP (see the module
    docstring for what `scale_log2` and `cap_log2` hold)."""
    if SOFTCAP:
        return _tanh(_dot(qt, tl.trans(kt), F32) * scale_log2) * cap_log2
    else:
        return _dot(qt, tl.trans(kt), F32) * scale_log2


@triton.jit
def _dot(a, b, F32: tl.constexpr):
    if F32:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        return tl.dot(a, b)


@triton.jit
def prefill_attention_kernel(
    q,  # (T, H, D)
    k_cache,  # (NB, KVH, BS, D)
    v_cache,  # (NB, KVH, BS, D)
    out,  # (T, H, D)
    query_start_loc,  # (S + 1,)
    seq_lens,  # (S,)
    block_tables,  # (S, W)
    scale_log2,  # softmax scale * log2(e); with SOFTCAP scale / softcap
    cap_log2,  # softcap * log2(e) (SOFTCAP only)
    window,  # sliding window in positions (WINDOW only)
    num_seqs,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_cb,  # k_cache and v_cache share strides
    stride_ch,
    stride_ct,
    stride_bt,
    G: tl.constexpr,  # query heads per kv head
    BLOCK_Q: tl.constexpr,  # query tokens per program (BLOCK_M // G)
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,  # pool block size
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
    F32: tl.constexpr,  # dots in float32 (float32 inputs, or the CPU interpreter)
    WINDOW: tl.constexpr = False,
    SOFTCAP: tl.constexpr = False,
):
    pid = tl.program_id(0)
    kvh = tl.program_id(1)
    s = _find_sequence(query_start_loc, pid, num_seqs, BLOCK_Q)
    q_start = tl.load(query_start_loc + s).to(tl.int32)
    q_len = tl.load(query_start_loc + s + 1).to(tl.int32) - q_start
    tile = pid - (q_start // BLOCK_Q + s)
    if tile * BLOCK_Q >= q_len:
        return
    seq_len = tl.load(seq_lens + s).to(tl.int32)
    ctx0 = seq_len - q_len  # position of the sequence's first new token

    m = tl.arange(0, BLOCK_M)
    qi = tile * BLOCK_Q + m // G  # (BLOCK_M,) query token within the sequence
    head = kvh * G + m % G
    row_ok = (m < BLOCK_Q * G) & (qi < q_len)
    qpos = ctx0 + qi
    d = tl.arange(0, D_PAD)
    d_ok = d < HEAD_DIM
    tok = (q_start + qi).to(tl.int64)
    qmask = row_ok[:, None] & d_ok[None, :]
    qt = tl.load(q + tok[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :], mask=qmask, other=0.0)

    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, D_PAD), tl.float32)
    # the tile's last query sees positions < kv_end
    kv_end = tl.minimum(seq_len, ctx0 + tl.minimum(q_len, (tile + 1) * BLOCK_Q))
    kv_start = 0
    if WINDOW:  # the tile's first query sees positions from kv_start + (up to BLOCK_N - 1) on
        kv_start = tl.maximum(0, ctx0 + tile * BLOCK_Q - window + 1) // BLOCK_N * BLOCK_N
    table = block_tables + s.to(tl.int64) * stride_bt
    for start in range(kv_start, kv_end, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)  # (BLOCK_N,) context positions
        n_ok = n < kv_end
        blk = tl.load(table + n // BLOCK_SIZE, mask=n_ok, other=0).to(tl.int64)
        row = blk * stride_cb + kvh * stride_ch + (n % BLOCK_SIZE) * stride_ct  # (BLOCK_N,)
        kvmask = n_ok[:, None] & d_ok[None, :]
        kt = tl.load(k_cache + row[:, None] + d[None, :], mask=kvmask, other=0.0)  # (BLOCK_N, D_PAD)
        scores = _scores(qt, kt, scale_log2, cap_log2, F32, SOFTCAP)  # (BLOCK_M, BLOCK_N)
        visible = (n[None, :] <= qpos[:, None]) & n_ok[None, :]
        if WINDOW:
            visible = visible & (n[None, :] > qpos[:, None] - window)
        scores = tl.where(visible, scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows that see nothing yet: no NaN
        p = tl.exp2(scores - m_use[:, None])
        alpha = tl.exp2(m_i - m_use)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        vt = tl.load(v_cache + row[:, None] + d[None, :], mask=kvmask, other=0.0)  # (BLOCK_N, D_PAD)
        acc = acc * alpha[:, None] + _dot(p.to(vt.dtype), vt, F32)
        m_i = m_new
    o = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    tl.store(out + tok[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
             o.to(out.dtype.element_ty), mask=qmask)
