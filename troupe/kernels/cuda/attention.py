"""`paged_attention`: the launcher over the CUDA pool, dispatching to the decode or the prefill kernel.

Contract (the flattened batch of `troupe.kernels.base.AttentionMetadata`, with the pool layout of
`troupe.kernels.cuda.cache_write`): T new tokens of S sequences, sequence s owning tokens
`query_start_loc[s] : query_start_loc[s + 1]`; its context after the step is `seq_lens[s]` positions,
the new tokens being the last `q_len` of them (their K/V already written by `reshape_and_cache`);
position p lives at `k_cache[block_tables[s, p // block_size], :, p % block_size]`. Query token i of
sequence s attends causally to positions `0 ..= seq_lens[s] - q_len + i`. `out` (T, H, D) is written.
`max_query_len` / `max_seq_len` are host ints, bounds the caller already knows (no device read).
`sliding_window` W (a query at p sees only p - W < j <= p) and `softcap` c (scores `c * tanh(s / c)`
before the mask): see `troupe.kernels.reference.paged_attention`; both are constexpr switches of the
kernels (`WINDOW`, `SOFTCAP`), so a call without them runs the plain kernels.

Dispatch: `max_query_len == 1` (every sequence one token, T == S) goes to the split-K decode kernel,
with the split count from `decode_splits`; anything else goes to the prefill kernel, which also serves
the decodes of a mixed batch as one-token q-tiles. Dots run in 16 bits with float32 accumulation
on a GPU, in float32 for float32 inputs and under the CPU interpreter (`checks.dot_in_float32`).
"""

from __future__ import annotations

import functools
import math

import torch
import triton

from troupe.kernels.cuda.attention_decode import decode_attention_kernel, decode_reduce_kernel
from troupe.kernels.cuda.attention_prefill import prefill_attention_kernel
from troupe.kernels.cuda.checks import (
    check,
    check_float,
    check_index,
    check_rows,
    check_same_device,
    dot_in_float32,
)

DECODE_BLOCK_N = 64  # context positions per decode tile
MIN_SPLIT_TILES = 2  # a split covers at least this many tiles (128 positions)
MAX_SPLITS = 32
PREFILL_BLOCK_N = 64
MAX_HEAD_DIM = 256
_NOMINAL_SMS = 132  # an H100 / H200, for launches on CPU tensors (the interpreter)


@functools.cache
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return _NOMINAL_SMS
    return int(torch.cuda.get_device_properties(device).multi_processor_count)


def decode_splits(num_seqs: int, num_kv_heads: int, max_seq_len: int, num_sms: int = _NOMINAL_SMS) -> int:
    """How many ranges to split each decode context into: a power of 2 in [1, MAX_SPLITS].

    Enough (sequence, kv head, split) programs for about two waves over the SMs, no split shorter
    than MIN_SPLIT_TILES tiles: a big batch gets 1 split (no reduce kernel), a lone long context many."""
    by_length = triton.cdiv(max_seq_len, DECODE_BLOCK_N) // MIN_SPLIT_TILES
    by_occupancy = triton.cdiv(2 * num_sms, max(1, num_seqs * num_kv_heads))
    splits = min(MAX_SPLITS, by_length, by_occupancy)
    return 1 if splits <= 1 else 1 << (splits.bit_length() - 1)


def prefill_meta(max_query_len: int, G: int, D: int, block_size: int, f32: bool, window: bool = False,
                 softcap: bool = False) -> dict[str, int]:
    """Constexprs and launch options of `prefill_attention_kernel` (shared with the AOT check).

    M rows = query tokens x group heads: 128-row tiles (8 warps) for long chunks, 64 for medium ones,
    16-32 when every sequence brings few tokens (mixed batches of decodes and short chunks). float32
    dots run on the FMA units, not the tensor cores: at most 64 rows there."""
    rows = max_query_len * G
    if rows >= 128 and D <= 128 and not f32:
        block_m, warps = 128, 8
    else:
        block_m, warps = (64 if rows >= 64 else max(16, triton.next_power_of_2(rows))), 4
    block_m = max(block_m, triton.next_power_of_2(G))
    return dict(G=G, BLOCK_Q=block_m // G, BLOCK_M=block_m, BLOCK_N=PREFILL_BLOCK_N, BLOCK_SIZE=block_size,
                HEAD_DIM=D, D_PAD=max(16, triton.next_power_of_2(D)), F32=f32, WINDOW=window, SOFTCAP=softcap,
                num_warps=warps, num_stages=2)


