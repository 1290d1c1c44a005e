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

`null_model=True` loads no weights and computes nothing: every row of logits picks one fixed text token
(`null_token_id`), with a tiny KV pool but the `num_blocks` a real pool would have, so scheduling,
detokenizing and benchmarks of the engine around the model behave as with the real model.
"""

from __future__ import annotations

import torch

from troupe.config import EngineConfig
from troupe.core.batch import ScheduledSeq
from troupe.kernels.attention import AttentionMetadata
from troupe.models.loader import ModelInfo, load_model, read_model_info, resolve_model_path

DEFAULT_KV_TOKENS_PER_SEQ = 512
DEFAULT_KV_CAP_BYTES = 1 << 30
NULL_TOKEN_ID = 260  # " the" in the SmolLM2 vocabulary: plain text, never EOS


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
        self.block_size = config.block_size
        self.null_token_id = NULL_TOKEN_ID if NULL_TOKEN_ID < self.vocab_size else 0
        self.num_blocks = self._count_blocks(config)
        shape = (self.num_blocks, self.block_size, self.info.num_kv_heads, self.info.head_dim)
        self.kv_caches = [  # per layer (K pool, V pool); none for the null model
            (torch.zeros(shape, dtype=self.info.dtype), torch.zeros(shape, dtype=self.info.dtype))
            for _ in range(0 if self.null_model else self.info.num_layers)
        ]

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
        return input_ids, positions, meta
