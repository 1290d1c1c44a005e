"""`KernelSet`: the interface between the model description and the code that does its heavy work.

The model (`troupe.models.llama`) is one plain description of the decoder. Everything heavy it does —
projections, the embedding lookup, norms, rotary + the KV write, attention over the paged pool, SiLU x up —
goes through one `KernelSet`, chosen once when the model loads (`troupe.kernels.select_kernels`), by
device and by what the machine can run: the eager torch set (always there; the fallback and the
oracle's neighbour in tests), compiled CPU kernels, Triton kernels on CUDA. One interface, several
implementations; the model has no `if device == ...`.

Contract (shapes: T new tokens in the step, S sequences, H query heads, KVH kv heads, D head dim):

- Weights, at load time: `linear(weight (N, K), bias (N,) | None)` returns the projection
  `x (M, K) -> (M, N)` (= `F.linear`, up to summation order). The set may take the weight's storage over
  (pack it, quantize it, move it, release the dense copy): pass a tensor nothing else needs.
  `embedding(table (V, hidden))` returns the lookup `ids (T,) -> (T, hidden)`. Either weight may be a
  `troupe.kernels.quant.QuantizedTensor` (GGUF blocks; never modified, so it may be shared): a set computes
  on the blocks, or expands them once (`quant.dense`); the projection's output is then float32.
- KV pool: `allocate_kv(spec)` returns one `(k_pool, v_pool)` pair per layer, in the layout and dtype the
  set's attention reads (`kv_cache_shape`, `kv_cache_dtype`); the scheduler and KV manager only ever see
  block ids.
- Per step: `prepare(seqs, block_size)` flattens the scheduled sequences into a `StepBatch` on the set's
  device: token ids, positions, the `AttentionMetadata` every layer shares, and the token index of each
  row of logits wanted. A set may keep state across steps here (a row cache, CUDA graph buffers); it is
  called once per step, before the model runs.
- Per layer, in this order: `add_rms_norm` / `rms_norm`; `linear`; `rope_and_cache(positions, q, k, v,
  rope_cache, kv, meta)`, which rotates q and k (HF rotate-half layout) and writes the rotated k and v of
  every new token at `meta.slot_mapping` before any attention reads the pool, returning the rotated
  (q, k); `attention(q, k, v, kv, meta, scale, layer, *, sliding_window=None, softcap=None)` (see
  `troupe.kernels.reference.paged_attention` for the exact semantics; `k`, `v` are the new tokens'
  rotated keys and values, which a set may use instead of reading them back); `silu_and_mul`.
- Attention features (`ATTENTION_FEATURES`, per call, so per layer): `sliding_window` W, a query at
  position p sees only keys p - W < j <= p (the pool still holds the whole context); `softcap` c, the
  scaled scores become `c * tanh(s / c)` before the softmax (Gemma 2). None: plain causal attention,
  computed exactly as without the feature. `KernelSet.attention_features` says which a set computes;
  a model must not ask a set for one it lacks (`check_attention_options`).

Every op has a plain-torch reference in `troupe.kernels.reference`, which tests compare each set with.
"""

from __future__ import annotations

import abc
import math
import mmap
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import chain
from typing import ClassVar, NamedTuple, Protocol

import numpy as np
import torch
import torch.nn.functional as F

from troupe.errors import InvalidInputError
from troupe.kernels.moe import ExpertGateUp, MoeOp, grouped_experts, linear_rows
from troupe.kernels.quant import Weight, dense

LinearOp = Callable[[torch.Tensor], torch.Tensor]  # (M, K) -> (M, N)
EmbeddingOp = Callable[[torch.Tensor], torch.Tensor]  # (T,) int64 -> (T, hidden)
LayerKV = tuple[torch.Tensor, torch.Tensor]  # (k_pool, v_pool) of one layer
ATTENTION_FEATURES = frozenset({"sliding_window", "softcap"})  # optional arguments of `KernelSet.attention`


