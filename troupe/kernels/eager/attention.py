"""Paged attention in eager torch over the block pool (the `eager` kernel set's attention).

Contract: `troupe.kernels.base` (`KernelSet.attention`) and the reference
`troupe.kernels.reference.paged_attention`. The new tokens' K/V are already in the pool
(`rope_and_cache` ran first); `k`, `v` are passed as well, so a chunk whose whole context is itself
attends to them directly instead of reading them back.

Decodes (one new token) go through one batched SDPA over their gathered block tables; longer chunks
go one attention call per sequence (reading the context back from the pool only when there is earlier
context; small float32 chunks use bmm + softmax, faster than CPU SDPA at prefill sizes). GQA is folded
into the query length (`enable_gqa=True` is several times slower in bf16 on CPU). Masks, gather
indices and gather buffers depend only on the step, so they are built on the first layer's call and
kept on the step's `EagerMetadata`.

Decode rows (`meta.rows`, optional; decodes it does not list still gather): the gather above copies
every decode's whole context out of the pool in every layer of every step, which costs more than the
attention itself at large batches. When the kernel set keeps a contiguous copy of each decode's context
in a row cache (`troupe.kernels.eager.rows`), the decodes attend over that instead: the new K/V are
written to the rows too, a row that is new (or stale) is first filled from the pool, and per group of
`ROW_GROUP` rows one bmm + softmax + bmm up to the group's longest context does the rest. The pool stays
the source of truth.

Sliding window and soft-capping (`troupe.kernels.base`, "Attention features"): a window changes which
positions are read, so the plan is built per window (`EagerMetadata.plans`) and reads only the blocks that
hold a query's window (a decode gathers its window's blocks; a chunk the blocks from its first query's
window on; a group of rows from the earliest window start of its rows). A cap is applied to the scores
before the mask, which SDPA cannot do: with a cap, every path computes scores, cap, mask, softmax and P V
itself in float32 (`_capped_attention`, in pieces of at most `_MATH_MAX_SCORES` scores).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from troupe.kernels.base import AttentionMetadata


@dataclass(slots=True)
class EagerMetadata(AttentionMetadata):
    """The step's metadata plus what the eager ops build once and every layer reuses."""

    rows: DecodeRows | None = None  # the decodes' row cache; None: decodes gather from the pool
    plan: _TorchPlan | None = field(default=None, repr=False)  # attention indices, built on first use
    plans: dict[int, _TorchPlan] = field(default_factory=dict, repr=False)  # the same per sliding window
    # (the table they came from, cos, sin (T, 1, D/2)): the last gathered, reused while layers share the table
    rope: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = field(default=None, repr=False)


ROW_GROUP = 8  # decode rows attend in groups of this many rows, each group only up to its longest context


