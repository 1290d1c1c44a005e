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
free row filled from the pool. The rows grow in steps of `ROW_LEN_STEP` positions; if rows x row_len
would take more than `decode_row_cache_bytes` (default: twice the pool's bytes, at least
`ROW_CACHE_MIN_BYTES`; 0 turns the cache off), the cache is dropped and
decodes gather from the pool.

`null_model=True` loads no weights and computes nothing: every row of logits picks one fixed text token
(`null_token_id`), with a tiny KV pool but the `num_blocks` a real pool would have, so scheduling,
detokenizing and benchmarks of the engine around the model behave as with the real model.
"""

from __future__ import annotations

import torch

from troupe.config import EngineConfig
from troupe.core.batch import ScheduledSeq
from troupe.kernels.attention import AttentionMetadata, DecodeRows
from troupe.models.loader import ModelInfo, load_model, read_model_info, resolve_model_path

DEFAULT_KV_TOKENS_PER_SEQ = 512
DEFAULT_KV_CAP_BYTES = 1 << 30
NULL_TOKEN_ID = 260  # " the" in the SmolLM2 vocabulary: plain text, never EOS
ROW_LEN_STEP = 128  # the decode row cache grows its row length in steps of this many positions
ROW_CACHE_MIN_BYTES = 64 << 20  # its budget: twice the pool's bytes, and at least this


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
        """Give each decode of this step a row (kept from the previous step when still valid), growing the
        row cache if needed; None (and no cache) when there is no decode or it would exceed its budget."""
        old, self._row_of = self._row_of, {}
        dec = [i for i, s in enumerate(seqs) if len(s.token_ids) == 1]
        if not dec:
            return None
        kept = [old.get(seqs[i].request_id, (-1, -1)) for i in dec]
        rows = [row if held == seqs[i].start_pos else -1 for (row, held), i in zip(kept, dec, strict=True)]
        used = set(rows)
        free = (r for r in range(len(dec) + len(used)) if r not in used)
        refill = [j for j, row in enumerate(rows) if row < 0]
        for j in refill:
            rows[j] = next(free)
        if not self._fit_rows(max(rows) + 1, max(seq_lens[i] for i in dec)):
            return None
        lens = [seq_lens[i] for i in dec]
        for j, i in enumerate(dec):
            self._row_of[seqs[i].request_id] = (rows[j], lens[j])
        bs = self.block_size
        refills = [(rows[j], block_tables[dec[j], : -(-lens[j] // bs)], lens[j]) for j in refill]
        return DecodeRows.build(self._row_k, self._row_v, starts[torch.tensor(dec)], rows, lens, refills)

    def _fit_rows(self, num_rows: int, length: int) -> bool:
        """Make the row cache hold at least `num_rows` rows of `length` positions (keeping its contents);
        False, and the cache dropped, if that exceeds `row_cache_bytes`."""
        rc, lc = (self._row_k[0].shape[0], self._row_k[0].shape[2]) if self._row_k else (0, 0)
        if rc >= num_rows and lc >= length:
            return True
        lc = max(lc, -(-length // ROW_LEN_STEP) * ROW_LEN_STEP)
        # rows for a full batch at once when the budget allows: growing copies the whole cache
        rc = max(rc, num_rows, self.max_num_seqs)
        if rc * lc * self.kv_bytes_per_token > self.row_cache_bytes:
            rc = max(num_rows, self._row_k[0].shape[0] if self._row_k else 0)
        if rc * lc * self.kv_bytes_per_token > self.row_cache_bytes:
            self._row_k, self._row_v, self._row_of = [], [], {}
            return False
        shape = (rc, self.info.num_kv_heads, lc, self.info.head_dim)
        grown: list[list[torch.Tensor]] = [[], []]
        for cache, out in zip((self._row_k, self._row_v), grown, strict=True):
            for layer in range(self.info.num_layers):
                new = torch.zeros(shape, dtype=self.info.dtype)  # zeros: rows and positions not yet written
                if cache:
                    new[: cache[layer].shape[0], :, : cache[layer].shape[2]] = cache[layer]
                    cache[layer] = torch.empty(0)  # free the old one before allocating the next
                out.append(new)
        self._row_k, self._row_v = grown
        return True