class LayerWeights(NamedTuple):
    """What a decoder stack (`KernelSet.decoder_stack`) takes of one bound Llama-family layer."""

    input_norm: torch.Tensor
    post_norm: torch.Tensor
    qkv: LinearOp
    o_proj: LinearOp
    gate_up: LinearOp
    down: LinearOp


# (embedded x, positions, rope table, kv caches, metadata) -> (last layer's output, residual stream)
DecoderStack = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, Sequence[LayerKV], "AttentionMetadata"],
                        tuple[torch.Tensor, torch.Tensor]]


class ScheduledSeq(Protocol):
    """What a kernel set reads of one scheduled sequence (`troupe.core.batch.ScheduledSeq` has the
    contract; kernels do not import the engine core)."""

    @property
    def request_id(self) -> str: ...
    @property
    def token_ids(self) -> list[int]: ...
    @property
    def start_pos(self) -> int: ...
    @property
    def block_ids(self) -> list[int]: ...
    @property
    def needs_logits(self) -> bool: ...


@dataclass(slots=True)
class AttentionMetadata:
    """What every layer's attention needs about one step; built once per step by `KernelSet.prepare`.

    Sequence s owns tokens `query_start_loc[s] : query_start_loc[s+1]` of the flattened step; its context
    after the step is `seq_lens[s]` tokens, the new ones being the last of them. Position p of sequence s
    lives in block `block_tables[s, p // block_size]` (rows padded with block 0); new token i goes to the
    flat pool slot `slot_mapping[i]` (`block * block_size + offset`).
    """

    slot_mapping: torch.Tensor  # (T,) int64
    query_start_loc: torch.Tensor  # (S+1,) int64, starting with 0
    seq_lens: torch.Tensor  # (S,) int64
    block_tables: torch.Tensor  # (S, max_blocks) int64
    max_query_len: int = 0  # longest new-token run of a sequence this step (0: not computed)
    max_seq_len: int = 0  # longest context after this step (0: not computed)


@dataclass(slots=True)
class StepBatch:
    """One step's inputs for the model, on the kernel set's device."""

    input_ids: torch.Tensor  # (T,)
    positions: torch.Tensor  # (T,)
    meta: AttentionMetadata
    logits_indices: torch.Tensor  # (N,) index in the step of the last token of each seq that needs logits


@dataclass(frozen=True, slots=True)
class KVSpec:
    """The KV pool a model needs: `num_layers` pairs of pools of `num_blocks` blocks."""

    num_layers: int
    num_blocks: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype  # the model's compute dtype (`kv_cache_dtype` decides the pool's)
    max_model_len: int
    max_num_seqs: int


HUGE_PAGE = 2 << 20  # bytes: a transparent huge page on x86-64 and most aarch64 kernels


def anonymous_bytes(nbytes: int, huge_pages: bool) -> torch.Tensor:
    """(nbytes,) uint8 over fresh private anonymous memory starting on a 2 MiB boundary. Its pages are zero
    and committed on first write. With `huge_pages`, the range is advised for transparent huge pages
    (`MADV_HUGEPAGE`, where the platform has it; in THP's "madvise" mode nothing else gets them). The
    memory lives as long as a view of it does."""
    mem = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if huge_pages and advice is not None:
        mem.madvise(advice)
    whole = torch.frombuffer(mem, dtype=torch.uint8)  # keeps `mem` alive as long as a view of it lives
    skip = -whole.data_ptr() % HUGE_PAGE
    return whole[skip:skip + nbytes]


def zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str = "cpu") -> torch.Tensor:
    """A zero-filled tensor for a KV pool. On the CPU its memory is committed lazily (`anonymous_bytes`):
    a page joins the process's resident memory only when a block on it is first written, so a pool sized
    for the worst case costs only the blocks that requests have used (the scheduler's free queue hands out
    the same blocks again first: `KVCacheManager`). The first write of each page is a fault, a
    few percent of an offline run that fills the pool. The pool keeps 4 KiB pages: advised for huge
    pages, a first touch was many times slower whenever the kernel had to compact memory for them, and a
    huge page would round each of the 2 x layers pools up by 2 MiB. Elsewhere: `torch.zeros`."""
    if torch.device(device).type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    return anonymous_bytes(max(nbytes, 1), huge_pages=False)[:nbytes].view(dtype).view(shape)


class KernelSet(abc.ABC):
    """One implementation of the model's heavy ops (see the module docstring for the contract)."""

    name: ClassVar[str]
    # True: quantized weights are expanded to the model's dtype when bound, so a GGUF model may compute in
    # any dtype; False: projections on quantized weights take and return float32 (the model computes in it)
    dequantizes_to_model_dtype: ClassVar[bool] = False
    # the attention features (`ATTENTION_FEATURES`) this set's `attention` computes natively
    attention_features: ClassVar[frozenset[str]] = frozenset()

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)

    # ------------------------------------------------------------------ weights (load time)

    @abc.abstractmethod
    def linear(self, weight: Weight, bias: torch.Tensor | None = None) -> LinearOp:
        """The projection `x (M, K) -> x @ weight.T + bias (M, N)`; may take `weight`'s storage over."""

    def moe(self, gate_up: Sequence[ExpertGateUp], down: Sequence[Weight]) -> MoeOp:
        """A layer's routed experts as one op `(x (T, h), ids (T, k), weights (T, k) float32) -> (T, h)`
        (`troupe.kernels.moe`): each expert's `gate_up` (2f, h) (or its parts [gate, up]) and `down` (h, f)
        bound by `linear`, run on the tokens routed to it. A set may replace it with a fused kernel of the
        same results."""
        ups = [linear_rows(self.linear, w) for w in gate_up]
        downs = [self.linear(w) for w in down]
        return grouped_experts(ups, downs, self.silu_and_mul)

    def embedding(self, table: Weight) -> EmbeddingOp:
        """The token-embedding lookup `ids (T,) -> (T, hidden)` over `table (V, hidden)` (a quantized table
        is expanded once)."""
        dense_table = dense(table)
        return lambda ids: F.embedding(ids, dense_table)

    # ------------------------------------------------------------------ the KV pool

    def kv_cache_dtype(self, model_dtype: torch.dtype) -> torch.dtype:
        """The dtype the pool holds for a model computing in `model_dtype`."""
        return model_dtype

    def kv_cache_shape(self, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int) -> tuple[int, ...]:
        """The shape of one layer's K (and V) pool."""
        return (num_blocks, block_size, num_kv_heads, head_dim)

    def kv_bytes_per_token(self, spec: KVSpec) -> int:
        """K and V of all layers for one token, in the pool's dtype."""
        itemsize = self.kv_cache_dtype(spec.dtype).itemsize
        return 2 * spec.num_layers * spec.num_kv_heads * spec.head_dim * itemsize

    def allocate_kv(self, spec: KVSpec) -> list[LayerKV]:
        """One zero-filled (K, V) pool pair per layer: never-written slots that a padded read touches and
        a mask hides must hold no NaN."""
        shape = self.kv_cache_shape(spec.num_blocks, spec.block_size, spec.num_kv_heads, spec.head_dim)
        dtype = self.kv_cache_dtype(spec.dtype)
        return [(zeros(shape, dtype, self.device), zeros(shape, dtype, self.device)) for _ in range(spec.num_layers)]

    # ------------------------------------------------------------------ per step

    def prepare(self, seqs: Sequence[ScheduledSeq], block_size: int) -> StepBatch:
        """Flatten the step (see `flatten_step`) and move it to the set's device."""
        batch = flatten_step(seqs, block_size)
        if self.device.type != "cpu":
            m = batch.meta
            def dev(t: torch.Tensor) -> torch.Tensor:
                return t.to(self.device, non_blocking=True)

            meta = AttentionMetadata(dev(m.slot_mapping), dev(m.query_start_loc), dev(m.seq_lens),
                                     dev(m.block_tables), max_query_len=m.max_query_len, max_seq_len=m.max_seq_len)
            batch = StepBatch(dev(batch.input_ids), dev(batch.positions), meta, dev(batch.logits_indices))
        return batch

    def decoder_stack(self, layers: Sequence[LayerWeights], num_heads: int, num_kv_heads: int, head_dim: int,
                      eps: float, scale: float) -> DecoderStack | None:
        """All the layers of a bound Llama-family model as one call with the same results as the model's
        own loop over them, or None (the default): the model then calls the per-layer ops below."""
        return None

    # ------------------------------------------------------------------ per layer

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """(T, h) -> (T, h): `x / rms(x) * weight`."""
        return F.rms_norm(x, (x.shape[-1],), weight, eps)

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(normed, summed): `summed = residual + x`, `normed = rms_norm(summed)`; either input may be
        overwritten in place."""
        summed = residual + x
        return self.rms_norm(summed, weight, eps), summed

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        """(T, 2f) -> (T, f): `silu(x[:, :f]) * x[:, f:]`."""
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up

    @abc.abstractmethod
    def rope_and_cache(
        self,
        positions: torch.Tensor,  # (T,)
        q: torch.Tensor,  # (T, H, D)
        k: torch.Tensor,  # (T, KVH, D)
        v: torch.Tensor,  # (T, KVH, D)
        rope_cache: torch.Tensor,  # (max_pos, D) float32: cos in [:, :D/2], sin in [:, D/2:]
        kv: LayerKV,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate q and k (may be in place), write the rotated k and v at `meta.slot_mapping`; returns (q, k)."""

    @abc.abstractmethod
    def attention(
        self,
        q: torch.Tensor,  # (T, H, D), rotated
        k: torch.Tensor,  # (T, KVH, D), rotated: the new tokens' keys, already in the pool
        v: torch.Tensor,  # (T, KVH, D)
        kv: LayerKV,
        meta: AttentionMetadata,
        scale: float,
        layer: int,
        *,
        sliding_window: int | None = None,
        softcap: float | None = None,
    ) -> torch.Tensor:
        """Causal attention of each new token over its sequence's context in the pool: (T, H, D); with
        `sliding_window` W only over its last W positions (itself included), with `softcap` c on the
        scores `c * tanh(scale * q.k / c)` (see the module docstring)."""

    def check_attention_options(self, sliding_window: int | None, softcap: float | None) -> None:
        """Raise `InvalidInputError` unless this set computes attention with these options: a window of at
        least 1 position, a finite positive cap, each feature in `attention_features`. A model calls it
        once when it binds its layers."""
        check_attention_options(sliding_window, softcap)
        for name, value in (("sliding_window", sliding_window), ("softcap", softcap)):
            if value is not None and name not in self.attention_features:
                raise InvalidInputError(name, f"the {self.name!r} kernel set has no attention with {name}")


