"""OpenAI response bodies as msgspec Structs: what the server encodes, and what `/openapi.json`
documents (`troupe.server.openapi` builds the schema from these and the request Structs).

Non-streaming answers are one `CompletionResponse` / `ChatCompletionResponse`; streams are SSE
`data:` events of `CompletionChunk` / `ChatCompletionChunk` (with `usage` present, as null, only
when `stream_options.include_usage` asked for the final usage chunk; filled on every chunk with
`continuous_usage_stats`); errors are `ErrorResponse`. Fields typed `... | UnsetType` are vLLM's
extras, sent only when the request asked for them (`return_token_ids`, `prompt_logprobs`) or when
there are some (`tool_calls`).
"""

from __future__ import annotations

from typing import Literal

import msgspec

FinishReasonText = Literal["stop", "length", "abort", "error", "tool_calls"]
StopReason = int | str | None


class Usage(msgspec.Struct, kw_only=True):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class ErrorInfo(msgspec.Struct, kw_only=True):
    message: str
    type: str
    param: str | None  # the offending field (a JSON path such as `messages[0].role`), when one is known
    code: str | int | None


class ErrorResponse(msgspec.Struct, kw_only=True):
    """Every 4xx/5xx answer, and the last SSE event of a stream that failed after it started."""

    error: ErrorInfo


class LogprobOut(msgspec.Struct, kw_only=True):
    """One entry of vLLM's `prompt_logprobs` (keyed by token id)."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


PromptLogprobs = list[dict[int, LogprobOut] | None]


class CompletionLogprobs(msgspec.Struct, kw_only=True):
    """OpenAI's legacy logprobs: per token its text, logprob (None for the first prompt token),
    the top alternatives (text -> logprob) and its offset in the choice's text."""

    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(msgspec.Struct, kw_only=True):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: FinishReasonText | None
    stop_reason: StopReason = None
    prompt_logprobs: PromptLogprobs | msgspec.UnsetType = msgspec.UNSET
    prompt_token_ids: list[int] | msgspec.UnsetType = msgspec.UNSET
    token_ids: list[int] | msgspec.UnsetType = msgspec.UNSET


class CompletionResponse(msgspec.Struct, kw_only=True):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class CompletionChunk(msgspec.Struct, kw_only=True):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None | msgspec.UnsetType = msgspec.UNSET


class ChatLogprob(msgspec.Struct, kw_only=True):
    token: str
    logprob: float
    bytes: list[int] | None


class ChatLogprobContent(msgspec.Struct, kw_only=True):
    token: str
    logprob: float
    bytes: list[int] | None
    top_logprobs: list[ChatLogprob]


class ChatLogprobs(msgspec.Struct, kw_only=True):
    content: list[ChatLogprobContent] | None


class FunctionCallOut(msgspec.Struct, kw_only=True):
    name: str
    arguments: str


class ToolCallOut(msgspec.Struct, kw_only=True):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCallOut


class ChatMessageOut(msgspec.Struct, kw_only=True):
    role: Literal["assistant"] = "assistant"
    content: str | None
    reasoning_content: str | None | msgspec.UnsetType = msgspec.UNSET  # with a reasoning parser
    tool_calls: list[ToolCallOut] | msgspec.UnsetType = msgspec.UNSET


class ChatChoice(msgspec.Struct, kw_only=True):
    index: int
    message: ChatMessageOut
    logprobs: ChatLogprobs | None = None
    finish_reason: FinishReasonText | None
    stop_reason: StopReason = None
    token_ids: list[int] | msgspec.UnsetType = msgspec.UNSET


class ChatCompletionResponse(msgspec.Struct, kw_only=True):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    prompt_logprobs: PromptLogprobs | msgspec.UnsetType = msgspec.UNSET
    prompt_token_ids: list[int] | msgspec.UnsetType = msgspec.UNSET


class FunctionCallDelta(msgspec.Struct, kw_only=True, omit_defaults=True):
    name: str | None = None
    arguments: str | None = None


class ToolCallDelta(msgspec.Struct, kw_only=True, omit_defaults=True):
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: FunctionCallDelta | None = None


class ChatDelta(msgspec.Struct, kw_only=True, omit_defaults=True):
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChatChunkChoice(msgspec.Struct, kw_only=True):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: FinishReasonText | None
    stop_reason: StopReason = None
    token_ids: list[int] | msgspec.UnsetType = msgspec.UNSET


class ChatCompletionChunk(msgspec.Struct, kw_only=True):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None | msgspec.UnsetType = msgspec.UNSET
    prompt_token_ids: list[int] | msgspec.UnsetType = msgspec.UNSET


class ModelCard(msgspec.Struct, kw_only=True):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str
    root: str
    parent: str | None = None
    max_model_len: int


class ModelList(msgspec.Struct, kw_only=True):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeResponse(msgspec.Struct, kw_only=True):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeResponse(msgspec.Struct, kw_only=True):
    prompt: str


class VersionResponse(msgspec.Struct, kw_only=True):
    version: str


def usage(prompt_tokens: int, completion_tokens: int) -> Usage:
    return Usage(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                 total_tokens=prompt_tokens + completion_tokens)
