"""`ModelRunner`: owns the model weights, its kernel set and the paged KV pool; runs one step on a list of
`ScheduledSeq`.

Contract of `execute(seqs)` (see `troupe.core.batch`): sequence i computes `seqs[i].token_ids` at
positions `start_pos ..`, its K/V going to the blocks `block_ids` (slot of position p:
`block_ids[p // block_size] * block_size + p % block_size`); it returns float32 logits
`(number of seqs with needs_logits, vocab)`, one row per such entry in order, taken at its last token.
The KV pool is mutated in place; nothing else is. Not thread-safe: one step at a time.

The kernel set (`troupe.kernels`, chosen by `EngineConfig.kernels` when the runner is built) flattens
each step (`KernelSet.prepare`), allocates the pool in its own layout and runs the model's heavy ops;
the runner only sizes the pool and asks for logits where a token is sampled.

KV pool sizing (`num_blocks`): `num_kv_blocks` if given, else `kv_cache_memory_bytes`, else a default of
`max_num_seqs * 512` tokens capped at `DEFAULT_KV_CAP_BYTES`: enough for a full batch of chat-sized
requests without taking a large share of the machine's memory.

`null_model=True` loads no weights and computes nothing: every row of logits picks one fixed text token
(`null_token_id`), with no pool but the `num_blocks` a real pool would have, so scheduling, detokenizing
and benchmarks of the engine around the model behave as with the real model.
"""

from __future__ import annotations

import dataclasses

import torch

from troupe.config import EngineConfig
from troupe.core.batch import ScheduledSeq
from troupe.kernels import KVSpec, select_kernels
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
        self.kernels = select_kernels(config)
        if self.null_model:
            self.model = None
            self.info: ModelInfo = read_model_info(self.model_path, config.dtype)
        else:
            self.model, self.info = load_model(self.model_path, config.dtype, max_len=config.max_model_len,
                                               kernels=self.kernels, quantization=config.quantization)
        self.max_model_len = min(config.max_model_len or self.info.max_model_len, self.info.max_model_len)
        self.vocab_size = self.info.vocab_size
        self.max_num_seqs = config.max_num_seqs
        self.block_size = config.block_size
        self.null_token_id = NULL_TOKEN_ID if NULL_TOKEN_ID < self.vocab_size else 0
        i = self.info
        spec = KVSpec(num_layers=i.num_layers, num_blocks=0, block_size=self.block_size, num_kv_heads=i.num_kv_heads,
                      head_dim=i.head_dim, dtype=i.dtype, max_model_len=self.max_model_len,
                      max_num_seqs=self.max_num_seqs)
        self.kv_bytes_per_token = self.kernels.kv_bytes_per_token(spec)  # K and V of all layers, one token
        self.num_blocks = self._count_blocks(config)
        self.kv_spec = dataclasses.replace(spec, num_blocks=self.num_blocks)
        self.kv_caches = [] if self.null_model else self.kernels.allocate_kv(self.kv_spec)  # per layer (K, V)

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

        1. The kernel set flattens the step (token ids, positions, attention metadata) on its device.
        2. The model runs over every new token, writing K/V into the pool.
        3. The LM head runs on the last token of each seq that needs logits; logits come back on the CPU.
        """
        n_out = sum(s.needs_logits for s in seqs)
        if self.model is None:
            logits = torch.zeros(n_out, self.vocab_size)  # (N, vocab)
            logits[:, self.null_token_id] = 1.0
            return logits
        if not seqs:
            return torch.empty(0, self.vocab_size)
        assert max(s.start_pos + len(s.token_ids) for s in seqs) <= self.max_model_len, "a seq runs past max_model_len"
        batch = self.kernels.prepare(seqs, self.block_size)
        hidden = self.model(batch.input_ids, batch.positions, self.kv_caches, batch.meta)  # (T, hidden)
        return self.model.compute_logits(hidden[batch.logits_indices]).cpu()  # (N, vocab)