def decode_meta(G: int, D: int, block_size: int, f32: bool, direct: bool, window: bool = False,
                softcap: bool = False) -> dict[str, int]:
    """Constexprs and launch options of `decode_attention_kernel` (shared with the AOT check)."""
    return dict(G=G, G_PAD=max(16, triton.next_power_of_2(G)), BLOCK_N=DECODE_BLOCK_N, BLOCK_SIZE=block_size,
                HEAD_DIM=D, D_PAD=max(16, triton.next_power_of_2(D)), F32=f32, DIRECT=direct, WINDOW=window,
                SOFTCAP=softcap, num_warps=4, num_stages=2)


def reduce_meta(D: int, splits: int) -> dict[str, int]:
    """Constexprs and launch options of `decode_reduce_kernel` (shared with the AOT check)."""
    return dict(HEAD_DIM=D, D_PAD=max(16, triton.next_power_of_2(D)),
                SPLITS_PAD=max(2, triton.next_power_of_2(splits)), num_warps=1)


def paged_attention(
    q: torch.Tensor,  # (T, H, D)
    k_cache: torch.Tensor,  # (NB, KVH, BS, D)
    v_cache: torch.Tensor,  # (NB, KVH, BS, D)
    out: torch.Tensor,  # (T, H, D), written
    query_start_loc: torch.Tensor,  # (S + 1,) int32 / int64
    seq_lens: torch.Tensor,  # (S,) int32 / int64
    block_tables: torch.Tensor,  # (S, W) int32 / int64
    scale: float,
    max_query_len: int,
    max_seq_len: int,
    num_splits: int | None = None,  # decode only; None: `decode_splits`
    *,
    sliding_window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Causal attention of the step's queries over their paged context; fills and returns `out`."""
    check_rows("q", q, 3)
    check_rows("out", out, 3)
    check_rows("k_cache", k_cache, 4)
    check_rows("v_cache", v_cache, 4)
    check_float("q", q)
    check_index("query_start_loc", query_start_loc)
    check_index("seq_lens", seq_lens)
    check_index("block_tables", block_tables, ndim=2)
    check_same_device(q=q, k_cache=k_cache, v_cache=v_cache, out=out, query_start_loc=query_start_loc,
                      seq_lens=seq_lens, block_tables=block_tables)
    T, H, D = q.shape
    NB, KVH, BS, Dc = k_cache.shape
    S = seq_lens.shape[0]
    check(Dc == D, f"k_cache: head_dim must be q's {D}, got shape {tuple(k_cache.shape)}")
    check(0 < D <= MAX_HEAD_DIM, f"q: head_dim must be in [1, {MAX_HEAD_DIM}], got {D}")
    check(H % KVH == 0, f"q: num_heads {H} must be a multiple of the pool's num_kv_heads {KVH}")
    check(v_cache.shape == k_cache.shape and v_cache.stride() == k_cache.stride(),
          f"v_cache: shape and strides must match k_cache's {tuple(k_cache.shape)} / {k_cache.stride()}")
    check(q.dtype == k_cache.dtype == v_cache.dtype == out.dtype,
          f"q, k_cache, v_cache, out: one dtype expected, got {q.dtype}, {k_cache.dtype}, {v_cache.dtype}, "
          f"{out.dtype}")
    check(out.shape == q.shape, f"out: shape must be {tuple(q.shape)}, got {tuple(out.shape)}")
    check(query_start_loc.shape == (S + 1,),
          f"query_start_loc: shape must be ({S + 1},) (num_seqs + 1), got {tuple(query_start_loc.shape)}")
    check(block_tables.shape[0] == S, f"block_tables: must have {S} rows (num_seqs), got {block_tables.shape[0]}")
    check(max_query_len >= 1 and max_seq_len >= 1,
          f"max_query_len, max_seq_len: must be >= 1, got {max_query_len}, {max_seq_len}")
    check(sliding_window is None or sliding_window >= 1, f"sliding_window: must be >= 1, got {sliding_window}")
    check(softcap is None or softcap > 0, f"softcap: must be > 0, got {softcap}")
    if T == 0 or S == 0:
        return out
    G = H // KVH
    F32 = dot_in_float32(q)
    features = _Features(sliding_window, softcap, scale)
    if max_query_len == 1:
        check(T == S, f"q: a decode batch (max_query_len 1) has one token per sequence: {S}, got {T}")
        longest = max_seq_len if sliding_window is None else min(max_seq_len, sliding_window)  # keys read
        splits = num_splits or decode_splits(S, KVH, longest, _num_sms(q.device))
        check(1 <= splits <= 256, f"num_splits: must be in [1, 256], got {splits}")
        _decode(q, k_cache, v_cache, out, seq_lens, block_tables, features, splits, F32)
        return out
    meta = prefill_meta(max_query_len, G, D, BS, F32, features.window_on, features.softcap_on)
    prefill_attention_kernel[(T // meta["BLOCK_Q"] + S, KVH)](
        q, k_cache, v_cache, out, query_start_loc, seq_lens, block_tables, features.scale_log2,
        features.cap_log2, features.window, S,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        **meta,
    )
    return out


class _Features:
    """The kernels' feature arguments: constexpr switches and the runtime values (see `attention_prefill`)."""

    def __init__(self, sliding_window: int | None, softcap: float | None, scale: float) -> None:
        self.window_on = sliding_window is not None
        self.softcap_on = softcap is not None
        self.window = sliding_window or 0
        log2e = math.log2(math.e)
        self.scale_log2 = scale * log2e if softcap is None else scale / softcap
        self.cap_log2 = 0.0 if softcap is None else softcap * log2e


def _decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, out: torch.Tensor,
            seq_lens: torch.Tensor, block_tables: torch.Tensor, features: _Features, splits: int, F32: bool) -> None:
    S, H, D = q.shape
    _, KVH, BS, _ = k_cache.shape
    direct = splits == 1
    # workspaces: sized by shapes and the split count only (graph-capturable)
    part_out = q.new_empty((S, H, splits, D), dtype=torch.float32) if not direct else out
    part_lse = q.new_empty((S, H, splits), dtype=torch.float32) if not direct else out
    decode_attention_kernel[(S, KVH, splits)](
        q, k_cache, v_cache, out, part_out, part_lse, seq_lens, block_tables, features.scale_log2,
        features.cap_log2, features.window, splits,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        **decode_meta(H // KVH, D, BS, F32, direct, features.window_on, features.softcap_on),
    )
    if not direct:
        decode_reduce_kernel[(S, H)](
            out, part_out, part_lse, splits, out.stride(0), out.stride(1),
            **reduce_meta(D, splits),
        )


def paged_attention_reference(
    q: torch.Tensor,  # (T, H, D)
    k_cache: torch.Tensor,  # (NB, KVH, BS, D)
    v_cache: torch.Tensor,  # (NB, KVH, BS, D)
    query_start_loc: torch.Tensor,  # (S + 1,)
    seq_lens: torch.Tensor,  # (S,)
    block_tables: torch.Tensor,  # (S, W)
    scale: float,
    *,
    sliding_window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Same contract in plain torch: per sequence, gather its context, float64 causal softmax."""
    T, H, D = q.shape
    _, KVH, BS, _ = k_cache.shape
    out = torch.zeros_like(q)
    starts = query_start_loc.tolist()
    for s, ctx in enumerate(seq_lens.tolist()):
        n = starts[s + 1] - starts[s]
        if n == 0 or ctx == 0:
            continue
        pos = torch.arange(ctx, device=q.device)
        blocks = block_tables[s].long()[pos // BS]  # (ctx,)
        keys = k_cache[blocks, :, pos % BS].double().repeat_interleave(H // KVH, dim=1)  # (ctx, H, D)
        vals = v_cache[blocks, :, pos % BS].double().repeat_interleave(H // KVH, dim=1)
        qs = q[starts[s] : starts[s + 1]].double()  # (n, H, D)
        scores = torch.einsum("ihd,khd->hik", qs, keys) * scale  # (H, n, ctx)
        if softcap is not None:
            scores = softcap * torch.tanh(scores / softcap)
        qpos = torch.arange(ctx - n, ctx, device=q.device)[:, None]  # (n, 1)
        visible = pos[None, :] <= qpos  # (n, ctx)
        if sliding_window is not None:
            visible &= pos[None, :] > qpos - sliding_window
        probs = scores.masked_fill(~visible, float("-inf")).softmax(-1)
        out[starts[s] : starts[s + 1]] = torch.einsum("hik,khd->ihd", probs, vals).to(q.dtype)
    return out
