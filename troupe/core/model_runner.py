"""`ModelRunner`: owns the model weights and the paged KV pool; runs one step on a list of `ScheduledSeq`.

Contract of `execute(seqs)` (see `troupe.core.batch`): sequence i computes `seqs[i].token_ids` at
positions `start_pos ..`, its K/V going to the blocks `block_ids` (slot of position p:
`block_ids[p // block_size] * block_size + p % block_size`); it returns float32 logits
`(number of seqs with needs_logits, vocab)`, one row per such entry in order, taken at its last token.
The KV pool is mutated in place; nothing else is. Not thread-safe: one step at a time.

KV pool sizing (`num_blocks`): `num_kv_blocks` if given, else `kv_cache_memory_bytes`, else a default of
`max_num_seqs * 512` tokens capped at 1 GiB (64 seqs x 512 tokens is 720 MiB for the default model in
bf16, 1 GiB in float32 holds 23k tokens): enough for a full batch of chat-sized requests without taking
a large share of a 24 GiB machine. The pool is zero-filled so that never-written slots, which padded
gathers read but masks hide, hold no NaN.

Decode row cache: besides the pool, each layer keeps a contiguous copy of every decoding sequence's
context, one row per sequence (`(rows, kv_heads, row_len, head_dim)`), so decode attention reads it in
place instead of gathering the blocks again in every layer of every step (see
`troupe.kernels.attention`). A request keeps its row only while it decodes in consecutive steps (its row
then holds exactly `start_pos` tokens); any other step drops it, and a new or returning decode gets a
free row filled from the pool. The cache is allocated once, `max_num_seqs` rows as long as
`decode_row_cache_bytes` allows (default: twice the pool's bytes, at least `ROW_CACHE_MIN_BYTES`; 0 turns
the cache off), and its pages are touched only as decodes reach them; a decode whose context is longer
than a row gathers its blocks from the pool instead, in the same step as the others. Attention reads
the rows in groups of `ROW_GROUP`, each up to its longest context, so the runner keeps the rows sorted by
context length: when the layout would read more than `ROW_SORT_SLACK` times the sorted one (new decodes
land in free rows anywhere), the kept rows are moved into length order (one copy of the rows, then every
later step reads about a third less than padding all to the longest: 16.7k against 26k positions
per layer for 64 decodes of 20..430 tokens).

`null_model=True` loads no weights and computes nothing: every row of logits picks one fixed text token
(`null_token_id`), with a tiny KV pool but the `num_blocks` a real pool would have, so scheduling,
detokenizing and benchmarks of the engine around the model behave as with the real model.
"""

from __future__ import annotations

import torch

from troupe.config import EngineConfig
from troupe.core.batch import ScheduledSeq
from troupe.kernels.attention import ROW_GROUP, AttentionMetadata, DecodeRows
from troupe.models.loader import ModelInfo, load_model, read_model_info, resolve_model_path

DEFAULT_KV_TOKENS_PER_SEQ = 512
DEFAULT_KV_CAP_BYTES = 1 << 30
NULL_TOKEN_ID = 260  # " the" in the SmolLM2 vocabulary: plain text, never EOS
ROW_LEN_STEP = 128  # row length is a multiple of this; rows are zeroed in steps of this many positions
ROW_CACHE_MIN_BYTES = 64 << 20  # its budget: twice the pool's bytes, and at least this
ROW_SORT_SLACK = 1.25  # re-sort the rows by length when their layout reads this much more than sorted


