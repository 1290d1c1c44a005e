"""`RequestState`: the frontend's view of one live request (its detokenizer, output kind, metrics,
the consumer's queue, and for a child of an n > 1 request its index and parent), and the outputs it
makes after each engine step. Owned by the `OutputProcessor` (troupe.output.processor)."""

from __future__ import annotations

from troupe.errors import ErrorKind
from troupe.messages import EngineCoreOutput, FinishReason
from troupe.output.collector import OutputSink
from troupe.output.detokenizer import IncrementalDetokenizer
from troupe.output.logprobs import LogprobsState
from troupe.output.parallel import ParentRequest
from troupe.outputs import CompletionOutput, RequestMetrics, RequestOutput
from troupe.sampling_params import RequestOutputKind

_DELTA = RequestOutputKind.DELTA
_FINAL_ONLY = RequestOutputKind.FINAL_ONLY
_FINISH_STR = {reason: str(reason) for reason in FinishReason}


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
        "queue",
        "index",
        "parent",
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
        queue: OutputSink | None = None,
        index: int = 0,
        parent: ParentRequest | None = None,
        logprobs: LogprobsState | None = None,
    ) -> None:
        self.request_id = request_id
        self.external_id = external_id
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.output_kind = output_kind
        self.detokenizer = detokenizer
        self.num_cached_tokens = 0
        self.metrics = RequestMetrics(arrival_time=arrival_time)
        self.queue = queue
        self.index = index  # the sample number (n > 1: the child's index)
        self.parent = parent
        self.logprobs = logprobs  # None unless the request asked for logprobs or prompt logprobs

    def record(self, eco: EngineCoreOutput, now: float, engine_index: int | None) -> None:
        """Timing, token counts, prefix-cache hits and preemptions of one engine output."""
        metrics = self.metrics
        if eco.new_token_ids:
            if metrics.first_token_time is None:
                metrics.first_token_time = now
                metrics.engine_index = engine_index
            metrics.last_token_time = now
            metrics.num_generation_tokens += len(eco.new_token_ids)
        if eco.num_cached_tokens:
            self.num_cached_tokens = eco.num_cached_tokens
        if eco.num_preemptions:
            metrics.num_preemptions = eco.num_preemptions

    def make_output(
        self, new_token_ids: list[int], finish_reason: FinishReason | None, stop_reason: int | str | None,
        error: str | None = None, error_kind: ErrorKind | None = None,
    ) -> RequestOutput | None:
        """The output to deliver after this step, or None when there is nothing to say yet; with the
        request's logprobs on it, sliced for its output kind."""
        out = self._make_output(new_token_ids, finish_reason, stop_reason, error, error_kind)
        if out is not None and self.logprobs is not None:
            self.logprobs.attach(out)
        return out

    def _make_output(
        self, new_token_ids: list[int], finish_reason: FinishReason | None, stop_reason: int | str | None,
        error: str | None, error_kind: ErrorKind | None,
    ) -> RequestOutput | None:
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
                [CompletionOutput(self.index, text, token_ids)],
                False,
                None,
                self.num_cached_tokens,
            )
        assert finish_reason is not None
        completion = CompletionOutput(
            self.index, text, token_ids, finish_reason=_FINISH_STR[finish_reason], stop_reason=stop_reason
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
            error_kind=error_kind,
        )

    def make_error_output(self, error: str) -> RequestOutput:
        """The final output of a request whose output processing raised: finish_reason "error",
        the token ids so far (none in DELTA mode) and no text (the detokenizer is not trusted)."""
        token_ids = [] if self.output_kind is _DELTA else list(self.detokenizer.token_ids)
        completion = CompletionOutput(self.index, "", token_ids, finish_reason=_FINISH_STR[FinishReason.ERROR])
        return RequestOutput(self.external_id, self.prompt, self.prompt_token_ids, [completion], True,
                             num_cached_tokens=self.num_cached_tokens, metrics=self.metrics, error=error,
                             error_kind="internal")
