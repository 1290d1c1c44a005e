"""Plain-torch references of every kernel-set op: slow, obvious, and the oracle the tests compare each
kernel set with (`troupe.kernels.base` has the contract). Nothing here is used on a serving path.

- `write_kv`: the KV write at `slot_mapping` (slot -1: skip, as a padded batch needs).
- `rope`: rotate-half rotary embedding from a `(max_pos, D)` cos | sin table.
- `paged_attention`: one token at a time over its visible positions (causal, optionally a sliding window,
  optionally soft-capped scores), softmax in float64.
- `rms_norm`, `silu_and_mul`: in float32, cast back to the input dtype.
- `rope_cache`: the `(max_pos, D)` float32 table the model builds from its inverse frequencies.
"""

from __future__ import annotations

import torch

from troupe.kernels.base import AttentionMetadata


def rope_cache(inv_freq: torch.Tensor, max_pos: int) -> torch.Tensor:
    """(max_pos, D) float32: `cos(p * f)` in the first D/2 columns, `sin(p * f)` in the last; `inv_freq`
    (D/2,) float64."""
    angles = torch.outer(torch.arange(max_pos, dtype=torch.float64), inv_freq)  # (max_pos, D/2)
    return torch.cat([angles.cos(), angles.sin()], dim=-1).float()


def rope(positions: torch.Tensor, x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """Rotate-half rotary (HF layout) of x (T, n, D) at `positions` (T,); returns a new tensor."""
    half = x.shape[-1] // 2
    cos = table[positions, :half].double().unsqueeze(1)  # (T, 1, D/2)
    sin = table[positions, half:].double().unsqueeze(1)
    x1, x2 = x.double().chunk(2, dim=-1)  # (T, n, D/2) each
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Token i's K/V (T, KVH, D) to slot `slot_mapping[i]` of pools (NB, BS, KVH, D); slot -1 is skipped."""
    BS = k_cache.shape[1]
    for i, slot in enumerate(slot_mapping.tolist()):
        if slot >= 0:
            k_cache[slot // BS, slot % BS] = k[i]
            v_cache[slot // BS, slot % BS] = v[i]


def paged_attention(
    q: torch.Tensor,  # (T, H, D)
    k_cache: torch.Tensor,  # (NB, BS, KVH, D), already holding the step's new tokens
    v_cache: torch.Tensor,  # (NB, BS, KVH, D)
    meta: AttentionMetadata,
    scale: float,
    *,
    sliding_window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Causal paged attention: query token i of sequence s (position `p = seq_lens[s] - q_len + i`) attends
    to context positions `0 ..= p` of its blocks, with `sliding_window` W only to `p - W < j <= p` (W
    positions, itself included: transformers' `kv_idx > q_idx - sliding_window`); GQA by repeating each kv
    head over `H // KVH` query heads. Scores are `scale * q.k`, then with `softcap` c `c * tanh(score / c)`
    (Gemma 2's order: scale, cap, then the mask and the softmax). Returns (T, H, D) in q's dtype."""
    T, H, D = q.shape
    _, BS, KVH, _ = k_cache.shape
    out = torch.empty_like(q)
    starts = meta.query_start_loc.tolist()
    for s, ctx in enumerate(meta.seq_lens.tolist()):
        n = starts[s + 1] - starts[s]
        table = meta.block_tables[s].tolist()
        keys = torch.stack([k_cache[table[p // BS], p % BS] for p in range(ctx)]).double()  # (ctx, KVH, D)
        vals = torch.stack([v_cache[table[p // BS], p % BS] for p in range(ctx)]).double()  # (ctx, KVH, D)
        keys = keys.repeat_interleave(H // KVH, dim=1)  # (ctx, H, D)
        vals = vals.repeat_interleave(H // KVH, dim=1)  # (ctx, H, D)
        for i in range(n):
            visible = ctx - n + i + 1
            first = 0 if sliding_window is None else max(0, visible - sliding_window)
            qi = q[starts[s] + i].double()  # (H, D)
            scores = torch.einsum("hd,khd->hk", qi, keys[first:visible]) * scale  # (H, visible - first)
            if softcap is not None:
                scores = softcap * torch.tanh(scores / softcap)
            out[starts[s] + i] = torch.einsum("hk,khd->hd", scores.softmax(-1), vals[first:visible]).to(q.dtype)
    return out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """(T, h): `x / sqrt(mean(x^2) + eps) * weight`, computed in float32."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.float()).to(x.dtype)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """(T, 2f) -> (T, f): `silu(gate) * up`, computed in float32."""
    gate, up = x.float().chunk(2, dim=-1)
    return (gate * torch.sigmoid(gate) * up).to(x.dtype)