def _rows_read(rows: list[int], lens: list[int]) -> int:
    """Positions decode attention reads for this layout: each group of `ROW_GROUP` rows up to its longest
    context (`DecodeRows`), empty groups skipped."""
    longest: dict[int, int] = {}
    for r, n in zip(rows, lens, strict=True):
        longest[r // ROW_GROUP] = max(longest.get(r // ROW_GROUP, 0), n)
    return ROW_GROUP * sum(longest.values())


class ModelRunner:
    def __init__(self, config: EngineConfig) -> None:
        if config.num_threads is not None:
            torch.set_num_threads(config.num_threads)
        torch.manual_seed(config.seed)
        self.model_path = resolve_model_path(config.model)
        self.null_model = config.null_model
        if self.null_model:
            self.model = None
            self.info: ModelInfo = read_model_info(self.model_path, config.dtype)
        else:
            self.model, self.info = load_model(self.model_path, config.dtype, max_len=config.max_model_len)
        self.max_model_len = min(config.max_model_len or self.info.max_model_len, self.info.max_model_len)
        self.vocab_size = self.info.vocab_size
        self.max_num_seqs = config.max_num_seqs
        self.block_size = config.block_size
        self.null_token_id = NULL_TOKEN_ID if NULL_TOKEN_ID < self.vocab_size else 0
        self.num_blocks = self._count_blocks(config)
        shape = (self.num_blocks, self.block_size, self.info.num_kv_heads, self.info.head_dim)
        self.kv_caches = [  # per layer (K pool, V pool); none for the null model
            (torch.zeros(shape, dtype=self.info.dtype), torch.zeros(shape, dtype=self.info.dtype))
            for _ in range(0 if self.null_model else self.info.num_layers)
        ]
        pool_bytes = self.num_blocks * self.block_size * self.kv_bytes_per_token
        self.row_cache_bytes = max(2 * pool_bytes, ROW_CACHE_MIN_BYTES) if config.decode_row_cache_bytes is None \
            else config.decode_row_cache_bytes
        self._row_k: list[torch.Tensor] = []  # per layer (RC, KVH, LC, D); empty: no row cache yet
        self._row_v: list[torch.Tensor] = []
        self._row_of: dict[str, tuple[int, int]] = {}  # request id -> (row, tokens it holds)
        self._rows_clean = 0  # positions [0, this) of every row hold finite values

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V of all layers for one token."""
        i = self.info
        return 2 * i.num_layers * i.num_kv_heads * i.head_dim * i.dtype.itemsize

    def _count_blocks(self, config: EngineConfig) -> int:
        if config.num_kv_blocks is not None:
            return config.num_kv_blocks
        per_block = self.kv_bytes_per_token * self.block_size
        budget = config.kv_cache_memory_bytes
        if budget is None:
            budget = min(
                config.max_num_seqs * DEFAULT_KV_TOKENS_PER_SEQ * self.kv_bytes_per_token,
                DEFAULT_KV_CAP_BYTES,
            )
        return max(1, budget // per_block)

    @torch.inference_mode()
    def execute(self, seqs: list[ScheduledSeq]) -> torch.Tensor:
        """Run one step; returns (num seqs with needs_logits, vocab) float32 logits, in order.

        1. Flatten the new tokens of all seqs and their positions.
        2. Build the attention metadata: slot of each new token, block tables, context lengths.
        3. Run the model, then the LM head on the last token of each seq that needs logits.
        """
        n_out = sum(s.needs_logits for s in seqs)
        if self.model is None:
            logits = torch.zeros(n_out, self.vocab_size)  # (N, vocab)
            logits[:, self.null_token_id] = 1.0
            return logits
        if not seqs:
            return torch.empty(0, self.vocab_size)
        input_ids, positions, meta = self._prepare(seqs)
        hidden = self.model(input_ids, positions, self.kv_caches, meta)  # (T, hidden)
        last = meta.query_start_loc[1:][torch.tensor([s.needs_logits for s in seqs])] - 1  # (N,)
        return self.model.compute_logits(hidden[last])  # (N, vocab)

    def _prepare(self, seqs: list[ScheduledSeq]) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """Flattened (input_ids (T,), positions (T,)) and the step's attention metadata."""
        bs = self.block_size
        lens = [len(s.token_ids) for s in seqs]
        seq_lens = [s.start_pos + n for s, n in zip(seqs, lens, strict=True)]
        assert min(lens) > 0, "a scheduled seq computes at least one token"
        assert max(seq_lens) <= self.max_model_len, "a seq runs past max_model_len"
        assert all(len(s.block_ids) * bs >= n for s, n in zip(seqs, seq_lens, strict=True)), (
            "block table too short"
        )
        width = max(-(-n // bs) for n in seq_lens)
        tables = [s.block_ids[:width] + [0] * (width - len(s.block_ids[:width])) for s in seqs]

        input_ids = torch.tensor([t for s in seqs for t in s.token_ids])  # (T,)
        positions = torch.cat(
            [torch.arange(s.start_pos, n) for s, n in zip(seqs, seq_lens, strict=True)]
        )  # (T,)
        seq_of_token = torch.repeat_interleave(torch.arange(len(seqs)), torch.tensor(lens))  # (T,)
        block_tables = torch.tensor(tables)  # (S, width)
        meta = AttentionMetadata(
            slot_mapping=block_tables[seq_of_token, positions // bs] * bs + positions % bs,  # (T,)
            query_start_loc=torch.tensor([0, *lens]).cumsum(0),  # (S+1,)
            seq_lens=torch.tensor(seq_lens),  # (S,)
            block_tables=block_tables,
        )
        meta.rows = self._plan_rows(seqs, seq_lens, block_tables, meta.query_start_loc)
        return input_ids, positions, meta

    def _plan_rows(
        self, seqs: list[ScheduledSeq], seq_lens: list[int], block_tables: torch.Tensor, starts: torch.Tensor
    ) -> DecodeRows | None:
        """Give each decode of this step a row (kept from the previous step when still valid); None when
        no decode fits a row (none this step, no budget, or longer than the rows). Decodes left without a
        row gather their context from the pool (`troupe.kernels.attention`)."""
        old, self._row_of = self._row_of, {}
        if not self._alloc_rows():
            return None
        lc = self._row_k[0].shape[2]
        dec = [i for i, s in enumerate(seqs) if len(s.token_ids) == 1 and seq_lens[i] <= lc]
        if not dec:
            return None
        kept = [old.get(seqs[i].request_id, (-1, -1)) for i in dec]
        rows = [row if held == seqs[i].start_pos else -1 for (row, held), i in zip(kept, dec, strict=True)]
        used = set(rows)
        free = (r for r in range(len(dec) + len(used)) if r not in used)
        refill = [j for j, row in enumerate(rows) if row < 0]
        for j in refill:
            rows[j] = next(free)
        lens = [seq_lens[i] for i in dec]
        self._clean_rows(max(lens))
        if _rows_read(rows, lens) > ROW_SORT_SLACK * _rows_read(list(range(len(lens))), sorted(lens)):
            rows = self._sort_rows(rows, lens, refill)
        for j, i in enumerate(dec):
            self._row_of[seqs[i].request_id] = (rows[j], lens[j])
        bs = self.block_size
        refills = [(rows[j], block_tables[dec[j], : -(-lens[j] // bs)], lens[j]) for j in refill]
        return DecodeRows.build(self._row_k, self._row_v, starts[torch.tensor(dec)], rows, lens, refills, ROW_GROUP)

    def _sort_rows(self, rows: list[int], lens: list[int], refill: list[int]) -> list[int]:
        """Give the decodes rows `0..B-1` in order of context length, moving the kept rows' contents
        (refilled ones are written from the pool later anyway); returns the new rows."""
        order = sorted(range(len(lens)), key=lens.__getitem__)
        new = [0] * len(rows)
        for r, j in enumerate(order):
            new[j] = r
        fresh = set(refill)
        moved = [j for j in range(len(rows)) if j not in fresh and rows[j] != new[j]]
        if moved:
            src, dst = torch.tensor([rows[j] for j in moved]), torch.tensor([new[j] for j in moved])
            held = max(lens[j] for j in moved) - 1  # what a kept row holds: all but this step's token
            for t in (*self._row_k, *self._row_v):
                t[dst, :, :held] = t[src, :, :held]  # the right side is a copy: cycles are safe
        return new

    def _alloc_rows(self) -> bool:
        """Allocate the row cache once, on the first decode: `max_num_seqs` rows (a decode step never has
        more), each as long as the budget allows (a multiple of `ROW_LEN_STEP`, at most the context
        length). `torch.empty`: pages are only touched as `_clean_rows` reaches them, so memory grows
        with the longest decode seen, not with the budget. False if not even `ROW_LEN_STEP` fits."""
        if self._row_k:
            return True
        rc, per_token = self.max_num_seqs, self.kv_bytes_per_token
        lc = min(self.row_cache_bytes // (rc * per_token), -(-self.max_model_len // ROW_LEN_STEP) * ROW_LEN_STEP)
        lc -= lc % ROW_LEN_STEP
        if lc <= 0:
            return False
        shape = (rc, self.info.num_kv_heads, lc, self.info.head_dim)
        self._row_k = [torch.empty(shape, dtype=self.info.dtype) for _ in range(self.info.num_layers)]
        self._row_v = [torch.empty(shape, dtype=self.info.dtype) for _ in range(self.info.num_layers)]
        return True

    def _clean_rows(self, length: int) -> None:
        """Make positions `[0, length)` of every row hold finite values: attention reads rows up to the
        longest decode and masks the rest, but a masked NaN would still poison the weighted sum. Zeroes
        new positions in steps of `ROW_LEN_STEP`; what a row held before stays (finite)."""
        if length <= self._rows_clean:
            return
        end = min(-(-length // ROW_LEN_STEP) * ROW_LEN_STEP, self._row_k[0].shape[2])
        for t in (*self._row_k, *self._row_v):
            t[:, :, self._rows_clean : end].zero_()
        self._rows_clean = end
