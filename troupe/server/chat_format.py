"""`/v1/chat/completions` answers: messages, tool calls, logprobs, usage, streamed or whole.

Tool calls by `ChatCompletionRequest.tool_mode`:
- `named`: the output is the function's arguments (forced by structured outputs): one call, content
  null, finish_reason as generated; streamed as the call (id, name) first, then argument pieces.
- `required`: the output is a JSON array of `{name, parameters}` (forced): one call each;
  finish_reason `tool_calls`; streamed whole at the end (the array is only useful complete).
- `auto` with a tool parser on (`troupe serve --tool-call-parser`, `troupe.tools.parsers`): the
  calls in the format it reads (hermes `<tool_call>` blocks by default); the text before is the
  content; finish_reason `tool_calls` when a tool was called; streamed content as it comes, each
  call when the parser has it whole.

With a reasoning parser (`--reasoning-parser`, `troupe.tools.reasoning`) and no output constraint
(structured outputs force the answer from its first token), the output's reasoning is split off
first into `reasoning_content` (left out with `include_reasoning=false`), and only the rest is read
for tool calls; streamed, reasoning deltas come as they are generated.
`parallel_tool_calls=false` keeps the first call only. A streamed answer starts with one role chunk
per choice; `continuous_usage_stats` puts the usage so far (the prompt and all choices' tokens) on
every chunk.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from troupe.outputs import CompletionOutput, RequestOutput
from troupe.server.chat import ChatCompletionRequest, tool_dicts
from troupe.server.completions import finish, positions
from troupe.server.logprobs import TokenText, chat_logprobs, prompt_logprobs_out
from troupe.server.responses import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatDelta,
    ChatLogprobs,
    ChatMessageOut,
    FunctionCallDelta,
    FunctionCallOut,
    ToolCallDelta,
    ToolCallOut,
    usage,
)
from troupe.server.sse import DONE, sse_event
from troupe.tools import ToolCall, tool_calls_from_required
from troupe.tools.hermes import new_call_id
from troupe.tools.parsers import ToolParser, ToolStream
from troupe.tools.reasoning import ReasoningParser, ReasoningStream


@dataclass
class _Choice:
    parser: ToolStream | None = None
    thinking: ReasoningStream | None = None
    buffer: list[str] = field(default_factory=list)
    call_id: str | None = None
    calls_sent: int = 0
    tokens: int = 0


class ChatFormat:
    """Turns one chat request's outputs into choices; also the SSE formatter (`chunks`, `tail`)."""

    def __init__(self, req: ChatCompletionRequest, tokenizer: Any, tool_parser: ToolParser | None,
                 response_id: str, model: str, created: int, reasoning: ReasoningParser | None = None) -> None:
        self.req = req
        mode = req.tool_mode
        self.mode = "none" if mode == "auto" and tool_parser is None else mode
        self._tools = tool_parser.for_tools(tool_dicts(req.tools)) if tool_parser is not None else None
        self.reasoning = reasoning  # None where the output is constrained (the caller knows)
        self._text = TokenText(tokenizer, req.return_tokens_as_token_ids)
        self._prefix = req.echo_prefix()
        self._id, self._model, self._created = response_id, model, created
        self._choices: dict[int, _Choice] = {}
        self._prompt_tokens = 0
        self._prompt_ids: list[int] = []
        self._started = False

    def logprobs(self, c: CompletionOutput) -> ChatLogprobs | None:
        """The logprobs of `c`'s new tokens, when the request asked for them."""
        if not self.req.logprobs:
            return None
        return ChatLogprobs(content=chat_logprobs(c.token_ids, positions(c.logprobs, len(c.token_ids)),
                                                  self.req.top_logprobs or 0, self._text))

    def _keep(self, calls: list[ToolCall]) -> list[ToolCall]:
        return calls[:1] if self.req.parallel_tool_calls is False else calls

    def _finish(self, c: CompletionOutput, called: bool) -> str | None:
        if c.finish_reason is None:
            return None
        if called and (self.mode == "auto" or self.mode == "required" and c.finish_reason == "stop"):
            return "tool_calls"
        return c.finish_reason

    # ------------------------------------------------------------------ whole answers

    def _message(self, c: CompletionOutput) -> tuple[ChatMessageOut, bool]:
        text, thought = c.text, None
        if self.reasoning is not None:
            thought, answer = self.reasoning.split(text)
            text = answer or ""
        content: str | None = self._prefix + text
        calls: list[ToolCall] = []
        if self.mode == "named":
            calls, content = [ToolCall(name=self.req.named_tool().name, arguments=c.text)], None
        elif self.mode == "required":
            parsed = tool_calls_from_required(c.text)
            if parsed is not None:
                calls, content = parsed, None
        elif self.mode == "auto":
            assert self._tools is not None
            found = self._tools.parse(text)
            calls, content = found.tool_calls, found.content if found.called else content
        calls = self._keep(calls)
        message = ChatMessageOut(content=content)
        if self.reasoning is not None:
            message.reasoning_content = thought if self.req.include_reasoning else None
            if not content:
                message.content = None
        if calls:
            message.tool_calls = [ToolCallOut(id=t.id, function=FunctionCallOut(name=t.name, arguments=t.arguments))
                                  for t in calls]
        return message, bool(calls)

    def response(self, final: RequestOutput) -> ChatCompletionResponse:
        choices = []
        for c in sorted(final.outputs, key=lambda c: c.index):
            message, called = self._message(c)
            choice = ChatChoice(index=c.index, message=message, logprobs=self.logprobs(c),
                                finish_reason=finish(self._finish(c, called)), stop_reason=c.stop_reason)
            if self.req.return_token_ids:
                choice.token_ids = list(c.token_ids)
            choices.append(choice)
        resp = ChatCompletionResponse(id=self._id, created=self._created, model=self._model, choices=choices,
                                      usage=usage(len(final.prompt_token_ids or ()),
                                                  sum(len(c.token_ids) for c in final.outputs)))
        if self.req.prompt_logprobs is not None and final.prompt_logprobs is not None:
            resp.prompt_logprobs = prompt_logprobs_out(final.prompt_logprobs) or []
        if self.req.return_token_ids:
            resp.prompt_token_ids = list(final.prompt_token_ids or [])
        return resp

    # ------------------------------------------------------------------ streams

    def _chunk(self, choices: list[ChatChunkChoice]) -> ChatCompletionChunk:
        chunk = ChatCompletionChunk(id=self._id, created=self._created, model=self._model, choices=choices)
        if self.req.continuous_usage:
            chunk.usage = usage(self._prompt_tokens, sum(st.tokens for st in self._choices.values()))
        elif self.req.include_usage:
            chunk.usage = None
        return chunk

    def _tool_deltas(self, st: _Choice, calls: list[ToolCall]) -> list[ToolCallDelta]:
        out = []
        for call in calls:
            if self.req.parallel_tool_calls is False and st.calls_sent:
                break
            out.append(ToolCallDelta(index=st.calls_sent, id=call.id, type="function",
                                     function=FunctionCallDelta(name=call.name, arguments=call.arguments)))
            st.calls_sent += 1
        return out

    def delta(self, c: CompletionOutput, st: _Choice) -> ChatDelta:
        """One output's new text as a delta: reasoning split off, then tool calls (module docstring)."""
        done = c.finish_reason is not None
        text, thought = c.text, ""
        if self.reasoning is not None:
            if st.thinking is None:
                st.thinking = self.reasoning.stream()
            thought, text = st.thinking.feed(c.text)
            if done:
                more_thought, more_text = st.thinking.finish()
                thought, text = thought + more_thought, text + more_text
        delta = self._answer_delta(text, done, st)
        if thought and self.req.include_reasoning:
            delta.reasoning_content = thought
        return delta

    def _answer_delta(self, text: str, done: bool, st: _Choice) -> ChatDelta:
        if self.mode == "named":
            if st.call_id is None:
                st.call_id = new_call_id()
                st.calls_sent = 1
                return ChatDelta(tool_calls=[ToolCallDelta(index=0, id=st.call_id, type="function", function=FunctionCallDelta(
                    name=self.req.named_tool().name, arguments=text))])
            return ChatDelta(tool_calls=[ToolCallDelta(index=0, function=FunctionCallDelta(arguments=text))]
                             if text else None)
        if self.mode == "required":
            st.buffer.append(text)
            if not done:
                return ChatDelta()
            text = "".join(st.buffer)
            parsed = tool_calls_from_required(text)
            return ChatDelta(content=text) if parsed is None else ChatDelta(tool_calls=self._tool_deltas(st, parsed))
        if self.mode == "auto":
            if st.parser is None:
                assert self._tools is not None
                st.parser = self._tools.stream()
            content, calls = st.parser.feed(text)
            if done:
                rest, more = st.parser.finish()
                content, calls = content + rest, calls + more
            if st.parser.calls and not content.strip():
                content = ""
            return ChatDelta(content=content or None, tool_calls=self._tool_deltas(st, calls) or None)
        return ChatDelta(content=text or None)

    def step(self, c: CompletionOutput) -> tuple[ChatDelta, str | None]:
        """One streamed output's delta and finish reason, for other stream shapes (the Responses API)."""
        st = self._choices.setdefault(c.index, _Choice())
        st.tokens += len(c.token_ids)
        return self.delta(c, st), self._finish(c, st.calls_sent > 0)

    def chunks(self, index: int, out: RequestOutput) -> list[bytes]:
        self._prompt_tokens = len(out.prompt_token_ids or ())
        events = []
        if not self._started:
            self._started = True
            self._prompt_ids = list(out.prompt_token_ids or [])
            for i in range(self.req.n):
                self._choices[i] = _Choice()
                chunk = self._chunk([ChatChunkChoice(index=i, delta=ChatDelta(role="assistant", content=self._prefix),
                                                     finish_reason=None)])
                if self.req.return_token_ids and i == 0:
                    chunk.prompt_token_ids = self._prompt_ids
                events.append(sse_event(chunk))
        for c in out.outputs:
            st = self._choices.setdefault(c.index, _Choice())
            st.tokens += len(c.token_ids)
            delta = self.delta(c, st)
            logprobs = self.logprobs(c) if c.token_ids else None
            reason = self._finish(c, st.calls_sent > 0)
            if (delta.content is None and delta.tool_calls is None and delta.reasoning_content is None
                    and reason is None and logprobs is None):
                continue
            choice = ChatChunkChoice(index=c.index, delta=delta, logprobs=logprobs, finish_reason=finish(reason),
                                     stop_reason=c.stop_reason)
            if self.req.return_token_ids:
                choice.token_ids = list(c.token_ids)
            events.append(sse_event(self._chunk([choice])))
        return events

    def tail(self) -> list[bytes]:
        events = []
        if self.req.include_usage:
            chunk = ChatCompletionChunk(id=self._id, created=self._created, model=self._model, choices=[],
                                        usage=usage(self._prompt_tokens, sum(st.tokens for st in self._choices.values())))
            events.append(sse_event(chunk))
        events.append(DONE)
        return events
