"""`OutputProcessor`: engine outputs -> the `RequestOutput`s users see (pure, synchronous).

Contract:

- `add_request` registers a request before the engine can produce anything for it.
- `process_outputs(outputs)` takes any list of `EngineCoreOutput`s (a whole step, or a slice of
  one: the async caller feeds slices of <= 128 entries with a checkpoint between them). Per
  entry it detokenizes, checks stop strings, and builds the output the request's
  `output_kind` asks for: CUMULATIVE, everything so far; DELTA, what is new since the previous
  output; FINAL_ONLY, one output at the end. Exactly one output per request has
  `finished=True`, and a finished request's state is dropped at once.
- Requests that finished on a stop string are listed in `reqs_to_abort`: the engine does not
  know about stop strings, so the caller must abort them there.
- Outputs for unknown (finished, aborted, never added) ids are dropped silently.
- Concatenated DELTA texts and token ids equal the final CUMULATIVE text and token ids. Token ids
  are never held back: in DELTA mode the ids of tokens whose text is still withheld (stop-string
  hold-back, partial characters) go out before their text (vLLM's known desync). A stop string
  cuts the text but never the token ids.
- DELTA outputs reuse the engine message's `new_token_ids` list (no copy): nothing downstream
  mutates lists in place (`RequestOutput.add` builds new ones).
- Logprobs (when asked) are kept and sliced by `troupe.output.logprobs.LogprobsState`, aligned with
  the token ids.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, NamedTuple

from troupe.errors import InvalidInputError
from troupe.messages import EngineCoreOutput, FinishReason
from troupe.output.detokenizer import IncrementalDetokenizer, make_detokenizer
from troupe.output.logprobs import LogprobsState, TokenTexts, make_logprobs_state
from troupe.outputs import CompletionOutput, RequestMetrics, RequestOutput
from troupe.sampling_params import RequestOutputKind, SamplingParams

_DELTA = RequestOutputKind.DELTA
_FINAL_ONLY = RequestOutputKind.FINAL_ONLY
_STOP = FinishReason.STOP
_FINISH_STR = {reason: str(reason) for reason in FinishReason}


class ProcessedOutputs(NamedTuple):
    """What one `process_outputs` call produced."""

    request_outputs: dict[str, RequestOutput]  # internal id -> output to deliver
    reqs_to_abort: list[str]  # internal ids that finished on a stop string, or failed here
    failed: dict[str, Exception] = {}  # internal id -> what raised while processing its output


class RequestState:
    """The frontend's view of one live request."""

    __slots__ = (
        "request_id",
        "external_id",
        "prompt",
        "prompt_token_ids",
        "output_kind",
        "detokenizer",
        "num_cached_tokens",
        "metrics",
        "logprobs",
    )

    def __init__(
        self,
        request_id: str,
        external_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        output_kind: RequestOutputKind,
        detokenizer: IncrementalDetokenizer,
        arrival_time: float,
    ) -> None:
        self.request_id = request_id
        self.external_id = external_id
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.output_kind = output_kind
        self.detokenizer = detokenizer
        self.num_cached_tokens = 0
        self.metrics = RequestMetrics(arrival_time=arrival_time)
        self.logprobs: LogprobsState | None = None

    def make_output(
        self, new_token_ids: list[int], finish_reason: FinishReason | None, stop_reason: int | str | None,
        error: str | None = None,
    ) -> RequestOutput | None:
        """The output to deliver after this step, or None when there is nothing to say yet."""
        finished = finish_reason is not None
        kind = self.output_kind
        if kind is _FINAL_ONLY and not finished:
            return None
        detok = self.detokenizer
        if kind is _DELTA:
            text = detok.get_next_output_text(finished, True)
            if not (text or new_token_ids or finished):
                return None
            token_ids = new_token_ids  # a fresh list per engine output; nothing mutates it
        else:
            if not (new_token_ids or finished):
                return None
            text = detok.get_next_output_text(finished, False)
            token_ids = detok.token_ids.copy()
        if not finished:  # the common case: positional construction is the cheapest
            return RequestOutput(
                self.external_id,
                self.prompt,
                self.prompt_token_ids,
                [CompletionOutput(0, text, token_ids)],
                False,
                None,
                self.num_cached_tokens,
            )
        assert finish_reason is not None
        completion = CompletionOutput(
            0, text, token_ids, finish_reason=_FINISH_STR[finish_reason], stop_reason=stop_reason
        )
        return RequestOutput(
            self.external_id,
            self.prompt,
            self.prompt_token_ids,
            [completion],
            True,
            num_cached_tokens=self.num_cached_tokens,
            metrics=self.metrics,
            error=error,
        )

    def make_error_output(self, error: str) -> RequestOutput:
        """The final output of a request whose output processing raised: finish_reason "error",
        the token ids so far (none in DELTA mode) and no text (the detokenizer is not trusted)."""
        token_ids = [] if self.output_kind is _DELTA else list(self.detokenizer.token_ids)
        completion = CompletionOutput(0, "", token_ids, finish_reason=_FINISH_STR[FinishReason.ERROR])
        return RequestOutput(self.external_id, self.prompt, self.prompt_token_ids, [completion], True,
                             num_cached_tokens=self.num_cached_tokens, metrics=self.metrics, error=error)


