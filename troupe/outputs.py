"""What a user gets back: `RequestOutput` holding one `CompletionOutput` per sample.

Follows vLLM's `vllm/outputs.py`:

- `RequestOutput.request_id` is the user's *external* id; the engine works on internal ids.
- `CompletionOutput.text` / `.token_ids` are either everything so far (CUMULATIVE, FINAL_ONLY) or
  only what is new since the previous output (DELTA), depending on `SamplingParams.output_kind`.
- `finish_reason` is one of "stop", "length", "abort", "error" (None while running); `stop_reason`
  is the stop token id (int), the matched stop string (str), or None (EOS, length, abort).
- Logprobs (when `SamplingParams.logprobs` / `prompt_logprobs` asked for them): one
  `{token_id: Logprob}` dict per token, holding the chosen token and the top-k of the distribution;
  `CompletionOutput.logprobs` is sliced like `token_ids` (everything so far, or only what is new);
  `RequestOutput.prompt_logprobs` has one entry per prompt token, the first None (nothing predicts it),
  sent on every output (CUMULATIVE), once (DELTA) or at the end (FINAL_ONLY).
  `cumulative_logprob` is the sum of the chosen tokens' logprobs (None unless `logprobs` was asked).

The objects are mutable msgspec Structs: `RequestOutput.add` merges a newer output into a pending
one in place (the per-request collector does this when the consumer falls behind). The frontend
never keeps a reference to an output it handed out, so merging in place is safe.
"""

from __future__ import annotations

import msgspec

from troupe.errors import ErrorKind

_REPR_TEXT = 60  # characters of text shown by __repr__ before eliding


def _short(text: str) -> str:
    if len(text) <= _REPR_TEXT:
        return repr(text)
    half = _REPR_TEXT // 2
    return f"{text[:half]!r}...{text[-half:]!r}"


def _short_ids(ids: list[int] | None) -> str:
    if ids is None:
        return "None"
    if len(ids) <= 8:
        return repr(ids)
    return f"[{', '.join(map(str, ids[:4]))}, ... {len(ids) - 6} more, {ids[-2]}, {ids[-1]}]"


class RequestMetrics(msgspec.Struct, gc=False):
    """Timestamps (time.monotonic seconds) and counts of one request, attached to its final output.

    `first_token_time` / `last_token_time` are None until a token arrived; `finished_time` is None
    until the request finished (any reason, abort included). `engine_index` is the engine (DP rank)
    that served the request, None until it produced something.
    """

    arrival_time: float
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    num_generation_tokens: int = 0
    num_preemptions: int = 0
    engine_index: int | None = None

    @property
    def time_to_first_token(self) -> float | None:
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time

    @property
    def total_time(self) -> float | None:
        """Arrival to finish, in seconds (None while running)."""
        if self.finished_time is None:
            return None
        return self.finished_time - self.arrival_time


class Logprob(msgspec.Struct, gc=False, frozen=True):
    """One token's log-probability, its rank in the distribution (1 = most likely) and its text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


SampleLogprobs = list[dict[int, Logprob]]  # one dict per token
PromptLogprobs = list[dict[int, Logprob] | None]  # one per prompt token, the first None


class CompletionOutput(msgspec.Struct, gc=False):
    """One sample of a request. `index` is the sample number (0..n-1)."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: SampleLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None

    def __repr__(self) -> str:
        return (
            f"CompletionOutput(index={self.index}, text={_short(self.text)}, "
            f"token_ids={_short_ids(self.token_ids)}, finish_reason={self.finish_reason!r}, "
            f"stop_reason={self.stop_reason!r})"
        )


class RequestOutput(msgspec.Struct, gc=False):
    """What one request produced so far (or since its previous output, in DELTA mode).

    `finished` is True on exactly one output per request: the last one.
    `num_cached_tokens` is the number of prompt tokens served from the prefix cache.
    `metrics` is set on the final output only. `error` says why a request with finish_reason
    "error" failed (on its final output), else None; `error_kind` says whose fault that was
    (`troupe.errors.ErrorKind`: "invalid_request", the request's own parameters, or "internal").
    `pooled` carries a pooling request's vector to the facade, which returns it as a
    `troupe.pooling.PoolingRequestOutput`.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int] | None
    outputs: list[CompletionOutput]
    finished: bool = False
    prompt_logprobs: PromptLogprobs | None = None
    num_cached_tokens: int = 0
    metrics: RequestMetrics | None = None
    error: str | None = None
    error_kind: ErrorKind | None = None
    pooled: list[float] | None = None  # a pooling request's vector (troupe.pooling), on its final output

    def add(self, next_output: RequestOutput, aggregate: bool) -> None:
        """Merge a newer output of the same request into this one, in place.

        Samples are matched by `CompletionOutput.index`; a sample this output lacks is appended.
        With `aggregate` (DELTA) text, token ids and logprobs are concatenated; otherwise the newer
        sample replaces the older. No list is mutated in place: outputs may share lists with the
        engine's messages (token ids) or with each other after a merge.
        """
        self.finished |= next_output.finished
        self.num_cached_tokens = next_output.num_cached_tokens or self.num_cached_tokens
        if next_output.metrics is not None:
            self.metrics = next_output.metrics
        if next_output.error is not None:
            self.error, self.error_kind = next_output.error, next_output.error_kind
        if next_output.prompt_logprobs is not None:
            self.prompt_logprobs = next_output.prompt_logprobs
        if next_output.pooled is not None:
            self.pooled = next_output.pooled
        for new in next_output.outputs:
            for i, old in enumerate(self.outputs):
                if old.index != new.index:
                    continue
                if aggregate:
                    old.text += new.text
                    old.token_ids = old.token_ids + new.token_ids
                    if new.logprobs is not None:
                        old.logprobs = (old.logprobs or []) + new.logprobs
                    old.cumulative_logprob = new.cumulative_logprob
                    old.finish_reason = new.finish_reason
                    old.stop_reason = new.stop_reason
                else:
                    self.outputs[i] = new
                break
            else:
                self.outputs.append(new)

    def __repr__(self) -> str:
        return (
            f"RequestOutput(request_id={self.request_id!r}, "
            f"prompt={_short(self.prompt) if self.prompt is not None else None}, "
            f"prompt_token_ids={_short_ids(self.prompt_token_ids)}, outputs={self.outputs!r}, "
            f"finished={self.finished}, num_cached_tokens={self.num_cached_tokens})"
        )
