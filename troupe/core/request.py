"""`Request`: the engine's mutable view of one request (scheduler, KV manager and engine share it).

Contract:
- `all_token_ids` = prompt followed by generated tokens; `num_computed_tokens` of them have their
  K/V in the cache. The scheduler advances `num_computed_tokens`; the engine appends sampled tokens.
- Preemption frees every block and resets `num_computed_tokens` to 0 (recompute). What sampling
  keeps about the request (its output tokens for the penalties and bad words, its grammar matcher, the
  prompt logprobs computed so far) lives outside the KV cache and survives it.
- A pooling request (`pooling_params` set) computes its prompt and finishes after the chunk that
  ends it (no token is sampled); it neither reads nor fills the prefix cache. `pooling_state` holds
  what the pooler folded from its chunks so far.
- `generator` (a seeded request's RNG) is created with the request and lives as long as it.
- A structured-output request enters the waiting queue as `WAITING_FOR_FSM` while its grammar compiles;
  the engine then sets `matcher` (which the grammar's bitmask and accepted tokens go through) and makes
  it `WAITING`.
- `prompt_logprob_rows` holds one row per prompt token after the first, filled as prefill chunks
  run; `prompt_logprobs_sent` once they went out with the first token.
"""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING

import torch

from troupe.messages import AddRequest, FinishReason
from troupe.pooling import PoolingParams
from troupe.sampling_params import SamplingParams

if TYPE_CHECKING:
    from troupe.core.sampling_metadata import SamplingRow
    from troupe.structured.backend import Matcher


class RequestStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    FINISHED = 3
    WAITING_FOR_FSM = 4  # queued while its structured-output grammar compiles: admission skips it


class Request:
    __slots__ = (
        "request_id", "external_id", "prompt_token_ids", "output_token_ids", "all_token_ids",
        "params", "max_tokens", "eos_token_ids", "stop_token_ids", "arrival_time", "priority",
        "num_computed_tokens", "num_cached_tokens", "num_preemptions", "status", "finish_reason",
        "stop_reason", "block_hashes", "bad_words_token_ids", "prompt_logprob_rows", "prompt_logprobs_sent",
        "grammar_terminated", "matcher", "pooling_params", "pooling_state", "generator", "added_at",
        "sampling_row", "num_pending",
    )

    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                 max_tokens: int, eos_token_ids: list[int] | None = None, arrival_time: float = 0.0,
                 priority: int = 0, external_id: str = "", bad_words_token_ids: list[list[int]] | None = None,
                 pooling_params: PoolingParams | None = None) -> None:
        self.request_id = request_id
        self.external_id = external_id or request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.params = params
        self.max_tokens = max_tokens
        self.eos_token_ids: frozenset[int] = frozenset(() if params.ignore_eos else (eos_token_ids or ()))
        self.stop_token_ids: frozenset[int] = frozenset(params.stop_token_ids or ())
        self.arrival_time = arrival_time
        self.priority = priority
        self.num_computed_tokens = 0
        self.num_cached_tokens = -1  # prompt tokens served by the prefix cache, set at first admission
        self.num_preemptions = 0
        self.status = RequestStatus.WAITING
        self.finish_reason: FinishReason | None = None
        self.stop_reason: int | str | None = None
        self.block_hashes: list[int] = []  # hash chain of this request's full blocks (prefix cache)
        self.bad_words_token_ids: list[list[int]] = bad_words_token_ids or []
        self.prompt_logprob_rows: list[tuple[list[int], list[float], int]] = []
        self.prompt_logprobs_sent = False
        self.matcher: Matcher | None = None  # its structured-output grammar's state, once compiled
        self.grammar_terminated = False  # the structured-output grammar accepted its end
        self.pooling_params = pooling_params  # a pooling request: prefill only, then its pooled vector
        self.pooling_state: torch.Tensor | None = None  # the pooler's state between prefill chunks
        # its own RNG when it has a seed (one draw per sampled token; survives preemption)
        self.generator: torch.Generator | None = None if params.seed is None else \
            torch.Generator().manual_seed(params.seed)
        self.added_at: float | None = None  # trace only: when the engine took it, until first scheduled
        self.num_pending = 0  # async scheduling: tokens sampled on the device, not appended yet (troupe.core.overlap)
        self.sampling_row: SamplingRow | None = None  # the engine's SamplingRow for it, kept while nothing in it changes

    @classmethod
    def from_message(cls, msg: AddRequest) -> Request:
        return cls(msg.request_id, msg.prompt_token_ids, msg.params, msg.max_tokens, msg.eos_token_ids,
                   msg.arrival_time, msg.priority, msg.external_id, msg.bad_words_token_ids, msg.pooling_params)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def needs_prompt_logits(self) -> bool:
        """It asked for prompt logprobs and some prompt positions have none yet (so the prefix cache,
        which skips positions, is not read for it)."""
        return self.params.prompt_logprobs is not None and len(self.prompt_logprob_rows) < self.num_prompt_tokens - 1

    @property
    def needs_every_position(self) -> bool:
        """Every prompt position must be computed here (prompt logprobs, pooling): no prefix-cache read."""
        return self.pooling_params is not None or self.needs_prompt_logits

    @property
    def is_finished(self) -> bool:
        return self.status == RequestStatus.FINISHED

    def append_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, prompt={self.num_prompt_tokens}, out={self.num_output_tokens}, "
                f"computed={self.num_computed_tokens}, {self.status.name})")