class OutputProcessor:
    """Per-request detokenizers and output state, fed by engine outputs (see module docstring).

    `tokenizer` is an HF tokenizer or a `tokenizers.Tokenizer`; None means no text (token ids
    only), which rejects requests with stop strings.
    """

    def __init__(self, tokenizer: Any = None) -> None:
        self.tokenizer = tokenizer
        self._states: dict[str, RequestState] = {}
        self._by_external: dict[str, list[str]] = {}
        self._token_texts: dict[int, TokenTexts] = {}

    # ------------------------------------------------------------ bookkeeping

    @property
    def num_unfinished_requests(self) -> int:
        return len(self._states)

    def has_unfinished_requests(self) -> bool:
        return bool(self._states)

    def request_ids(self) -> Iterator[str]:
        """Internal ids of the live requests (a snapshot)."""
        return iter(list(self._states))

    def internal_ids(self, external_id: str) -> list[str]:
        """Internal ids of the live requests the user submitted under `external_id`."""
        return list(self._by_external.get(external_id, ()))

    def add_request(
        self,
        request_id: str,
        external_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        arrival_time: float | None = None,
    ) -> None:
        """Register a request under its internal id; raises ValueError for a live duplicate id."""
        if request_id in self._states:
            raise ValueError(f"request id {request_id!r} is already live")
        if params.stop_strings and self.tokenizer is None:
            raise InvalidInputError("stop", "stop strings need a tokenizer (this engine has none)")
        detok = make_detokenizer(self.tokenizer, prompt_token_ids, params, request_id)
        self._states[request_id] = RequestState(
            request_id,
            external_id,
            prompt,
            prompt_token_ids,
            params.output_kind,
            detok,
            time.monotonic() if arrival_time is None else arrival_time,
        )
        self._states[request_id].logprobs = make_logprobs_state(self.tokenizer, params, self._token_texts)
        self._by_external.setdefault(external_id, []).append(request_id)

    def _free(self, state: RequestState, now: float) -> None:
        del self._states[state.request_id]
        ids = self._by_external[state.external_id]
        ids.remove(state.request_id)
        if not ids:
            del self._by_external[state.external_id]
        state.metrics.finished_time = now

    # ------------------------------------------------------------ the hot loop

    def process_outputs(
        self, outputs: Sequence[EngineCoreOutput], now: float | None = None, engine_index: int | None = None
    ) -> ProcessedOutputs:
        """Turn engine outputs into user outputs.

        1. look up the request (unknown ids are skipped);
        2. record timing, prefix-cache hits and the engine (`engine_index`, the engine that sent
           `outputs`);
        3. detokenize and check stop strings; a match finishes the request with "stop" and the
           string as `stop_reason`, and lists it in `reqs_to_abort` unless the engine finished it;
        4. build the output for its output kind; an id seen twice in `outputs` gets one merged
           output;
        5. drop the state of finished requests.

        An exception in steps 3-4 belongs to that request alone: it finishes with finish_reason
        "error" and the error text (`RequestOutput.error`), is listed in `failed` and, unless the
        engine already finished it, in `reqs_to_abort`; the other entries are processed as usual.
        """
        if now is None:
            now = time.monotonic()
        states = self._states
        request_outputs: dict[str, RequestOutput] = {}
        reqs_to_abort: list[str] = []
        failed: dict[str, Exception] = {}
        for eco in outputs:
            state = states.get(eco.request_id)
            if state is None:
                continue
            new_ids = eco.new_token_ids
            metrics = state.metrics
            if new_ids:
                if metrics.first_token_time is None:
                    metrics.first_token_time = now
                    metrics.engine_index = engine_index
                metrics.last_token_time = now
                metrics.num_generation_tokens += len(new_ids)
            if eco.num_cached_tokens:
                state.num_cached_tokens = eco.num_cached_tokens
            if eco.num_preemptions:
                metrics.num_preemptions = eco.num_preemptions
            finish_reason = eco.finish_reason
            stop_reason = eco.stop_reason
            try:  # this request's own failure (detokenizer, stop strings) fails it alone
                stop_string = state.detokenizer.update(new_ids, finish_reason is _STOP, finish_reason is not None)
                if stop_string is not None:
                    if finish_reason is None:
                        reqs_to_abort.append(eco.request_id)
                    finish_reason, stop_reason = _STOP, stop_string
                if state.logprobs is not None:
                    state.logprobs.update(eco)
                out = state.make_output(new_ids, finish_reason, stop_reason, eco.error)
                if out is not None and state.logprobs is not None:
                    state.logprobs.attach(out)
            except Exception as exc:
                if finish_reason is None:
                    reqs_to_abort.append(eco.request_id)
                finish_reason = FinishReason.ERROR
                out = state.make_error_output(f"output processing failed: {type(exc).__name__}: {exc}")
                failed[eco.request_id] = exc
                request_outputs.pop(eco.request_id, None)  # an earlier entry's output in this list is void
            if out is not None:
                pending = request_outputs.setdefault(eco.request_id, out)
                if pending is not out:  # the same request twice in one list
                    pending.add(out, aggregate=state.output_kind is _DELTA)
            if finish_reason is not None:
                if metrics.engine_index is None:
                    metrics.engine_index = engine_index
                self._free(state, now)
        return ProcessedOutputs(request_outputs, reqs_to_abort, failed)

    # ------------------------------------------------------------ aborts

    def abort_requests(
        self, request_ids: Iterable[str], *, internal: bool = True
    ) -> dict[str, RequestOutput]:
        """Finish live requests with finish_reason "abort"; returns each one's final output.

        The final output follows the request's kind: CUMULATIVE and FINAL_ONLY carry all text and
        ids so far (held-back text included), DELTA carries only what was not sent yet. With
        `internal=False` the ids are users' external ids (every live request under each).
        Unknown ids are ignored. Returns internal id -> final output.
        """
        ids = list(request_ids)
        if not internal:
            ids = [rid for ext in ids for rid in self._by_external.get(ext, ())]
        now = time.monotonic()
        finals: dict[str, RequestOutput] = {}
        for rid in ids:
            state = self._states.get(rid)
            if state is None:
                continue
            self._free(state, now)
            state.detokenizer.catch_up()
            out = state.make_output([], FinishReason.ABORT, None)
            assert out is not None
            if state.logprobs is not None:
                state.logprobs.attach(out)
            finals[rid] = out
        return finals