def check_attention_options(sliding_window: int | None, softcap: float | None) -> None:
    """Raise `InvalidInputError` for a window below 1 position or a cap that is not finite and positive."""
    if sliding_window is not None and (isinstance(sliding_window, bool) or int(sliding_window) != sliding_window
                                       or sliding_window < 1):
        raise InvalidInputError("sliding_window", f"must be None or an int >= 1, got {sliding_window!r}")
    if softcap is not None and not (math.isfinite(softcap) and softcap > 0):
        raise InvalidInputError("softcap", f"must be None or a finite float > 0, got {softcap!r}")


def flatten_step(seqs: Sequence[ScheduledSeq], block_size: int) -> StepBatch:
    """The step on the CPU: tokens and positions concatenated, one slot per new token, block tables padded
    to the longest context (`troupe.core.batch` has the `ScheduledSeq` contract).

    Built as Python lists, then one `torch.tensor` per field: a chain of small torch ops (an `arange` per
    sequence, `repeat_interleave`, a gather for the slots) costs several times more per step, which shows
    in a single stream's decode step (`python -m troupe.bench.step` times `prepare`). A long prefill
    chunk's per-token Python stays far below its step. A decode step (one token per sequence) takes
    `_flatten_decode`, which builds its per-sequence fields as one array."""
    bs = block_size
    lens = [len(s.token_ids) for s in seqs]
    assert min(lens) > 0, "a scheduled seq computes at least one token"
    if max(lens) == 1:
        return _flatten_decode(seqs, bs)
    seq_lens = [s.start_pos + n for s, n in zip(seqs, lens, strict=True)]
    assert all(len(s.block_ids) * bs >= n for s, n in zip(seqs, seq_lens, strict=True)), "block table too short"
    width = max(-(-n // bs) for n in seq_lens)
    ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    starts = [0]
    for s, end in zip(seqs, seq_lens, strict=True):
        ids += s.token_ids
        span = range(s.start_pos, end)
        positions += span
        slots += [s.block_ids[p // bs] * bs + p % bs for p in span]
        starts.append(len(ids))
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots),  # (T,)
        query_start_loc=torch.tensor(starts),  # (S+1,)
        seq_lens=torch.tensor(seq_lens),  # (S,)
        block_tables=_block_tables(seqs, width)[0],  # (S, width)
        max_query_len=max(lens),
        max_seq_len=max(seq_lens),
    )
    logits_indices = torch.tensor([starts[i + 1] - 1 for i, s in enumerate(seqs) if s.needs_logits], dtype=torch.int64)
    return StepBatch(torch.tensor(ids), torch.tensor(positions), meta, logits_indices)


def _flatten_decode(seqs: Sequence[ScheduledSeq], bs: int) -> StepBatch:
    """`flatten_step` for one token per sequence: ids, positions, slots and seq_lens as the rows of one
    (4, S) array, one conversion; half the per-step cost of the general path at 256 sequences."""
    n = len(seqs)
    fields = np.empty((4, n), dtype=np.int64)
    fields[0] = [s.token_ids[0] for s in seqs]
    pos = fields[1]
    pos[:] = [s.start_pos for s in seqs]
    longest = int(pos.max()) + 1
    width = -(-longest // bs)
    tables, counts = _block_tables(seqs, width)  # (S, width)
    block = pos // bs
    assert (counts > block).all(), "block table too short"
    fields[2] = tables.numpy()[np.arange(n), block] * bs + pos % bs  # slots
    fields[3] = pos + 1  # seq_lens
    t = torch.from_numpy(fields)
    meta = AttentionMetadata(slot_mapping=t[2], query_start_loc=torch.arange(n + 1), seq_lens=t[3],
                             block_tables=tables, max_query_len=1, max_seq_len=longest)
    wanted = [i for i, s in enumerate(seqs) if s.needs_logits]
    logits_indices = torch.arange(n) if len(wanted) == n else torch.tensor(wanted, dtype=torch.int64)
    return StepBatch(t[0], t[1], meta, logits_indices)


def _block_tables(seqs: Sequence[ScheduledSeq], width: int) -> tuple[torch.Tensor, np.ndarray]:
    """(S, width) int64: each sequence's first `width` blocks, zero-padded, and how many each has (S,).
    Filled through one mask (a numpy row assignment per sequence costs more)."""
    rows = [s.block_ids[:width] for s in seqs]
    counts = np.fromiter(map(len, rows), np.int64, len(rows))
    tables = np.zeros((len(rows), width), dtype=np.int64)
    tables[np.arange(width) < counts[:, None]] = np.fromiter(chain.from_iterable(rows), np.int64, int(counts.sum()))
    return torch.from_numpy(tables), counts