@dataclass(slots=True)
class DecodeRows:
    """Where this step's decodes live in a row cache: contiguous copies of their context, per layer.

    `k[layer]`, `v[layer]`: (RC, KVH, LC, D); row r holds one sequence's keys for kv head h at
    `[r, h, :len]`, where len is its context length. Rows are read in groups: group `(r0, r1, bias)` covers
    rows `[r0, r1)` and positions `[0, L)`, `L = bias.shape[-1]` (its longest context), `bias` being
    ((r1 - r0) * KVH, 1, L) float 0 / -inf (position < the row's length). A row no decode uses this step
    only needs finite values. Rows sorted by context length (the runner keeps them so) make each group
    read little more than its decodes' contexts instead of everyone padded to the longest.
    """

    k: list[torch.Tensor]  # per layer (RC, KVH, LC, D)
    v: list[torch.Tensor]
    tokens: torch.Tensor  # (B,) step token index of each decode
    rows: torch.Tensor  # (B,) its row
    write_idx: torch.Tensor  # (B * KVH,) its new token's index in `k[layer].view(-1, D)`, per kv head
    refills: list[tuple[int, torch.Tensor, int]]  # (row, blocks (nb,), ctx_len): copy from the pool first
    groups: list[tuple[int, int, torch.Tensor]]  # (r0, r1, bias ((r1 - r0) * KVH, 1, L))
    row_lens: list[int] = field(default_factory=list)  # (R,) context length of each row's decode, 0: none
    # (window or 0, dtype) -> per group (first position read, its bias repeated for the G heads)
    _bias_g: dict[tuple[int, torch.dtype], list[tuple[int, torch.Tensor]]] = field(default_factory=dict, repr=False)

    @property
    def num_rows(self) -> int:
        """Rows `[0, R)` take part (the last group's end)."""
        return self.groups[-1][1]

    @classmethod
    def build(
        cls,
        k: list[torch.Tensor],  # per layer (RC, KVH, LC, D)
        v: list[torch.Tensor],
        tokens: torch.Tensor,  # (B,)
        rows: list[int],  # distinct, < RC
        seq_lens: list[int],  # context length of each decode after this step, <= LC
        refills: list[tuple[int, torch.Tensor, int]],
        group: int = ROW_GROUP,
    ) -> DecodeRows:
        _, KVH, LC, _ = k[0].shape
        row_t, len_t = torch.tensor(rows), torch.tensor(seq_lens)
        R = max(rows) + 1
        heads = (row_t[:, None] * KVH + torch.arange(KVH)) * LC  # (B, KVH) first slot of each row / head
        row_len = [0] * R  # unused rows: 0
        for r, n in zip(rows, seq_lens, strict=True):
            row_len[r] = n
        groups = []
        for r0 in range(0, R, group):
            lens = torch.tensor(row_len[r0 : r0 + group])  # (n,)
            L = int(lens.max())
            if L == 0:
                continue  # no decode in these rows: skipped (the last group is never empty)
            visible = torch.arange(L)[None, :] < lens[:, None]  # (n, L)
            visible[lens == 0] = True  # a row without a decode attends to finite garbage, never to nothing
            bias = torch.zeros(len(lens), L).masked_fill_(~visible, float("-inf"))  # (n, L)
            groups.append((r0, r0 + len(lens), bias.repeat_interleave(KVH, dim=0)[:, None, :]))
        return cls(
            k=k,
            v=v,
            tokens=tokens,
            rows=row_t,
            write_idx=(heads + (len_t - 1)[:, None]).reshape(-1),  # (B * KVH,)
            refills=refills,
            groups=groups,
            row_lens=row_len,
        )

    def biases(self, window: int | None, dtype: torch.dtype, G: int) -> list[tuple[int, torch.Tensor]]:
        """Per group: the first position it reads, and its bias from there ((r1 - r0) * KVH, G, L - first)
        in `dtype`, with `window` also -inf before each row's window (built once per step and window)."""
        key = (window or 0, dtype)
        if key not in self._bias_g:
            out = []
            for r0, r1, bias in self.groups:
                first = 0
                if window is not None:
                    lens = torch.tensor(self.row_lens[r0:r1])  # (n,)
                    starts = (lens - window).clamp(min=0)  # (n,) each row's first visible position
                    first = int(starts[lens > 0].min())
                    old = torch.arange(bias.shape[-1])[None, :] < starts[:, None]  # (n, L)
                    bias = bias.masked_fill(old.repeat_interleave(bias.shape[0] // len(lens), dim=0)[:, None, :],
                                            float("-inf"))
                bias = bias[..., first:].to(dtype)
                out.append((first, bias.expand(bias.shape[0], G, bias.shape[-1]).contiguous()))
            self._bias_g[key] = out
        return self._bias_g[key]


@dataclass(slots=True)
class _Decodes:
    tokens: torch.Tensor  # (B,) token index of each decode in the step
    blocks: torch.Tensor  # (B * nb,) their block tables from each window's first block, nb blocks each
    mask: torch.Tensor  # (B, 1, 1, nb * block_size) bool: the key position is in [seq_len - window, seq_len)
    k_buf: torch.Tensor | None = None  # (B * nb, BS, KVH, D) gather targets, reused by every layer
    v_buf: torch.Tensor | None = None


@dataclass(slots=True)
class _Chunk:
    start: int  # token range of this sequence in the step
    end: int
    blocks: torch.Tensor | None  # (nb,) the blocks holding the keys it reads; None: no earlier context
    key0: int  # the first position it reads (0 without a window)
    ctx_len: int
    mask: torch.Tensor  # (G * q_len, ctx_len - key0) bool, causal with offset (and the window), G times
    bias: torch.Tensor | None = None  # the mask as float32 0 / -inf, for the bmm path


@dataclass(slots=True)
class _TorchPlan:
    decodes: _Decodes | None
    chunks: list[_Chunk]


# Below this many scores (G * q_len * ctx_len per kv head) a float32 chunk uses bmm + softmax, which is
# faster than CPU SDPA at prefill sizes; above it SDPA keeps memory flat.
_MATH_MAX_SCORES = 1 << 22


def paged_attention(
    q: torch.Tensor,  # (T, H, D)
    k: torch.Tensor,  # (T, KVH, D), already written to the pool
    v: torch.Tensor,  # (T, KVH, D)
    k_cache: torch.Tensor,  # (NB, BS, KVH, D)
    v_cache: torch.Tensor,  # (NB, BS, KVH, D)
    meta: EagerMetadata,
    scale: float,
    layer: int = 0,
    *,
    sliding_window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Attend over the pool (which holds the step's new tokens); returns (T, H, D). `sliding_window`,
    `softcap`: see `troupe.kernels.reference.paged_attention`.

    `layer` picks this layer's tensors in `meta.rows` (unused without a row cache)."""
    T, H, D = q.shape
    _, BS, KVH, _ = k_cache.shape
    G = H // KVH
    if sliding_window is None:
        if meta.plan is None:
            meta.plan = _build_plan(meta, BS, G, None)
        plan = meta.plan
    else:
        if sliding_window not in meta.plans:
            meta.plans[sliding_window] = _build_plan(meta, BS, G, sliding_window)
        plan = meta.plans[sliding_window]
    out = torch.empty_like(q)  # (T, H, D)
    if meta.rows is not None:
        _row_attention(q, k, v, k_cache, v_cache, meta.rows, layer, scale, out, sliding_window, softcap)
    if plan.decodes is not None:
        _decode_attention(q, k_cache, v_cache, plan.decodes, scale, out, softcap)
    for c in plan.chunks:
        n = c.end - c.start
        qc = q[c.start : c.end].view(n, KVH, G, D).permute(1, 2, 0, 3).reshape(KVH, G * n, D)  # (KVH, G*n, D)
        if c.blocks is None:  # the whole context is this chunk: no need to read it back from the pool
            kc = k[c.start + c.key0 : c.end].transpose(0, 1)  # (KVH, L, D)
            vc = v[c.start + c.key0 : c.end].transpose(0, 1)  # (KVH, L, D)
        else:
            skip = c.key0 % BS  # the blocks start on a boundary, the keys at key0
            kc = (
                k_cache.index_select(0, c.blocks).view(-1, KVH, D)[skip : skip + c.ctx_len - c.key0].transpose(0, 1)
            )  # (KVH, L, D)
            vc = (
                v_cache.index_select(0, c.blocks).view(-1, KVH, D)[skip : skip + c.ctx_len - c.key0].transpose(0, 1)
            )  # (KVH, L, D)
        if softcap is not None:
            oc = _capped_attention(qc, kc, vc, c.mask, scale, softcap)  # (KVH, G*n, D)
        elif q.dtype == torch.float32 and G * n * (c.ctx_len - c.key0) <= _MATH_MAX_SCORES:
            if c.bias is None:
                c.bias = torch.zeros(c.mask.shape).masked_fill_(~c.mask, float("-inf"))
            scores = torch.baddbmm(c.bias, qc, kc.transpose(1, 2), alpha=scale)  # (KVH, G*n, L)
            oc = torch.bmm(torch.softmax(scores, dim=-1, out=scores), vc)  # (KVH, G*n, D)
        else:
            oc = F.scaled_dot_product_attention(qc, kc, vc, attn_mask=c.mask, scale=scale)  # (KVH, G*n, D)
        out[c.start : c.end] = oc.view(KVH, G, n, D).permute(2, 0, 1, 3).reshape(n, H, D)
    return out


def _decode_attention(
    q: torch.Tensor,  # (T, H, D)
    k_cache: torch.Tensor,  # (NB, BS, KVH, D)
    v_cache: torch.Tensor,  # (NB, BS, KVH, D)
    dec: _Decodes,
    scale: float,
    out: torch.Tensor,  # (T, H, D), the decode rows are filled in
    softcap: float | None,
) -> None:
    _, BS, KVH, D = k_cache.shape
    B, H = dec.tokens.shape[0], q.shape[1]
    L = dec.mask.shape[-1]
    if dec.k_buf is None or dec.k_buf.dtype != k_cache.dtype:
        dec.k_buf = k_cache.new_empty((dec.blocks.shape[0], BS, KVH, D))
        dec.v_buf = k_cache.new_empty((dec.blocks.shape[0], BS, KVH, D))
    assert dec.v_buf is not None
    # index_select into a reused buffer: much cheaper than k_cache[table] plus a fresh allocation per layer
    kd = (
        torch.index_select(k_cache, 0, dec.blocks, out=dec.k_buf).view(B, L, KVH, D).transpose(1, 2)
    )  # (B, KVH, L, D)
    vd = (
        torch.index_select(v_cache, 0, dec.blocks, out=dec.v_buf).view(B, L, KVH, D).transpose(1, 2)
    )  # (B, KVH, L, D)
    qd = q.index_select(0, dec.tokens).view(B, KVH, H // KVH, D)  # (B, KVH, G, D)
    if softcap is None:
        od = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=dec.mask, scale=scale)  # (B, KVH, G, D)
    else:
        mask = dec.mask.view(B, 1, L)  # per kv head: the gathered blocks are read in place (strided, no copy)
        od = torch.stack([_capped_attention(qd[:, h], kd[:, h], vd[:, h], mask, scale, softcap)
                          for h in range(KVH)], dim=1)  # (B, KVH, G, D)
    out.index_copy_(0, dec.tokens, od.reshape(B, H, D))


def _row_attention(
    q: torch.Tensor,  # (T, H, D)
    k: torch.Tensor,  # (T, KVH, D)
    v: torch.Tensor,  # (T, KVH, D)
    k_cache: torch.Tensor,  # (NB, BS, KVH, D), already holding this step's tokens
    v_cache: torch.Tensor,  # (NB, BS, KVH, D)
    dr: DecodeRows,
    layer: int,
    scale: float,
    out: torch.Tensor,  # (T, H, D), the decode rows are filled in
    window: int | None,
    softcap: float | None,
) -> None:
    kr, vr = dr.k[layer], dr.v[layer]  # (RC, KVH, LC, D)
    RC, KVH, LC, D = kr.shape
    B, H = dr.tokens.shape[0], q.shape[1]
    G = H // KVH
    kr.view(-1, D).index_copy_(0, dr.write_idx, k.index_select(0, dr.tokens).view(B * KVH, D))
    vr.view(-1, D).index_copy_(0, dr.write_idx, v.index_select(0, dr.tokens).view(B * KVH, D))
    for row, blocks, n in dr.refills:  # the pool already holds the new token, so the copy includes it
        kr[row, :, :n] = k_cache.index_select(0, blocks).view(-1, KVH, D)[:n].transpose(0, 1)
        vr[row, :, :n] = v_cache.index_select(0, blocks).view(-1, KVH, D)[:n].transpose(0, 1)
    R = dr.num_rows
    qr = q.new_zeros(R, H, D)  # (R, H, D): rows without a decode get a zero query
    qr.index_copy_(0, dr.rows, q.index_select(0, dr.tokens))
    o = q.new_zeros(R * KVH, G, D)  # (R*KVH, G, D): rows in skipped groups stay zero (no decode reads them)
    for (r0, r1, _), (first, bias_g) in zip(dr.groups, dr.biases(window, q.dtype, G), strict=True):
        L = bias_g.shape[-1]  # positions [first, first + L)
        kk = kr.view(RC * KVH, LC, D)[r0 * KVH : r1 * KVH, first : first + L]  # (n*KVH, L, D), strided: no copy
        vv = vr.view(RC * KVH, LC, D)[r0 * KVH : r1 * KVH, first : first + L]  # (n*KVH, L, D)
        qg = qr[r0:r1].view((r1 - r0) * KVH, G, D)  # (n*KVH, G, D)
        if softcap is not None:
            o[r0 * KVH : r1 * KVH] = _capped_attention(qg, kk, vv, bias_g == 0, scale, softcap)
        elif q.dtype == torch.float32:
            scores = torch.baddbmm(bias_g, qg, kk.transpose(1, 2), alpha=scale)  # (n*KVH, G, L)
            torch.bmm(torch.softmax(scores, dim=-1, out=scores), vv, out=o[r0 * KVH : r1 * KVH])
        else:  # bmm + softmax in bf16 would lose precision: SDPA accumulates in float
            n = r1 - r0
            o[r0 * KVH : r1 * KVH] = F.scaled_dot_product_attention(
                qg.view(n, KVH, G, D), kk.view(n, KVH, L, D), vv.view(n, KVH, L, D),
                attn_mask=bias_g.view(n, KVH, G, L), scale=scale,
            ).view(n * KVH, G, D)
    out.index_copy_(0, dr.tokens, o.view(R, H, D).index_select(0, dr.rows))


def _build_plan(meta: EagerMetadata, block_size: int, G: int, window: int | None) -> _TorchPlan:
    BS = block_size
    starts = meta.query_start_loc.tolist()
    seq_lens = meta.seq_lens.tolist()
    in_rows = set() if meta.rows is None else set(meta.rows.tokens.tolist())
    dec_seqs = [s for s in range(len(seq_lens)) if starts[s + 1] - starts[s] == 1 and starts[s] not in in_rows]
    decodes = None
    if dec_seqs:
        idx = torch.tensor(dec_seqs)
        lens = meta.seq_lens[idx]  # (B,)
        if window is None:
            nb = -(-max(seq_lens[s] for s in dec_seqs) // BS)
            mask = torch.arange(nb * BS) < lens[:, None]  # (B, L)
            blocks = meta.block_tables[idx, :nb].reshape(-1)  # (B * nb,)
        else:  # each decode's blocks from the one holding its window's first position
            lo = (lens - window).clamp(min=0)  # (B,) first visible position
            b0 = lo // BS  # (B,)
            nb = int(((lens - 1) // BS - b0).max()) + 1
            cols = b0[:, None] + torch.arange(nb)  # (B, nb) block index in each table, past its end for some
            pos = cols[:, :, None] * BS + torch.arange(BS)  # (B, nb, BS) the position each key slot holds
            mask = ((pos >= lo[:, None, None]) & (pos < lens[:, None, None])).view(len(dec_seqs), nb * BS)
            cols = cols.clamp(max=meta.block_tables.shape[1] - 1)  # read some valid block there; masked
            blocks = meta.block_tables[idx[:, None], cols].reshape(-1)  # (B * nb,)
        decodes = _Decodes(tokens=meta.query_start_loc[idx], blocks=blocks, mask=mask[:, None, None, :])
    chunks = []
    for s, ctx in enumerate(seq_lens):
        n = starts[s + 1] - starts[s]
        if n <= 1:
            continue
        key0 = 0 if window is None else max(0, ctx - n + 1 - window)  # what the first query sees first
        ctx_blocks = meta.block_tables[s, key0 // BS : -(-ctx // BS)] if ctx > n else None
        qpos = torch.arange(ctx - n, ctx)  # (n,) positions of the new tokens
        kpos = torch.arange(key0, ctx)  # (L,) positions read
        mask = kpos[None, :] <= qpos[:, None]  # (n, L)
        if window is not None:
            mask &= kpos[None, :] > qpos[:, None] - window
        chunks.append(_Chunk(starts[s], starts[s + 1], ctx_blocks, key0, ctx, mask.repeat(G, 1)))
    return _TorchPlan(decodes, chunks)


def _capped_attention(
    q: torch.Tensor,  # (B, M, D)
    k: torch.Tensor,  # (B, L, D)
    v: torch.Tensor,  # (B, L, D)
    mask: torch.Tensor,  # (M, L) or (B or 1, M or 1, L) bool: visible
    scale: float,
    softcap: float,
) -> torch.Tensor:
    """Soft-capped attention in float32: `softmax(mask(cap * tanh(scale * q.k / cap))) v`, in pieces of
    query rows of at most `_MATH_MAX_SCORES` scores; (B, M, D) in q's dtype."""
    B, M, D = q.shape
    L = k.shape[1]
    kf, vf = k.float().transpose(1, 2), v.float()  # (B, D, L), (B, L, D)
    mask = mask.expand(B, M, L)
    out = q.new_empty(B, M, D)
    rows = max(1, _MATH_MAX_SCORES // max(1, B * L))
    for m0 in range(0, M, rows):
        scores = torch.bmm(q[:, m0 : m0 + rows].float(), kf).mul_(scale / softcap).tanh_().mul_(softcap)
        scores.masked_fill_(~mask[:, m0 : m0 + rows], float("-inf"))  # (B, m, L)
        out[:, m0 : m0 + rows] = torch.bmm(torch.softmax(scores, dim=-1), vf).to(q.dtype)
    return out
