"""`/v1/completions` answers: choices (n per prompt), echo, logprobs, usage, streamed or whole.

Choice `index` is `prompt_index * n + CompletionOutput.index`, as vLLM numbers a batch. With `echo`
the choice starts with the prompt's text (its token ids and, with `logprobs`, its logprobs: the
first token has none); `max_tokens=0` with echo returns the prompt alone. Usage counts each
prompt once and the generated tokens of every choice. Streams: each chunk carries one choice's
new text (and logprobs); `continuous_usage_stats` adds, on every chunk, that choice's usage so far
(its prompt and its tokens, as vLLM).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgspec

from troupe.outputs import CompletionOutput, RequestOutput
from troupe.server.logprobs import Position, TokenText, completion_logprobs, prompt_logprobs_out
from troupe.server.protocol import CompletionRequest
from troupe.server.responses import (
    CompletionChoice,
    CompletionChunk,
    CompletionResponse,
    FinishReasonText,
    usage,
)
from troupe.server.sse import DONE, sse_event


def finish(reason: str | None) -> FinishReasonText | None:
    assert reason in (None, "stop", "length", "abort", "error", "tool_calls"), reason
    return reason  # type: ignore[return-value]


def positions(logprobs: Sequence[Position] | None, count: int) -> list[Position]:
    return list(logprobs) if logprobs is not None else [None] * count


@dataclass
class _Choice:
    echoed: bool = False
    offset: int = 0  # text_offset of the next token
    tokens: int = 0


class CompletionFormat:
    """Turns one request's outputs into choices; also the SSE formatter (`chunks`, `tail`)."""

    def __init__(self, req: CompletionRequest, prompt_texts: Sequence[str | None], tokenizer: Any,
                 response_id: str, model: str, created: int) -> None:
        self.req, self.n = req, req.n
        self._prompt_texts = list(prompt_texts)
        self._tokenizer = tokenizer
        self._text = TokenText(tokenizer, req.return_tokens_as_token_ids)
        self._id, self._model, self._created = response_id, model, created
        self._choices: dict[int, _Choice] = {}
        self._prompt_tokens = [0] * len(prompt_texts)
        self._prompt_logprobs: list[list[Position] | None] = [None] * len(prompt_texts)

    def _prompt_text(self, i: int, out: RequestOutput) -> str:
        text = self._prompt_texts[i]
        if text is None:
            text = self._prompt_texts[i] = str(self._tokenizer.decode(out.prompt_token_ids or []))
        return text

    def _choice(self, i: int, out: RequestOutput, c: CompletionOutput, st: _Choice) -> CompletionChoice | None:
        """The choice for `c` (whole, or the delta when streaming); None for an empty delta."""
        req = self.req
        text, ids = c.text, list(c.token_ids)
        pos = positions(c.logprobs, len(ids))
        prompt_ids = list(out.prompt_token_ids or [])
        if req.echo and not st.echoed:
            st.echoed = True
            prompt_pos = positions(self._prompt_logprobs[i], len(prompt_ids))
            if req.echo_only:
                text, ids, pos = self._prompt_text(i, out), prompt_ids, prompt_pos
            else:
                text, ids, pos = self._prompt_text(i, out) + text, prompt_ids + ids, prompt_pos + pos
        elif req.echo_only:
            text, ids, pos = "", [], []
        reason = "length" if req.echo_only and c.finish_reason is not None else c.finish_reason
        if req.stream and not text and not ids and reason is None:
            return None
        logprobs = None
        if req.logprobs is not None:
            logprobs, st.offset = completion_logprobs(ids, pos, self._text, st.offset)
        choice = CompletionChoice(index=i * self.n + c.index, text=text, logprobs=logprobs, finish_reason=finish(reason),
                                  stop_reason=c.stop_reason)
        if req.return_token_ids:
            choice.token_ids = list(c.token_ids)
            if not req.stream or st.tokens == 0:
                choice.prompt_token_ids = prompt_ids
        if req.prompt_logprobs is not None and self._prompt_logprobs[i] is not None and not req.stream:
            choice.prompt_logprobs = prompt_logprobs_out(self._prompt_logprobs[i]) or msgspec.UNSET
        return choice

    def _observe(self, i: int, out: RequestOutput) -> None:
        self._prompt_tokens[i] = len(out.prompt_token_ids or ())
        if out.prompt_logprobs is not None:
            self._prompt_logprobs[i] = list(out.prompt_logprobs)

    # ------------------------------------------------------------------ whole answers

    def response(self, finals: Sequence[RequestOutput]) -> CompletionResponse:
        choices = []
        completion_tokens = 0
        for i, out in enumerate(finals):
            self._observe(i, out)
            for c in sorted(out.outputs, key=lambda c: c.index):
                choice = self._choice(i, out, c, _Choice())
                assert choice is not None
                choices.append(choice)
                completion_tokens += len(c.token_ids)
        return CompletionResponse(id=self._id, created=self._created, model=self._model, choices=choices,
                                  usage=usage(sum(self._prompt_tokens), completion_tokens))

    # ------------------------------------------------------------------ streams

    def chunks(self, index: int, out: RequestOutput) -> list[bytes]:
        self._observe(index, out)
        events = []
        for c in out.outputs:
            st = self._choices.setdefault(index * self.n + c.index, _Choice())
            choice = self._choice(index, out, c, st)
            st.tokens += len(c.token_ids)
            if choice is None:
                continue
            chunk = CompletionChunk(id=self._id, created=self._created, model=self._model, choices=[choice])
            if self.req.continuous_usage:
                chunk.usage = usage(self._prompt_tokens[index], st.tokens)
            elif self.req.include_usage:
                chunk.usage = None
            events.append(sse_event(chunk))
        return events

    def tail(self) -> list[bytes]:
        events = []
        if self.req.include_usage:
            total = sum(st.tokens for st in self._choices.values())
            events.append(sse_event(CompletionChunk(id=self._id, created=self._created, model=self._model, choices=[],
                                                    usage=usage(sum(self._prompt_tokens), total))))
        events.append(DONE)
        return events
