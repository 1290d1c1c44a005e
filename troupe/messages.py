"""Messages between the frontend actors and the EngineCore (the engine boundary).

Frozen msgspec Structs in two tagged unions, the same whether they travel over an in-process
memory stream or a ZMQ socket:

- `EngineInput` (frontend -> engine): `AddRequest`, `AbortRequest`, `UtilityCall`.
- `EngineOutput` (engine -> frontend): `EngineCoreOutputs` (one per step), `UtilityResult`,
  `EngineDead`.

Every message about a request carries its ids (the internal `request_id`, unique, and the user's
`external_id` for logs), because log context does not cross a process boundary.
"""

from __future__ import annotations

import enum
import time

import msgspec

from troupe.errors import ErrorKind
from troupe.pooling import PoolingParams
from troupe.sampling_params import SamplingParams


class FinishReason(enum.IntEnum):
    STOP = 0
    LENGTH = 1
    ABORT = 2
    ERROR = 3

    def __str__(self) -> str:
        return self.name.lower()


# ---------------------------------------------------------------- frontend -> engine


class AddRequest(msgspec.Struct, frozen=True, tag="add", array_like=True, omit_defaults=True):
    """A validated request ready for the engine.

    `eos_token_ids` are the model's end-of-sequence ids (tokenizer + generation_config); the engine
    stops on them unless `params.ignore_eos`. `max_tokens` is resolved (never None).
    `bad_words_token_ids` are `params.bad_words` tokenized by the frontend (vLLM's rule: each word
    alone and after a space), one token sequence each.
    """

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    max_tokens: int
    eos_token_ids: list[int] = []
    arrival_time: float = 0.0
    priority: int = 0
    external_id: str = ""
    data_parallel_rank: int | None = None
    bad_words_token_ids: list[list[int]] = []
    pooling_params: PoolingParams | None = None


class AbortRequest(msgspec.Struct, frozen=True, tag="abort", array_like=True):
    request_ids: list[str]


class UtilityCall(msgspec.Struct, frozen=True, tag="utility", array_like=True):
    call_id: int
    method: str
    args: list[object] = []


EngineInput = AddRequest | AbortRequest | UtilityCall


# ---------------------------------------------------------------- engine -> frontend


class LogprobsLists(msgspec.Struct, frozen=True, array_like=True, gc=False):
    """Logprobs of a run of token positions, compactly: row i is position i's `token_ids[i]` =
    [the chosen token, top-1, .., top-k] and their `logprobs[i]`; `ranks[i]` is the chosen token's rank
    (1 = most likely; the top-k have ranks 1..k). The chosen token may appear again among the top-k."""

    token_ids: list[list[int]]
    logprobs: list[list[float]]
    ranks: list[int]


class EngineCoreOutput(msgspec.Struct, frozen=True, array_like=True, omit_defaults=True):
    """What one request produced in one step (only sent when there is something new).

    `new_logprobs`: one row per new token (when `params.logprobs` is set). `prompt_logprobs`: one row
    per prompt token after the first, all of them at once with the request's first token (when
    `params.prompt_logprobs` is set). `pooled`: a pooling request's vector, on its one output."""

    request_id: str
    new_token_ids: list[int]
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    num_preemptions: int = 0
    error: str | None = None  # set with FinishReason.ERROR: why this request failed
    new_logprobs: LogprobsLists | None = None
    prompt_logprobs: LogprobsLists | None = None
    error_kind: ErrorKind | None = None  # set with `error`: whose fault (troupe.errors.ErrorKind)
    pooled: list[float] | None = None  # a pooling request's vector, with its finish (troupe.core.pooler)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class SchedulerStats(msgspec.Struct, frozen=True, array_like=True):
    """A snapshot of one engine after a step."""

    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0
    prefix_cache_queries: int = 0  # cumulative prompt tokens looked up
    prefix_cache_hits: int = 0  # cumulative prompt tokens served from the cache
    num_preemptions: int = 0  # cumulative
    step_counter: int = 0
    num_prompt_tokens: int = 0  # prompt tokens computed in this step
    num_generation_tokens: int = 0  # tokens sampled in this step


class EngineCoreOutputs(msgspec.Struct, frozen=True, tag="outputs", array_like=True, omit_defaults=True):
    engine_index: int = 0
    outputs: list[EngineCoreOutput] = []
    scheduler_stats: SchedulerStats | None = None
    finished_requests: list[str] = []
    timestamp: float = msgspec.field(default_factory=time.monotonic)


class UtilityResult(msgspec.Struct, frozen=True, tag="utility_result", array_like=True, omit_defaults=True):
    call_id: int
    result: object = None
    failure: str | None = None
    engine_index: int = 0


class EngineDead(msgspec.Struct, frozen=True, tag="dead", array_like=True):
    reason: str
    engine_index: int = 0


EngineOutput = EngineCoreOutputs | UtilityResult | EngineDead
